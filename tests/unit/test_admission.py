"""The start-of-job gate's signal, no stack: the settings read from the admission ConfigMap's
environment, the saturation rule, the answer served to the gateway with its age, and the
autoscaling policy deciding it each control loop."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest

from local_stack.polling import until
from local_stack.ports import free_ports
from triton_pod.admission import (
    PATH,
    PORT_ENV,
    SATURATED_ENV,
    Admission,
    AdmissionSettings,
    admission,
    saturation,
)
from triton_pod.autoscaling import TritonQueueTimePolicy
from triton_pod.triton_metrics import QUEUE_METRIC


def test_settings_from_the_environment() -> None:
    assert AdmissionSettings.from_env({}) == AdmissionSettings(None, None)
    assert AdmissionSettings.from_env({PORT_ENV: "8003", SATURATED_ENV: " 250 "}) == (
        AdmissionSettings(8003, 250.0))
    assert AdmissionSettings.from_env({SATURATED_ENV: ""}).saturated_queue_ms is None


@pytest.mark.parametrize(("env", "named"), [
    ({PORT_ENV: "http"}, PORT_ENV), ({PORT_ENV: "70000"}, PORT_ENV),
    ({SATURATED_ENV: "fast"}, SATURATED_ENV), ({SATURATED_ENV: "0"}, SATURATED_ENV),
    ({SATURATED_ENV: "nan"}, SATURATED_ENV),
])
def test_a_bad_setting_is_refused_by_name(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        AdmissionSettings.from_env(env)


@pytest.mark.parametrize(("observed", "current", "maximum", "limit", "saturated"), [
    (500.0, 4, 4, 200.0, True),     # at max_replicas and over the limit
    (500.0, 3, 4, 200.0, False),    # a pod may still be added
    (150.0, 4, 4, 200.0, False),    # under the limit
    (500.0, 4, 4, None, False),     # no limit set: only "no Triton ready" closes the gate
    (None, 4, 4, 200.0, False),     # nothing measured
])
def test_saturated_only_at_max_replicas_over_the_limit(
        observed: float | None, current: int, maximum: int, limit: float | None,
        saturated: bool) -> None:
    reason = saturation(observed, current, maximum, limit)
    assert (reason is not None) == saturated
    if reason:
        assert "500 ms" in reason and "200 ms" in reason and "max_replicas" in reason


def _get(port: int, path: str = PATH) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        answer: dict[str, Any] = json.load(response)
    return answer


def test_the_answer_says_its_state_and_age() -> None:
    (port,) = free_ports(1)
    served = Admission(port)
    assert served.error is None
    until("the answer", lambda: _get(port)["state"] == "unknown", 5)
    served.decide(None)
    assert _get(port)["state"] == "open"
    served.decide("the GPUs are saturated")
    answer = _get(port)
    assert answer["state"] == "closed" and answer["reason"] == "the GPUs are saturated"
    # The age grows while nothing decides: what the gateway's staleness rule reads.
    until("the answer to age", lambda: _get(port)["age_s"] >= 0.3 or _get(port), 5)
    assert _get(port)["state"] == "closed"
    with pytest.raises(urllib.error.HTTPError):
        _get(port, "/other")


def test_a_port_in_use_is_reported_not_raised() -> None:
    (port,) = free_ports(1)
    first = admission(port)
    assert admission(port) is first  # one server per port in a process
    second = Admission(port)
    assert second.error is not None and str(port) in second.error


def _context(current: int, maximum: int, queue_ms: float) -> Any:
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=current,
                           capacity_adjusted_max_replicas=maximum,
                           aggregated_metrics={QUEUE_METRIC: {"replica-0": queue_ms}},
                           policy_state={}, current_time=0.0)


def test_the_policy_decides_the_gate_each_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    (port,) = free_ports(1)
    monkeypatch.setenv(PORT_ENV, str(port))
    monkeypatch.setenv(SATURATED_ENV, "200")
    policy = TritonQueueTimePolicy(target_queue_ms_per_exec=100)
    policy(_context(2, 2, 500.0))
    assert _get(port)["state"] == "closed"
    policy(_context(2, 2, 120.0))
    assert _get(port)["state"] == "open"
    monkeypatch.setenv(SATURATED_ENV, "soon")
    with pytest.raises(ValueError, match=SATURATED_ENV):
        TritonQueueTimePolicy()


def test_the_answer_says_for_how_long_gpu_pods_have_been_on_their_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the gateway's "no Triton is ready" reads to say roughly when to retry: from the
    control loop that first wants more replicas than run, until as many run."""
    (port,) = free_ports(1)
    monkeypatch.setenv(PORT_ENV, str(port))
    policy = TritonQueueTimePolicy()

    def loop(current: int, target: int, now: float, state: dict[str, Any]) -> dict[str, Any]:
        ctx = SimpleNamespace(current_num_replicas=current, target_num_replicas=target,
                              capacity_adjusted_max_replicas=4, aggregated_metrics={},
                              policy_state=state, current_time=now)
        return policy(ctx)[1]

    state = loop(0, 0, 100.0, {})
    assert _get(port)["starting_for_s"] is None
    state = loop(0, 1, 130.0, state)  # from zero: Serve wants one, none runs
    assert _get(port)["starting_for_s"] == 0
    state = loop(0, 1, 145.5, state)
    assert _get(port)["starting_for_s"] == 15.5
    state = loop(1, 2, 150.0, state)  # still one missing: counted from the first
    assert _get(port)["starting_for_s"] == 20
    state = loop(2, 2, 160.0, state)
    assert _get(port)["starting_for_s"] is None and "starting_since" not in state
    loop(2, 3, 170.0, state)  # a new wait counts from its own start
    assert _get(port)["starting_for_s"] == 0
