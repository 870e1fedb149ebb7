"""What the pods run is exactly the triton-pod-code ConfigMap: its files, alone with the pinned
Ray in a clean interpreter, import everything the Serve config names (application, gRPC
servicer registration, autoscaling policy), build the application, and forward one call (to a
stand-in Triton in the same interpreter: what is tested is that the shipped code runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kustomize import ROOT, build, objects

# The checkout's own packages are installed editable (make venv): their finder goes, so
# that only the shipped files can be imported.
SHIPPED_CHECK = """
import importlib, sys, yaml
sys.meta_path[:] = [f for f in sys.meta_path
                    if "__editable__" not in str(getattr(f, "__module__", ""))]
config = yaml.safe_load(open(sys.argv[1]))
names = list(config["grpc_options"]["grpc_servicer_functions"])
for app in config["applications"]:
    names.append(app["import_path"].replace(":", "."))
    for deployment in app["deployments"]:
        policy = deployment["autoscaling_config"]["policy"]["policy_function"]
        names.append(policy.replace(":", "."))
for name in names:
    module, _, attr = name.rpartition(".")
    getattr(importlib.import_module(module), attr)
app = config["applications"][0]
module, _, attr = app["import_path"].partition(":")
getattr(importlib.import_module(module), attr)(app["args"])

import asyncio, grpc
from aiohttp import web
from triton_pod.pod import TritonPodArgs, TritonPod
from triton_pod.rpcs import BY_NAME, SERVICE

class Context:
    code = None
    def invocation_metadata(self): return [("x-job", "1")]
    def set_code(self, code): self.code = code
    def set_details(self, details): pass
    def set_trailing_metadata(self, metadata): pass

async def one_call():
    async def ready(request, context): return b"\x08\x01"
    async def infer(request, context): return b"reply:" + request
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "ServerReady": grpc.unary_unary_rpc_method_handler(ready),
        "ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # Triton's HTTP endpoint: ready, and no model to warm.
    http = web.Application()
    http.router.add_get("/v2/health/ready", lambda request: web.Response())
    http.router.add_post("/v2/repository/index", lambda request: web.json_response([]))
    runner = web.AppRunner(http)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_port = site._server.sockets[0].getsockname()[1]
    forwarder = TritonPod.__new__(TritonPod)
    await TritonPod.__init__(forwarder, TritonPodArgs.model_validate(
        {**app["args"], "triton_address": f"127.0.0.1:{port}",
         "triton_http_address": f"127.0.0.1:{http_port}", "ready_timeout_s": 30}))
    context = Context()
    reply = await forwarder.forward_unary(BY_NAME["ModelInfer"], b"call", context)
    await server.stop(None)
    assert reply.SerializeToString() == b"reply:call" and context.code is None
    return reply.SerializeToString()

print("forwarded", asyncio.run(one_call()))
print("imported", len(names), "names from", importlib.import_module("triton_pod").__file__)
"""


def shipped_package(into: Path) -> Path:
    (code,) = [o for o in objects(build(ROOT / "serve")) if o["kind"] == "ConfigMap"
               and o["metadata"]["name"].startswith("triton-pod-code")]
    package = into / "triton_pod"
    package.mkdir()
    for name, text in code["data"].items():
        (package / name).write_text(text)
    return into


def test_the_shipped_files_alone_import_what_the_serve_config_names(tmp_path: Path) -> None:
    root = shipped_package(tmp_path)
    # -I: no PYTHONPATH, no current directory; only the shipped files and site-packages.
    result = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(root)!r})\n"
         + SHIPPED_CHECK, str(ROOT / "serve" / "serve-config.yaml")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(root) in result.stdout
    assert "forwarded b'reply:call'" in result.stdout


def test_the_check_would_catch_a_module_left_out(tmp_path: Path) -> None:
    root = shipped_package(tmp_path)
    (root / "triton_pod" / "autoscaling.py").unlink()
    result = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(root)!r})\n"
         + SHIPPED_CHECK, str(ROOT / "serve" / "serve-config.yaml")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode != 0
    assert "No module named 'triton_pod.autoscaling'" in result.stderr


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
