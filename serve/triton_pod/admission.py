"""The start-of-job gate's signal: whether the facility is saturated, as the control plane
knows it, answered to the gateway (gateway/gate-word.sh fetches it once a second per gateway
pod, and gateway/gate.lua reads it before a RepositoryIndex passes; no call waits on it, nor
on Prometheus).

Saturated means Triton's queue time per execution, averaged over the replicas, is above the
site's hard limit while no more replicas may be added (max_replicas). The autoscaling policy
(autoscaling.py) decides it each control loop; this module serves the latest decision with its
age on the head pod's `admission` port, so a gateway can tell a stale answer (the controller
gone, the policy no longer called) from a fresh one. "No Triton ready" needs no signal from
here: the gateway sees it itself; what it cannot see is whether a GPU pod is on its way, so
the answer also says for how long the deployment has wanted more replicas than run
(`starting_for_s`, null while none is missing), from which the gateway's "no Triton is ready"
tells a client roughly when to retry.

The settings come from the `admission` ConfigMap (gateway/admission.env; a site merges its
own in its overlay), which both the gateway and the Ray head read as environment variables.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger("ray.serve")

# The head pod's port of this answer (base/rayservice.yaml names it `admission`); unset, as
# outside a Ray head, nothing is served.
PORT_ENV = "SONIC_RAY_ADMISSION_PORT"
SATURATED_ENV = "SONIC_RAY_SATURATED_QUEUE_MS"
PATH = "/admission"


@dataclass(frozen=True)
class AdmissionSettings:
    port: int | None
    # Queue milliseconds per execution above which a facility at max_replicas is saturated;
    # None: the gate closes only while no Triton is ready.
    saturated_queue_ms: float | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> AdmissionSettings:
        raw_port = env.get(PORT_ENV, "").strip()
        if raw_port and (not raw_port.isdigit() or not 0 < int(raw_port) < 65536):
            raise ValueError(f"{PORT_ENV}={raw_port!r} is not a port number")
        raw = env.get(SATURATED_ENV, "").strip()
        limit: float | None = None
        if raw:
            try:
                limit = float(raw)
            except ValueError:
                raise ValueError(f"{SATURATED_ENV}={raw!r} is not a number of "
                                 "milliseconds") from None
            if not math.isfinite(limit) or limit <= 0:
                raise ValueError(f"{SATURATED_ENV}={raw!r} must be a positive number")
        return cls(int(raw_port) if raw_port else None, limit)


def saturation(observed_ms: float | None, current: int, max_replicas: int,
               limit_ms: float | None) -> str | None:
    """Why the facility is saturated, or None when it is not (or nothing says it is)."""
    if limit_ms is None or observed_ms is None or current < max_replicas:
        return None
    if observed_ms <= limit_ms:
        return None
    return (f"the GPUs are saturated: requests wait {observed_ms:.0f} ms per execution in "
            f"Triton's queue (the site's limit is {limit_ms:.0f} ms) on all {current} GPU "
            f"pods, the most this facility runs (max_replicas)")


class Admission:
    """The latest decision and when it was made; served on `port` by a thread of its own."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._starting_for_s: float | None = None
        self._at: float | None = None
        self.error: str | None = None
        try:
            server = ThreadingHTTPServer(("0.0.0.0", port), self._handler())
        except OSError as error:
            # The gateway then finds no answer and applies its rule for a stale signal.
            self.error = f"cannot serve the gate's signal on port {port}: {error}"
            logger.error("admission: %s", self.error)
            return
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="admission", daemon=True).start()

    def decide(self, reason: str | None, starting_for_s: float | None = None) -> None:
        """`reason`: why the facility is saturated, or None; `starting_for_s`: how long the
        deployment has wanted more GPU pods than run, or None while none is missing."""
        with self._lock:
            if reason != self._reason:
                logger.info("admission: %s", reason or "open: the GPUs have room")
            self._reason, self._at = reason, time.monotonic()
            self._starting_for_s = starting_for_s

    def answer(self) -> dict[str, object]:
        with self._lock:
            reason, at, starting = self._reason, self._at, self._starting_for_s
        if at is None:
            return {"state": "unknown", "reason": "the autoscaling policy has not run yet",
                    "age_s": None, "starting_for_s": None}
        return {"state": "closed" if reason else "open", "reason": reason or "",
                "age_s": round(time.monotonic() - at, 3),
                "starting_for_s": None if starting is None else round(starting, 1)}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        admission = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server calls it by this name
                if self.path != PATH:
                    self.send_error(404)
                    return
                body = json.dumps(admission.answer()).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # one GET a second per gateway pod: not worth a log line

        return Handler


_SHARED: dict[int, Admission] = {}
_SHARED_LOCK = threading.Lock()


def admission(port: int) -> Admission:
    """One server per port in a process: Serve makes a new policy object at every config
    update, and each must not bind the port again."""
    with _SHARED_LOCK:
        if port not in _SHARED:
            _SHARED[port] = Admission(port)
        return _SHARED[port]
