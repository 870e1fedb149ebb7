"""A pod's live sequences (docs/data-paths.md, "Sequences"): its Triton holds the state of
the sequences it started and no other Triton can run their later calls, so a pod out of the
gateway's ready Tritons (its replica leaving in a scale-down, or a NewCluster upgrade's old
cluster once KubeRay switched the ready pods' Service) must still get them. The gateway lists
every worker pod a second time, at priority 1 (gateway/envoy.yaml, the Triton clusters;
gateway/gateway.yaml's `triton-all-pods`), health-checked on this pod's holding ports, which
answer healthy while its Triton holds a live sequence, whether or not the pod is among the
ready ones: so it is healthy there before it leaves them, however the gateway learns that it
left (a replica cannot know before the gateway does when a Service stops listing its pod);
a call of such a sequence that the ready Tritons refused gets there. A sequence is live while
its model ran a call within the model's `max_sequence_idle_microseconds` (after that Triton
itself drops it): Triton's statistics say when each model last ran one."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from .pod_ready import answer_once

logger = logging.getLogger("ray.serve")

# Set only by `make local`, whose simulated pods share one host: each replica's own ports.
HOLDING_PORT_ENV = "SONIC_RAY_POD_HOLDING_PORT"
HOLDING_GRPC_PORT_ENV = "SONIC_RAY_POD_HOLDING_GRPC_PORT"
# Triton's default max_sequence_idle_microseconds (its model configuration's docs).
DEFAULT_SEQUENCE_IDLE_US = 1_000_000
# The gRPC health service Envoy's grpc_health_check asks, and its two answers serialised
# (HealthCheckResponse.status, field 1: SERVING 1, NOT_SERVING 2).
HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"
SERVING = b"\x08\x01"
NOT_SERVING = b"\x08\x02"


def sequence_idle_s(config: dict[str, Any]) -> float | None:
    """How long Triton keeps an idle sequence of the model whose configuration (Triton's
    /v2/models/<m>/config) this is; None for a model without sequences."""
    batching = config.get("sequence_batching")
    if not isinstance(batching, dict):
        return None
    micros = int(batching.get("max_sequence_idle_microseconds") or DEFAULT_SEQUENCE_IDLE_US)
    return micros / 1e6


def live_sequence_models(stats: dict[str, Any], idle_s: dict[str, float],
                         now_s: float) -> list[str]:
    """The sequence models (those in `idle_s`) that Triton's statistics (/v2/models/stats) say
    ran a call within their idle time before `now_s` (seconds since the epoch)."""
    live = set()
    for model in stats.get("model_stats", []):
        name = str(model.get("name", ""))
        last_ms = int(model.get("last_inference") or 0)
        if name in idle_s and last_ms > 0 and now_s - last_ms / 1000 < idle_s[name]:
            live.add(name)
    return sorted(live)


@dataclass
class Holding:
    """Whether this pod's replica is leaving, and the models whose sequences its Triton holds
    live."""

    leaving: bool = False
    live: list[str] = field(default_factory=list)

    def verdict(self) -> str | None:
        """None while the gateway may send this pod the calls of its sequences at priority 1,
        else why not. A ready pod's healthy copy there takes no call that the ready ones did
        not refuse first (the retry policies' previous_priorities)."""
        if not self.live:
            return "its Triton holds no live sequence"
        return None


class HoldingAnswers:
    """The holding ports: any GET on the HTTP one answers 200 while the holding's verdict is
    None, else 503 saying why (the HTTP cluster's check); grpc.health.v1 Check on the other
    answers SERVING or NOT_SERVING (the gRPC cluster's check). The gRPC server runs on a thread
    of its own, apart from the replica's event loop (which runs Serve's own gRPC)."""

    def __init__(self, holding: Holding) -> None:
        self._holding = holding
        self._http: asyncio.Server | None = None
        self._grpc: grpc.Server | None = None
        # When a check last came (time.monotonic()); None: never.
        self._asked: float | None = None

    def asked_within(self, seconds: float) -> bool:
        """Whether a check came within `seconds`: a gateway lists this pod at priority 1 (its
        Envoy checks every pod every second), so its sequences' calls can come here. On the
        Serve path nobody asks."""
        return self._asked is not None and time.monotonic() - self._asked <= seconds

    async def start(self, http_port: int, grpc_port: int) -> None:
        self._http = await asyncio.start_server(self._answer, "0.0.0.0", http_port)
        # Not shared with another process's server on the same port (gRPC's default).
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2,
                                                            thread_name_prefix="holding"),
                                 options=[("grpc.so_reuseport", 0)])
        handler = grpc.unary_unary_rpc_method_handler(self._check)
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "grpc.health.v1.Health", {"Check": handler}),))
        if self._grpc.add_insecure_port(f"0.0.0.0:{grpc_port}") == 0:
            raise OSError(f"the holding gRPC port {grpc_port} could not be bound")
        self._grpc.start()
        logger.info("the pod's holding of live sequences answers on ports %d (HTTP) and %d "
                    "(gRPC health)", http_port, grpc_port)

    async def stop(self) -> None:
        if self._grpc is not None:
            done = self._grpc.stop(grace=None)
            await asyncio.to_thread(done.wait, 5.0)
        if self._http is not None:
            self._http.close()
            await self._http.wait_closed()

    def _check(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._asked = time.monotonic()
        return SERVING if self._holding.verdict() is None else NOT_SERVING

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def answer(head: bytes) -> tuple[str, str]:
            self._asked = time.monotonic()
            why = self._holding.verdict()
            return (("200 OK", f"holding live sequences of {self._holding.live}")
                    if why is None else ("503 Service Unavailable", f"not holding: {why}"))

        await answer_once(reader, writer, answer)


__all__ = ["Holding", "HoldingAnswers", "live_sequence_models", "sequence_idle_s"]
