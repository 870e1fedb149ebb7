"""Our RPC table against tritonclient's own service descriptor: a protocol change in Triton
(a new, renamed or re-typed RPC) fails here."""

import contextlib
import http.server
import threading
from collections.abc import Callable, Iterator
from typing import ClassVar

import pytest
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2

from triton_pod.http_forwarding import restricted_rpc
from triton_pod.rpcs import HTTP_RESTRICTED, REFUSABLE, RPCS, SERVICE


def test_table_matches_tritonclient_descriptor() -> None:
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == SERVICE
    theirs = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    ours = {rpc.name: (rpc.streaming, rpc.streaming) for rpc in RPCS}
    assert ours == theirs


def test_refused_by_default_are_the_load_balancer_hazards() -> None:
    assert frozenset({
        "RepositoryModelLoad", "RepositoryModelUnload",
        "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
        "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
        "TraceSetting", "LogSettings",
    }) == REFUSABLE


def test_rpcs_in_tritons_restricted_groups_are_marked() -> None:
    # --grpc-restricted-protocol=model-repository,shared-memory,trace,logging
    restricted = {rpc.name for rpc in RPCS if rpc.restricted}
    assert restricted == REFUSABLE | {
        "RepositoryIndex", "SystemSharedMemoryStatus", "CudaSharedMemoryStatus"}


_Call = Callable[[httpclient.InferenceServerClient], object]
# Each restricted RPC as tritonclient.http calls it; the URL it sends must map back to the RPC.
_HTTP_CALLS: dict[str, _Call] = {
    "RepositoryIndex": lambda c: c.get_model_repository_index(),
    "RepositoryModelLoad": lambda c: c.load_model("m"),
    "RepositoryModelUnload": lambda c: c.unload_model("m"),
    "SystemSharedMemoryStatus": lambda c: c.get_system_shared_memory_status("r"),
    "SystemSharedMemoryRegister": lambda c: c.register_system_shared_memory("r", "/k", 8),
    "SystemSharedMemoryUnregister": lambda c: c.unregister_system_shared_memory(),
    "CudaSharedMemoryStatus": lambda c: c.get_cuda_shared_memory_status(),
    "CudaSharedMemoryRegister": lambda c: c.register_cuda_shared_memory("r", b"h", 0, 8),
    "CudaSharedMemoryUnregister": lambda c: c.unregister_cuda_shared_memory("r"),
    "TraceSetting": lambda c: c.update_trace_settings("m", {"trace_level": ["OFF"]}),
    "LogSettings": lambda c: c.update_log_settings({"log_info": False}),
}
# ...and the other spellings of the same calls.
_HTTP_CALLS_TOO: dict[str, list[_Call]] = {
    "TraceSetting": [lambda c: c.get_trace_settings(), lambda c: c.get_trace_settings("m")],
    "LogSettings": [lambda c: c.get_log_settings()],
    "SystemSharedMemoryStatus": [lambda c: c.get_system_shared_memory_status()],
    "SystemSharedMemoryUnregister": [lambda c: c.unregister_system_shared_memory("r")],
    "CudaSharedMemoryUnregister": [lambda c: c.unregister_cuda_shared_memory()],
}


class _Recorder(http.server.BaseHTTPRequestHandler):
    paths: ClassVar[list[str]] = []

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        _Recorder.paths.append(self.path)
        body = b"{}"
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer  # noqa: N815 - the handler names http.server calls

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def recording_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_paths_are_the_ones_tritonclient_http_calls(recording_server: str) -> None:
    assert set(_HTTP_CALLS) == {rpc.name for rpc in HTTP_RESTRICTED} == {
        rpc.name for rpc in RPCS if rpc.restricted}
    client = httpclient.InferenceServerClient(recording_server)
    for name, call in _HTTP_CALLS.items():
        for each in (call, *_HTTP_CALLS_TOO.get(name, [])):
            _Recorder.paths.clear()
            with contextlib.suppress(Exception):  # the answer is not what the client expects
                each(client)
            assert _Recorder.paths, name
            path = _Recorder.paths[-1].split("?")[0]
            rpc = restricted_rpc(path)
            assert rpc is not None and rpc.name == name, (name, path)
    # What is neither refused nor restricted passes untouched.
    for path in ("/v2", "/v2/models/m/infer", "/v2/models/m/versions/1/stats",
                 "/v2/models/m/generate", "/v2/health/ready", "/v2/repository/models/m"):
        assert restricted_rpc(path) is None, path
