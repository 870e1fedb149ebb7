"""The overload cell's scenario, one home for `make bench` (bench/overload.py) and the tests
that assert its outcome (tests/stack/test_admission.py, tests/stack/test_fair_share.py): two
simulated pods at max_replicas serve the queue-bounded `queue_limited` model (tests/models:
0.2 s per batch, two instances, Triton's own queue policy); open-loop arrivals at twice that
capacity; the start-of-job gate read as a job reads it (docs/admission.md)."""

from __future__ import annotations

import asyncio
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc
import tritonclient.grpc.aio as tc_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gateway import local as gateway
from local_stack.harness import RunningStack, running_stack, serve_config_with
from local_stack.polling import until
from local_stack.triton import TEST_MODELS

MODEL = "queue_limited"


def one_number(path: Path, pattern: str) -> int:
    """The number `pattern` (one group, one match per line) finds exactly once in `path`."""
    found = re.findall(pattern, path.read_text(), re.MULTILINE)
    if len(found) != 1:
        raise RuntimeError(f"{path}: expected one {pattern!r}, found {found}")
    return int(found[0])


def model_setting(name: str) -> int:
    """One number of the model's config (tests/models/queue_limited/config.pbtxt, its home)."""
    return one_number(TEST_MODELS / MODEL / "config.pbtxt", rf"\b{name}: (\d+)")


# One execution (a batch of up to BATCH) takes this long, whatever the batch; the Tritons serve
# CAPACITY_PER_S between them.
EXEC_S = 0.2
TRITONS = 2
BATCH = model_setting("max_batch_size")
INSTANCES = model_setting("count")
CAPACITY_PER_S = TRITONS * INSTANCES * BATCH / EXEC_S
DEADLINE_S = 10.0
# The site's settings of the run, as the admission ConfigMap would give them.
SATURATED_QUEUE_MS = 150
RETRY_AFTER_S = 1
# Serve's autoscaling at test speed; min = max: the facility runs max_replicas.
AUTOSCALING = {"metrics_interval_s": 0.5, "look_back_period_s": 2, "upscale_delay_s": 1,
               "downscale_delay_s": 4, "min_replicas": TRITONS, "max_replicas": TRITONS}
GATE_WORD = gateway.HERE / "gate-word.sh"


def gateway_refresh_s() -> int:
    """How often the gateway fetches the control plane's word (every_s in
    gateway/gate-word.sh, its home)."""
    return one_number(GATE_WORD, r"^every_s=(\d+)$")


# How long the gateway's word lags the load: Serve's look-back and metrics interval, then the
# gateway's next fetch.
SIGNAL_LAG_S = (AUTOSCALING["look_back_period_s"] + AUTOSCALING["metrics_interval_s"]
                + gateway_refresh_s())
# How soon the gate opens again once the load is gone: the signal's lag, the policy's next
# loop, and room for this machine's pauses.
REOPEN_S = 15


@contextmanager
def saturable_stack(extra_env: dict[str, str] | None = None) -> Iterator[RunningStack]:
    """The gateway path with two pods at max_replicas and this run's admission settings."""
    with tempfile.TemporaryDirectory(prefix="sonic-ray-overload-") as directory:
        config = serve_config_with(Path(directory), deployment={"health_check_period_s": 2},
                                   autoscaling=AUTOSCALING,
                                   policy_kwargs={"target_queue_ms_per_exec": 50})
        with running_stack({"DATA_PATH": "gateway", "TRITONS": str(TRITONS),
                            "SERVE_CONFIG": str(config),
                            "SONIC_RAY_SATURATED_QUEUE_MS": str(SATURATED_QUEUE_MS),
                            "SONIC_RAY_RETRY_AFTER_S": str(RETRY_AFTER_S), **(extra_env or {})},
                           ready_pattern=r"gateway discovery: pods \[0, 1\]") as running:
            yield running


@dataclass
class Outcome:
    status: str  # "OK" or the gRPC status name
    took_s: float
    trailers: dict[str, str] = field(default_factory=dict)
    message: str = ""


@dataclass
class GateAnswer:
    at_s: float  # since the load began
    status: str  # "OK" or tritonclient's status, e.g. "StatusCode.CANCELLED"
    took_s: float
    message: str


@dataclass
class OverloadRun:
    seconds: float
    offered_per_s: float
    unloaded_s: list[float]
    outcomes: list[Outcome]
    gate: list[GateAnswer]
    reopened_after_s: float | None = None

    def of(self, status: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == status]

    def summary(self) -> str:
        admitted, refused = self.of("OK"), self.of("RESOURCE_EXHAUSTED")
        closed = [g for g in self.gate if g.status == "StatusCode.CANCELLED"]
        others = sorted({o.status for o in self.outcomes} - {"OK", "RESOURCE_EXHAUSTED"})
        parts = [
            f"{self.offered_per_s:.0f} calls/s offered (2x capacity) for {self.seconds:.0f} s: "
            f"{len(self.outcomes)} calls",
            f"admitted {len(admitted) / self.seconds:.1f}/s, p99 "
            f"{p99([o.took_s for o in admitted]) * 1000:.0f} ms (unloaded p99 "
            f"{p99(self.unloaded_s) * 1000:.0f} ms)",
            f"refused {len(refused)} ({len(refused) / max(1, len(self.outcomes)):.0%}), p99 "
            f"{p99([o.took_s for o in refused]) * 1000:.1f} ms, slowest "
            f"{max([o.took_s for o in refused], default=0) * 1000:.1f} ms",
            f"other outcomes: {', '.join(others) or 'none'}",
            (f"gate closed {len(closed)} of {len(self.gate)} times asked (first at "
             f"{closed[0].at_s:.1f} s)") if closed else "the gate never closed",
        ]
        if self.reopened_after_s is not None:
            parts.append(f"open again {self.reopened_after_s:.1f} s after the load")
        return "; ".join(parts)


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else 0.0


def _request(seconds: float) -> service_pb2.ModelInferRequest:
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name="SECONDS", datatype="FP32",
                                                            shape=[1, 1])
    return service_pb2.ModelInferRequest(
        model_name=MODEL, inputs=[tensor],
        raw_input_contents=[np.array([[seconds]], dtype=np.float32).tobytes()])


async def infer(stub: service_pb2_grpc.GRPCInferenceServiceStub,
                metadata: tuple[tuple[str, str], ...] = ()) -> Outcome:
    """One call of EXEC_S to the model, as it ended."""
    started = time.monotonic()
    try:
        await stub.ModelInfer(_request(EXEC_S), timeout=DEADLINE_S, metadata=metadata)
        return Outcome("OK", time.monotonic() - started)
    except grpc.aio.AioRpcError as error:
        trailers = {k: str(v) for k, v in (error.trailing_metadata() or ())}
        return Outcome(error.code().name, time.monotonic() - started, trailers,
                       error.details() or "")


async def job_start(client: tc_aio.InferenceServerClient, since: float = 0.0,
                    timeout_s: float | None = None) -> GateAnswer:
    """A job's RepositoryIndex, as tritonclient reports its answer (with `timeout_s`, its
    deadline)."""
    started = time.monotonic()
    try:
        await client.get_model_repository_index(client_timeout=timeout_s)
        return GateAnswer(started - since, "OK", time.monotonic() - started, "")
    except InferenceServerException as error:
        return GateAnswer(started - since, str(error.status()), time.monotonic() - started,
                          str(error.message()))


def gate_answer(url: str, timeout_s: float | None = None) -> GateAnswer:
    async def ask() -> GateAnswer:
        client = tc_aio.InferenceServerClient(url)
        try:
            return await job_start(client, timeout_s=timeout_s)
        finally:
            await client.close()

    return asyncio.run(ask())


# A poll's deadline: a job start that reached a Triton just before it froze waits for the
# gateway's upstream keepalive (gateway/envoy.yaml, 15 s), longer than a poll may take.
POLL_DEADLINE_S = 2.0


def gate_is(url: str, status: str) -> bool | GateAnswer:
    """True once RepositoryIndex gets `status` ("OK" or a gRPC status), else the answer (a
    call still unanswered after POLL_DEADLINE_S counts as not yet)."""
    answer = gate_answer(url, timeout_s=POLL_DEADLINE_S)
    return True if answer.status == status else answer


async def open_loop(stub: service_pb2_grpc.GRPCInferenceServiceStub, rate: float,
                    seconds: float, start: float, in_flight: int | None = None,
                    stop: threading.Event | None = None) -> tuple[list[Outcome], int]:
    """Calls at `rate` from `start` for `seconds`, each at its time whatever came back (open
    loop): how they ended. With `in_flight`, a call due while that many are under way is
    refused by the caller instead (as a gateway's bound would), and counted. With `stop`, no
    call starts once it is set (call i is still the one due at start + i / rate)."""
    calls: list[asyncio.Task[Outcome]] = []
    refused_here = under_way = 0

    def ended(_: asyncio.Task[Outcome]) -> None:
        nonlocal under_way
        under_way -= 1

    for i in range(int(seconds * rate)):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if stop is not None and stop.is_set():
            break
        if in_flight is not None and under_way >= in_flight:
            refused_here += 1
            continue
        calls.append(asyncio.create_task(infer(stub)))
        under_way += 1
        calls[-1].add_done_callback(ended)
    return list(await asyncio.gather(*calls)), refused_here


def overload(url: str, seconds: float = 60.0) -> OverloadRun:
    """The unloaded latency, then arrivals at twice the capacity for `seconds` with a job
    start every half second, then how long until the gate opens again."""

    async def run() -> OverloadRun:
        async with grpc.aio.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            unloaded = []
            for _ in range(20):
                outcome = await infer(stub)
                if outcome.status != "OK":
                    raise RuntimeError(f"an unloaded call failed: {outcome}")
                unloaded.append(outcome.took_s)
            client = tc_aio.InferenceServerClient(url)
            gate: list[GateAnswer] = []
            start = time.monotonic()

            async def watch_gate() -> None:
                while time.monotonic() - start < seconds:
                    gate.append(await job_start(client, start))
                    await asyncio.sleep(0.5)

            watcher = asyncio.create_task(watch_gate())
            rate = 2 * CAPACITY_PER_S
            outcomes, _ = await open_loop(stub, rate, seconds, start)
            await watcher
            await client.close()
            return OverloadRun(seconds, rate, unloaded, outcomes, gate)

    result = asyncio.run(run())
    gone = time.monotonic()
    until("the gate to open", lambda: gate_is(url, "OK"), REOPEN_S)
    result.reopened_after_s = time.monotonic() - gone
    return result


@dataclass
class TritonCounts:
    """One Triton's cumulative statistics of MODEL (its own, not the client's view)."""

    executions: int
    calls: int
    queue_ns: int
    compute_ns: int

    @classmethod
    def read(cls, url: str) -> TritonCounts:
        client = tritonclient.grpc.InferenceServerClient(url)
        try:
            stats = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        finally:
            client.close()
        inference = stats["inference_stats"]
        # Protobuf's JSON leaves out what is zero.
        return cls(int(stats.get("execution_count", 0)), int(stats.get("inference_count", 0)),
                   int(inference.get("queue", {}).get("ns", 0)),
                   int(inference.get("compute_infer", {}).get("ns", 0)))

    def since(self, before: TritonCounts, seconds: float) -> str:
        executions, calls = self.executions - before.executions, self.calls - before.calls
        return (f"{executions / seconds:.1f} executions/s of {calls / max(executions, 1):.1f} "
                f"calls, per call {(self.queue_ns - before.queue_ns) / max(calls, 1) / 1e6:.0f} "
                f"ms queued and {(self.compute_ns - before.compute_ns) / max(calls, 1) / 1e6:.0f}"
                " ms executing")
