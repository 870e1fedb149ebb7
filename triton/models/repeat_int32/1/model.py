"""Streams IN[i] back as one response each, DELAY[i] milliseconds apart (decoupled)."""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self._inflight = 0
        self._lock = threading.Lock()
        self._threads = []

    def execute(self, requests):
        # A decoupled model answers through each request's sender, off the execute() thread,
        # so that one long stream does not hold the model instance.
        for request in requests:
            thread = threading.Thread(target=self._stream, args=(request,), daemon=True)
            with self._lock:
                self._inflight += 1
            thread.start()
        return None

    def _stream(self, request):
        sender = request.get_response_sender()
        try:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delay = pb_utils.get_input_tensor_by_name(request, "DELAY")
            delays = delay.as_numpy() if delay is not None else np.zeros_like(values)
            if delays.shape != values.shape:
                error = pb_utils.TritonError("DELAY must have the same shape as IN")
                sender.send(pb_utils.InferenceResponse(error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            for index, (value, wait_ms) in enumerate(zip(values, delays, strict=True)):
                if request.is_cancelled():
                    break
                time.sleep(float(wait_ms) / 1000.0)
                sender.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[
                            pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                            pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32)),
                        ]
                    )
                )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self._lock:
                self._inflight -= 1

    def finalize(self):
        deadline = time.monotonic() + 5
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.05)
