import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self._markers = os.path.join(args["model_repository"], "cancelled")
        os.makedirs(self._markers, exist_ok=True)

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._stream, args=(request,), daemon=True).start()
        return None

    def _stream(self, request):
        sender = request.get_response_sender()
        count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
        for index in range(count):
            if request.is_cancelled():
                with open(os.path.join(self._markers, request.request_id() or "unnamed"), "w") as f:
                    f.write(str(index))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("INDEX", np.array([index], dtype=np.int32))]))
            time.sleep(0.1)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
