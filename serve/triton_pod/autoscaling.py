"""The custom autoscaling policy that the Serve config names by import path: replicas (one GPU
pod each) from the Triton queue time each replica reports (triton_metrics.py).

Serve applies min/max replicas, upscale and downscale delays after this returns. It runs in
the Serve controller every control loop, so it only does arithmetic.
"""

from __future__ import annotations

import math
from typing import Any

from .triton_metrics import QUEUE_METRIC


class TritonQueueTimePolicy:
    """Kubernetes' HPA rule on queue milliseconds per execution: desired replicas =
    ceil(current x observed / target), left alone within `tolerance` of the target."""

    def __init__(self, target_queue_ms_per_exec: float = 100.0, tolerance: float = 0.1) -> None:
        if target_queue_ms_per_exec <= 0:
            raise ValueError("target_queue_ms_per_exec must be positive")
        self.target = float(target_queue_ms_per_exec)
        self.tolerance = float(tolerance)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        current = ctx.current_num_replicas
        reported = (ctx.aggregated_metrics or {}).get(QUEUE_METRIC) or {}
        if current == 0 or not reported:
            # Nothing measured yet (replicas starting): keep the decision Serve has.
            return ctx.target_num_replicas, {}
        observed = sum(reported.values()) / len(reported)
        ratio = observed / self.target
        if abs(ratio - 1.0) <= self.tolerance:
            return current, {"queue_ms_per_exec": observed}
        return max(1, math.ceil(current * ratio)), {"queue_ms_per_exec": observed}
