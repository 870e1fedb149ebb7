import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json

        parameters = json.loads(args["model_config"])["parameters"]
        self._first_s = float(parameters["FIRST_EXECUTION_S"]["string_value"])
        self._warm = False

    def execute(self, requests):
        if not self._warm:
            time.sleep(self._first_s)
            self._warm = True
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy())])
            for request in requests
        ]
