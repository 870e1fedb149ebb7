import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's sequence models for the tests (tests/sequence_models): with a CORRID control
    (sequence_sum), OUTPUT is the running sum of the sequence's INPUTs; without one
    (simple_sequence, the contract of Triton's example), OUTPUT is INPUT plus START."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        controls = config["sequence_batching"].get("control_input", [])
        self.stateful = any(c["name"] == "CORRID" for c in controls)
        self.sums: dict[int, np.ndarray] = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
            if self.stateful and ready.flat[0]:
                corrid = int(pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().flat[0])
                if start.flat[0]:
                    self.sums[corrid] = np.zeros_like(value)
                self.sums[corrid] = self.sums[corrid] + value
                out = self.sums[corrid]
                if pb_utils.get_input_tensor_by_name(request, "END").as_numpy().flat[0]:
                    del self.sums[corrid]
            elif self.stateful:  # a free slot of the batch Triton formed: no sequence's call
                out = np.zeros_like(value)
            else:
                out = value + start.astype(value.dtype)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT", out.astype(np.int32))]))
        return responses
