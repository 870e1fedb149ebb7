"""The dashboard and the alerts against a real Prometheus (Debian's package) scraping the real
stack of each data path while calls flow: every panel query and every alert expression returns
data from the real exporters (tests/unit/test_observability_files.py checks the files alone)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from local_stack.polling import until
from local_stack.triton_inputs import simple_inputs
from observability import dashboard
from tests.stack.conftest import Stack
from tests.support.promql import (
    _COMPARISON,
    ALERTS,
    CLUSTER_METRICS,
    SUBSTITUTIONS,
    TRITON_GPU_METRICS,
    _metrics,
    _needs,
)
from tests.support.raw_http import request

ROOT = Path(__file__).resolve().parents[2]


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
    # One failure, so that the failure counters have a series.
    with pytest.raises(InferenceServerException):
        client.infer("no-such-model", simple_inputs(ones, ones), client_timeout=30)
    end = time.monotonic() + 8
    while time.monotonic() < end:
        client.infer("simple", simple_inputs(ones, ones), client_timeout=30)
        status, _, _ = request(stack.http_url, "POST", "/v2/models/simple/infer", body)
        assert status == 200


def _poll_for_data(prometheus: str, exprs: dict[str, str]) -> dict[str, str]:
    """Each expression's query, polled until it returns a series; what never did, and why."""
    missing = dict(exprs)

    def found() -> object:
        for name, expr in list(missing.items()):
            if _query(prometheus, expr):
                del missing[name]
        return not missing or sorted(missing)

    with contextlib.suppress(TimeoutError):
        until("a series for each query", found, 90, every_s=2)
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
