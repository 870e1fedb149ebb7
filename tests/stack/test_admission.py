"""Admission on the gateway path (docs/admission.md), on a stack of its own: two simulated pods
(TRITONS=2) at max_replicas, the queue-bounded `queue_limited` model (tests/models), and site
settings in the environment as the `admission` ConfigMap gives them (gateway/admission.env):
a saturated facility refuses calls beyond Triton's queue at once with RESOURCE_EXHAUSTED and a
retry hint, keeps the admitted calls' latency bounded, and turns new jobs away at
RepositoryIndex (the start-of-job gate) while saturated and while no Triton is ready; by the
shipped rule, a stale word of the control plane turns no job away (both rules:
tests/gateway/test_gate_stale_rule.py). The load is make bench's overload cell
(local_stack/overload.py, which bench/overload.py runs)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from local_stack.harness import RunningStack, processes_left_behind
from local_stack.overload import (
    CAPACITY_PER_S,
    DEADLINE_S,
    EXEC_S,
    MODEL,
    POLL_DEADLINE_S,
    REOPEN_S,
    RETRY_AFTER_S,
    SIGNAL_LAG_S,
    Outcome,
    gate_answer,
    gate_is,
    open_loop,
    overload,
    p99,
    saturable_stack,
)
from local_stack.polling import until
from tests.support.callers import a_line_since, lines_since
from tests.support.sockets import listening_pid

STALE_S = 3
# The overload's length: bench/overload.py measures 60 s; half holds every bound below (the
# gate closes within 2 s of saturation and thousands of calls are refused).
OVERLOAD_S = 30
# An admitted call may wait for the batch executing, then run its own: near two executions
# against one unloaded (docs/admission.md, "Why 2x is the edge"), and Triton's batcher still
# leaves an instance idle up to 500 ms now and then: measured 1.8-3.6x the unloaded p99 here
# (3.6x with one instance, which idles after most batches). The 2x is not always met.
ADMITTED_P99_BOUND = 5
# Refusals take ~5 ms; the slowest of thousands meets a pause of this 2-core machine.
REFUSED_P99_S = 0.05
REFUSED_MAX_S = 0.25
# The bound for every refusal, held at the gateway but for this shared 2-core
# machine's pauses (the slowest of ~5,000 refusals measured 15-114 ms at the client, 21 ms at
# the gateway, the same pause): at most one refusal in REFUSED_PAUSED_SHARE over it.
REFUSED_AT_GATEWAY_S = 0.05
REFUSED_PAUSED_SHARE = 1 / 1000
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
# How Envoy's %GRPC_STATUS% names RESOURCE_EXHAUSTED in the access log.
REFUSED_STATUS = {"ResourceExhausted", "8"}


def _access_log(stack: RunningStack) -> Path:
    return Path(stack.process.wait_for_line(r"access log \(a JSON line per call\): (\S+)",
                                            1).group(1))


def _refused_infer(line: dict[str, Any]) -> bool:
    """An access-log line of an inference the gateway answered RESOURCE_EXHAUSTED."""
    return bool(line["path"] == INFER_PATH and line["grpc_status"] in REFUSED_STATUS)


@pytest.fixture(scope="module")
def saturable() -> Iterator[RunningStack]:
    # The shipped stale rule (open), stale sooner than the shipped 10 s.
    with saturable_stack({"SONIC_RAY_GATE_STALE_S": str(STALE_S)}) as running:
        yield running
    assert running.process.process.returncode == 0
    assert not processes_left_behind(running.process)


def test_twice_the_capacity_is_refused_at_once_and_closes_the_gate(saturable: RunningStack) -> None:
    since = time.time()
    run = overload(saturable.url("GRPC_PORT"), seconds=OVERLOAD_S)
    print(run.summary())
    admitted, refused = run.of("OK"), run.of("RESOURCE_EXHAUSTED")
    others = sorted({o.status for o in run.outcomes} - {"OK", "RESOURCE_EXHAUSTED"})
    assert others == [], f"calls ended otherwise (none at its deadline): {others}"
    assert refused and admitted
    assert p99([o.took_s for o in refused]) < REFUSED_P99_S
    assert max(o.took_s for o in refused) < REFUSED_MAX_S
    # Every refusal as the gateway answered it (its access log): the client's own time adds
    # this loaded 2-core machine's pauses.
    lines = lines_since(_access_log(saturable), since,
                        len(run.unloaded_s) + len(run.outcomes) + len(run.gate))
    at_gateway = [line["duration_ms"] / 1000 for line in lines if _refused_infer(line)]
    print(f"refused at the gateway: {len(at_gateway)}, p99 {p99(at_gateway) * 1000:.1f} ms, "
          f"slowest {max(at_gateway, default=0) * 1000:.1f} ms")
    assert len(at_gateway) == len(refused), {line["grpc_status"] for line in lines}
    slow = [took for took in at_gateway if took >= REFUSED_AT_GATEWAY_S]
    assert len(slow) <= REFUSED_PAUSED_SHARE * len(at_gateway), sorted(at_gateway)[-10:]
    assert {o.trailers.get("grpc-retry-pushback-ms") for o in refused} == {
        str(RETRY_AFTER_S * 1000)}
    # The start-of-job gate closed while saturated, answered at once, and opened again.
    closed = [g for g in run.gate if g.status == "StatusCode.CANCELLED"]
    assert closed, f"the gate never closed: {run.gate}"
    assert all(g.took_s < 0.05 for g in closed), closed
    assert all("saturated" in g.message for g in closed), closed
    assert run.reopened_after_s is not None
    # What Triton's queue policy bounds (docs/admission.md); without it the wait would grow
    # to the deadline.
    assert p99([o.took_s for o in admitted]) <= ADMITTED_P99_BOUND * p99(run.unloaded_s)


def test_http_beyond_the_queue_gets_429_with_retry_after(saturable: RunningStack) -> None:
    url = f"http://{saturable.url('HTTP_PORT')}/v2/models/{MODEL}/infer"
    body = json.dumps({"inputs": [{"name": "SECONDS", "shape": [1, 1], "datatype": "FP32",
                                   "data": [EXEC_S]}]}).encode()

    def one(_: int) -> tuple[int, str | None, str]:
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
                return response.status, None, ""
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("retry-after"), error.read().decode()

    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(one, range(30)))
    codes = sorted({code for code, _, _ in answers})
    assert codes == [200, 429], [a for a in answers if a[0] != 200][:3]
    for code, retry_after, text in answers:
        if code == 429:
            assert retry_after == str(RETRY_AFTER_S)
            assert "Exceeds maximum queue size" in json.loads(text)["error"]


def _from_an_open_gate(url: str) -> None:
    """Waits out the saturation an earlier test's load left: a test of another reason for the
    gate starts with it open, else its answers say "saturated" (the control plane's word comes
    first; seen after the 429 test's load, through the next two tests). Open for SIGNAL_LAG_S
    on end: open once may be before the control plane has seen that load (seen: open, then
    "saturated" while the Tritons were stopped)."""
    open_since: float | None = None

    def stays_open() -> object:
        nonlocal open_since
        answer = gate_is(url, "OK")
        if answer is not True:
            open_since = None
            return answer
        now = time.monotonic()
        open_since = open_since or now
        return now - open_since >= SIGNAL_LAG_S or f"open for {now - open_since:.1f} s"

    until("the gate to stay open after the earlier load", stays_open, REOPEN_S + SIGNAL_LAG_S)


def test_no_triton_ready_closes_the_gate_and_one_ready_opens_it(saturable: RunningStack) -> None:
    url = saturable.url("GRPC_PORT")
    _from_an_open_gate(url)
    pids = [saturable.process.triton_pid(pod) for pod in (0, 1)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        until("the gate to close", lambda: gate_is(url, "StatusCode.CANCELLED"), 15)
        answer = gate_answer(url)
        assert answer.status == "StatusCode.CANCELLED" and answer.took_s < 0.05, answer
        assert "no Triton is ready" in answer.message
        grpc_answers = _grpc_answers(url)
        http_answers = _http_answers(saturable.url("HTTP_PORT"))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    until("the gate to open", lambda: gate_is(url, "OK"), 15)
    # The other job starts skip this server as RepositoryIndex does; any other call is told to
    # retry, and when (docs/admission.md, "No Triton ready").
    for rpc in ("ServerReady", "ModelReady"):
        code, message, _, took = grpc_answers[rpc]
        assert code == "CANCELLED" and "no Triton is ready" in message and took < 0.25, (
            rpc, grpc_answers[rpc])
    code, message, trailers, took = grpc_answers["ModelInfer"]
    hint = NO_TRITON_HINT.search(message)
    assert code == "UNAVAILABLE" and hint and took < 0.25, grpc_answers["ModelInfer"]
    assert trailers.get("grpc-retry-pushback-ms") == str(int(hint["retry_s"]) * 1000), trailers
    (ready_status, ready_retry, ready_words), (status, retry_after, words) = (
        http_answers["/v2/health/ready"], http_answers[f"/v2/models/{MODEL}/infer"])
    assert ready_status == 503 and ready_retry and "no new jobs here now" in ready_words, (
        http_answers)
    hint = NO_TRITON_HINT.search(words)
    assert status == 503 and hint and retry_after == hint["retry_s"], http_answers


# The gateway's words for a call while no Triton is ready (gateway/client-checks.lua).
NO_TRITON_HINT = re.compile(
    r"^no Triton is ready behind this endpoint(: a GPU pod is starting \(asked for \d+ s ago; "
    r"one takes about \d+ s here\)|, and no GPU pod is starting \(.+\)); retry in about "
    r"(?P<retry_s>\d+) s$")


def _grpc_answers(url: str) -> dict[str, tuple[str, str, dict[str, str], float]]:
    """How ServerReady, ModelReady and an inference end: status name, message, trailers, time."""
    answers: dict[str, tuple[str, str, dict[str, str], float]] = {}
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls: dict[str, Callable[[], object]] = {
            "ServerReady": lambda: stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=5),
            "ModelReady": lambda: stub.ModelReady(
                service_pb2.ModelReadyRequest(name=MODEL), timeout=5),
            "ModelInfer": lambda: stub.ModelInfer(
                service_pb2.ModelInferRequest(model_name=MODEL), timeout=5),
        }
        for rpc, call in calls.items():
            started = time.monotonic()
            try:
                call()
                answers[rpc] = ("OK", "", {}, time.monotonic() - started)
            except grpc.RpcError as error:
                trailers = {k: str(v) for k, v in (error.trailing_metadata() or ())}
                answers[rpc] = (error.code().name, error.details() or "", trailers,
                                time.monotonic() - started)
    return answers


def _http_answers(url: str) -> dict[str, tuple[int, str | None, str]]:
    """The HTTP status, Retry-After and error words of a readiness question and an
    inference."""
    answers: dict[str, tuple[int, str | None, str]] = {}
    for path, body in (("/v2/health/ready", None), (f"/v2/models/{MODEL}/infer", b"{}")):
        request = urllib.request.Request(f"http://{url}{path}", data=body)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                answers[path] = (response.status, response.headers.get("retry-after"), "")
        except urllib.error.HTTPError as error:
            answers[path] = (error.code, error.headers.get("retry-after"),
                             str(json.loads(error.read()).get("error")))
    return answers


# At most this long: for the gate to close, its word to go stale and calls still to be refused
# after it opened; the load stops once the gateway has refused a call a second after that.
STALE_LOAD_S = 20


def _load(url: str, seconds: float, start: float, stop: threading.Event) -> list[Outcome]:
    """Arrivals at twice the capacity from `start`: call i starts at start + i / rate."""

    async def run() -> list[Outcome]:
        async with grpc.aio.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            outcomes, _ = await open_loop(stub, 2 * CAPACITY_PER_S, seconds, start,
                                          stop=stop)
            return outcomes

    return asyncio.run(run())


def test_a_stale_word_turns_no_job_away_by_the_shipped_rule(saturable: RunningStack) -> None:
    """SONIC_RAY_GATE_WHEN_STALE=open, gateway/admission.env's default: the control plane's
    last word, "saturated", stops counting SONIC_RAY_GATE_STALE_S after its answers stopped
    (the Serve controller that serves them stopped), and new jobs start though the Tritons are
    still saturated: an outage of the control plane turns no job away while Tritons answer."""
    url = saturable.url("GRPC_PORT")
    _from_an_open_gate(url)
    controller = listening_pid(int(saturable.ports["ADMISSION_PORT"]))
    start = time.monotonic() + 0.5
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(_load, url, STALE_LOAD_S, start, stop)

        def closed_for_saturation() -> object:
            answer = gate_answer(url, timeout_s=POLL_DEADLINE_S)
            return "saturated" in answer.message or answer

        until("the gate to close for saturation", closed_for_saturation, 15)
        os.kill(controller, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            until("the gate to open with the control plane stopped",
                  lambda: gate_is(url, "OK"), STALE_S + 10)
            opened, opened_wall = time.monotonic(), time.time()
        finally:
            os.kill(controller, signal.SIGCONT)
        # A second's calls due after the gate opened have been sent once the gateway refuses
        # one that reached it a second later.
        a_line_since(_access_log(saturable), opened_wall + 1, _refused_infer, STALE_LOAD_S)
        stop.set()
        outcomes = load.result()
    # Never before the word it had went stale (os.time()'s whole seconds aside).
    assert opened - stopped >= STALE_S - 1, opened - stopped
    rate = 2 * CAPACITY_PER_S
    still_refused = [o for i, o in enumerate(outcomes)
                     if start + i / rate > opened and o.status == "RESOURCE_EXHAUSTED"]
    assert still_refused, "no call was refused after the gate opened: not saturated then"
