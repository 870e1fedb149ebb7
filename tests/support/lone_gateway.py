"""One gateway Envoy outside any stack, for the gateway tier (tests/gateway/): the shipped config
as `make local` writes it for the settings given (token checks, JWKS, tenants and shares as
the environment says: local_stack/gateway_config.py write_lone_config), started as the
gateway's container starts it (gateway/start.sh), in front of a stand-in Triton that speaks
Triton's gRPC protocol (its own protos) and HTTP, answers at once and records what reaches it.
The thing tested is the gateway's config and Lua; what crosses components stays in tests/stack/."""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
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
from gateway.routes import HTTP_CLUSTER
from local_stack.gateway_config import gateway_env, write_lone_config
from local_stack.harness import stack_ports_env
from local_stack.polling import until
from local_stack.processes import spawn, terminate
from local_stack.settings import Settings
from tools import certificates

ADMIN_KEY = "the-gateways-own-key"
# A model whose every call the stand-in refuses as Triton refuses a call its full queue cannot
# hold (Triton's words).
FULL, QUEUE_FULL = "full", "Exceeds maximum queue size"
# The Lua filters' counters (gateway/envoy.yaml: each filter's stat_prefix), and every Lua
# filter's whatever its prefix.
CHECKS, ERRORS, ANY = "lua.client_checks.executions", "lua.error_answers.executions", "executions"


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


class StandInTriton(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def _saw(self, name: str, context: grpc.ServicerContext) -> None:
        self.seen.add(f"/inference.GRPCInferenceService/{name}",
                      {k.lower(): v for k, v in context.invocation_metadata()})

    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._saw("ServerReady", context)
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelReady(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._saw("ModelReady", context)
        return service_pb2.ModelReadyResponse(ready=True)

    def RepositoryIndex(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._saw("RepositoryIndex", context)
        return service_pb2.RepositoryIndexResponse()

    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._saw("ModelInfer", context)
        if request.model_name == FULL:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{QUEUE_FULL} (a stand-in's words)")
        return service_pb2.ModelInferResponse(model_name=request.model_name)

    def ModelStreamInfer(self, requests: Iterator[Any],  # noqa: N802
                         context: grpc.ServicerContext) -> Iterator[Any]:
        self._saw("ModelStreamInfer", context)
        for request in requests:
            yield service_pb2.ModelStreamInferResponse(
                infer_response=service_pb2.ModelInferResponse(model_name=request.model_name))


def _serving(request: bytes, context: grpc.ServicerContext) -> bytes:
    return b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}


def _http_handler(seen: Seen) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
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
class LoneGateway:
    settings: Settings
    seen: Seen
    folder: Path
    log: Path
    # The stand-in Triton's ports (gRPC, HTTP).
    upstream: tuple[int, int]

    def list_triton(self, listed: bool) -> None:
        """The stand-in Triton in the gateway's discovery, or out of it (no Triton ready), as
        the headless Service lists a pod or not."""
        grpc_ports, http_ports = ([self.upstream[0]], [self.upstream[1]]) if listed else ([], [])
        gateway.write_endpoints(self.folder / "endpoints.json", grpc_ports)
        gateway.write_endpoints(self.folder / "endpoints-http.json", http_ports, HTTP_CLUSTER)

    # With TLS on (TLS=1 in the settings): the throw-away CA and client certificate.
    files: certificates.Files | None = None

    @property
    def grpc(self) -> str:
        return f"localhost:{self.settings.grpc_port}"

    def grpc_client(self, client_certificate: bool = True) -> tc.InferenceServerClient:
        """A client of the gRPC listener, over TLS where it is on (with the client
        certificate unless told not to)."""
        if self.files is None:
            return tc.InferenceServerClient(self.grpc)
        mine = {"private_key": str(self.files.client_key),
                "certificate_chain": str(self.files.client_cert)} if client_certificate else {}
        return tc.InferenceServerClient(self.grpc, ssl=True,
                                        root_certificates=str(self.files.ca), **mine)

    @property
    def access_log(self) -> Path:
        return self.folder / "access.log"

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
        """Each Lua filter's executions (CHECKS, ERRORS, ANY), summed over the listeners."""
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

    def counted(self, *suffixes: str) -> dict[str, int]:
        """Envoy's counters whose names end with each of suffixes, summed over the listeners."""
        url = f"http://127.0.0.1:{self.settings.gateway_admin_port}/stats"
        with urllib.request.urlopen(url, timeout=5) as response:
            lines = response.read().decode().splitlines()
        found = dict.fromkeys(suffixes, 0)
        for line in lines:
            name, _, value = line.partition(": ")
            for suffix in suffixes:
                if name.endswith(suffix):
                    found[suffix] += int(value)
        return found

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.access_log.read_text().splitlines()
                if line.startswith("{")]


def _carries_calls(lone: LoneGateway, envoy: subprocess.Popen[bytes],
                   headers: dict[str, str] | None) -> object:
    if envoy.poll() is not None:
        raise RuntimeError(f"Envoy exited ({envoy.returncode}): {lone.log.read_text()[-2000:]}")
    client = lone.grpc_client()
    try:
        return client.is_server_ready(headers=headers) or "not ready"
    except InferenceServerException as error:
        return str(error)
    finally:
        client.close()


@contextmanager
def envoy_before(folder: Path, env: dict[str, str], grpc_ports: list[int],
                 http_ports: list[int]) -> Iterator[tuple[Settings, Path, subprocess.Popen[bytes],
                                                          certificates.Files | None]]:
    """The gateway's Envoy with these settings (over ports of its own) in `folder`, its
    Tritons those listening on these ports, started as its container starts it: its settings,
    log, process and (with TLS on) the throw-away certificates."""
    env = {**stack_ports_env(), **env}
    with pytest.MonkeyPatch.context() as patch:
        # The settings' readers take the process's environment (the tenant shares).
        for name, value in env.items():
            patch.setenv(name, value)
        settings = Settings.from_env(env)
        files = certificates.write_local(folder / "certificates")[0] if settings.tls else None
        config = write_lone_config(settings, folder, grpc_ports, http_ports,
                                   certificates=folder / "certificates" if files else None)
        log = folder / "envoy.log"
        envoy: subprocess.Popen[bytes] = spawn(gateway.command(config), log,
                                               gateway_env(settings, ADMIN_KEY))
    try:
        yield settings, log, envoy, files
    finally:
        terminate(envoy, 5)


@contextmanager
def lone_gateway(folder: Path, env: dict[str, str],
                 ready_headers: dict[str, str] | None = None) -> Iterator[LoneGateway]:
    """The gateway with these settings (over ports of its own) in `folder`, once it carries a
    ServerReady (sent with `ready_headers`: a credential where the settings ask for one) to
    the stand-in Triton."""
    seen = Seen()
    with ExitStack() as stack:
        server = grpc.server(futures.ThreadPoolExecutor(8))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(StandInTriton(seen), server)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(_serving)})])
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        stack.callback(server.stop, 0)
        http = ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(seen))
        threading.Thread(target=http.serve_forever, daemon=True).start()
        stack.callback(http.server_close)
        stack.callback(http.shutdown)
        settings, log, envoy, files = stack.enter_context(
            envoy_before(folder, env, [grpc_port], [http.server_address[1]]))
        lone = LoneGateway(settings, seen, folder, log, (grpc_port, http.server_address[1]), files)
        until("Envoy to carry calls to the stand-in Triton",
              lambda: _carries_calls(lone, envoy, ready_headers), 30)
        yield lone
