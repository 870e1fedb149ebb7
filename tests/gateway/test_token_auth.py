"""components/token-auth at the gateway, on a gateway of its own (tests/support/lone_gateway.py:
the shipped config as `make local` writes it with SONIC_RAY_AUTH_TOKENS_FILE and a tenant
map, before a stand-in Triton that records the headers reaching it), with real tritonclient
clients: who is refused and how, that a token never reaches Triton nor a log, who each call is
recorded as, and a rotated Secret. The Serve path's own check (the replicas') stays in
tests/stack/test_token_auth.py."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from local_stack.polling import until
from tests.support.callers import counters_after, lines_since, tenant_counters
from tests.support.echo import (
    echo_inputs,
    http_refusals,
    infer_with_token,
    outcome,
    stream_with_token,
)
from tests.support.lone_gateway import CHECKS, ERRORS, LoneGateway, envoy_before, lone_gateway
from tests.support.raw_http import request

pytestmark = pytest.mark.processes

FIRST = "tok-first-5f1c0a"
SECOND = "tok-second-9e27b4"
ROTATED = "tok-rotated-c83d61"
LEAKED = "leaked-if-logged-0d9a"


@dataclass
class TokenGateway:
    lone: LoneGateway
    tokens_file: Path
    folder: Path

    @property
    def url(self) -> str:
        return self.lone.grpc

    @property
    def http_url(self) -> str:
        return f"localhost:{self.lone.settings.http_port}"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenGateway]:
    folder = tmp_path_factory.mktemp("token-auth")
    tokens_file = folder / "tokens"
    # The second token is named: the gateway records the name as the caller.
    tokens_file.write_text(f"# one token a line\n{FIRST}\nalice {SECOND}\n")
    with lone_gateway(folder / "gateway", {
        "SONIC_RAY_AUTH_TOKENS_FILE": str(tokens_file),
        "SONIC_RAY_TENANTS": "physics=token:al*",
    }, ready_headers={"authorization": f"Bearer {FIRST}"}) as lone:
        yield TokenGateway(lone, tokens_file, folder)


def test_calls_without_a_known_token_are_unauthenticated(tokens: TokenGateway) -> None:
    for token in (None, "not-a-token", FIRST + "x", ""):
        answer = infer_with_token(tokens.url, token)
        assert answer.startswith("StatusCode.UNAUTHENTICATED"), (token, answer)
        assert "Bearer" in answer  # says what to send
    client = tc.InferenceServerClient(tokens.url)
    metadata_call = outcome(lambda: client.get_model_metadata("echo_headers"))
    assert metadata_call.startswith("StatusCode.UNAUTHENTICATED"), metadata_call


def test_known_tokens_pass_and_are_not_passed_on_to_triton(tokens: TokenGateway) -> None:
    for token in (FIRST, SECOND):
        client = tc.InferenceServerClient(tokens.url)
        client.infer("echo_headers", echo_inputs(), client_timeout=30,
                     headers={"authorization": f"Bearer {token}", "x-sonic-job": "auth"})
        seen_by_triton = tokens.lone.seen.headers_of("/ModelInfer")[-1]
        assert seen_by_triton.get("x-sonic-job") == "auth", seen_by_triton  # headers reach it...
        assert "authorization" not in seen_by_triton  # ...not this one
        assert not any(token in value for value in seen_by_triton.values())


def test_http_requests_without_a_known_token_get_401(tokens: TokenGateway) -> None:
    assert http_refusals(tokens.http_url, (None, "not-a-token", FIRST + "x")) == []


def test_http_known_tokens_pass_and_are_not_passed_on_to_triton(tokens: TokenGateway) -> None:
    for token in (FIRST, SECOND):
        status, _, body = request(tokens.http_url, "POST", "/v2/models/echo_headers/infer",
                                  body=b'{"inputs": []}',
                                  headers={"Authorization": f"Bearer {token}",
                                           "X-Sonic-Job": "http"})
        assert status == 200, body
        seen_by_triton = tokens.lone.seen.headers_of("/v2/models/echo_headers/infer")[-1]
        assert seen_by_triton.get("x-sonic-job") == "http", seen_by_triton
        assert "authorization" not in seen_by_triton
        assert not any(token in value for value in seen_by_triton.values())


def test_streams_are_checked_too(tokens: TokenGateway) -> None:
    refused = stream_with_token(tokens.url, None)
    assert isinstance(refused, InferenceServerException), refused
    assert refused.status() == "StatusCode.UNAUTHENTICATED"
    assert not isinstance(stream_with_token(tokens.url, FIRST), InferenceServerException)
    assert tokens.lone.seen.headers_of("/ModelStreamInfer"), "the stream never reached Triton"


def test_each_call_is_recorded_with_its_caller_and_tenant(tokens: TokenGateway) -> None:
    """The access log's lines and the per-tenant counters match the calls made: an unnamed
    token's calls under "unnamed", alice's under the tenant SONIC_RAY_TENANTS maps her to, a
    refused call under "anonymous" and counted as a failure."""
    metrics_port = str(tokens.lone.settings.gateway_metrics_port)
    before = tenant_counters(metrics_port)
    since = time.time()
    made = [infer_with_token(tokens.url, token)
            for token in (FIRST, FIRST, FIRST, SECOND, SECOND, "not-a-token", None)]
    assert made[:5] == ["OK"] * 5 and all(m.startswith("StatusCode.UNAUTHENTICATED")
                                          for m in made[5:]), made
    status, _, _ = request(tokens.http_url, "POST", "/v2/models/echo_headers/infer",
                           body=b'{"inputs": []}', headers={"authorization": f"Bearer {SECOND}"})
    assert status == 200

    lines = lines_since(tokens.lone.access_log, since, 8)
    who = collections.Counter((line["tenant"], line["identity"], line["protocol"],
                               line["grpc_status"]) for line in lines)
    assert who == {("unnamed", "token:unnamed", "grpc", "OK"): 3,
                   ("physics", "token:alice", "grpc", "OK"): 2,
                   ("physics", "token:alice", "http", None): 1,
                   ("anonymous", "anonymous", "grpc", "Unauthenticated"): 2}, lines
    (http_line,) = [line for line in lines if line["protocol"] == "http"]
    assert http_line["model"] == "echo_headers" and http_line["http_status"] == 200, http_line
    served = [line for line in lines if line["identity"] != "anonymous"]
    assert all(line["bytes_in"] > 0 and line["bytes_out"] > 0 for line in served), lines

    calls = {("calls", "unnamed", "grpc"): 3, ("calls", "physics", "grpc"): 2,
             ("calls", "physics", "http"): 1, ("calls", "anonymous", "grpc"): 2,
             ("failures", "anonymous", "grpc"): 2}
    counted = counters_after(metrics_port, before, calls)
    assert {key: value for key, value in counted.items()
            if key[0] in ("calls", "failures")} == calls, counted
    assert counted["bytes_received", "physics", "grpc"] == sum(
        line["bytes_in"] for line in lines
        if line["identity"] == "token:alice" and line["protocol"] == "grpc"), (counted, lines)


def test_checked_calls_run_no_lua(tokens: TokenGateway) -> None:
    """Tokens and a tenant map are checked by Envoy's own filters (gateway/callers.sh): an
    inference, passed or refused, runs no client checks' Lua; a refusal runs the error answers'
    Lua only, as every error answer does."""
    assert "by Envoy's own filters" in tokens.lone.log.read_text()
    before = tokens.lone.executions()
    made = [infer_with_token(tokens.url, token) for token in (FIRST, SECOND, "not-a-token")]
    assert made[:2] == ["OK", "OK"] and made[2].startswith("StatusCode.UNAUTHENTICATED"), made
    # The scheme in any case and more blanks (RFC 6750), as the Lua takes them.
    client = tc.InferenceServerClient(tokens.url)
    try:
        client.infer("echo_headers", echo_inputs(), client_timeout=30,
                     headers={"authorization": f"bEaReR   {SECOND}"})
    finally:
        client.close()
    after = tokens.lone.executions()
    assert after[CHECKS] == before[CHECKS] and after[ERRORS] == before[ERRORS] + 1, (before,
                                                                                    after)


def test_a_rotated_secret_takes_effect_without_a_restart(tokens: TokenGateway) -> None:
    # Kubelet swaps a Secret volume's files by renaming; so does this.
    staged = tokens.tokens_file.with_name("tokens.new")
    staged.write_text(f"{ROTATED}\n")
    staged.replace(tokens.tokens_file)
    until("the new token accepted", lambda: (answer := infer_with_token(
        tokens.url, ROTATED)) == "OK" or answer, 30, every_s=0.5)
    assert infer_with_token(tokens.url, FIRST).startswith("StatusCode.UNAUTHENTICATED")


def test_tokens_appear_in_no_log(tokens: TokenGateway) -> None:
    infer_with_token(tokens.url, LEAKED)  # a refused one, the likeliest to be logged
    infer_with_token(tokens.url, ROTATED)
    files = [p for p in (tokens.folder / "gateway").rglob("*") if p.is_file()]
    logs = [p for p in files if p.name in ("envoy.log", "access.log")]
    assert len(logs) == 2 and all(p.stat().st_size > 0 for p in logs), files
    for path in logs:
        data = path.read_bytes()
        for token in (FIRST, SECOND, ROTATED, LEAKED):
            assert token.encode() not in data, f"{token} in {path}"


def test_with_no_token_file_yet_every_call_is_refused(tmp_path: Path) -> None:
    """A Secret not yet mounted: Envoy starts, and refuses every call as it refuses an unknown
    token, until the file comes."""
    with envoy_before(tmp_path, {"SONIC_RAY_AUTH_TOKENS_FILE": str(tmp_path / "absent")},
                      [], []) as (settings, log, _, _):
        url = f"localhost:{settings.grpc_port}"

        def refused() -> object:
            answer = infer_with_token(url, FIRST)
            return ("UNAUTHENTICATED" in answer and "missing or invalid bearer token" in answer
                    ) or answer

        until("Envoy to refuse calls", refused, 30)
        assert http_refusals(f"localhost:{settings.http_port}", (FIRST, None)) == []
        assert "cannot be read yet: every call is refused" in log.read_text()
