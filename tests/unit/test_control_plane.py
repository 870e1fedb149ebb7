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
import yaml

from tests.support.stand_in_http import serving
from tests.unit.test_gateway_started import _hosts
from triton_pod.access import TokenCheck
from triton_pod.autoscaling import TritonQueueTimePolicy
from triton_pod.gateway_view import (
    CLUSTERS_PATH,
    TRITON_CLUSTER,
    Demand,
    GatewayView,
    PodStats,
    demand_between,
    pod_stats,
    ready_tritons,
)
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


def _context(current: int, values: list[float], target: int | None = None,
             state: dict[str, Any] | None = None, now: float = 0.0) -> Any:
    metrics = {QUEUE_METRIC: {f"replica-{i}": v for i, v in enumerate(values)}} if values else {}
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=target or current,
                           aggregated_metrics=metrics, policy_state=state or {},
                           current_time=now)


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
    with pytest.raises(ValueError, match="negative"):
        TritonQueueTimePolicy(gateway_wait_s=-1)


def _clusters(ready: int, healthy: int, holding: int) -> str:
    """Envoy's /clusters text for the gateway's Triton clusters: `ready` pods at priority 0,
    `healthy` of them passing their checks, and every one again at priority 1, `holding` of
    them healthy there (their Tritons hold live sequences)."""
    return "".join([f"{name}::observability_name::{name}\n" + _hosts(name, ready, healthy)
                    + _hosts(name, ready, holding, priority=1)
                    for name in (TRITON_CLUSTER, "triton-http")])


def test_the_gateways_ready_tritons_are_read_from_its_host_list() -> None:
    """Priority 0 only: a ready pod whose Triton holds a live sequence is healthy at priority 1
    too (serve/triton_pod/holding.py), and Envoy's own healthy count (membership_healthy)
    counts it twice, which would hold an upgrade's new cluster at more GPU pods than served."""
    from gateway.routes import GRPC_CLUSTER, ROOT

    assert TRITON_CLUSTER == GRPC_CLUSTER  # the name the gateway's config gives the cluster
    envoy = yaml.safe_load((ROOT / "gateway" / "envoy.yaml").read_text())
    metrics = next(listener for listener in envoy["static_resources"]["listeners"]
                   if listener["name"] == "metrics")
    routes = metrics["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"][0]["routes"]
    assert {"match": {"path": CLUSTERS_PATH}, "route": {"cluster": "envoy-admin"}} in routes
    assert ready_tritons(_clusters(ready=3, healthy=3, holding=2)) == 3
    assert ready_tritons(_clusters(ready=3, healthy=1, holding=3)) == 1
    assert ready_tritons(_clusters(ready=0, healthy=0, holding=0)) == 0
    assert ready_tritons("envoy-admin::observability_name::envoy-admin\n") is None


class _Gateway:
    def __init__(self, count: int | None, demand: Demand | None = None) -> None:
        self.count, self.demand, self.error = count, demand, "connection refused"


def _with_gateway(count: int | None, wait_s: float = 60.0,
                  demand: Demand | None = None) -> TritonQueueTimePolicy:
    policy = TritonQueueTimePolicy(target_queue_ms_per_exec=100, gateway_wait_s=wait_s)
    policy.gateway = _Gateway(count, demand)  # type: ignore[assignment]
    return policy


# Envoy's own Prometheus text for the shipped listeners (gateway/envoy.yaml's stat_prefix):
# the metrics listener's requests (Prometheus, probes) are no demand.
ENVOY_DEMAND = """# TYPE envoy_http_downstream_rq_total counter
envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="metrics"} 900
envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="triton_grpc"} 40
envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="triton_http"} 2
envoy_http_downstream_rq_active{envoy_http_conn_manager_prefix="metrics"} 1
envoy_http_downstream_rq_active{envoy_http_conn_manager_prefix="triton_grpc"} 3
envoy_http_downstream_rq_active{envoy_http_conn_manager_prefix="triton_http"} 0
envoy_cluster_membership_healthy{envoy_cluster_name="triton"} 3
"""


def test_the_gateways_demand_is_read_from_its_client_listeners_only() -> None:
    from gateway.routes import ROOT

    shipped = (ROOT / "gateway" / "envoy.yaml").read_text()
    assert all(f"stat_prefix: {name}" in shipped for name in ("triton_grpc", "triton_http"))
    assert pod_stats(ENVOY_DEMAND, 2) == PodStats(healthy=2, requests=42, active=3)


def test_demand_is_summed_over_pods_and_survives_a_restarted_envoy() -> None:
    before = {"10.0.0.1": PodStats(2, 100, 0), "10.0.0.2": PodStats(2, 50, 0)}
    # Pod 1 got 5 calls; pod 2's Envoy restarted (its counter went back, 7 since); pod 3 is new.
    now = {"10.0.0.1": PodStats(2, 105, 1), "10.0.0.2": PodStats(2, 7, 0),
           "10.0.0.3": PodStats(2, 4, 0)}
    assert demand_between(before, now) == Demand(arrived=16, in_flight=1)
    idle = demand_between(now, now)
    assert idle == Demand(0, 1) and idle.calls  # a call still in flight is demand
    assert not Demand(0, 0).calls


@pytest.mark.parametrize(("current", "values", "demand", "wanted"), [
    (0, [], Demand(3, 0), 1),          # calls with no Triton: one GPU pod, from zero
    (0, [], Demand(0, 0), 0),          # none: stay at zero
    (2, [0.0, 0.0], Demand(0, 0), 0),  # idle: toward zero (Serve's delays and bounds apply)
    (2, [0.0, 0.0], Demand(0, 1), 1),  # one long stream open: not idle
    (1, [300.0], Demand(50, 8), 3),    # busy: queue time decides
    (2, [0.0, 0.0], None, 1),          # no answer from the gateway: queue time alone
])
def test_the_gateways_demand_scales_from_and_to_zero(current: int, values: list[float],
                                                     demand: Demand | None, wanted: int) -> None:
    policy = _with_gateway(current, demand=demand)
    serving = {"caught_up": True}  # past an upgrade's floor
    assert policy(_context(current, values, target=current, state=serving))[0] == wanted


def test_without_the_gateways_demand_the_policy_says_so_once_and_never_goes_to_zero(
        caplog: pytest.LogCaptureFixture) -> None:
    policy = _with_gateway(1, demand=None)
    serving = {"caught_up": True}
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        for _ in range(3):
            assert policy(_context(1, [0.0], state=serving))[0] == 1
    assert caplog.text.count("no demand from the gateway (connection refused)") == 1


def test_the_view_polls_every_gateway_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Envoys' stats and host lists at one port on two loopback addresses, as the headless
    Service lists two pods: their requests add up between polls, their ready Tritons give the
    largest."""
    texts = {"127.0.0.1": ENVOY_DEMAND, "127.0.0.2": ENVOY_DEMAND.replace(
        'prefix="triton_grpc"} 40', 'prefix="triton_grpc"} 10')}
    hosts = {"127.0.0.1": _clusters(ready=2, healthy=1, holding=2),
             "127.0.0.2": _clusters(ready=2, healthy=2, holding=1)}
    monkeypatch.setattr(GatewayView, "_poll", lambda self: None)  # polled by hand below
    monkeypatch.setattr(GatewayView, "_addresses", lambda self: ["127.0.0.1", "127.0.0.2"])
    with serving(lambda address, path: (hosts if path == CLUSTERS_PATH else texts)[
                     address].encode(), ("127.0.0.1", "127.0.0.2")) as port:
        view = GatewayView(f"http://gateway-metrics:{port}/stats/prometheus")
        view._poll_once()
        assert view.count == 2 and view.demand == Demand(0, 6)
        texts["127.0.0.1"] = texts["127.0.0.1"].replace('prefix="triton_grpc"} 40',
                                                        'prefix="triton_grpc"} 45')
        view._poll_once()
        assert view.demand == Demand(5, 6)


def test_a_new_cluster_holds_the_gateways_count_until_it_runs_as_many() -> None:
    # An upgrade: the gateway balances over the old cluster's 3 Tritons; the new deployment
    # starts with none running and min_replicas 1.
    policy = _with_gateway(3)
    decision, state = policy(_context(0, [], target=1, now=100.0))
    assert decision == 3 and not state.get("caught_up")
    # Idle new replicas report no queue time: the floor still holds.
    decision, state = policy(_context(2, [0.0, 0.0], target=3, state=state, now=110.0))
    assert decision == 3 and not state.get("caught_up")
    decision, state = policy(_context(3, [0.0] * 3, target=3, state=state, now=120.0))
    assert decision == 3 and state["caught_up"]
    # From then on queue time alone decides.
    assert policy(_context(3, [0.0] * 3, target=3, state=state, now=130.0))[0] == 1


def test_the_floor_never_exceeds_what_the_deployment_may_run() -> None:
    """A config lowering max_replicas to 1 while the gateway still lists 3 Tritons (in place,
    Serve removes two replicas at once): the floor is 1, reached, so the policy lets go; held
    at 3 it would never be caught up and keep the deployment from ever scaling down."""
    policy = _with_gateway(3, demand=Demand(0, 0))
    ctx = _context(1, [0.0], target=1)
    ctx.capacity_adjusted_max_replicas = 1
    decision, state = policy(ctx)
    assert state["floor"] == 1 and state["caught_up"] and decision == 1
    ctx = _context(1, [0.0], target=1, state=state)
    ctx.capacity_adjusted_max_replicas = 1
    assert policy(ctx)[0] == 0  # idle: toward zero


def test_a_cluster_already_serving_is_caught_up_at_once() -> None:
    policy = _with_gateway(2)
    decision, state = policy(_context(2, [20.0, 20.0], target=2, now=0.0))
    assert state["caught_up"] and decision == 2
    assert policy(_context(2, [20.0, 20.0], target=2, state=state, now=5.0))[0] == 1


def test_without_an_answer_from_the_gateway_the_policy_waits_then_goes_on_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    policy = _with_gateway(None, wait_s=30)
    decision, state = policy(_context(0, [], target=1, now=0.0))
    assert decision == 1 and not state.get("caught_up")
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        decision, state = policy(_context(1, [], target=1, state=state, now=31.0))
    assert decision == 1 and state["caught_up"]
    assert "connection refused" in caplog.text


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


def test_a_named_token_passes_by_its_token_not_its_name(tmp_path: Path) -> None:
    """`<name> <token>` lines (the gateway records the name as the caller): the Serve path
    accepts the token and never the name."""
    tokens = tmp_path / "tokens"
    tokens.write_text("# who calls\nalice tok-alice-1\ntok-unnamed-2\n")
    check = TokenCheck(tokens)
    assert check.allows([("authorization", "Bearer tok-alice-1")])
    assert check.allows([("authorization", "Bearer tok-unnamed-2")])
    assert not check.allows([("authorization", "Bearer alice")])


def test_a_token_line_of_three_fields_is_refused_naming_the_line(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice tok-alice-1\nbob has a token\n")
    with pytest.raises(RuntimeError, match=r"tokens line 2: 4 fields"):
        TokenCheck(tokens)
