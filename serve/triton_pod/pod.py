"""The Serve deployment, one replica per Triton pod: the control plane of both data paths.

Each replica holds its pod's `triton` resource, becomes ready only once its Triton answers
ServerReady, fails its health check when Triton does not answer ServerLive, and reports its
Triton's queue time to Serve's autoscaler (autoscaling.py turns that into replicas, the Ray
autoscaler into GPU pods). On the gateway path (the default) Envoy carries the calls and the
replica only steers; on the Serve path it also forwards each call to its pod's Triton
(grpc_forwarding.py, and http_forwarding.py for Triton's HTTP/REST API)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import grpc
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.util.metrics import Counter, Gauge
from starlette.requests import Request
from starlette.responses import Response

from .access import HTTP_ADMIN_HEADER, TokenCheck, admin_key
from .grpc_forwarding import MAX_MESSAGE_BYTES, GrpcForwarding, install_rpc_methods
from .holding import (
    HOLDING_GRPC_PORT_ENV,
    HOLDING_PORT_ENV,
    Holding,
    HoldingAnswers,
    live_sequence_models,
    sequence_idle_s,
)
from .http_forwarding import HttpForwarder
from .pod_ready import POD_READY_PORT_ENV, TRITON_CHECK_S, PodReadiness
from .routing import ASKED
from .rpcs import BY_NAME, REFUSABLE, RPCS
from .sequences import INFERENCE_HEADER_LENGTH, Answer, AnswerT, HttpAnswer, held_elsewhere
from .triton_metrics import QUEUE_METRIC, QueueTime, scrape
from .warmup import WarmupArgs, WarmupError, warm_up

logger = logging.getLogger("ray.serve")

# Set only by `make local`, whose simulated pods share one host: each Ray node's replica talks
# to its own Triton, as a pod's does on localhost.
TRITON_ADDRESS_ENV = "SONIC_RAY_TRITON_ADDRESS"
TRITON_HTTP_ADDRESS_ENV = "SONIC_RAY_TRITON_HTTP_ADDRESS"
TRITON_METRICS_URL_ENV = "SONIC_RAY_TRITON_METRICS_URL"
GAUGES_AGAIN_S = 10.0
# How long a count of the deployment's running replicas serves the calls of sequences held
# elsewhere (one question to Serve's controller, not one per such call). A replica added since
# holds no sequence yet; one gone since answers that it was asked (sequences.py).
REPLICAS_AGAIN_S = 2.0
# A leaving pod with live sequences answers healthy on its holding ports this long before it
# stops being ready: Envoy checks every second (gateway/envoy.yaml, the Triton clusters), so
# its priority-1 copy is healthy before its priority-0 one goes, even for a sequence that
# started since its last read (HOLDING_POLL_S).
HANDOVER_S = 2.0
# How often a leaving replica reads its Triton's statistics again.
LEAVE_POLL_S = 0.5
# How often a ready pod that a gateway checks reads which sequences its Triton holds live
# (holding.py): its holding ports answer from that.
HOLDING_POLL_S = 1.0
# A leaving replica waits for its sequences only where a gateway checked its holding ports
# this recently (gateway/envoy.yaml: every second): on the Serve path nothing would reach it.
GATEWAY_CHECKED_S = 5.0


class TritonPodArgs(BaseModel):
    """The application's `args` in the Serve config; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    triton_address: str = Field(
        "localhost:8001", description="host:port of the Triton gRPC endpoint in this pod"
    )
    triton_http_address: str = Field(
        "localhost:8100",
        description="host:port of the Triton HTTP endpoint in this pod (Serve path's HTTP)",
    )
    triton_metrics_url: str = Field(
        "http://localhost:8002/metrics",
        description="Triton's Prometheus metrics in this pod: the autoscaling signal",
    )
    allowed_admin_rpcs: list[str] = Field(
        default_factory=list,
        description="RPCs refused by default that this deployment should forward anyway",
    )
    ready_timeout_s: float = Field(
        600.0, gt=0, description="how long a new replica waits for Triton's ServerReady"
    )
    health_timeout_s: float = Field(
        5.0, gt=0, description="deadline of the ServerLive call of each health check"
    )
    max_message_bytes: int = Field(MAX_MESSAGE_BYTES, gt=0, le=MAX_MESSAGE_BYTES)
    ready_port: int = Field(
        8103, gt=0, lt=65536,
        description="where the pod's readiness (Triton ready, models warm) answers: the "
                    "Triton container's readinessProbe (pod_ready.py)")
    holding_port: int = Field(
        8104, gt=0, lt=65536,
        description="where a leaving pod answers the HTTP Triton cluster's check of its live "
                    "sequences (holding.py; gateway/envoy.yaml's priority 1)")
    holding_grpc_port: int = Field(
        8105, gt=0, lt=65536,
        description="the same for the gRPC Triton cluster (grpc.health.v1)")
    leave_wait_s: float = Field(
        45.0, ge=0,
        description="how long a stopping replica waits while its Triton holds live sequences "
                    "(below graceful_shutdown_timeout_s: invariant leaving-pods-reachable)")
    warmup: WarmupArgs = Field(default_factory=WarmupArgs,
                               description="the models' warm-up before the pod joins (warmup.py)")

    @field_validator("allowed_admin_rpcs")
    @classmethod
    def _known_rpcs(cls, names: list[str]) -> list[str]:
        unknown = sorted(set(names) - REFUSABLE)
        if unknown:
            raise ValueError(
                f"allowed_admin_rpcs: {unknown} are not refusable Triton RPCs; "
                f"choose from {sorted(REFUSABLE)}"
            )
        return names


# The failure counter's model when Triton's list of ready models could not be read: no model's
# warm-up could start, so the failure is the pod's, not one model's.
NO_MODEL_LIST = "(no list of models)"


class TritonPod(GrpcForwarding):
    # Serve awaits an async constructor, so a replica counts as started only once its Triton
    # is ready.
    async def __init__(self, args: TritonPodArgs) -> None:  # type: ignore[misc]
        address = os.environ.get(TRITON_ADDRESS_ENV) or args.triton_address
        http_address = os.environ.get(TRITON_HTTP_ADDRESS_ENV) or args.triton_http_address
        metrics_url = os.environ.get(TRITON_METRICS_URL_ENV) or args.triton_metrics_url
        args = args.model_copy(update={"triton_address": address,
                                       "triton_http_address": http_address,
                                       "triton_metrics_url": metrics_url})
        self._args = args
        self._queue_time = QueueTime()
        options = [
            ("grpc.max_send_message_length", args.max_message_bytes),
            ("grpc.max_receive_message_length", args.max_message_bytes),
            # Triton restarts in place; reconnect quickly instead of backing off for minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._channel = grpc.aio.insecure_channel(args.triton_address, options=options)
        self._unary = {
            rpc.name: self._channel.unary_unary(rpc.path) for rpc in RPCS if not rpc.streaming
        }
        self._streams = {
            rpc.name: self._channel.stream_stream(rpc.path) for rpc in RPCS if rpc.streaming
        }
        self._allowed = frozenset(args.allowed_admin_rpcs)
        self._tokens = TokenCheck.from_env()
        self._admin_key = admin_key()
        self._http = HttpForwarder(args.triton_http_address, self._allowed, self._tokens,
                                   self._admin_key)
        self._http.held_elsewhere = self._http_held_elsewhere
        self._readiness = PodReadiness(self._triton_ready)
        self._warmup_seconds = Gauge(
            "sonic_ray_warmup_seconds", "Seconds the last warm-up of a model took on this pod",
            tag_keys=("model",))
        self._warmup_pod_seconds = Gauge(
            "sonic_ray_warmup_pod_seconds", "Seconds the last warm-up of this pod took")
        self._warmup_failures = Counter(
            "sonic_ray_warmup_failures", "Warm-ups of a model that failed or ran out of time",
            tag_keys=("model",))
        self._warm_failed: str | None = None
        # This deployment's handle, made on the first call of a sequence held elsewhere, and
        # when its running replicas were last counted, and how many.
        self._peers: Any = None
        self._replicas_seen: tuple[float, int] | None = None
        # The last warm-up's gauges, recorded again now and then (GAUGES_AGAIN_S).
        self._gauges: dict[str | None, float] = {}
        await self._readiness.start(int(os.environ.get(POD_READY_PORT_ENV) or args.ready_port))
        self._holding = Holding()
        self._holding_answers = HoldingAnswers(self._holding)
        # The models' idle times, read from Triton once the holding meets them.
        self._idle_s: dict[str, float | None] = {}
        self._stats_failed = False
        await self._holding_answers.start(
            int(os.environ.get(HOLDING_PORT_ENV) or args.holding_port),
            int(os.environ.get(HOLDING_GRPC_PORT_ENV) or args.holding_grpc_port))
        await self._wait_for_triton()
        await self._warm()
        self._watch = asyncio.get_running_loop().create_task(self._watch_triton())
        self._holding_watch = asyncio.get_running_loop().create_task(self._watch_live())

    def __del__(self) -> Awaitable[None] | None:
        """Serve's stop of this replica: Serve awaits what this returns (its replica wrapper
        accepts a coroutine from `__del__`). Python's own call when the object is collected,
        outside a running loop, does nothing."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        if not hasattr(self, "_holding") or self._holding.leaving:
            return None
        return self._leave()

    async def _leave(self) -> None:
        """The pod leaves the ready ones; while its Triton holds live sequences (holding.py),
        up to `leave_wait_s`, the replica stays, answering healthy on its holding ports, so the
        gateway sends those sequences' calls here until they end or go idle."""
        self._holding.leaving = True
        await self._update_holding()
        if self._holding.live and not self._holding_answers.asked_within(GATEWAY_CHECKED_S):
            logger.info("leaving with live sequences of %s, which end here: no gateway checks "
                        "this pod's holding ports (the Serve path)", self._holding.live)
            self._holding.live = []
        if self._holding.live:
            logger.info("leaving with live sequences of %s: the gateway sends their calls here "
                        "for up to %.0f s", self._holding.live, self._args.leave_wait_s)
            await asyncio.sleep(HANDOVER_S)
        self._readiness.stopping = True
        deadline = time.monotonic() + self._args.leave_wait_s
        while self._holding.live and time.monotonic() < deadline:
            await asyncio.sleep(LEAVE_POLL_S)
            await self._update_holding()
        if self._holding.live:
            logger.warning("left after %.0f s (leave_wait_s) with live sequences of %s: their "
                           "next calls are refused", self._args.leave_wait_s,
                           self._holding.live)
        else:
            logger.info("left holding no live sequence")
        await self._holding_answers.stop()

    async def _watch_live(self) -> None:
        """Which sequences its Triton holds live, read every HOLDING_POLL_S while a gateway
        checks the holding ports (nobody does on the Serve path): they answer healthy while
        there is one, so the pod is healthy at the gateway's priority 1 before it leaves the
        ready ones, by a scale-down or by an upgrade's switch of the ready pods' Service to a
        new cluster (which the gateway may learn first); a leaving replica reads them itself."""
        while not self._holding.leaving:
            await asyncio.sleep(HOLDING_POLL_S)
            if self._holding.leaving or not self._holding_answers.asked_within(
                    GATEWAY_CHECKED_S):
                continue
            live = await self._live_sequences()
            if not self._holding.leaving:
                self._holding.live = live

    async def _update_holding(self) -> None:
        self._holding.live = await self._live_sequences()

    async def _live_sequences(self) -> list[str]:
        """The sequence models Triton ran a call of within their idle time; what Triton does
        not answer counts as none (a Triton gone holds nothing), said once until it answers."""
        try:
            status, body = await self._request("GET", "/v2/models/stats", None, {}, 2.0)
            if status != 200:
                raise RuntimeError(f"Triton's statistics answered {status}: {body[:200]!r}")
            stats: dict[str, Any] = json.loads(body)
            for model in {str(m.get("name", "")) for m in stats.get("model_stats", [])}:
                if model not in self._idle_s:
                    self._idle_s[model] = sequence_idle_s(await self._config(model))
            idle = {m: s for m, s in self._idle_s.items() if s is not None}
            self._stats_failed = False
            return live_sequence_models(stats, idle, time.time())
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as error:
            if not self._stats_failed:
                logger.warning("the pod could not read its Triton's statistics: %s; it holds "
                               "no live sequence until they answer", error)
            self._stats_failed = True
            return []

    async def _triton_says(self, rpc: str, timeout: float) -> str | None:
        """None when Triton answers `rpc` (ServerReady or ServerLive) true, else why not. Both
        answer OK with one bool field, which serialises to b"\\x08\\x01" when true and to
        nothing when false (ServerReady while models load)."""
        try:
            reply = await self._unary[rpc](b"", timeout=timeout)
        except grpc.aio.AioRpcError as error:
            return f"{error.code().name}: {error.details()}"
        return None if reply == b"\x08\x01" else f"{rpc} answered false"

    async def _triton_ready(self) -> str | None:
        why = await self._triton_says("ServerReady", TRITON_CHECK_S) or await self._http_ready()
        return None if why is None else f"Triton: {why}"

    async def _post(self, path: str, body: bytes, header_length: int | None,
                    timeout_s: float) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/octet-stream" if header_length is not None
                   else "application/json"}
        if header_length is not None:
            headers[INFERENCE_HEADER_LENGTH] = str(header_length)
        return await self._request("POST", path, body, headers, timeout_s)

    async def _request(self, method: str, path: str, body: bytes | None,
                       headers: dict[str, str], timeout_s: float) -> tuple[int, bytes]:
        return await self._http.call(method, path, body, headers, timeout_s)

    async def _config(self, model: str) -> dict[str, Any]:
        status, body = await self._request("GET", f"/v2/models/{model}/config", None, {},
                                           self._args.warmup.call_timeout_s)
        if status != 200:
            raise RuntimeError(f"its config: Triton answered {status}: {body[:300]!r}")
        config: dict[str, Any] = json.loads(body)
        return config

    async def _ready_models(self) -> list[str]:
        headers = {"Content-Type": "application/json"}
        if self._admin_key:
            headers[HTTP_ADMIN_HEADER] = self._admin_key
        status, body = await self._request("POST", "/v2/repository/index", b'{"ready": true}',
                                           headers, self._args.warmup.call_timeout_s)
        if status != 200:
            raise RuntimeError(f"Triton's repository index answered {status}: {body[:300]!r}")
        return sorted({str(entry["name"]) for entry in json.loads(body)
                       if entry.get("state", "READY") == "READY"})

    def _report(self, model: str, seconds: float | None, error: str | None) -> None:
        if seconds is not None:
            self._gauges[model] = seconds
            self._warmup_seconds.set(seconds, tags={"model": model})
        if error is not None:
            self._warmup_failures.inc(tags={"model": model})

    async def _warm(self) -> None:
        """Warms the ready models (warmup.py); the pod answers ready only after it. Raises
        WarmupError under `on_failure: fail`: Serve starts another replica."""
        self._readiness.warm = False
        self._readiness.reason = "its models are warming up"
        started = time.monotonic()
        if not self._args.warmup.enabled:
            logger.info("warm-up: turned off by the site (args.warmup.enabled)")
            self._readiness.warm = True
            return
        try:
            models = await self._ready_models()
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as error:
            message = f"warm-up: the ready models could not be listed: {error}"
            logger.error("%s", message)
            self._warmup_failures.inc(tags={"model": NO_MODEL_LIST})
            if self._args.warmup.on_failure == "fail":
                raise WarmupError(message) from error
            models = []
        outcome = await warm_up(models, self._config, self._post, self._args.warmup,
                                self._report)
        self._gauges[None] = time.monotonic() - started
        self._record_gauges()
        logger.info("Triton at %s: %s", self._args.triton_address, outcome.line())
        self._readiness.warm = True

    def _record_gauges(self) -> None:
        for model, seconds in self._gauges.items():
            if model is None:
                self._warmup_pod_seconds.set(seconds)
            else:
                self._warmup_seconds.set(seconds, tags={"model": model})

    async def _watch_triton(self) -> None:
        """A Triton that was not ready (restarted, reloading) has cold models again: the pod
        stays unready until they are warmed once more. Records the last warm-up's gauges
        again every GAUGES_AGAIN_S: a gauge set once is gone from Ray's export when a replica in
        the same node is replaced (seen: every warm-up series absent 15 s after a SIGKILLed
        replica's successor warmed; tests/stack/test_observability.py's serve path)."""
        recorded = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            if time.monotonic() - recorded >= GAUGES_AGAIN_S:
                self._record_gauges()
                recorded = time.monotonic()
            why = await self._triton_ready()
            if why is not None:
                if self._readiness.warm:
                    logger.warning("Triton at %s is not ready (%s): its models will be "
                                   "warmed again before the pod takes calls",
                                   self._args.triton_address, why)
                self._readiness.warm = False
                self._readiness.reason = why
                continue
            if not self._readiness.warm and self._warm_failed is None:
                try:
                    await self._warm()
                except WarmupError as error:
                    self._warm_failed = str(error)
                    self._readiness.reason = self._warm_failed
                except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as error:
                    logger.warning("warm-up after Triton's restart: %s; trying again", error)

    async def _http_ready(self) -> str | None:
        """None when Triton's HTTP endpoint answers ready, else why not. Triton starts its gRPC
        endpoint a moment before its HTTP one: ready over gRPC, it may still refuse HTTP (seen:
        the warm-up's list of models refused 3 ms after ServerReady, so the pod joined with
        every model cold). Asked on a connection of its own, closed after the answer: Triton's
        shutdown waits for every open HTTP connection (seen: a kept-alive one of this check held
        a draining Triton until its --exit-timeout-secs, which it then left with status 1)."""
        try:
            status, _ = await self._request("GET", "/v2/health/ready", None,
                                            {"Connection": "close"}, 2.0)
        except (aiohttp.ClientError, TimeoutError) as error:
            return f"HTTP: {error}"
        return None if status == 200 else f"HTTP: /v2/health/ready answered {status}"

    async def _wait_for_triton(self) -> None:
        """Until Triton answers ready on both its endpoints (gRPC ServerReady, HTTP
        /v2/health/ready): the warm-up and the Serve path's HTTP calls use the latter."""
        address = self._args.triton_address
        deadline = time.monotonic() + self._args.ready_timeout_s
        next_log = 0.0
        last_error = ""
        while True:
            why = await self._triton_says("ServerReady", 2.0) or await self._http_ready()
            if why is None:
                logger.info("Triton at %s is ready", address)
                return
            last_error = why
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"Triton at {address} was not ready within "
                    f"{self._args.ready_timeout_s:.0f}s (last answer: {last_error})"
                )
            if now >= next_log:
                logger.info("waiting for Triton at %s to be ready (%s)", address, last_error)
                next_log = now + 10.0
            await asyncio.sleep(0.5)

    async def infer_if_held(self, request: bytes, metadata: list[tuple[str, Any]],
                            timeout: float | None, asked: list[str]) -> Answer:
        """Another replica's call of a sequence its Triton does not hold, asked of this one
        (sequences.py; routing.py sends it to a replica not in `asked`); answered at once if
        this one was asked before."""
        me = serve.get_replica_context().replica_tag
        if me in asked:
            return Answer(me, asked_before=True)
        return await self.ask_triton(request, metadata, timeout, me)

    async def http_if_held(self, method: str, path: str, headers: list[tuple[str, str]],
                           body: bytes, asked: list[str]) -> HttpAnswer:
        """infer_if_held for an HTTP infer."""
        me = serve.get_replica_context().replica_tag
        if me in asked:
            return HttpAnswer(me, asked_before=True)
        status, returned, reply = await self._http.ask(method, path, headers, body)
        return HttpAnswer(me, status=status, headers=returned, body=reply)

    async def _held_elsewhere(self, request: bytes, metadata: list[tuple[str, Any]],
                              timeout: float | None) -> Answer | None:
        deadline = None if timeout is None else time.monotonic() + timeout

        async def ask(peers: Any, asked: list[str]) -> Answer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            answer: Answer = await peers.infer_if_held.remote(request, metadata, left,
                                                              **{ASKED: asked})
            return answer

        return await self._ask_others(ask)

    async def _http_held_elsewhere(self, method: str, path: str,
                                   headers: list[tuple[str, str]],
                                   body: bytes) -> HttpAnswer | None:
        async def ask(peers: Any, asked: list[str]) -> HttpAnswer:
            answer: HttpAnswer = await peers.http_if_held.remote(method, path, headers, body,
                                                                 **{ASKED: asked})
            return answer

        return await self._ask_others(ask)

    async def _ask_others(self, ask: Callable[[Any, list[str]], Awaitable[AnswerT]],
                          ) -> AnswerT | None:
        """held_elsewhere (sequences.py) over this deployment's other replicas, each question
        put by `ask` (this deployment's handle, the replicas asked so far)."""
        context = serve.get_replica_context()
        try:
            now = time.monotonic()
            if self._replicas_seen is None or now - self._replicas_seen[0] >= REPLICAS_AGAIN_S:
                self._replicas_seen = (now, await asyncio.to_thread(
                    running_replicas, context.app_name, context.deployment))
            replicas = self._replicas_seen[1]
            if replicas < 2:
                return None
            if self._peers is None:
                self._peers = serve.get_deployment_handle(context.deployment, context.app_name)
            peers = self._peers
            return await held_elsewhere(lambda asked: ask(peers, asked), context.replica_tag,
                                        replicas)
        # Whatever Serve raises, the refusal stands (and is said).
        except Exception as error:
            logger.warning("a call of a sequence this pod's Triton does not hold was not "
                           "asked of the other replicas: %r; the client gets the refusal",
                           error)
            return None

    async def __call__(self, request: Request) -> Response:
        """Serve's HTTP proxy: Triton's HTTP/REST API, passed to this pod's Triton."""
        return await self._http.forward(request)

    async def check_health(self) -> None:
        """Serve's health check: a Triton that does not answer ServerLive fails the replica,
        as does a warm-up after a Triton restart that failed under `on_failure: fail`."""
        if self._warm_failed is not None:
            raise RuntimeError(self._warm_failed)
        why = await self._triton_says("ServerLive", self._args.health_timeout_s)
        if why is not None:
            raise RuntimeError(f"Triton at {self._args.triton_address} is not live: {why}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook: this replica's Triton queue time per execution."""
        counters = await asyncio.to_thread(scrape, self._args.triton_metrics_url, 5.0)
        return {QUEUE_METRIC: self._queue_time.update(counters)}


def running_replicas(app: str, deployment: str) -> int:
    """How many replicas of the deployment run now (Serve's controller)."""
    overview = serve.status().applications.get(app)
    found = overview.deployments.get(deployment) if overview is not None else None
    if found is None:
        return 0
    # Serve's ReplicaState is a str enum: its RUNNING equals the string.
    return sum(count for state, count in found.replica_states.items() if state == "RUNNING")


install_rpc_methods(TritonPod)
TritonPodDeployment: Any = serve.deployment(TritonPod, name="TritonPod")


def build_app(args: dict[str, Any]) -> Any:
    """The application builder that the Serve config's `import_path` names: the app's `args`
    are checked here, so a misspelt key fails the deploy with a message naming it."""
    return TritonPodDeployment.bind(TritonPodArgs.model_validate(args))


__all__ = ["BY_NAME", "TritonPod", "TritonPodArgs", "build_app"]
