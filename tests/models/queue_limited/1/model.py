import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        # One batch, one sleep: the longest SECONDS of the batch.
        seconds = [float(pb_utils.get_input_tensor_by_name(r, "SECONDS").as_numpy()[0][0])
                   for r in requests]
        time.sleep(max(seconds))
        return [pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("SLEPT", np.array([[s]], dtype=np.float32))])
                for s in seconds]
