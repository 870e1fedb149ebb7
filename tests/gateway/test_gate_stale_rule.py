"""The gateway's stale rule (gateway/client-checks.lua: SONIC_RAY_GATE_WHEN_STALE,
SONIC_RAY_GATE_STALE_S) against a control plane that answers with the age of its word, as the
policy's answer does (serve/triton_pod/admission.py): a real Envoy with the gateway's config,
no Triton, and a stand-in control plane, the thing tested being the Lua. A fresh "closed"
turns job starts away by either rule; an old one, one the policy has not yet made, or none
at all (the control plane silent) counts as the rule says. tests/stack/test_admission.py
stops the real control plane under the shipped rule."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway import local as gateway
from local_stack.gateway_config import gateway_env, write_lone_config
from local_stack.harness import stack_ports_env
from local_stack.overload import gate_answer
from local_stack.polling import until
from local_stack.processes import spawn, terminate
from local_stack.settings import Settings
from tests.support.stand_in_http import serving

STALE_S = 3
SATURATED = "the GPUs are saturated (a stand-in's word)"
# What a job start hears: the control plane's reason, the stale rule's, or, let through the
# gate, the gateway's own answer while no Triton is ready.
THE_WORD, STALE, PASSED = SATURATED, "missing or older than 3 s", "no Triton is ready"


class Gateway:
    def __init__(self, url: str, answer: dict[str, Any], asked: list[float]) -> None:
        self.url = url
        self.answer = answer
        self.asked = asked  # when the control plane was asked (time.monotonic())

    def says(self, answer: dict[str, Any], words: str) -> None:
        """Has the control plane answer `answer` until a job start hears `words` (the gateway
        asks it at most once a second)."""
        self.answer.clear()
        self.answer.update(answer)

        def heard() -> object:
            got = gate_answer(self.url, timeout_s=2)
            return (got.status == "StatusCode.CANCELLED" and words in got.message) or got

        until(f"a job start to hear {words!r}", heard, 10)


# Longer than the gateway waits for the control plane's answer (100 ms): no answer.
SILENT_S = 1.0


@pytest.fixture(scope="module", params=["open", "closed"])
def lone_gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 ) -> Iterator[tuple[str, Gateway]]:
    rule = request.param
    tmp_path = tmp_path_factory.mktemp(f"gate-{rule}")
    answer: dict[str, Any] = {}
    asked: list[float] = []

    def control_plane_answer(_: str, path: str) -> bytes:
        asked.append(time.monotonic())
        if answer.get("silent"):
            time.sleep(SILENT_S)
        return json.dumps(answer).encode()

    with serving(control_plane_answer) as control_plane, pytest.MonkeyPatch.context() as patch:
        env = {**stack_ports_env(), "ADMISSION_PORT": str(control_plane),
               "SONIC_RAY_GATE_WHEN_STALE": rule, "SONIC_RAY_GATE_STALE_S": str(STALE_S)}
        for name, value in env.items():
            patch.setenv(name, value)
        settings = Settings.from_env(env)
        config = write_lone_config(settings, tmp_path / "gateway", [], [])
        log = tmp_path / "envoy.log"
        envoy: subprocess.Popen[bytes] = spawn(gateway.command(config), log,
                                               gateway_env(settings, "admin-key"))
        try:
            url = f"localhost:{settings.grpc_port}"

            def answers() -> object:
                if envoy.poll() is not None:
                    raise RuntimeError(f"Envoy exited ({envoy.returncode}): "
                                       f"{log.read_text()[-2000:]}")
                got = gate_answer(url, timeout_s=2)
                return got.status != "StatusCode.UNAVAILABLE" or got

            until("Envoy to answer", answers, 30)
            yield rule, Gateway(url, answer, asked)
        finally:
            terminate(envoy, grace_s=5)


def test_a_fresh_closed_word_turns_jobs_away_by_either_rule(
        lone_gateway: tuple[str, Gateway]) -> None:
    _, gate = lone_gateway
    gate.says({"state": "closed", "reason": SATURATED, "age_s": 0.2}, THE_WORD)
    gate.says({"state": "open", "reason": "", "age_s": 0.2}, PASSED)


def test_an_old_word_counts_as_the_rule_says(lone_gateway: tuple[str, Gateway]) -> None:
    rule, gate = lone_gateway
    gate.says({"state": "closed", "reason": SATURATED, "age_s": 0.2}, THE_WORD)
    # The same word, made longer ago than the stale time: the policy no longer decides.
    gate.says({"state": "closed", "reason": SATURATED, "age_s": STALE_S + 60},
              PASSED if rule == "open" else STALE)


def test_no_word_yet_counts_as_the_rule_says(lone_gateway: tuple[str, Gateway]) -> None:
    rule, gate = lone_gateway
    gate.says({"state": "unknown", "reason": "the autoscaling policy has not run yet",
               "age_s": None, "starting_for_s": None}, PASSED if rule == "open" else STALE)


def test_a_silent_control_plane_counts_as_the_rule_says(lone_gateway: tuple[str, Gateway],
                                                        ) -> None:
    rule, gate = lone_gateway
    gate.says({"state": "closed", "reason": SATURATED, "age_s": 0.2}, THE_WORD)
    # No answer within the gateway's wait: its last word ages until it is stale.
    gate.says({"state": "closed", "reason": SATURATED, "age_s": 0.2, "silent": True},
              PASSED if rule == "open" else STALE)


def test_the_word_comes_beside_envoy_while_no_call_comes(lone_gateway: tuple[str, Gateway],
                                                          ) -> None:
    """The control plane is asked once a second by gateway/gate-word.sh, not from a call: no
    job start waits on it, and none is needed for the word to stay fresh."""
    _, gate = lone_gateway
    gate.says({"state": "closed", "reason": SATURATED, "age_s": 0.2}, THE_WORD)
    since = len(gate.asked)
    until("the control plane to be asked 3 times with no call made",
          lambda: len(gate.asked) >= since + 3 or len(gate.asked) - since, 10)
    # The word fetched meanwhile is the one the next job start hears.
    gate.says({"state": "open", "reason": "", "age_s": 0.2}, PASSED)


def test_the_fetcher_writes_each_answer_after_its_second_and_ends_with_envoy(
        tmp_path: Path) -> None:
    """gateway/gate-word.sh alone, against a stand-in for Envoy's metrics listener: the file
    holds the second of the fetch, then the answer; when the answers stop it says so once and
    leaves the last word to age; once its Envoy (here a stand-in process) is gone, the fetcher
    ends and takes its file with it."""
    word, said = tmp_path / "word", tmp_path / "said"
    body = {"state": "closed", "reason": SATURATED, "age_s": 0.5, "starting_for_s": None}
    envoy = subprocess.Popen(["sleep", "60"])
    try:
        with serving(lambda _, path: json.dumps(body).encode() if path == "/admission"
                     else b"") as port, open(said, "wb") as out:
            fetcher = subprocess.Popen(
                ["bash", str(gateway.HERE / "gate-word.sh"), str(envoy.pid)], stderr=out,
                env={**os.environ, "SONIC_RAY_GATE_WORD": str(word),
                     "GATEWAY_METRICS_PORT": str(port)})
            until("the word written", lambda: word.exists() or "no file yet", 10)
        fetched_at, answer = word.read_text().split("\n", 1)
        assert abs(int(fetched_at) - time.time()) < 5, fetched_at
        assert json.loads(answer) == body
        until("the fetcher to say the word stopped coming",
              lambda: "stopped coming (no answer)" in said.read_text() or said.read_text(), 10)
        assert word.read_text().startswith(fetched_at + "\n")
        envoy.kill()
        envoy.wait()
        until("the fetcher to end with its Envoy", lambda: fetcher.poll() is not None, 10)
        assert not word.exists() and not word.with_name("word.new").exists()
        lines = said.read_text().splitlines()
        assert [line.split(" (")[0] for line in lines] == [
            "[gateway] the control plane's word on the GPUs comes",
            "[gateway] the control plane's word stopped coming"], lines
    finally:
        envoy.kill()
        envoy.wait()


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
