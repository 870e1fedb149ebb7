"""The gateway's hot path (gateway/envoy.yaml, gateway/start.sh): a real Envoy with the shipped
config as `make local` writes it, in front of a stand-in Triton (gRPC with Triton's own
protos, and HTTP) that records what reaches it; the thing tested is the config and its Lua.

With nothing configured that checks or names callers, a call other than a job start runs no
Lua at all (Envoy's counters of each Lua filter's executions), yet the access log still names
an anonymous caller, its protocol and (HTTP) its model; a job start runs the client checks;
an error answer, and only that, runs the error answers' Lua, which turns Triton's queue-full
UNAVAILABLE / 503 into RESOURCE_EXHAUSTED / 429 with a retry hint. With a site's tenants
configured, every call runs the client checks. A client-sent admin header never reaches
Triton on any route; the gateway's own reaches it on the routes that carry it."""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gateway import local as gateway
from local_stack.gateway_config import gateway_env, write_lone_config
from local_stack.harness import stack_ports_env
from local_stack.polling import until
from local_stack.processes import spawn, terminate
from local_stack.settings import Settings
from triton_pod.access import ADMIN_HEADER, HTTP_ADMIN_HEADER

ADMIN_KEY = "the-gateways-own-key"
# A model whose every call Triton refuses as a full queue does (its words).
FULL, QUEUE_FULL = "full", "Exceeds maximum queue size"
RETRY_AFTER_S = 2
# The Lua filters' counters (gateway/envoy.yaml: each filter's stat_prefix).
CHECKS, ERRORS = "lua.client_checks.executions", "lua.error_answers.executions"
# Every Lua filter's, whatever its prefix.
ANY = "executions"
CALLS = 10


@dataclass
class Seen:
    """What reached the stand-in Triton: each call's path and headers (lower-case)."""

    calls: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, path: str, headers: dict[str, str]) -> None:
        with self.lock:
            self.calls.append((path, headers))

    def headers_of(self, path_end: str) -> list[dict[str, str]]:
        with self.lock:
            return [h for p, h in self.calls if p.endswith(path_end)]


class Triton(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def _saw(self, name: str, context: grpc.ServicerContext) -> None:
        self.seen.add(f"/inference.GRPCInferenceService/{name}",
                      {k.lower(): v for k, v in context.invocation_metadata()})

    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._saw("ServerReady", context)
        return service_pb2.ServerReadyResponse(ready=True)

    def RepositoryIndex(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._saw("RepositoryIndex", context)
        return service_pb2.RepositoryIndexResponse()

    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._saw("ModelInfer", context)
        if request.model_name == FULL:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{QUEUE_FULL} (a stand-in's words)")
        return service_pb2.ModelInferResponse(model_name=request.model_name)


def _health(request: bytes, context: grpc.ServicerContext) -> bytes:
    return b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}


def http_handler(seen: Seen) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            seen.add(self.path, {k.lower(): v for k, v in self.headers.items()})
            status, body = 200, b"{}"
            if self.path == f"/v2/models/{FULL}/infer":
                status, body = 503, json.dumps({"error": QUEUE_FULL}).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@dataclass
class Gateway:
    settings: Settings
    seen: Seen
    access_log: Path
    checked_always: bool

    @property
    def grpc(self) -> str:
        return f"localhost:{self.settings.grpc_port}"

    def http(self, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
             ) -> tuple[int, dict[str, str], str]:
        request = urllib.request.Request(f"http://localhost:{self.settings.http_port}{path}",
                                         data=body, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, dict(response.headers), response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read().decode()

    def executions(self) -> dict[str, int]:
        """Each Lua filter's executions, summed over both listeners."""
        url = f"http://127.0.0.1:{self.settings.gateway_admin_port}/stats?filter=lua"
        with urllib.request.urlopen(url, timeout=5) as response:
            lines = response.read().decode().splitlines()
        found = {CHECKS: 0, ERRORS: 0, ANY: 0}
        for line in lines:
            name, _, value = line.partition(": ")
            for counter in (CHECKS, ERRORS):
                if name.endswith("." + counter):
                    found[counter] += int(value)
            if name.startswith("http.") and name.endswith(".executions"):
                found[ANY] += int(value)
        return found

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.access_log.read_text().splitlines()
                if line.startswith("{")]


@pytest.fixture(scope="module", params=["nothing-configured", "tenants"])
def lone_gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 ) -> Iterator[Gateway]:
    tmp_path = tmp_path_factory.mktemp(request.param)
    seen = Seen()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Triton(seen), server)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(_health)})])
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), http_handler(seen))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    env = {**stack_ports_env(), "SONIC_RAY_RETRY_AFTER_S": str(RETRY_AFTER_S)}
    if request.param == "tenants":
        env["SONIC_RAY_TENANTS"] = "cms=*"
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            settings = Settings.from_env(env)
            folder = tmp_path / "gateway"
            config = write_lone_config(settings, folder, [grpc_port], [http.server_address[1]])
            access_log = folder / "access.log"
            log = tmp_path / "envoy.log"
            envoy: subprocess.Popen[bytes] = spawn(gateway.command(config), log,
                                                   gateway_env(settings, ADMIN_KEY))
        try:
            lone = Gateway(settings, seen, access_log, request.param == "tenants")

            def answers() -> object:
                if envoy.poll() is not None:
                    raise RuntimeError(f"Envoy exited ({envoy.returncode}): "
                                       f"{log.read_text()[-2000:]}")
                client = tc.InferenceServerClient(lone.grpc)
                try:
                    return client.is_server_ready() and lone.http("/v2/health/ready")[0] == 200
                except InferenceServerException as error:
                    return str(error)
                finally:
                    client.close()

            until("Envoy to carry calls to the stand-in Triton", answers, 30)
            said = log.read_text()
            assert ("run on every call" if lone.checked_always
                    else "run on job starts only") in said, said[-2000:]
            yield lone
        finally:
            terminate(envoy, grace_s=5)
    finally:
        server.stop(0)
        http.shutdown()
        http.server_close()


def _infer(client: tc.InferenceServerClient, model: str,
           headers: dict[str, str] | None = None) -> None:
    data = tc.InferInput("INPUT0", [1], "INT32")
    data.set_data_from_numpy(__import__("numpy").array([1], dtype="int32"))
    client.infer(model, [data], headers=headers)


def test_calls_other_than_job_starts_run_no_lua_unless_callers_are_checked(
        lone_gateway: Gateway) -> None:
    before = lone_gateway.executions()
    client = tc.InferenceServerClient(lone_gateway.grpc)
    try:
        for _ in range(CALLS):
            _infer(client, "simple")
    finally:
        client.close()
    for _ in range(CALLS):
        status, _, _ = lone_gateway.http("/v2/models/simple/infer", b"{}",
                                         {"content-type": "application/json"})
        assert status == 200
    after = lone_gateway.executions()
    # The error answers' Lua never runs on a call that succeeds; the client checks only where
    # the site checks or names callers.
    expected = 2 * CALLS if lone_gateway.checked_always else 0
    assert after[ANY] - before[ANY] == expected, (before, after)
    assert after[CHECKS] - before[CHECKS] == expected, (before, after)

    def calls_logged() -> list[dict[str, Any]]:
        return [line for line in lone_gateway.log_lines()
                if line["path"].endswith(("/ModelInfer", "/simple/infer"))]

    until("the calls' access log lines",
          lambda: len(calls_logged()) >= 2 * CALLS or len(calls_logged()), 10)
    lines = calls_logged()
    tenant = "cms" if lone_gateway.checked_always else "anonymous"
    assert {(line["identity"], line["tenant"]) for line in lines} == {("anonymous", tenant)}
    assert {line["protocol"] for line in lines} == {"grpc", "http"}
    assert {line["model"] for line in lines if line["protocol"] == "http"} == {"simple"}


def test_job_starts_run_the_client_checks(lone_gateway: Gateway) -> None:
    before = lone_gateway.executions()
    client = tc.InferenceServerClient(lone_gateway.grpc)
    try:
        assert client.is_server_ready()
        client.get_model_repository_index()
    finally:
        client.close()
    assert lone_gateway.http("/v2/health/ready")[0] == 200
    after = lone_gateway.executions()
    assert after[CHECKS] - before[CHECKS] == 3, (before, after)


def test_a_client_sent_admin_key_never_reaches_triton(lone_gateway: Gateway) -> None:
    forged = {ADMIN_HEADER: "forged"}
    client = tc.InferenceServerClient(lone_gateway.grpc)
    try:
        _infer(client, "simple", forged)
        client.get_model_repository_index(headers=forged)
    finally:
        client.close()
    lone_gateway.http("/v2/models/simple/infer", b"{}", {HTTP_ADMIN_HEADER: "forged"})
    lone_gateway.http("/v2/repository/index", b"{}", {HTTP_ADMIN_HEADER: "forged"})
    for path, header in (("/ModelInfer", ADMIN_HEADER), ("/simple/infer", HTTP_ADMIN_HEADER)):
        assert {h.get(header) for h in lone_gateway.seen.headers_of(path)} == {None}, path
    # The gateway's own key, on the route that carries it, and never the client's.
    for path, header in (("/RepositoryIndex", ADMIN_HEADER),
                         ("/v2/repository/index", HTTP_ADMIN_HEADER)):
        assert {h.get(header) for h in lone_gateway.seen.headers_of(path)} == {ADMIN_KEY}, path


def test_a_full_queue_is_answered_as_backpressure_by_the_error_answers_alone(
        lone_gateway: Gateway) -> None:
    before = lone_gateway.executions()
    client = tc.InferenceServerClient(lone_gateway.grpc)
    try:
        with pytest.raises(InferenceServerException) as refused:
            _infer(client, FULL)
    finally:
        client.close()
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
    assert QUEUE_FULL in str(refused.value) and f"retry in {RETRY_AFTER_S} s" in str(
        refused.value)
    status, headers, body = lone_gateway.http(f"/v2/models/{FULL}/infer", b"{}",
                                              {"content-type": "application/json"})
    assert (status, headers.get("retry-after")) == (429, str(RETRY_AFTER_S)), (status, headers)
    assert QUEUE_FULL in json.loads(body)["error"]
    after = lone_gateway.executions()
    assert after[ERRORS] - before[ERRORS] == 2, (before, after)


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
