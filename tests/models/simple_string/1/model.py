import numpy as np
import triton_python_backend_utils as pb_utils


def _ints(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().astype(np.int64)


def _strings(values):
    return np.array([str(v).encode() for v in values.flat], dtype=np.object_).reshape(values.shape)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            a, b = _ints(r, "INPUT0"), _ints(r, "INPUT1")
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", _strings(a + b)),
                pb_utils.Tensor("OUTPUT1", _strings(a - b)),
            ]))
        return responses
