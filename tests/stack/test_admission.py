"""Admission on the gateway path (docs/admission.md), on a stack of its own: two simulated pods
(TRITONS=2) at max_replicas, the queue-bounded `queue_limited` model (tests/models), and site
settings in the environment as the `admission` ConfigMap gives them (gateway/admission.env):
a saturated facility refuses calls beyond Triton's queue at once with RESOURCE_EXHAUSTED and a
retry hint, keeps the admitted calls' latency bounded, and turns new jobs away at
RepositoryIndex (the start-of-job gate) while saturated, while no Triton is ready, and, by this
site's rule, while the control plane's answer is stale. The load is make bench's overload cell
(bench/overload.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench.overload import (
    AUTOSCALING,
    DEADLINE_S,
    EXEC_S,
    MODEL,
    REOPEN_S,
    RETRY_AFTER_S,
    gate_answer,
    gate_is,
    overload,
    p99,
    saturable_stack,
)
from local_stack.harness import RunningStack, processes_left_behind
from local_stack.polling import until
from tests.support.sockets import listening_pid

STALE_S = 3
# An admitted call may wait for the batch executing, then run its own: near two executions
# against one unloaded (docs/admission.md, "Why 2x is the edge"), and Triton's batcher still
# leaves an instance idle up to 500 ms now and then: measured 1.8-3.5x the unloaded p99 here
# (3.6x with one instance, which idles after most batches). The 2x is not always met.
ADMITTED_P99_BOUND = 5
# Refusals take ~5 ms; the slowest of thousands meets a pause of this 2-core machine.
REFUSED_P99_S = 0.05
REFUSED_MAX_S = 0.25


@pytest.fixture(scope="module")
def saturable() -> Iterator[RunningStack]:
    with saturable_stack({"SONIC_RAY_GATE_WHEN_STALE": "closed",
                          "SONIC_RAY_GATE_STALE_S": str(STALE_S)}) as running:
        yield running
    assert running.process.process.returncode == 0
    assert not processes_left_behind(running.process)


def test_twice_the_capacity_is_refused_at_once_and_closes_the_gate(saturable: RunningStack) -> None:
    run = overload(saturable.url("GRPC_PORT"), seconds=60)
    print(run.summary())
    admitted, refused = run.of("OK"), run.of("RESOURCE_EXHAUSTED")
    others = sorted({o.status for o in run.outcomes} - {"OK", "RESOURCE_EXHAUSTED"})
    assert others == [], f"calls ended otherwise (none at its deadline): {others}"
    assert refused and admitted
    assert p99([o.took_s for o in refused]) < REFUSED_P99_S
    assert max(o.took_s for o in refused) < REFUSED_MAX_S
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


# How long the control plane's word lags a load: Serve's look-back and metrics interval, the
# gateway's next question (each second).
SIGNAL_LAG_S = AUTOSCALING["look_back_period_s"] + AUTOSCALING["metrics_interval_s"] + 1


def _from_an_open_gate(url: str) -> None:
    """Waits out the saturation an earlier test's load left: a test of another reason for the
    gate starts with it open, else its answers say "saturated" (the control plane's word comes
    first; seen after the 429 test's load, through the next two tests). Open for SIGNAL_LAG_S
    on end: open once may be before the control plane has seen that load (seen: open, then
    "saturated" while the Tritons were stopped)."""
    opened: list[float] = []

    def stays_open() -> object:
        answer = gate_is(url, "OK")
        if answer is not True:
            opened.clear()
            return answer
        opened.append(time.monotonic())
        return opened[-1] - opened[0] >= SIGNAL_LAG_S or f"open for {opened[-1] - opened[0]:.1f} s"

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


def test_stale_signal_closes_the_gate_by_this_sites_rule(saturable: RunningStack) -> None:
    """SONIC_RAY_GATE_WHEN_STALE=closed here: with the control plane's answer gone (the Serve
    controller that serves it stopped), new jobs are turned away after SONIC_RAY_GATE_STALE_S."""
    url = saturable.url("GRPC_PORT")
    _from_an_open_gate(url)
    controller = listening_pid(int(saturable.ports["ADMISSION_PORT"]))
    os.kill(controller, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        until("the gate to close", lambda: gate_is(url, "StatusCode.CANCELLED"), 15)
        waited = time.monotonic() - stopped
        answer = gate_answer(url)
        assert answer.status == "StatusCode.CANCELLED", answer
        assert "missing or older than" in answer.message
        # Never before the answer it had went stale (os.time()'s whole seconds aside).
        assert waited >= STALE_S - 1, waited
        assert answer.took_s < 0.25, answer  # at most one unanswered question (100 ms) first
    finally:
        os.kill(controller, signal.SIGCONT)
    until("the gate to open", lambda: gate_is(url, "OK"), 15)
