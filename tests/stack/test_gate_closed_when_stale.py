"""A site's other stale rule, SONIC_RAY_GATE_WHEN_STALE=closed (gateway/admission.env), on a
stack of its own (the gateway path, one pod): with the control plane's answers gone (the Serve
controller that serves them stopped), new jobs are turned away after SONIC_RAY_GATE_STALE_S,
saying why, and start again once it answers. The shipped rule, open, is tested in
test_admission.py."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from bench.overload import gate_answer, gate_is
from local_stack.harness import RunningStack, processes_left_behind, running_stack
from local_stack.polling import until
from tests.support.sockets import listening_pid

STALE_S = 3


@pytest.fixture(scope="module")
def closes_when_stale() -> Iterator[RunningStack]:
    with running_stack({"DATA_PATH": "gateway", "SONIC_RAY_GATE_WHEN_STALE": "closed",
                        "SONIC_RAY_GATE_STALE_S": str(STALE_S)},
                       ready_pattern=r"gateway discovery: pods \[0\]") as running:
        yield running
    assert running.process.process.returncode == 0
    assert not processes_left_behind(running.process)


def test_a_stale_word_closes_the_gate_by_this_sites_rule(closes_when_stale: RunningStack,
                                                         ) -> None:
    url = closes_when_stale.url("GRPC_PORT")
    until("the gate to open", lambda: gate_is(url, "OK"), 30)
    controller = listening_pid(int(closes_when_stale.ports["ADMISSION_PORT"]))
    os.kill(controller, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        until("the gate to close", lambda: gate_is(url, "StatusCode.CANCELLED"), STALE_S + 10)
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
