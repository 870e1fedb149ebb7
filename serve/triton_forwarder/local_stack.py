"""`make local`: a real Triton and a real Ray Serve on this machine, run with the same Serve
config as the RayService, until Ctrl-C or SIGTERM.

Environment: MODEL_REPOSITORY, GRPC_PORT (8001), TRITON_GRPC_PORT (8101), TRITON_HTTP_PORT
(8100), TRITON_METRICS_PORT (8102), SERVE_HTTP_PORT (8000), RAY_GCS_PORT (6379),
RAY_DASHBOARD_PORT (8265), TRITON_RESOURCES (1, the `triton` resources the node advertises),
SERVE_CONFIG (serve/serve-config.yaml), TRITON_ARGS (extra tritonserver flags),
SONIC_RAY_ADMIN_KEY (the key of Triton's restricted RPCs; random when unset).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from . import triton_binary
from .access import ADMIN_KEY_ENV, TokenCheck
from .rpcs import SERVICE

SERVE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = SERVE_DIR / "serve-config.yaml"
DEFAULT_MODELS = SERVE_DIR / "models"
RAY_ENV_FILE = SERVE_DIR / "ray-env.env"
READY_TIMEOUT_S = 600.0


def say(message: str) -> None:
    print(f"[local] {message}", flush=True)


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a whole number") from None


@dataclass(frozen=True)
class Settings:
    model_repository: Path
    grpc_port: int
    triton: triton_binary.TritonPorts
    serve_http_port: int
    gcs_port: int
    dashboard_port: int
    triton_resources: int
    serve_config: Path
    triton_args: tuple[str, ...]

    @classmethod
    def from_env(cls) -> Settings:
        repo = Path(os.environ.get("MODEL_REPOSITORY") or DEFAULT_MODELS).resolve()
        if not repo.is_dir():
            raise SystemExit(f"MODEL_REPOSITORY={repo} is not a directory")
        config = Path(os.environ.get("SERVE_CONFIG") or DEFAULT_CONFIG).resolve()
        if not config.is_file():
            raise SystemExit(f"SERVE_CONFIG={config} is not a file")
        settings = cls(
            model_repository=repo,
            grpc_port=_int_env("GRPC_PORT", 8001),
            triton=triton_binary.TritonPorts(
                http=_int_env("TRITON_HTTP_PORT", 8100),
                grpc=_int_env("TRITON_GRPC_PORT", 8101),
                metrics=_int_env("TRITON_METRICS_PORT", 8102),
            ),
            serve_http_port=_int_env("SERVE_HTTP_PORT", 8000),
            gcs_port=_int_env("RAY_GCS_PORT", 6379),
            dashboard_port=_int_env("RAY_DASHBOARD_PORT", 8265),
            triton_resources=_int_env("TRITON_RESOURCES", 1),
            serve_config=config,
            triton_args=tuple(shlex.split(os.environ.get("TRITON_ARGS", ""))),
        )
        ports = {
            "GRPC_PORT": settings.grpc_port,
            "TRITON_HTTP_PORT": settings.triton.http,
            "TRITON_GRPC_PORT": settings.triton.grpc,
            "TRITON_METRICS_PORT": settings.triton.metrics,
            "SERVE_HTTP_PORT": settings.serve_http_port,
            "RAY_GCS_PORT": settings.gcs_port,
            "RAY_DASHBOARD_PORT": settings.dashboard_port,
        }
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                raise SystemExit(f"{name} and {seen[port]} are both {port}: ports must differ")
            seen[port] = name
        return settings


def local_serve_config(settings: Settings) -> dict[str, Any]:
    """The Serve config file with this machine's ports and Triton address."""
    config: dict[str, Any] = yaml.safe_load(settings.serve_config.read_text())
    config["http_options"] = {
        **config.get("http_options", {}), "host": "127.0.0.1", "port": settings.serve_http_port
    }
    config["grpc_options"] = {**config.get("grpc_options", {}), "port": settings.grpc_port}
    for app in config["applications"]:
        app.setdefault("args", {})["triton_address"] = f"localhost:{settings.triton.grpc}"
    return config


class TritonSupervisor:
    """Runs Triton and restarts it with backoff when it exits, as the kubelet would."""

    def __init__(self, settings: Settings, workdir: Path, admin_key: str) -> None:
        self._settings = settings
        self._admin_key = admin_key
        self._backends = triton_binary.prepare_backends(workdir / "backends")
        self.log_path = workdir / "triton.log"
        self._stopping = threading.Event()
        self._process: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="triton-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd = triton_binary.command(
            self._settings.model_repository, self._backends, self._settings.triton,
            self._admin_key, self._settings.triton_args,
        )
        with open(self.log_path, "ab") as log:
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=triton_binary.environment(),
                preexec_fn=_die_with_stack,
            )
        say(f"triton started (pid {process.pid}), log: {self.log_path}")
        return process

    def _run(self) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            started = time.monotonic()
            self._process = self._spawn()
            code = self._process.wait()
            # Its python-backend stubs outlive a killed Triton; a container's processes all go.
            _kill_session(self._process.pid)
            if self._stopping.is_set():
                return
            if time.monotonic() - started > 60:
                backoff = 1.0
            say(f"triton exited with status {code}; restarting in {backoff:.0f}s "
                f"(last lines in {self.log_path})")
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, 30.0)

    def stop(self) -> None:
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            _terminate_group(process, grace_s=15)
        self._thread.join(timeout=20)


def _die_with_stack() -> None:
    """Runs in a child before exec: if the stack dies without cleaning up, so does the child."""
    _set_parent_death_signal()
    os.setsid()


def session_members(sid: int) -> dict[int, list[str]]:
    """The live processes of a session: pid -> the fields of /proc/<pid>/stat after the name."""
    members = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # stat field 6: the session id
            members[int(proc.name)] = fields
    return members


def _kill_session(sid: int) -> None:
    """Ray's workers change process group (and HAProxy is their child): a session holds all."""
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _terminate_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    # Whatever the session leader left behind goes too.
    _kill_session(process.pid)
    process.wait()


def ray_env_defaults() -> dict[str, str]:
    """serve/ray-env.env: the same Ray environment as the RayService's ray-env ConfigMap."""
    defaults = {}
    for line in RAY_ENV_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            defaults[name.strip()] = value.strip()
    return defaults


def start_ray(settings: Settings, workdir: Path, admin_key: str) -> subprocess.Popen[bytes]:
    # What the caller's environment sets wins (make bench compares modes that way).
    env = {**ray_env_defaults(), **os.environ, ADMIN_KEY_ENV: admin_key}
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(SERVE_DIR), env.get("PYTHONPATH", "")) if part
    )
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # HAProxy's files in a directory of this stack's: two stacks on one machine must not share
    # them. Short, because HAProxy's socket path (under a node-id folder) has 97 bytes at most.
    haproxy = Path(tempfile.mkdtemp(prefix="srh-"))
    (workdir / "haproxy").symlink_to(haproxy)
    env.setdefault("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", str(haproxy / "haproxy.cfg"))
    env.setdefault("RAY_SERVE_HAPROXY_SOCKET_PATH", str(haproxy / "admin.sock"))
    env.setdefault("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", str(haproxy))
    env.setdefault("RAY_SERVE_HAPROXY_SERVER_STATE_FILE", str(haproxy / "server-state"))
    ray = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray), "start", "--head", "--block", "--disable-usage-stats",
        f"--port={settings.gcs_port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={settings.dashboard_port}",
        "--num-cpus=2",
        f"--resources={json.dumps({'triton': settings.triton_resources})}",
        f"--temp-dir={workdir / 'ray'}",
        "--object-store-memory=4000000000",
    ]
    with open(workdir / "ray.log", "ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=_die_with_stack)
    say(f"starting Ray (pid {process.pid}, GCS {settings.gcs_port}, dashboard "
        f"{settings.dashboard_port}), log: {workdir / 'ray.log'}")
    return process


def _http(method: str, url: str, body: dict[str, Any] | None = None,
          timeout_s: float = 10) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        text = response.read().decode()
    return json.loads(text) if text.strip() else None


def _wait(what: str, check: Any, timeout_s: float, alive: Any) -> None:
    deadline = time.monotonic() + timeout_s
    next_note = time.monotonic() + 10
    while True:
        alive()
        detail = check()
        if detail is True:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:.0f}s waiting for {what} ({detail})")
        if time.monotonic() > next_note:
            say(f"still waiting for {what}: {detail}")
            next_note = time.monotonic() + 10
        time.sleep(0.5)


def _server_ready(port: int, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    with grpc.insecure_channel(f"localhost:{port}") as channel:
        ready = channel.unary_unary(f"/{SERVICE}/ServerReady")
        try:
            # No progress line may contain the word the final line is known by.
            answer = ready(b"", timeout=2, metadata=metadata)
            return True if answer == b"\x08\x01" else "models still loading"
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"


class LocalStack:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.workdir = Path(tempfile.mkdtemp(prefix="sonic-ray-"))
        # Opens Triton's restricted RPCs; only Triton and the forwarder ever see it.
        self.admin_key = os.environ.get(ADMIN_KEY_ENV) or secrets.token_hex(16)
        self.triton = TritonSupervisor(settings, self.workdir, self.admin_key)
        self.ray: subprocess.Popen[bytes] | None = None

    def _ray_alive(self) -> None:
        if self.ray is not None and self.ray.poll() is not None:
            raise SystemExit(f"Ray exited with status {self.ray.returncode}; "
                             f"see {self.workdir / 'ray.log'}")

    def start(self) -> None:
        s = self.settings
        say(f"model repository: {s.model_repository}")
        self.triton.start()
        self.ray = start_ray(s, self.workdir, self.admin_key)
        dashboard = f"http://127.0.0.1:{s.dashboard_port}"

        def dashboard_up() -> Any:
            try:
                _http("GET", f"{dashboard}/api/version")
                return True
            except (urllib.error.URLError, OSError) as error:
                return str(error)

        _wait("Ray to start", dashboard_up, 180, self._ray_alive)
        say("Ray is up; deploying the Serve config")
        try:
            # The first deploy imports Serve in the dashboard: slow on a busy 2-core machine.
            _http("PUT", f"{dashboard}/api/serve/applications/", local_serve_config(s),
                  timeout_s=120)
        except urllib.error.HTTPError as error:
            raise SystemExit(f"Ray refused the Serve config: {error.read().decode()}") from None
        except (urllib.error.URLError, OSError) as error:
            raise SystemExit(f"could not deploy the Serve config: {error}") from None

        def triton_ready() -> Any:
            return _server_ready(s.triton.grpc)

        _wait("Triton to load its models", triton_ready, READY_TIMEOUT_S, self._ray_alive)
        say("Triton has loaded its models; waiting for Serve's replica to answer")

        # With token authentication on, the stack's own call needs a token like any client's.
        try:
            tokens = TokenCheck.from_env()
        except RuntimeError as error:
            raise SystemExit(str(error)) from None
        credentials = tokens.credentials() if tokens is not None else ()

        def serve_ready() -> Any:
            answer = _server_ready(s.grpc_port, credentials)
            if answer is True:
                return True
            try:
                apps = _http("GET", f"{dashboard}/api/serve/applications/")
                states = {name: app.get("status") for name, app in apps["applications"].items()}
                for app in apps["applications"].values():
                    if app.get("status") == "DEPLOY_FAILED":
                        raise SystemExit(f"Serve could not deploy: {app.get('message')}")
                return f"{answer}; applications: {states}"
            except (urllib.error.URLError, OSError, KeyError) as error:
                return f"{answer}; {error}"

        _wait("the Triton protocol through Serve", serve_ready, READY_TIMEOUT_S, self._ray_alive)
        print(
            "endpoints:\n"
            f"  Triton protocol through Ray Serve (gRPC): localhost:{s.grpc_port}\n"
            f"  Triton direct: gRPC localhost:{s.triton.grpc}, "
            f"HTTP localhost:{s.triton.http}, metrics http://localhost:{s.triton.metrics}/metrics\n"
            f"  Serve HTTP: localhost:{s.serve_http_port}; "
            f"Ray dashboard: http://127.0.0.1:{s.dashboard_port}",
            flush=True,
        )
        say(f"ready: Triton answers ServerReady through Serve at localhost:{s.grpc_port}")

    def run_until_stopped(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            self._ray_alive()

    def stop(self) -> None:
        say("stopping")
        if self.ray is not None and self.ray.poll() is None:
            _terminate_group(self.ray, grace_s=20)
        self.triton.stop()
        haproxy = self.workdir / "haproxy"
        if haproxy.is_symlink():
            shutil.rmtree(haproxy.resolve(), ignore_errors=True)
        say("stopped")


def _set_parent_death_signal() -> None:
    """Has the kernel send SIGTERM when the parent dies (Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def main() -> int:
    # `make local` killed by SIGTERM does not pass the signal on: the kernel does.
    _set_parent_death_signal()
    settings = Settings.from_env()
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            return  # already stopping: a second signal must not cut the cleanup short
        stop.set()
        # Interrupts whatever wait the stack is in, startup included.
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack = LocalStack(settings)
    try:
        stack.start()
        stack.run_until_stopped(stop)
        return 0
    except KeyboardInterrupt:
        return 0
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            say(f"error: {exit_.code}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
