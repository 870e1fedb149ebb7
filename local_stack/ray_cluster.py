"""Ray on this machine as KubeRay runs it: a head node without the `triton` resource (it runs
the Serve controller), and one Ray node per simulated pod advertising one `triton` resource,
whose replica finds its own Triton through the environment (serve/triton_pod/pod.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from local_stack.ports import free_ports
from local_stack.processes import spawn
from local_stack.settings import SERVE_DIR, Settings
from schema.serve_app import policy_kwargs, triton_app, with_policy_kwarg
from tools.env_file import env_file
from triton_pod.access import ADMIN_KEY_ENV
from triton_pod.admission import PATH as ADMISSION_PATH
from triton_pod.holding import HOLDING_GRPC_PORT_ENV, HOLDING_PORT_ENV
from triton_pod.pod import (
    TRITON_ADDRESS_ENV,
    TRITON_HTTP_ADDRESS_ENV,
    TRITON_METRICS_URL_ENV,
)
from triton_pod.pod_ready import POD_READY_PORT_ENV

RAY_ENV_FILE = SERVE_DIR / "ray-env.env"
APP = "triton"
DEPLOYMENT = "TritonPod"


def ray_env_defaults() -> dict[str, str]:
    """serve/ray-env.env: the same Ray environment as the RayService's ray-env ConfigMap."""
    return env_file(RAY_ENV_FILE)


def _environment(settings: Settings, workdir: Path, admin_key: str) -> dict[str, str]:
    # What the caller's environment sets wins (make bench compares modes that way).
    env = {**ray_env_defaults(), **os.environ, **settings.admission_env(),
           ADMIN_KEY_ENV: admin_key,
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": settings.ray_token}
    # Only the shipped package: what runs in Ray here is what the ConfigMap ships.
    env["PYTHONPATH"] = str(SERVE_DIR)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    haproxy = workdir / "haproxy"
    if not haproxy.exists():
        # HAProxy's files in a directory of this stack's: two stacks on one machine must not
        # share them. Short, because HAProxy's socket path has 97 bytes at most.
        haproxy.symlink_to(Path(tempfile.mkdtemp(prefix="srh-")))
    target = haproxy.resolve()
    env.setdefault("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", str(target / "haproxy.cfg"))
    env.setdefault("RAY_SERVE_HAPROXY_SOCKET_PATH", str(target / "admin.sock"))
    env.setdefault("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", str(target))
    env.setdefault("RAY_SERVE_HAPROXY_SERVER_STATE_FILE", str(target / "server-state"))
    return env


def _node_ports() -> list[str]:
    # Several raylets share this host: each needs ports of its own where Ray has fixed defaults.
    names = ["node-manager-port", "object-manager-port", "metrics-export-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port"]
    return [f"--{name}={port}" for name, port in zip(names, free_ports(len(names)), strict=True)]


def metrics_export_port(node: subprocess.Popen[bytes]) -> int:
    """The port on which a Ray node started here serves its metrics (Ray's and Serve's)."""
    args = node.args if isinstance(node.args, list) else []
    for arg in args:
        if str(arg).startswith("--metrics-export-port="):
            return int(str(arg).partition("=")[2])
    raise ValueError("the node was started without --metrics-export-port")


def start_head(settings: Settings, workdir: Path, admin_key: str) -> subprocess.Popen[bytes]:
    ray = Path(sys.executable).with_name("ray")
    (client_port,) = free_ports(1)
    cmd = [
        str(ray), "start", "--head", "--block", "--disable-usage-stats",
        f"--port={settings.gcs_port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={settings.dashboard_port}",
        f"--ray-client-server-port={client_port}",
        # As in the RayService: the head runs Serve's controller and proxy, no replica.
        "--num-cpus=0",
        f"--temp-dir={workdir / 'ray'}",
        "--object-store-memory=1000000000",
        *_node_ports(),
    ]
    return spawn(cmd, workdir / "ray.log", _environment(settings, workdir, admin_key))


def start_pod_node(settings: Settings, index: int, workdir: Path,
                   admin_key: str) -> subprocess.Popen[bytes]:
    ray = Path(sys.executable).with_name("ray")
    triton = settings.triton(index)
    env = {**_environment(settings, workdir, admin_key),
           TRITON_ADDRESS_ENV: f"localhost:{triton.grpc}",
           TRITON_HTTP_ADDRESS_ENV: f"localhost:{triton.http}",
           TRITON_METRICS_URL_ENV: f"http://localhost:{triton.metrics}/metrics",
           POD_READY_PORT_ENV: str(settings.pod_ready_port(index)),
           HOLDING_PORT_ENV: str(settings.pod_holding_ports(index)[0]),
           HOLDING_GRPC_PORT_ENV: str(settings.pod_holding_ports(index)[1])}
    cmd = [
        str(ray), "start", "--block", "--disable-usage-stats",
        f"--address=127.0.0.1:{settings.gcs_port}",
        "--num-cpus=1", f"--resources={json.dumps({'triton': 1})}",
        f"--node-name=pod-{index}",
        "--object-store-memory=500000000",
        *_node_ports(),
    ]
    return spawn(cmd, workdir / f"ray-pod-{index}.log", env)


def local_serve_config(settings: Settings, path: Path | None = None) -> dict[str, Any]:
    """A Serve config file (SERVE_CONFIG unless `path` names another) with this machine's
    ports. The simulated pods share one network namespace, so only the head runs Serve's
    proxies (every pod would bind the same ports)."""
    config: dict[str, Any] = yaml.safe_load((path or settings.serve_config).read_text())
    config["proxy_location"] = "HeadOnly"
    # On the Serve path its HTTP proxy is the clients' endpoint, reachable as the gateway is.
    host = "0.0.0.0" if settings.data_path == "serve" else "127.0.0.1"
    config["http_options"] = {
        **config.get("http_options", {}), "host": host, "port": settings.serve_http_proxy_port
    }
    serve_grpc = settings.grpc_port if settings.data_path == "serve" else settings.serve_grpc_port
    config["grpc_options"] = {**config.get("grpc_options", {}), "port": serve_grpc}
    # The gateway's stats on this machine's port (the cluster's name for them does not
    # resolve here); the Serve path has no gateway to ask.
    config = with_policy_kwarg(config, "gateway_stats_url",
                               f"http://127.0.0.1:{settings.gateway_metrics_port}/stats/prometheus"
                               if settings.data_path == "gateway" else None)
    if "prewarm_dir" in policy_kwargs(triton_app(config)[1]):
        if settings.prewarm_dir is None:
            raise ValueError("the Serve config reads a pre-warm request "
                             "(policy_kwargs.prewarm_dir): set PREWARM_DIR")
        # The stack's directory in place of the head's ConfigMap mount.
        config = with_policy_kwarg(config, "prewarm_dir", str(settings.prewarm_dir))
    return config


def deploy(settings: Settings, path: Path | None = None) -> None:
    """PUTs the Serve config to the dashboard's REST API, as KubeRay does."""
    # The first deploy imports Serve in the dashboard: slow on a busy 2-core machine.
    http("PUT", f"http://127.0.0.1:{settings.dashboard_port}/api/serve/applications/",
         settings.ray_token, local_serve_config(settings, path), timeout_s=120)


def http(method: str, url: str, token: str, body: dict[str, Any] | None = None,
         timeout_s: float = 10) -> Any:
    """A call to Ray's dashboard, which refuses any without the cluster's token."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        text = response.read().decode()
    return json.loads(text) if text.strip() else None


def dashboard_answers(dashboard: str, token: str) -> bool | str:
    """True once Ray's dashboard answers (with the cluster's token), else why not."""
    try:
        http("GET", f"{dashboard}/api/version", token)
        return True
    except (urllib.error.URLError, OSError) as error:
        return str(error)


def applications(dashboard: str, token: str) -> dict[str, dict[str, Any]]:
    """Every Serve application as Serve's REST API reports them, by name."""
    apps: dict[str, dict[str, Any]] = http(
        "GET", f"{dashboard}/api/serve/applications/", token).get("applications") or {}
    return apps


def application(dashboard: str, token: str) -> dict[str, Any]:
    """The Triton application as Serve's REST API reports it (empty before the first deploy)."""
    return applications(dashboard, token).get(APP) or {}


def deployment_of(app: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = (app.get("deployments") or {}).get(DEPLOYMENT, {})
    return found


def replicas(dashboard: str, token: str) -> list[dict[str, Any]]:
    """Serve's replicas of the Triton deployment, as its REST API reports them."""
    found: list[dict[str, Any]] = deployment_of(application(dashboard, token)).get(
        "replicas", [])
    return found


def triton_resources(dashboard: str, token: str) -> int:
    """The `triton` resources of the cluster's live nodes (one per GPU pod), from Ray's state
    API: what the Ray autoscaler sees."""
    body = http("GET", f"{dashboard}/api/v0/nodes?limit=1000", token)
    try:
        nodes = body["data"]["result"]["result"]
    except (KeyError, TypeError):
        raise ValueError(f"Ray's state API answered {body!r}") from None
    return int(sum(float((n.get("resources_total") or {}).get("triton", 0))
                   for n in nodes if n.get("state") == "ALIVE"))


def replica_triton_address(pid: int) -> str | None:
    """The Triton a replica talks to: its process's environment (it inherits its node's)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{TRITON_ADDRESS_ENV}=".encode()
    return next((item[len(prefix):].decode() for item in environ if item.startswith(prefix)), None)


def applications_running(dashboard: str, token: str) -> bool | str:
    """True once every Serve application reports RUNNING (KubeRay's test before it switches
    its Services to a new cluster), else what they report."""
    try:
        apps = applications(dashboard, token)
    except (urllib.error.URLError, OSError, ValueError) as error:
        return str(error)
    statuses = {name: app.get("status") for name, app in apps.items()}
    if statuses and all(status == "RUNNING" for status in statuses.values()):
        return True
    return "; ".join(f"{name} {app.get('status')}: {_why(app)}" for name, app in apps.items()
                     ) or "no application"


def _why(app: dict[str, Any]) -> str:
    """What Serve says of an application that is not RUNNING: its message, and each
    deployment's status, target and running replicas and message (cut short)."""
    parts = [str(app.get("message") or "")[:300]]
    for name, deployment in (app.get("deployments") or {}).items():
        running = sum(1 for r in deployment.get("replicas") or [] if r.get("state") == "RUNNING")
        parts.append(f"{name} {deployment.get('status')} (target "
                     f"{deployment.get('target_num_replicas')}, running {running}) "
                     f"{str(deployment.get('message') or '')[:300]}")
    return " | ".join(p for p in parts if p)


def policy_answers(head: str, port: int | str) -> bool | str:
    """True once the autoscaling policy has decided the start-of-job gate's state at the
    head's admission port (serve/triton_pod/admission.py), else why not."""
    try:
        with urllib.request.urlopen(f"http://{head}:{port}{ADMISSION_PATH}",
                                    timeout=5) as response:
            answer = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as error:
        return f"the policy's answer to the gateway: {error}"
    return answer.get("state") != "unknown" or str(answer.get("reason"))
