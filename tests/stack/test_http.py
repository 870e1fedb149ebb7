"""Triton's HTTP/REST API through the clients' endpoint (HTTP_PORT) on both data paths: Triton's
own example clients run unchanged, the same request straight to Triton and through the endpoint
gets the same answer, and the endpoint refuses what gRPC refuses, in Triton's error shape."""

from __future__ import annotations

import gzip
import json
import subprocess
import zlib
from collections.abc import Callable

import numpy as np
import pytest

from tests.stack.conftest import ADMIN_KEY, Stack
from tests.support.examples import EXAMPLES, SEQUENCE_EXAMPLES, run_example
from tests.support.raw_http import request
from triton_pod.access import HTTP_ADMIN_HEADER
from triton_pod.rpcs import BY_NAME, refusal_message

# Headers that Triton sets and a client reads; a proxy's own (server, date, x-request-id) aside.
TRITON_HEADERS = ("content-type", "content-length", "content-encoding",
                  "inference-header-content-length")
# One concrete request per HTTP endpoint of the refused RPCs.
REFUSED_REQUESTS = {
    "RepositoryModelLoad": ("POST", "/v2/repository/models/simple/load"),
    "RepositoryModelUnload": ("POST", "/v2/repository/models/simple/unload"),
    "SystemSharedMemoryRegister": ("POST", "/v2/systemsharedmemory/region/r0/register"),
    "SystemSharedMemoryUnregister": ("POST", "/v2/systemsharedmemory/unregister"),
    "CudaSharedMemoryRegister": ("POST", "/v2/cudasharedmemory/region/r0/register"),
    "CudaSharedMemoryUnregister": ("POST", "/v2/cudasharedmemory/region/r0/unregister"),
    "TraceSetting": ("GET", "/v2/models/simple/trace/setting"),
    "LogSettings": ("POST", "/v2/logging"),
}

Case = tuple[str, str, bytes, dict[str, str]]  # method, path, body, headers
INFER = "/v2/models/simple/infer"
IDENTITY = "/v2/models/identity_fp32/infer"


def _binary_infer(elements: int) -> Case:
    """identity_fp32 with binary input and output: a JSON header, then the raw tensor."""
    values = np.random.default_rng(7).random(elements, dtype=np.float32)
    header = json.dumps({
        "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [values.size],
                    "parameters": {"binary_data_size": values.nbytes}}],
        "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True}}],
    }).encode()
    return "POST", IDENTITY, header + values.tobytes(), {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream"}


def _simple_json(extra: int = 0) -> bytes:
    return json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [extra] * 16},
    ]}).encode()


# Each request made when its test runs: the large bodies stay out of test collection.
CASES: dict[str, Callable[[], Case]] = {
    "server-metadata": lambda: ("GET", "/v2", b"", {}),
    "model-config": lambda: ("GET", "/v2/models/simple/config", b"", {}),
    "model-ready": lambda: ("GET", "/v2/models/simple/versions/1/ready", b"", {}),
    "json-infer": lambda: ("POST", INFER, _simple_json(), {"Content-Type": "application/json"}),
    "json-fp32": lambda: ("POST", IDENTITY, json.dumps({"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": [4], "data": [0.5, 1, 2, 3]}]}).encode(),
        {}),
    "binary-1MiB": lambda: _binary_infer(1 << 18),
    "binary-64MiB": lambda: _binary_infer(1 << 24),
    "binary-256MiB": lambda: _binary_infer(1 << 26),
    "gzip-request": lambda: ("POST", INFER, gzip.compress(_simple_json(3)),
                             {"Content-Encoding": "gzip"}),
    "deflate-request": lambda: ("POST", INFER, zlib.compress(_simple_json(4)),
                                {"Content-Encoding": "deflate"}),
    "gzip-response": lambda: ("POST", INFER, _simple_json(5), {"Accept-Encoding": "gzip"}),
    "deflate-response": lambda: ("POST", INFER, _simple_json(6), {"Accept-Encoding": "deflate"}),
    "generate": lambda: ("POST", "/v2/models/text_echo/generate",
                         json.dumps({"text_input": "b-tag this jet"}).encode(), {}),
    "unknown-model": lambda: ("POST", "/v2/models/no_such_model/infer", _simple_json(), {}),
    "bad-shape": lambda: ("POST", INFER, json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]}]}).encode(),
        {}),
    "malformed-json": lambda: ("POST", INFER, b"{not json", {}),
}


# Examples whose first call the endpoint refuses: they stop there, with the refusal's words.
REFUSED_EXAMPLES = {"simple_http_shm_client.py": "SystemSharedMemoryUnregister"}


def _run_example(stack: Stack, example: str) -> subprocess.CompletedProcess[str]:
    return run_example(example, stack.http_url)


# The sequence clients (SEQUENCE_EXAMPLES) need tests/sequence_models and two pods to show
# anything: they run in tests/gateway/test_sequences.py and tests/stack/test_gateway.py.


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("simple_http_*.py")
                                           if p.name not in REFUSED_EXAMPLES
                                           and p.name not in SEQUENCE_EXAMPLES))
def test_tritons_own_http_examples_pass_unchanged(stack: Stack, example: str) -> None:
    done = _run_example(stack, example)
    assert done.returncode == 0, f"{example} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


@pytest.mark.parametrize("example", sorted(REFUSED_EXAMPLES))
def test_tritons_examples_of_refused_apis_read_why(stack: Stack, example: str) -> None:
    done = _run_example(stack, example)
    assert done.returncode != 0
    assert refusal_message(BY_NAME[REFUSED_EXAMPLES[example]]) in done.stdout + done.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_same_answer_as_triton_itself(stack: Stack, case: str) -> None:
    method, path, body, headers = CASES[case]()
    direct = request(stack.triton_http_url, method, path, body, headers)
    through = request(stack.http_url, method, path, body, headers)
    assert through[0] == direct[0], (through[0], through[2][:300], direct[2][:300])
    assert through[2] == direct[2], f"{case}: the body differs from Triton's"
    for name in TRITON_HEADERS:
        assert through[1].get(name) == direct[1].get(name), f"{case}: header {name}"
    if case.endswith("-response"):
        assert direct[1].get("content-encoding"), "Triton did not compress: the case is empty"


@pytest.mark.parametrize("rpc", sorted(REFUSED_REQUESTS))
def test_refused_as_on_grpc_in_tritons_error_shape(stack: Stack, rpc: str) -> None:
    method, path = REFUSED_REQUESTS[rpc]
    status, headers, body = request(stack.http_url, method, path, b"{}")
    assert status == 403, (status, body)
    assert headers["content-type"].startswith("application/json")
    assert json.loads(body) == {"error": refusal_message(BY_NAME[rpc])}


def test_a_clients_admin_header_opens_nothing(stack: Stack) -> None:
    status, _, body = request(stack.http_url, "POST", "/v2/repository/models/simple/unload",
                              b"{}", {HTTP_ADMIN_HEADER: ADMIN_KEY})
    assert status == 403, body
    # Triton itself refuses the restricted API without the key: what the endpoint adds.
    status, _, body = request(stack.triton_http_url, "POST", "/v2/repository/index", b"{}")
    assert status == 403 and b"restricted" in body, body


@pytest.mark.parametrize("path", ["/v2/repository/index", "/v2/systemsharedmemory/status",
                                  "/v2/cudasharedmemory/status"])
def test_read_only_restricted_endpoints_pass(stack: Stack, path: str) -> None:
    method = "POST" if "repository" in path else "GET"
    direct = request(stack.triton_http_url, method, path, b"", {HTTP_ADMIN_HEADER: ADMIN_KEY})
    through = request(stack.http_url, method, path)
    assert direct[0] == 200, direct
    assert through[0] == direct[0] and through[2] == direct[2], through
