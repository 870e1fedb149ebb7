"""The gateway's hot path (gateway/envoy.yaml, gateway/start.sh): a real Envoy with the shipped
config as `make local` writes it, in front of a stand-in Triton (gRPC with Triton's own
protos, and HTTP) that records what reaches it; the thing tested is the config and its Lua.

With nothing configured that checks or names callers, a call other than a job start runs no
Lua at all, nor the token check or the tenant shares (Envoy's counters of each filter's runs),
yet the access log still names
an anonymous caller, its protocol and (HTTP) its model; a job start runs the client checks;
an error answer, and only that, runs the error answers' Lua, which turns Triton's queue-full
UNAVAILABLE / 503 into RESOURCE_EXHAUSTED / 429 with a retry hint. With a site's tenants
configured, Envoy's own filters name every call's tenant (gateway/callers.sh) and the shares
meet every call, still with no Lua (where the Lua still runs on every call: certificate
subjects, tests/gateway/test_subjects.py; JWTs, tests/gateway/test_jwt.py). A client-sent admin
header never reaches Triton on any route; the gateway's own reaches it on the routes that carry
it."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from gateway import tenant_shares
from local_stack.gateway_config import jwt_folder
from local_stack.polling import until
from tests.support.lone_gateway import (
    ADMIN_KEY,
    ANY,
    CHECKS,
    ERRORS,
    FULL,
    QUEUE_FULL,
    LoneGateway,
    lone_gateway,
)
from triton_pod.access import ADMIN_HEADER, HTTP_ADMIN_HEADER

RETRY_AFTER_S = 2
# The gateway's words when no Triton is ready (gateway/gate.lua).
NO_TRITON = "no Triton is ready behind this endpoint, and no GPU pod is starting"
CALLS = 10
# Envoy's counters of the filters a site configures (gateway/envoy.yaml: sonic-ray.jwt,
# sonic-ray.tenant-shares, whose stat_prefix gateway/tenant_shares.py writes).
TOKEN_CHECK_RUNS, SHARES_RUNS = "jwt_authn.allowed", "tenant_shares.http_local_rate_limit.enabled"
# Which settings each gateway runs with: nothing that checks or names callers, and a site's
# tenant map, which names every caller (Envoy's own filters, gateway/callers.sh).
SETTINGS = {"nothing-configured": {}, "tenants": {"SONIC_RAY_TENANTS": "cms=*"}}
# What gateway/start.sh says it runs on each call, for each.
SAID = {"nothing-configured": "the client checks run on job starts only",
        "tenants": "the callers are checked and named on every call by Envoy's own filters"}


@dataclass
class Case:
    lone: LoneGateway
    # Whether calls other than job starts meet the shares and name their tenant (the settings
    # name callers).
    named_always: bool


@pytest.fixture(scope="module", params=list(SETTINGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         ) -> Iterator[Case]:
    env = {"SONIC_RAY_RETRY_AFTER_S": str(RETRY_AFTER_S), **SETTINGS[request.param]}
    with lone_gateway(tmp_path_factory.mktemp(request.param), env) as running:
        said = running.log.read_text()
        assert SAID[request.param] in said, said[-2000:]
        yield Case(running, bool(SETTINGS[request.param]))


def _infer(client: tc.InferenceServerClient, model: str,
           headers: dict[str, str] | None = None) -> None:
    data = tc.InferInput("INPUT0", [1], "INT32")
    data.set_data_from_numpy(np.array([1], dtype="int32"))
    client.infer(model, [data], headers=headers)


def test_calls_other_than_job_starts_run_no_lua_unless_callers_are_checked(case: Case) -> None:
    lone = case.lone
    before = lone.executions()
    client = tc.InferenceServerClient(lone.grpc)
    try:
        for _ in range(CALLS):
            _infer(client, "simple")
    finally:
        client.close()
    for _ in range(CALLS):
        status, _, _ = lone.http("/v2/models/simple/infer", b"{}",
                                         {"content-type": "application/json"})
        assert status == 200
    after = lone.executions()
    # The error answers' Lua never runs on a call that succeeds, nor the client checks on one
    # that is not a job start.
    assert after[ANY] - before[ANY] == 0, (before, after)
    assert after[CHECKS] - before[CHECKS] == 0, (before, after)

    def calls_logged() -> list[dict[str, Any]]:
        return [line for line in lone.log_lines()
                if line["path"].endswith(("/ModelInfer", "/simple/infer"))]

    # Written out every second (gateway/start.sh), not at Envoy's default ten.
    until("the calls' access log lines",
          lambda: len(calls_logged()) >= 2 * CALLS or len(calls_logged()), 3)
    lines = calls_logged()
    tenant = "cms" if case.named_always else "anonymous"
    assert {(line["identity"], line["tenant"]) for line in lines} == {("anonymous", tenant)}
    assert {line["protocol"] for line in lines} == {"grpc", "http"}
    assert {line["model"] for line in lines if line["protocol"] == "http"} == {"simple"}


def _filter_runs(lone: LoneGateway) -> dict[str, int]:
    """How many calls each filter that has nothing to do unless a site configures it ran on,
    over both listeners: the token check (jwt_authn's allowed calls) and the tenant shares
    (local_ratelimit's consulted calls, counted once a bucket exists)."""
    return lone.counted(TOKEN_CHECK_RUNS, SHARES_RUNS)


def test_calls_other_than_job_starts_make_no_token_check_nor_shares_unless_callers_are_checked(
        case: Case) -> None:
    """A filter disabled on a route is never made for its calls: with nothing that checks or
    names callers, an inference call meets neither filter (whose configs, by discovery, may
    change at any time), a job start meets both."""
    lone = case.lone
    shares = jwt_folder(lone.folder / "endpoints.json") / tenant_shares.SHARES_FILE
    # A bucket that limits nobody who calls: the filter counts each call it consults.
    reloads = _reloads(lone)
    tenant_shares.write(shares, {"nobody-calling": 1000})
    until("the gateway to load the shares", lambda: _reloads(lone) > reloads, 10)
    try:
        before = _filter_runs(lone)
        client = tc.InferenceServerClient(lone.grpc)
        try:
            for _ in range(CALLS):
                _infer(client, "simple")
            inference = _filter_runs(lone)
            assert client.is_server_ready()
        finally:
            client.close()
        for _ in range(CALLS):
            assert lone.http("/v2/models/simple/infer", b"{}",
                             {"content-type": "application/json"})[0] == 200
        after = _filter_runs(lone)
    finally:
        tenant_shares.write(shares, lone.settings.tenant_shares())
    expected = {TOKEN_CHECK_RUNS: 0, SHARES_RUNS: CALLS if case.named_always else 0}
    assert {k: inference[k] - before[k] for k in before} == expected, (before, inference)
    # The job start met both; HTTP inference as gRPC's.
    assert {k: after[k] - inference[k] for k in before} == {k: 1 + v for k, v in expected.items()
                                                          }, (inference, after)


def _reloads(lone: LoneGateway) -> int:
    url = (f"http://127.0.0.1:{lone.settings.gateway_admin_port}/stats?filter="
           f"{tenant_shares.FILTER_NAME}.config_reload")
    with urllib.request.urlopen(url, timeout=5) as response:
        return sum(int(line.partition(": ")[2] or 0) for line in
                   response.read().decode().splitlines())


def test_job_starts_run_the_client_checks(case: Case) -> None:
    lone = case.lone
    before = lone.executions()
    client = tc.InferenceServerClient(lone.grpc)
    try:
        assert client.is_server_ready() and client.is_model_ready("simple")
        client.get_model_repository_index()
    finally:
        client.close()
    assert lone.http("/v2/health/ready")[0] == 200
    after = lone.executions()
    assert after[CHECKS] - before[CHECKS] == 4, (before, after)


def test_a_client_sent_admin_key_never_reaches_triton(case: Case) -> None:
    lone = case.lone
    forged = {ADMIN_HEADER: "forged"}
    client = tc.InferenceServerClient(lone.grpc)
    try:
        _infer(client, "simple", forged)
        client.get_model_repository_index(headers=forged)
    finally:
        client.close()
    lone.http("/v2/models/simple/infer", b"{}", {HTTP_ADMIN_HEADER: "forged"})
    lone.http("/v2/repository/index", b"{}", {HTTP_ADMIN_HEADER: "forged"})
    for path, header in (("/ModelInfer", ADMIN_HEADER), ("/simple/infer", HTTP_ADMIN_HEADER)):
        assert {h.get(header) for h in lone.seen.headers_of(path)} == {None}, path
    # The gateway's own key, on the route that carries it, and never the client's.
    for path, header in (("/RepositoryIndex", ADMIN_HEADER),
                         ("/v2/repository/index", HTTP_ADMIN_HEADER)):
        assert {h.get(header) for h in lone.seen.headers_of(path)} == {ADMIN_KEY}, path


def test_a_full_queue_is_answered_as_backpressure_by_the_error_answers_alone(case: Case) -> None:
    lone = case.lone
    before = lone.executions()
    client = tc.InferenceServerClient(lone.grpc)
    try:
        with pytest.raises(InferenceServerException) as refused:
            _infer(client, FULL)
    finally:
        client.close()
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
    assert QUEUE_FULL in str(refused.value) and f"retry in {RETRY_AFTER_S} s" in str(
        refused.value)
    status, headers, body = lone.http(f"/v2/models/{FULL}/infer", b"{}",
                                              {"content-type": "application/json"})
    assert (status, headers.get("retry-after")) == (429, str(RETRY_AFTER_S)), (status, headers)
    assert QUEUE_FULL in json.loads(body)["error"]
    after = lone.executions()
    assert after[ERRORS] - before[ERRORS] == 2, (before, after)


def test_no_triton_ready_is_said_with_when_to_retry_by_the_error_answers_alone(
        case: Case) -> None:
    """Envoy's own answer when discovery lists no Triton (UH), rewritten by the error answers:
    the words and retry hints of gateway/gate.lua (the control plane silent here: no GPU pod is
    said to be starting)."""
    lone = case.lone
    client = tc.InferenceServerClient(lone.grpc)
    lone.list_triton(False)
    try:
        def none_ready() -> object:
            try:
                _infer(client, "simple")
            except InferenceServerException as error:
                return error.status() == "StatusCode.UNAVAILABLE" or str(error)
            return "still carried to the stand-in"

        until("the gateway to have no Triton", none_ready, 10)
        before = lone.executions()
        with pytest.raises(InferenceServerException) as refused:
            _infer(client, "simple")
        status, headers, body = lone.http("/v2/models/simple/infer", b"{}",
                                          {"content-type": "application/json"})
        after = lone.executions()
    finally:
        lone.list_triton(True)
        client.close()
    said = str(refused.value)
    assert refused.value.status() == "StatusCode.UNAVAILABLE", said
    assert NO_TRITON in said and f"retry in about {RETRY_AFTER_S} s" in said, said
    assert (status, headers.get("retry-after")) == (503, str(RETRY_AFTER_S)), (status, headers)
    assert NO_TRITON in json.loads(body)["error"], body
    assert after[ERRORS] - before[ERRORS] == 2, (before, after)
    # Inference calls: never the client checks' Lua.
    assert after[CHECKS] - before[CHECKS] == 0, (before, after)
    until("the stand-in Triton back in rotation", lambda: _carried(lone), 15)


def _carried(lone: LoneGateway) -> object:
    client = tc.InferenceServerClient(lone.grpc)
    try:
        _infer(client, "simple")
        return True
    except InferenceServerException as error:
        return str(error)
    finally:
        client.close()


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
