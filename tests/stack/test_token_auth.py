"""components/token-auth on the Serve path, end to end: a stack of its own whose replicas read
bearer tokens from a file (as the component mounts the Secret), with real tritonclient clients
through Serve's proxies. Triton forwards every header it gets into the request parameters
here, so the echo_headers model shows what reached Triton. The gateway's check is tested on a
gateway of its own (tests/gateway/test_token_auth.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from local_stack.harness import RunningStack, processes_left_behind, running_stack
from local_stack.polling import until
from tests.support.echo import (
    echo_inputs,
    http_refusals,
    infer_with_token,
    outcome,
    stream_with_token,
)

FIRST = "tok-first-5f1c0a"
SECOND = "tok-second-9e27b4"
ROTATED = "tok-rotated-c83d61"


@dataclass
class AuthStack:
    url: str
    http_url: str
    tokens_file: Path
    workdir: Path
    running: RunningStack
    data_path: str


@pytest.fixture(scope="module", params=["serve"])
def auth_stack(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthStack]:
    tokens_file = tmp_path_factory.mktemp("client-tokens") / "tokens"
    # The second token is named: the gateway records the name as the caller.
    tokens_file.write_text(f"# one token a line\n{FIRST}\nalice {SECOND}\n")
    with running_stack({
        "DATA_PATH": request.param,
        "SONIC_RAY_AUTH_TOKENS_FILE": str(tokens_file),
        "SONIC_RAY_TENANTS": "physics=token:al*",
        "TRITON_ARGS": "--grpc-header-forward-pattern=.* --http-header-forward-pattern=.*",
    }) as running:
        yield AuthStack(running.url("GRPC_PORT"), running.url("HTTP_PORT"), tokens_file,
                        running.process.workdir(), running, request.param)
    assert not processes_left_behind(running.process)


def test_calls_without_a_known_token_are_unauthenticated(auth_stack: AuthStack) -> None:
    for token in (None, "not-a-token", FIRST + "x", ""):
        answer = infer_with_token(auth_stack.url, token)
        assert answer.startswith("StatusCode.UNAUTHENTICATED"), (token, answer)
        assert "Bearer" in answer  # says what to send
    client = tc.InferenceServerClient(auth_stack.url)
    metadata_call = outcome(lambda: client.get_model_metadata("echo_headers"))
    assert metadata_call.startswith("StatusCode.UNAUTHENTICATED"), metadata_call


def test_known_tokens_pass_and_are_not_passed_on_to_triton(auth_stack: AuthStack) -> None:
    for token in (FIRST, SECOND):
        client = tc.InferenceServerClient(auth_stack.url)
        result = client.infer("echo_headers", echo_inputs(),
                              headers={"authorization": f"Bearer {token}", "x-sonic-job": "auth"},
                              client_timeout=30)
        seen_by_triton = result.as_numpy("PARAMETERS")[0].decode()
        assert '"x-sonic-job":"auth"' in seen_by_triton  # headers do reach Triton here...
        assert token not in seen_by_triton and "authorization" not in seen_by_triton  # ...not this


def test_http_requests_without_a_known_token_get_401(auth_stack: AuthStack) -> None:
    assert http_refusals(auth_stack.http_url, (None, "not-a-token", FIRST + "x")) == []


def test_http_known_tokens_pass_and_are_not_passed_on_to_triton(auth_stack: AuthStack) -> None:
    client = httpclient.InferenceServerClient(auth_stack.http_url)
    inputs = [httpclient.InferInput("INPUT", [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([1], np.int32))
    for token in (FIRST, SECOND):
        result = client.infer("echo_headers", inputs,
                              headers={"Authorization": f"Bearer {token}", "X-Sonic-Job": "http"})
        seen_by_triton = result.as_numpy("PARAMETERS")[0].decode().lower()
        assert '"x-sonic-job":"http"' in seen_by_triton  # headers do reach Triton here...
        assert token not in seen_by_triton and "authorization" not in seen_by_triton  # ...not this


def test_streams_are_checked_too(auth_stack: AuthStack) -> None:
    refused = stream_with_token(auth_stack.url, None)
    assert isinstance(refused, InferenceServerException), refused
    assert refused.status() == "StatusCode.UNAUTHENTICATED"
    assert not isinstance(stream_with_token(auth_stack.url, FIRST), InferenceServerException)


def test_a_rotated_secret_takes_effect_without_a_restart(auth_stack: AuthStack) -> None:
    # Kubelet swaps a Secret volume's files by renaming; so does this.
    staged = auth_stack.tokens_file.with_name("tokens.new")
    staged.write_text(f"{ROTATED}\n")
    staged.replace(auth_stack.tokens_file)
    until("the new token accepted", lambda: (answer := infer_with_token(
        auth_stack.url, ROTATED)) == "OK" or answer, 30, every_s=0.5)
    assert infer_with_token(auth_stack.url, FIRST).startswith("StatusCode.UNAUTHENTICATED")


def test_tokens_appear_in_no_log(auth_stack: AuthStack) -> None:
    infer_with_token(auth_stack.url, "leaked-if-logged-0d9a")  # a refused one, the likeliest to be logged
    infer_with_token(auth_stack.url, ROTATED)
    files = [p for p in auth_stack.workdir.rglob("*") if p.is_file()]
    assert len(files) > 10, "no logs found: the check would be empty"
    for path in files:
        if path.is_symlink() or path.suffix in {".sock", ".so"}:
            continue
        data = path.read_bytes() if path.stat().st_size < (64 << 20) else b""
        for token in (FIRST, SECOND, ROTATED, "leaked-if-logged-0d9a"):
            assert token.encode() not in data, f"{token} in {path}"
