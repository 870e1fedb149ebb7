"""The custom autoscaling policy that the Serve config names by import path: replicas (one GPU
pod each) from the Triton queue time each replica reports (triton_metrics.py); while a new Ray
cluster comes up beside the one serving, at least as many as the gateway balances over; and
from the gateway's demand (gateway_view.py), one at least while calls come and none while
none do, so that `min_replicas: 0` scales from and to zero; and at least an operator's
pre-warm request (prewarm.py) until its time passes.

Serve applies min/max replicas, upscale and downscale delays after this returns. It runs in
the Serve controller every control loop, so it only does arithmetic.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from ray.util.metrics import Gauge

from .admission import AdmissionSettings, admission, saturation
from .gateway_view import gateway_view
from .prewarm import PrewarmReader
from .triton_metrics import QUEUE_METRIC

logger = logging.getLogger("ray.serve")


def starting_for_s(ctx: Any, state: dict[str, Any]) -> float | None:
    """How long the deployment has wanted more replicas than run (GPU pods on their way: the
    Ray autoscaler adding a node, a Triton loading its models), or None while none is missing;
    kept in the policy's state between calls."""
    now = float(getattr(ctx, "current_time", 0.0))
    if ctx.target_num_replicas <= ctx.current_num_replicas:
        state.pop("starting_since", None)
        return None
    return now - float(state.setdefault("starting_since", now))


class TritonQueueTimePolicy:
    """Kubernetes' HPA rule on queue milliseconds per execution: desired replicas =
    ceil(current x observed / target), left alone within `tolerance` of the target.

    With `gateway_stats_url`, a deployment that starts holds the gateway's count of healthy
    Tritons as its floor until it runs that many, waiting `gateway_wait_s` at most for a first
    answer. Serve keeps a deployment UPDATING (its application DEPLOYING) while fewer replicas
    than min_replicas run and its target rises (Ray 2.60, DeploymentState.autoscale), and
    KubeRay switches to a new cluster only when its applications are RUNNING: so in an upgrade
    the new cluster takes the load with as many GPU pods as served it. In a cluster already
    serving, the count is its own: caught up at once.

    With `gateway_stats_url`, the gateway's demand also counts: while calls arrive or are in
    flight at least one replica (from zero, Serve 2.60 adds it at once, without
    upscale_delay_s), and with no call since the last poll none (Serve goes down to one after
    downscale_delay_s of such answers, and from one to zero after downscale_to_zero_delay_s,
    never below min_replicas): no replica reports anything while none runs, so only the gateway can say
    that jobs want a GPU pod. Without an answer from the gateway, the queue decision alone.

    Each call also decides whether the facility is saturated (admission.py) for the gateway's
    start-of-job gate, with the site's limit from the environment (the `admission` ConfigMap),
    and says for how long GPU pods have been on their way (the gateway's retry hint).

    With `prewarm_dir` (where the head mounts the optional ConfigMap `prewarm`), at least the
    GPU pods an operator asked for there until the time it gave (prewarm.py)."""

    def __init__(self, target_queue_ms_per_exec: float = 100.0, tolerance: float = 0.1,
                 gateway_stats_url: str | None = None, gateway_wait_s: float = 60.0,
                 prewarm_dir: str | None = None) -> None:
        if target_queue_ms_per_exec <= 0:
            raise ValueError("target_queue_ms_per_exec must be positive")
        if gateway_wait_s < 0:
            raise ValueError("gateway_wait_s must not be negative")
        self.target = float(target_queue_ms_per_exec)
        self.tolerance = float(tolerance)
        self.gateway = gateway_view(gateway_stats_url) if gateway_stats_url else None
        self.gateway_wait_s = float(gateway_wait_s)
        self._said_no_demand = False
        # A bad setting fails the deploy here, with its name in the message.
        settings = AdmissionSettings.from_env()
        self.saturated_queue_ms = settings.saturated_queue_ms
        self.admission = admission(settings.port) if settings.port else None
        self.prewarm = PrewarmReader(Path(prewarm_dir)) if prewarm_dir else None
        # Exported by the head's Ray metrics agent as ray_sonic_ray_prewarm_* (dashboard).
        self._prewarm_pods = Gauge("sonic_ray_prewarm_pods", "GPU pods held by an "
                                   "operator's pre-warm request now (0: none in force)")
        self._prewarm_invalid = Gauge("sonic_ray_prewarm_invalid", "1 while the pre-warm "
                                      "ConfigMap cannot be read (the controller's log says why)")

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = dict(getattr(ctx, "policy_state", None) or {})
        decision, found = self._queue_decision(ctx)
        if self.admission is not None:
            self.admission.decide(saturation(
                found.get("queue_ms_per_exec"), ctx.current_num_replicas,
                ctx.capacity_adjusted_max_replicas, self.saturated_queue_ms),
                starting_for_s(ctx, state))
        floor = self._floor(ctx, state)
        return max(self._with_demand(decision), floor, self._prewarmed()), {**state, **found}

    def _prewarmed(self) -> int:
        if self.prewarm is None:
            return 0
        pods = self.prewarm.floor()
        self._prewarm_pods.set(pods)
        self._prewarm_invalid.set(1 if self.prewarm.error else 0)
        return pods

    def _with_demand(self, decision: int) -> int:
        if self.gateway is None:
            return decision
        demand = self.gateway.demand
        if demand is None:
            if not self._said_no_demand:
                logger.warning("TritonQueueTimePolicy: no demand from the gateway (%s); "
                               "scaling on queue time alone, never to zero", self.gateway.error)
                self._said_no_demand = True
            return decision
        self._said_no_demand = False
        return max(decision, 1) if demand.calls else 0

    def _queue_decision(self, ctx: Any) -> tuple[int, dict[str, Any]]:
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

    def _floor(self, ctx: Any, state: dict[str, Any]) -> int:
        """The gateway's Tritons while this deployment has not run as many yet; 0 after."""
        if self.gateway is None or state.get("caught_up"):
            return 0
        now = float(getattr(ctx, "current_time", 0.0))
        since = state.setdefault("floor_since", now)
        seen = self.gateway.count
        # Never above what this deployment may run: a config whose max_replicas is below the
        # gateway's count (a site lowering it, in place or in an upgrade) would otherwise hold
        # a floor it can never reach, and never scale down again.
        floor = max(int(state.get("floor", 0)), seen or 0)
        most = getattr(ctx, "capacity_adjusted_max_replicas", None)
        if most is not None:
            floor = min(floor, int(most))
        state["floor"] = floor
        if seen is None and now - since < self.gateway_wait_s:
            return floor
        if seen is None:
            logger.warning("TritonQueueTimePolicy: no count of the gateway's Tritons within "
                           "%.0fs (%s); scaling on queue time alone", self.gateway_wait_s,
                           self.gateway.error)
        if ctx.current_num_replicas >= floor:
            state["caught_up"] = True
        return floor
