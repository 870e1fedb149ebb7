"""The control plane's own code, no stack: the queue-time signal read from Triton's metrics
text, the autoscaling policy's arithmetic, and the loud or safe failures of the forwarder's
helpers (a client-sent timeout key, a broken token file, Ray's hook missing)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from triton_pod.access import TokenCheck
from triton_pod.autoscaling import TritonQueueTimePolicy
from triton_pod.grpc_forwarding import _forwarded_metadata
from triton_pod.servicer import TIMEOUT_KEY, _ContextWithDeadline, add_triton_servicer
from triton_pod.triton_metrics import QUEUE_METRIC, Counters, QueueTime, parse

METRICS = """# HELP nv_inference_queue_duration_us Cumulative inference queuing duration
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="simple",version="1"} 3000
nv_inference_queue_duration_us{model="slow",version="1"} 7000
nv_inference_exec_count{model="simple",version="1"} 4
nv_inference_exec_count{model="slow",version="1"} 6
nv_inference_pending_request_count{model="slow",version="1"} 2
nv_inference_count{model="slow",version="1"} 60
"""


def test_counters_sum_over_models() -> None:
    assert parse(METRICS) == Counters(queue_us=10000, executions=10, pending=2)


def test_queue_time_is_per_execution_since_the_last_scrape() -> None:
    signal = QueueTime()
    assert signal.update(Counters(1000, 10, 0)) == 0.0  # the first scrape has no interval
    assert signal.update(Counters(51000, 20, 0)) == 5.0  # 50 ms over 10 executions
    # Nothing executed but requests wait: the last value holds instead of reading 0.
    assert signal.update(Counters(51000, 20, 3)) == 5.0
    assert signal.update(Counters(51000, 20, 0)) == 0.0
    # Triton restarted (counters went back): start over, never a negative rate.
    assert signal.update(Counters(10, 1, 0)) == 0.0


def _context(current: int, values: list[float], target: int | None = None) -> Any:
    metrics = {QUEUE_METRIC: {f"replica-{i}": v for i, v in enumerate(values)}} if values else {}
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=target or current,
                           aggregated_metrics=metrics)


@pytest.mark.parametrize(("current", "values", "wanted"), [
    (1, [300.0], 3),          # three times the target: three pods
    (2, [150.0, 50.0], 2),    # on average at the target: stay
    (2, [105.0, 105.0], 2),   # within the tolerance: stay
    (4, [20.0] * 4, 1),       # a fifth of the target: fewer pods
    (3, [0.0] * 3, 1),        # idle: the floor (Serve then applies min_replicas)
])
def test_policy_scales_by_the_ratio_to_the_target(current: int, values: list[float],
                                                  wanted: int) -> None:
    decision, state = TritonQueueTimePolicy(target_queue_ms_per_exec=100)(
        _context(current, values))
    assert decision == wanted
    assert state["queue_ms_per_exec"] == sum(values) / len(values)


def test_policy_keeps_serves_decision_until_replicas_report() -> None:
    assert TritonQueueTimePolicy()(_context(2, [], target=3)) == (3, {})


def test_policy_refuses_a_target_that_cannot_work() -> None:
    with pytest.raises(ValueError, match="positive"):
        TritonQueueTimePolicy(target_queue_ms_per_exec=0)


class _Context:
    def __init__(self, metadata: list[tuple[str, Any]], remaining: float | None) -> None:
        self._metadata, self._remaining = metadata, remaining

    def invocation_metadata(self) -> list[tuple[str, Any]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return self._remaining


def test_a_timeout_key_sent_by_a_client_is_dropped() -> None:
    sent = _Context([(TIMEOUT_KEY, "not-a-number"), ("x-job", "1")], None)
    assert dict(_ContextWithDeadline(sent).invocation_metadata()) == {"x-job": "1"}
    with_deadline = _ContextWithDeadline(_Context([(TIMEOUT_KEY, "99999")], 4.0))
    assert dict(with_deadline.invocation_metadata())[TIMEOUT_KEY] == "4.000000"


def test_a_bad_timeout_value_means_no_deadline_not_a_failure() -> None:
    context: Any = _Context([(TIMEOUT_KEY, "soon"), ("x", "y")], None)
    metadata, timeout = _forwarded_metadata(context)
    assert (metadata, timeout) == ([("x", "y")], None)


def test_registration_fails_loudly_without_rays_handler_hook() -> None:
    with pytest.raises(RuntimeError, match="service_handler_factory"):
        add_triton_servicer(None, grpc.server(thread_pool=None))  # type: ignore[arg-type]


def test_an_emptied_token_file_keeps_the_last_good_tokens_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("good-token\n")
    check = TokenCheck(tokens)
    bearer: list[tuple[str, object]] = [("authorization", "Bearer good-token")]
    assert check.allows(bearer)
    tokens.write_text("")
    tokens.touch()
    check._checked = -1e9
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        assert check.allows(bearer)
        check._checked = -1e9
        assert check.allows(bearer)
    assert [r.message for r in caplog.records].count(
        f"keeping the last good client tokens: SONIC_RAY_AUTH_TOKENS_FILE={tokens} holds no "
        "token") == 1
    tokens.unlink()
    check._checked = -1e9
    assert check.allows(bearer)  # unreadable: still the last good ones


def test_a_token_file_unreadable_at_start_stops_the_replica(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="cannot be read"):
        TokenCheck(tmp_path / "missing")
