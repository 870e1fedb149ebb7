import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self._markers = os.path.join(args["model_repository"], "cancelled")
        os.makedirs(self._markers, exist_ok=True)

    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = float(pb_utils.get_input_tensor_by_name(request, "SECONDS").as_numpy()[0])
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                if request.is_cancelled():
                    marker = os.path.join(self._markers, request.request_id() or "unnamed")
                    with open(marker, "w") as f:
                        f.write(f"{time.monotonic() - start:.3f}")
                    break
                time.sleep(0.01)
            slept = np.array([time.monotonic() - start], dtype=np.float32)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("SLEPT", slept)])
            )
        return responses
