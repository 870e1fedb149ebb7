"""The dashboard and the alerts against a real Prometheus (Debian's package) scraping the real
stack of each data path while calls flow: every panel query and every alert expression returns
data from the real exporters. Plus the dashboard's own model and the rules' promtool tests."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
import yaml
from grafana_foundation_sdk.models.dashboard import Dashboard

from local_stack.triton_inputs import simple_inputs
from observability import dashboard
from tests.conftest import Stack
from tests.raw_http import request

ROOT = Path(__file__).resolve().parent.parent
ALERTS = yaml.safe_load(dashboard.ALERTS.read_text())["groups"][0]["rules"]
# Exported by Triton only on a GPU (docs/user_guide/metrics.md of triton-inference-server/server,
# "GPU Metrics"): the panels that use them cannot return data here.
TRITON_GPU_METRICS = {"nv_gpu_utilization", "nv_gpu_memory_total_bytes",
                      "nv_gpu_memory_used_bytes", "nv_gpu_power_usage", "nv_gpu_power_limit",
                      "nv_energy_consumption"}
# kube-state-metrics' (docs/metrics/workload/pod-metrics.md): only in a cluster.
CLUSTER_METRICS = {"kube_pod_status_phase", "kube_pod_container_resource_requests",
                   "kube_pod_container_status_ready"}
# Grafana's own variables, and what the tests put in for them and for the dashboard's.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$model": ".*", "$pod": ".*"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(\s*)(?=[0-9(]|max|sum)")


def _metrics(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:nv|ray|envoy|kube)_[a-z_]+)\b", expr))


def _needs(expr: str) -> str:
    metrics = _metrics(expr)
    if metrics & TRITON_GPU_METRICS:
        return "gpu"
    if metrics & CLUSTER_METRICS:
        return "cluster"
    if any(m.startswith("envoy_") for m in metrics):
        return "gateway"
    return "any"


# --- the dashboard and the rules on their own


def test_committed_dashboard_and_rule_are_what_make_observability_writes() -> None:
    assert dashboard.main(["--check"]) == 0


def test_dashboard_loads_with_the_sdk_model_and_everything_resolves() -> None:
    raw = json.loads(dashboard.DASHBOARD_JSON.read_text())
    model = Dashboard.from_json(raw)
    assert model.uid == dashboard.UID and model.templating.list_val is not None
    variables = {v.name: v for v in model.templating.list_val}
    assert variables["datasource"].type_val == "datasource"
    assert variables["datasource"].query == "prometheus"
    panels = [p for p in raw["panels"] if p["type"] != "row"]
    assert len(panels) == len(dashboard.PANELS)
    assert len({p["id"] for p in raw["panels"]}) == len(raw["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= set(variables) | GRAFANA_VARIABLES, (panel["title"], used)
    for name in ("model", "pod"):
        source = variables[name].datasource
        assert source is not None and source.uid == "${datasource}"


def test_promtool_checks_the_rules_and_each_alert_fires_only_where_it_should() -> None:
    for args in (["check", "rules", str(dashboard.ALERTS)],
                 ["test", "rules", str(dashboard.ALERTS.with_name("alerts_test.yaml"))]):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    tested = yaml.safe_load(dashboard.ALERTS.with_name("alerts_test.yaml").read_text())
    fired = {t["alertname"] for group in tested["tests"] for t in group["alert_rule_test"]
             if t["exp_alerts"]}
    assert fired == {rule["alert"] for rule in ALERTS}


def test_every_alert_says_what_it_is_and_what_to_look_at() -> None:
    for rule in ALERTS:
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule.get("for"), rule["alert"]


# --- against the real stack


def _api(prometheus: str, path: str) -> Any:
    """The data of an answer of Prometheus's HTTP API."""
    with urllib.request.urlopen(f"http://{prometheus}/api/v1/{path}", timeout=10) as response:
        answer = json.load(response)
    assert answer["status"] == "success", answer
    return answer["data"]


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = _api(
        prometheus, "query?" + urllib.parse.urlencode({"query": expr}))["result"]
    return result


def _calls(stack: Stack) -> None:
    """A few seconds of calls over both protocols, so that every rate has samples."""
    client = tc.InferenceServerClient(stack.url)
    ones = np.ones((1, 16), dtype=np.int32)
    body = json.dumps({"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16],
                                   "data": [1] * 16} for n in ("INPUT0", "INPUT1")]}).encode()
    end = time.monotonic() + 8
    while time.monotonic() < end:
        client.infer("simple", simple_inputs(ones, ones), client_timeout=30)
        status, _, _ = request(stack.http_url, "POST", "/v2/models/simple/infer", body)
        assert status == 200


def _poll_for_data(prometheus: str, exprs: dict[str, str]) -> dict[str, str]:
    """Each expression's query, polled until it returns a series; what never did, and why."""
    missing = dict(exprs)
    deadline = time.monotonic() + 90
    while missing and time.monotonic() < deadline:
        for name, expr in list(missing.items()):
            if _query(prometheus, expr):
                del missing[name]
        if missing:
            time.sleep(2)
    return missing


@pytest.fixture(scope="module")
def observed(stack: Stack) -> tuple[Stack, str]:
    prometheus = stack.running.url("PROMETHEUS_PORT")
    _calls(stack)
    return stack, prometheus


def test_prometheus_scrapes_every_exporter_and_loads_the_rules(
    observed: tuple[Stack, str],
) -> None:
    stack, prometheus = observed
    targets = _api(prometheus, "targets")["activeTargets"]
    jobs = {t["labels"]["job"] for t in targets}
    expected = {"triton-metrics", "ray-metrics"} | (
        {"gateway-metrics"} if stack.data_path == "gateway" else set())
    assert jobs == expected
    assert _poll_for_data(prometheus, {job: f'up{{job="{job}"}} == 1' for job in jobs}) == {}
    rules = [r for g in _api(prometheus, "rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {rule["alert"] for rule in ALERTS}
    assert all(r["health"] == "ok" for r in rules), rules


def test_every_panel_query_returns_data(observed: tuple[Stack, str]) -> None:
    stack, prometheus = observed
    exprs: dict[str, str] = {}
    for panel in dashboard.PANELS:
        if panel.needs == "gpu":
            for expr, _ in panel.queries:
                assert _metrics(expr) <= TRITON_GPU_METRICS, panel.title
            continue
        if panel.needs not in ("any", stack.data_path):
            continue
        for expr, legend in panel.queries:
            for variable, value in SUBSTITUTIONS.items():
                expr = expr.replace(variable, value)
            exprs[f"{panel.title}: {legend}"] = expr
    assert exprs
    assert _poll_for_data(prometheus, exprs) == {}


def test_every_alert_expression_returns_data(observed: tuple[Stack, str]) -> None:
    stack, prometheus = observed
    exprs = {}
    for rule in ALERTS:
        needs = _needs(rule["expr"])
        if needs == "cluster":
            assert _metrics(rule["expr"]) <= CLUSTER_METRICS, rule
            continue
        if needs not in ("any", stack.data_path):
            continue
        # `bool` keeps every series of the comparison (0 or 1): the expression's data, not
        # whether it fires now.
        exprs[rule["alert"]] = _COMPARISON.sub(r"\1 bool\2", rule["expr"])
    assert len(exprs) >= 4
    assert _poll_for_data(prometheus, exprs) == {}
