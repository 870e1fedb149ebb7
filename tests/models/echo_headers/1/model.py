import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(
                        "PARAMETERS", np.array([r.parameters().encode()], dtype=np.object_)
                    )
                ]
            )
            for r in requests
        ]
