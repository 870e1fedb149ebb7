"""`make cluster`: the gateway path on the cluster's mechanics, on this machine (root).

Pods are network namespaces on one bridge (network.py), each with its own address and the
pod's real ports; the Ray head, every GPU pod (its Triton and its Ray node, whose Serve
replica reaches Triton at localhost:8001 as serve/serve-config.yaml says) and every gateway
pod (Envoy with gateway/envoy.yaml as built, byte for byte, at /etc/envoy) in one of their own.
The gateway resolves `triton-pods` through a real DNS with the stock Corefile's caching
(dns.py); clients reach the gateway pods through a Service IP balanced per connection as
kube-proxy does it (service.py). Pods start, probe, stop and are replaced as the kubelet, the
Deployment and the Ray autoscaler do it, from the built overlays/local (manifests.py, pods.py).

Contract (tests and operators use it): once ServerReady answers through the Service IP, one
line `[cluster] ready: grpc <ip>:8001 http <ip>:8000 pods <dir>`; pods are named triton-<i>
and gateway-<i>; `touch <dir>/<pod>/delete` does what `kubectl delete pod` does, and the
pod's owner replaces it; `touch <dir>/<pod>/cut` takes the pod's node off the network
(nothing answers, nothing resets); writing `<dir>/upgrade` (empty, or lines
`MODEL_REPOSITORY=<dir>` / `SERVE_CONFIG=<file>` for the new cluster) runs KubeRay's NewCluster
upgrade: a second Ray cluster with its own head and GPU pods, the Serve config deployed to it,
the switch of KubeRay's Services once every application is RUNNING, and the old cluster's
deletion rayClusterDeletionDelaySeconds later. Variables as for `make local` (TRITONS, MODEL_REPOSITORY,
SERVE_CONFIG, TRITON_ARGS, SONIC_RAY_AUTH_TOKENS_FILE, SONIC_RAY_ADMIN_KEY, RAY_AUTH_TOKEN),
plus GATEWAYS (the gateway Deployment's replicas; default: the build's) and DNS_TTL (the
cluster DNS's TTL and cache; default: the build's sonic-ray.io/cluster-dns-ttl-seconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from local_stack import ray_cluster, triton
from local_stack.autoscaler import idle_pods
from local_stack.cluster import dns, manifests, network, service
from local_stack.cluster.pods import ContainerSpec, Pod
from local_stack.polling import until
from local_stack.processes import (
    free_orphaned_regions,
    run_until_signalled,
    say_line,
    set_parent_death_signal,
)
from local_stack.settings import DEFAULT_MODELS, SERVE_DIR, int_env, min_replicas
from local_stack.stack import http_ready, server_ready
from schema.serve_app import with_policy_kwarg
from triton_pod.access import ADMIN_KEY_ENV, TOKENS_FILE_ENV
from triton_pod.admission import PORT_ENV as ADMISSION_PORT_ENV

SAID = "[cluster]"
READY = "ready:"
SERVICE_IP = str(network.SERVICE_SUBNET[10])
READY_TIMEOUT_S = 900.0
# Where the RayService mounts the code ConfigMap in the Ray containers (base/rayservice.yaml):
# here the same package from the checkout.
CODE_MOUNT = "/opt/sonic-ray"
HEAD = "ray-head"
# What the upgrade control file may set for the new cluster.
UPGRADE_SETTINGS = ("MODEL_REPOSITORY", "SERVE_CONFIG")
# Ray's GCS port on the head (the head's gcs-server container port).
GCS_PORT = 6379
# How long a GPU pod that is not ready yet counts as starting (Triton's startup probe allows 300 s).
STARTING_S = 300.0
# The dashboard agent's port when rayStartParams do not set one (Ray's default).
AGENT_PORT = 52365


def say(message: str) -> None:
    say_line(f"{SAID} {message}")


@dataclass(frozen=True)
class ClusterSettings:
    tritons: int
    gateways: int
    dns_ttl_s: int
    model_repository: Path | None
    serve_config: dict[str, Any]
    triton_args: tuple[str, ...]
    tokens_file: str | None
    admin_key: str
    ray_token: str

    @classmethod
    def from_env(cls, built: manifests.Built, env: Mapping[str, str] = os.environ
                 ) -> ClusterSettings:
        if env.get("DATA_PATH", "gateway") != "gateway":
            raise SystemExit("make cluster runs the gateway path; DATA_PATH=serve is make local's")
        repo, config = cluster_settings(built, env)
        tokens = env.get(TOKENS_FILE_ENV) or None
        if tokens and not Path(tokens).is_file():
            raise SystemExit(f"{TOKENS_FILE_ENV}={tokens} is not a file")
        return cls(
            # KubeRay starts a RayService's cluster with what Serve keeps at least.
            tritons=int_env(env, "TRITONS", min(min_replicas(config),
                                                built.worker_max_replicas),
                            0, built.worker_max_replicas),
            gateways=int_env(env, "GATEWAYS", built.gateway_replicas, 1, 8),
            dns_ttl_s=int_env(env, "DNS_TTL", built.dns_ttl_s, 0, 3600),
            model_repository=repo,
            serve_config=config,
            triton_args=tuple(shlex.split(env.get("TRITON_ARGS", ""))),
            tokens_file=str(Path(tokens).resolve()) if tokens else None,
            admin_key=env.get(ADMIN_KEY_ENV) or secrets.token_hex(16),
            ray_token=env.get("RAY_AUTH_TOKEN") or secrets.token_hex(32),
        )


def cluster_settings(built: manifests.Built, env: Mapping[str, str]
                     ) -> tuple[Path | None, dict[str, Any]]:
    """What one Ray cluster runs: MODEL_REPOSITORY (or the build's) and SERVE_CONFIG (or the
    build's serveConfigV2)."""
    repo = env.get("MODEL_REPOSITORY")
    if repo and not Path(repo).is_dir():
        raise SystemExit(f"MODEL_REPOSITORY={repo} is not a directory")
    config = built.serve_config
    if env.get("SERVE_CONFIG"):
        path = Path(env["SERVE_CONFIG"])
        if not path.is_file():
            raise SystemExit(f"SERVE_CONFIG={path} is not a file")
        config = yaml.safe_load(path.read_text())
    return (Path(repo).resolve() if repo else None), config


def upgrade_settings(text: str) -> dict[str, str]:
    """The upgrade control file: KEY=VALUE lines, each KEY one of UPGRADE_SETTINGS."""
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, eq, value = line.partition("=")
        if not eq or key.strip() not in UPGRADE_SETTINGS:
            raise SystemExit(f"upgrade file line {number}: {line!r} is not KEY=VALUE with KEY "
                             f"one of {', '.join(UPGRADE_SETTINGS)}")
        found[key.strip()] = value.strip()
    return found


@dataclass
class RayCluster:
    """One Ray cluster of the RayService, as KubeRay makes it: a head, the GPU pods Serve and
    the Ray autoscaler ask for, a token of its own (KubeRay's Secret named after the cluster),
    and what it runs."""

    name: str
    head: Pod
    dashboard: str
    token: str
    model_repository: Path | None
    serve_config: dict[str, Any]
    deleting: bool = False


def _expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) in a container's command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                  value)


class ClusterStack:
    def __init__(self, built: manifests.Built, settings: ClusterSettings) -> None:
        self.built = built
        self.settings = settings
        self.workdir = Path(tempfile.mkdtemp(prefix="sonic-ray-cluster-"))
        self.pods_dir = self.workdir / "pods"
        self.pods_dir.mkdir()
        self.prewarm_dir = self.workdir / "prewarm"
        self.network = network.Network()
        self.dns = dns.ClusterDns(self.workdir, str(network.BRIDGE_IP), built.namespace,
                                  settings.dns_ttl_s)
        client_ports = built.services["triton-grpc"]
        self.service = service.ServiceIp(SERVICE_IP, client_ports)
        self.pods: dict[str, Pod] = {}
        self._counters = {"triton": 0, "gateway": 0}
        self._lock = threading.RLock()
        self._backends = triton.prepare_backends(self.workdir / "backends")
        self._envoy_dir = self.workdir / "envoy"
        self._envoy_dir.mkdir()
        for name, text in built.envoy_files.items():
            (self._envoy_dir / name).write_text(text)
        self._made_etc_envoy = False
        self.clusters: dict[str, RayCluster] = {}
        # The cluster KubeRay's Services (spec.serveService among them) select.
        self.active = ""
        self._pod_cluster: dict[str, str] = {}
        self._labels: dict[str, dict[str, str]] = {}
        self._idle_since: dict[str, float] = {}
        self._upgrading = threading.Lock()
        self._stop = threading.Event()

    # --- the pods

    def _base_env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
                "LANG": "C.UTF-8"}

    def _container_env(self, container: manifests.Container) -> dict[str, str]:
        env = self._base_env()
        for name, value in container.env.items():
            if isinstance(value, dict):  # valueFrom: the Secrets a site creates
                key = (value.get("secretKeyRef") or {}).get("name")
                if key != "triton-admin-key":
                    raise SystemExit(f"{container.name}: env {name} from {value}: only the "
                                     "triton-admin-key Secret exists here")
                env[name] = self.settings.admin_key
            else:
                env[name] = str(value)
        return env

    def _ray_env(self, container: manifests.Container, token: str) -> dict[str, str]:
        env = self._container_env(container)
        env["PYTHONPATH"] = env.get("PYTHONPATH", "").replace(CODE_MOUNT, str(SERVE_DIR))
        # What KubeRay's authOptions gives every Ray container.
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
                "RAY_USAGE_STATS_ENABLED": "0"}
        return env

    def _ray_start(self, params: dict[str, str], ip: str, cluster: RayCluster | None,
                   temp_dir: Path) -> list[str]:
        """`ray start` as KubeRay builds it from rayStartParams: a head (no cluster yet), or
        a worker of `cluster`. Every pod has a /tmp/ray of its own (`temp_dir`): nodes
        sharing one pick the same socket and log names when they start together, and the
        raylets that lose bind() abort (a crash no cluster has)."""
        ray = Path(sys.executable).with_name("ray")
        cmd = [str(ray), "start", "--block", "--disable-usage-stats", f"--node-ip-address={ip}",
               # A small object store: every node of this machine shares its memory.
               "--object-store-memory=300000000"]
        if cluster is None:
            cmd += ["--head", f"--port={GCS_PORT}"]
        else:
            cmd += [f"--address={cluster.head.ip}:{GCS_PORT}", "--num-cpus=1",
                    f"--resources={json.dumps({'triton': 1})}"]
        cmd += [f"--temp-dir={temp_dir}", *(f"--{key}={value}" for key, value in params.items())]
        return cmd

    def _new_pod(self, kind: str, cluster: RayCluster | None = None) -> Pod | None:
        """A pod of `kind` (a GPU pod of `cluster`), started; None if the cluster's deletion
        began meanwhile: KubeRay makes no pod for a RayCluster being deleted, and the garbage
        collector deletes every pod it owns (`begin_deletion`)."""
        with self._lock:
            name = f"{kind}-{self._counters[kind]}"
            self._counters[kind] += 1
        etc = {"envoy": self._envoy_dir} if kind == "gateway" else None
        net = self.network.add_pod(name, dns.resolv_conf(str(network.BRIDGE_IP),
                                                         self.built.namespace), etc)
        if cluster is None:
            containers = self._gateway_containers()
            labels = dict(self.built.labels["gateway"])
        else:
            containers = self._triton_containers(name, net.ip, cluster)
            # What KubeRay v1.7.0 adds to a RayService's worker pods (BuildPod, pod.go):
            # the cluster's name, and ray.io/serve "true" (a worker's readiness decides).
            labels = {**self.built.labels["worker"], "ray.io/cluster": cluster.name,
                      "ray.io/node-type": "worker", "ray.io/serve": "true"}
        template = self.built.gateway if kind == "gateway" else self.built.worker
        pod = Pod(name, net, containers, template.grace_s, self.workdir, say, self.reconcile)
        with self._lock:
            deleted = cluster is not None and cluster.deleting
            if not deleted:
                self.pods[name] = pod
                self._labels[name] = labels
                if cluster is not None:
                    self._pod_cluster[name] = cluster.name
        if deleted:
            self.network.remove_pod(name)
            shutil.rmtree(pod.dir, ignore_errors=True)
            say(f"{name}: not created: its cluster is being deleted")
            return None
        pod.start()
        say(f"{name}: created at {net.ip} (namespace {net.namespace})")
        return pod

    def _triton_containers(self, name: str, ip: str, cluster: RayCluster) -> list[ContainerSpec]:
        worker = self.built.worker
        ray = worker.containers["ray-worker"]
        tri = worker.containers["triton"]
        triton_env = {**self._container_env(tri), **triton.environment_additions()}
        argv = [_expand(a, triton_env) for a in tri.command]
        binary = str(triton.server_binary())
        argv = [binary if a == "tritonserver" else a for a in argv]
        repository = cluster.model_repository or DEFAULT_MODELS
        keep = []
        for arg in argv:
            if arg.startswith("--model-repository="):
                arg = f"--model-repository={repository}"
            elif cluster.model_repository and arg.startswith(
                    ("--model-control-mode=", "--load-model=")):
                continue  # MODEL_REPOSITORY: every model in it, as make local loads them
            keep.append(arg)
        argv = [*keep, f"--backend-directory={self._backends}", *self.settings.triton_args]
        return [
            # Short (ray-w<n>): a Unix socket's path in it holds at most 107 bytes.
            ContainerSpec("ray-worker", self._ray_start(
                worker.ray_start_params, ip, cluster,
                self.workdir / f"ray-w{name.rsplit('-', 1)[-1]}"),
                self._ray_env(ray, cluster.token), manifests.WORKER_READINESS, None, None),
            ContainerSpec("triton", argv, triton_env, tri.readiness, tri.startup, tri.prestop),
        ]

    def _gateway_containers(self) -> list[ContainerSpec]:
        envoy = self.built.gateway.containers["envoy"]
        env = self._container_env(envoy)
        if self.settings.tokens_file:
            env[TOKENS_FILE_ENV] = self.settings.tokens_file
        binary = str(Path(sys.executable).with_name("envoy"))
        argv = list(envoy.command)
        if not argv or argv[0].startswith("-"):
            # Arguments only: the image's entrypoint runs Envoy with them.
            argv = [binary, *argv]
        else:
            # The container's own command (gateway/start.sh) runs the image's `envoy`.
            env["ENVOY"] = binary
        return [ContainerSpec("envoy", argv, env, envoy.readiness, envoy.startup,
                              envoy.prestop)]

    # --- controllers

    def reconcile(self) -> None:
        """The endpoints controller, CoreDNS's records and kube-proxy's rules in one: the
        ready, non-terminating pods each Service selects (every one where the Service publishes
        not-ready addresses), published. The build's headless
        Services select by their labels; spec.serveService as KubeRay sets its selector: the
        cluster it made active, `ray.io/serve: "true"`."""
        with self._lock:
            members = [(p, self._labels[n]) for n, p in self.pods.items()]
            clusters = list(self.clusters.values())
            members += [(c.head, self._labels[c.head.name]) for c in clusters]
            active = self.active
            gateways = [p.ip for n, p in self.pods.items() if n.startswith("gateway-")
                        and p.ready]

        def selected(selector: dict[str, str], every: bool = False) -> list[str]:
            return [pod.ip for pod, labels in members
                    if (every or pod.ready) and selector.items() <= labels.items()]

        # publishNotReadyAddresses: every pod selected, Ready or not, terminating or not (the
        # endpoints controller tolerates both then).
        for name, selector in self.built.headless.items():
            self.dns.publish(name, selected(selector, name in self.built.not_ready_published))
        self.dns.publish(self.built.head_service,
                         [c.head.ip for c in clusters if c.name == active])
        if self.built.serve_service:
            self.dns.publish(self.built.serve_service,
                             selected({"ray.io/cluster": active, "ray.io/serve": "true"}))
        if self.service.set_endpoints(gateways):
            say(f"service {SERVICE_IP}: endpoints {self.service.endpoints}")

    def _live(self, kind: str) -> list[Pod]:
        with self._lock:
            return [p for n, p in self.pods.items() if n.startswith(f"{kind}-")
                    and not p.terminating]

    def _delete(self, pod: Pod) -> threading.Thread:
        """`kubectl delete pod` in a thread of its own (returned, started); the pod's
        namespace and directory go once it is gone."""
        def run() -> None:
            pod.delete()
            with self._lock:
                self.pods.pop(pod.name, None)
            self.network.remove_pod(pod.name)
            shutil.rmtree(pod.dir, ignore_errors=True)

        thread = threading.Thread(target=run, name=f"delete {pod.name}", daemon=True)
        thread.start()
        return thread

    def _control_files(self) -> None:
        upgrade = self.pods_dir / "upgrade"
        if upgrade.exists():
            text = upgrade.read_text()
            upgrade.unlink()
            if not self._upgrading.acquire(blocking=False):
                say("upgrade: refused; an upgrade is already running")
            else:
                threading.Thread(target=self._upgrade, args=(text,), name="upgrade",
                                 daemon=True).start()
        in_place = self.pods_dir / "serve-config"
        if in_place.exists():
            text = in_place.read_text()
            in_place.unlink()
            threading.Thread(target=self._update_in_place, args=(text,), name="serve-config",
                             daemon=True).start()
        with self._lock:
            pods = list(self.pods.values())
        for pod in pods:
            if pod.terminating:
                continue
            if (pod.dir / "delete").exists():
                (pod.dir / "delete").unlink()
                self._delete(pod)
            if (pod.dir / "cut").exists():
                (pod.dir / "cut").unlink()
                say(f"{pod.name}: its node is off the network")
                self.network.cut(pod.name)

    def _update_in_place(self, text: str) -> None:
        """KubeRay's answer to a RayService whose serveConfigV2 alone changed: the new config
        sent to the active cluster's Serve, no new cluster."""
        try:
            config = yaml.safe_load(text)
            if not isinstance(config, dict):
                raise ValueError("not a Serve config (a YAML mapping)")
            with self._lock:
                cluster = self.clusters[self.active]
            ray_cluster.http("PUT", f"{cluster.dashboard}/api/serve/applications/",
                             cluster.token, self._with_prewarm_dir(config), timeout_s=180)
            cluster.serve_config = config
            say(f"serve config: updated in place on cluster {cluster.name}")
        except (yaml.YAMLError, ValueError, OSError, urllib.error.URLError) as error:
            say(f"serve config: refused: {error}")

    def _gateway_owner(self) -> None:
        """The Deployment: as many gateway pods not terminating as its replicas."""
        for _ in range(self.settings.gateways - len(self._live("gateway"))):
            self._new_pod("gateway")

    def _triton_owner(self, cluster: RayCluster) -> None:
        """Serve and the Ray autoscaler of one cluster: a GPU pod for every replica Serve
        wants that has no pod, up to the group's maxReplicas; a pod with no replica for
        idleTimeoutSeconds goes."""
        if cluster.deleting:
            return
        try:
            app = ray_cluster.application(cluster.dashboard, cluster.token)
        except (urllib.error.URLError, OSError, ValueError):
            return
        deployment = ray_cluster.deployment_of(app)
        if not deployment:
            return
        wanted = min(int(deployment.get("target_num_replicas", 0)),
                     self.built.worker_max_replicas)
        live = self._cluster_pods(cluster)
        # One GPU pod starting at a time: a Ray node must register within 30 s (Ray 2.60's
        # node.py), which this machine's two cores cannot give several beside a loaded cluster.
        starting = [p for p in live if not p.ready and time.monotonic() - p.created_at
                    < STARTING_S]
        if len(live) < wanted and not starting:
            self._new_pod("triton", cluster)
        holding = {r.get("node_ip") for r in deployment.get("replicas", [])}
        pods = {pod.name: pod for pod in live}
        for name in idle_pods({p.name: p.created_at for p in live},
                              {p.name for p in live if p.ip in holding}, wanted,
                              self.built.idle_timeout_s, self._idle_since, time.monotonic()):
            say(f"{name}: idle for {self.built.idle_timeout_s:.0f}s; the autoscaler removes it")
            self._delete(pods[name])

    def _loop(self, stop: threading.Event) -> None:
        next_owner = 0.0
        while not stop.wait(0.2):
            problem = self.dns.alive()
            if problem:
                raise SystemExit(problem)
            self._control_files()
            self.reconcile()
            if time.monotonic() >= next_owner:
                next_owner = time.monotonic() + 1.0
                self._gateway_owner()
                with self._lock:
                    clusters = list(self.clusters.values())
                for cluster in clusters:
                    self._triton_owner(cluster)

    # --- start and stop

    def start(self, stop: threading.Event) -> None:
        s = self.settings
        say(f"{s.tritons} GPU pod(s), {s.gateways} gateway pod(s), DNS TTL {s.dns_ttl_s}s; "
            f"work directory {self.workdir}")
        free_orphaned_regions()  # what an earlier run killed as a whole left behind
        self.network.start()
        if not Path("/etc/envoy").exists():
            # The mount point of the gateway pods' /etc/envoy (ip netns exec binds it).
            Path("/etc/envoy").mkdir()
            self._made_etc_envoy = True
        self.dns.start()
        self.service.start()
        first = self._start_cluster(s.ray_token, s.model_repository, s.serve_config, s.tritons)
        with self._lock:
            self.active = first.name
        for _ in range(s.gateways):
            self._new_pod("gateway")
        loop = threading.Thread(target=self._guarded_loop, args=(stop,), daemon=True)
        loop.start()
        self._wait_ready(stop)

    def _start_cluster(self, token: str, model_repository: Path | None,
                       serve_config: dict[str, Any], pods: int) -> RayCluster:
        """A Ray cluster as KubeRay creates one for the RayService: its head, `pods` GPU pods
        from the worker group's replicas, then the Serve config through the dashboard."""
        index = len(self.clusters)
        name = f"triton-{secrets.token_hex(3)}"
        head_name = HEAD if index == 0 else f"{HEAD}-{index}"
        container = self.built.head.containers["ray-head"]
        net = self.network.add_pod(head_name, dns.resolv_conf(str(network.BRIDGE_IP),
                                                              self.built.namespace))
        params = {**self.built.head.ray_start_params}
        readiness = manifests.head_readiness(int(params.get("dashboard-agent-listen-port",
                                                            AGENT_PORT)))
        head = Pod(head_name, net, [ContainerSpec(
            "ray-head", self._ray_start(params, net.ip, None, self.workdir / f"ray-{index}"),
            self._ray_env(container, token), readiness, None, None)], self.built.head.grace_s,
            self.workdir, say, lambda: None)
        cluster = RayCluster(name, head, f"http://{net.ip}:8265", token, model_repository,
                             serve_config)
        with self._lock:
            # KubeRay's head labels: ray.io/serve "false" while excludeHeadPodFromServeSvc
            # (rayservice_controller.go), otherwise "true" while its proxy is healthy.
            self._labels[head_name] = {**self.built.labels["head"], "ray.io/cluster": name,
                                       "ray.io/node-type": "head",
                                       "ray.io/serve": str(not self.built.exclude_head).lower()}
            self.clusters[name] = cluster
        # KubeRay's Secret of the cluster's token, where a test can read it.
        (head.dir / "ray-token").write_text(token)
        head.start()
        say(f"{head_name}: Ray head of cluster {name} at {net.ip} (dashboard "
            f"{cluster.dashboard})")
        until(f"{head_name} to be ready", lambda: self._stop.is_set() or head.ready or
              "not ready", 300, every_s=0.5, note=say)
        until("the Ray dashboard", lambda: self._stop.is_set() or ray_cluster.dashboard_answers(
            cluster.dashboard, token), 240, every_s=0.5, note=say)
        for _ in range(pods):
            self._new_pod("triton", cluster)
        say(f"deploying the Serve config to {name}")

        deployed_config = self._with_prewarm_dir(serve_config)

        def deployed() -> bool | str:
            # KubeRay sends it again at its next reconcile when a call fails.
            if self._stop.is_set():
                return True
            try:
                ray_cluster.http("PUT", f"{cluster.dashboard}/api/serve/applications/", token,
                                 deployed_config, timeout_s=180)
                return True
            except (urllib.error.URLError, OSError) as error:
                return str(error)

        until(f"the Serve config deployed to {name}", deployed, 600, every_s=2, note=say)
        return cluster

    def _with_prewarm_dir(self, serve_config: dict[str, Any]) -> dict[str, Any]:
        """The config with the policy's prewarm_dir where this machine projects the ConfigMap
        `prewarm` that every head mounts there (base/rayservice.yaml): `make prewarm DIR=`."""
        return with_policy_kwarg(serve_config, "prewarm_dir", str(self.prewarm_dir))

    def _running_replicas(self, cluster: RayCluster) -> int | str:
        try:
            replicas = ray_cluster.replicas(cluster.dashboard, cluster.token)
        except (urllib.error.URLError, OSError, ValueError) as error:
            return f"unknown ({error})"
        return sum(1 for r in replicas if r.get("state") == "RUNNING")

    def begin_deletion(self, cluster: RayCluster) -> list[Pod]:
        """A RayCluster's deletion: marked, and every pod it owns (its head last) to delete.
        Under the lock `_new_pod` registers a pod under, so no pod of it comes after."""
        with self._lock:
            cluster.deleting = True
            return [*self._cluster_pods(cluster), cluster.head]

    def _cluster_pods(self, cluster: RayCluster) -> list[Pod]:
        return [p for p in self._live("triton") if self._pod_cluster.get(p.name) == cluster.name]

    def _upgrade(self, text: str) -> None:
        """KubeRay v1.7.0's NewCluster upgrade (rayservice_controller.go): a pending cluster
        with the new settings; once every Serve application on it is RUNNING, KubeRay's
        Services (reconcileServices) select it; rayClusterDeletionDelaySeconds later the old
        cluster is deleted, each of its pods as `kubectl delete pod` does."""
        try:
            env = upgrade_settings(text)
            repo, config = cluster_settings(self.built, env)
            with self._lock:
                old = self.clusters[self.active]
            if "MODEL_REPOSITORY" not in env:
                repo = old.model_repository
            if "SERVE_CONFIG" not in env:
                config = old.serve_config
            # Its GPU pods come as Serve asks for them, one at a time (_triton_owner).
            pending = self._start_cluster(secrets.token_hex(32), repo, config, 0)
            say(f"upgrade: cluster {pending.name} pending, {old.name} active")

            def pending_running() -> object:
                if self._stop.is_set():
                    return True
                running = ray_cluster.applications_running(pending.dashboard, pending.token)
                if running is True:
                    return True
                waiting = [f"{p.name}: {p.waiting_on()}" for p in self._cluster_pods(pending)
                           if not p.ready]
                return f"{running}; not ready: {' | '.join(waiting)}" if waiting else running

            until(f"every Serve application of {pending.name} RUNNING", pending_running,
                  READY_TIMEOUT_S, every_s=1, note=say, note_every_s=60)
            running = {c.name: self._running_replicas(c) for c in (old, pending)}
            with self._lock:
                self.active = pending.name
            self.reconcile()
            say(f"upgrade: KubeRay's Services select {pending.name}; Serve replicas running: "
                f"{running[pending.name]} there, {running[old.name]} in {old.name}")
            if self._stop.wait(self.built.deletion_delay_s):
                return
            say(f"upgrade: deleting cluster {old.name} "
                f"({self.built.deletion_delay_s:.0f}s after the switch)")
            for thread in [self._delete(p) for p in self.begin_deletion(old)]:
                thread.join()
            with self._lock:
                self.clusters.pop(old.name, None)
            say(f"upgrade: done; cluster {old.name} deleted")
        except (SystemExit, TimeoutError, OSError, urllib.error.URLError, ValueError) as error:
            say(f"upgrade: failed: {error}")
        finally:
            self._upgrading.release()

    def _guarded_loop(self, stop: threading.Event) -> None:
        try:
            self._loop(stop)
        except BaseException as error:
            say(f"error: {error}")
            os.kill(os.getpid(), signal.SIGTERM)

    def _wait_ready(self, stop: threading.Event) -> None:
        metadata: tuple[tuple[str, str], ...] = ()
        if self.settings.tokens_file:
            token = next(line.strip() for line in Path(self.settings.tokens_file).read_text()
                         .splitlines() if line.strip() and not line.startswith("#"))
            metadata = (("authorization", f"Bearer {token}"),)
        ports = self.built.services["triton-grpc"]
        channels = {SERVICE_IP: grpc.insecure_channel(f"{SERVICE_IP}:8001")}

        def answers(ip: str, grpc_port: int, http_port: int) -> object:
            if ip not in channels:
                channels[ip] = grpc.insecure_channel(f"{ip}:{grpc_port}")
            answer = server_ready(grpc_port, metadata, channels[ip])
            if answer is True:
                answer = http_ready(http_port, metadata, host=ip)
            return answer

        def through_the_service() -> object:
            # The Service IP balances each new connection over the gateway pods, and each
            # Envoy learns the Tritons from the DNS on its own clock: ready means every ready
            # gateway pod answers, or a client's first calls could meet one that does not yet.
            if stop.is_set():
                raise SystemExit("stopped while starting")
            answer = answers(SERVICE_IP, 8001, 8000)
            if answer is not True:
                return answer
            with self._lock:
                gateways = sorted((n, p.ip) for n, p in self.pods.items()
                                  if n.startswith("gateway-") and p.ready)
            for name, ip in gateways:
                answer = answers(ip, ports[8001], ports[8000])
                if answer is not True:
                    return f"{name} at {ip}: {answer}"
            return True

        at_zero = self.settings.tritons == 0 and min_replicas(self.settings.serve_config) == 0
        try:
            if at_zero:
                self._wait_ready_at_zero(stop)
            else:
                until("ServerReady through the Service IP and every gateway pod",
                      through_the_service, READY_TIMEOUT_S, every_s=0.5, note=say)
        finally:
            for channel in channels.values():
                channel.close()
        if at_zero:
            say("no GPU pod runs (min_replicas 0): the first call starts one; until its "
                "Triton is ready the gateway answers each call at once (a job start with "
                "the start-of-job gate's status, any other call UNAVAILABLE / 503 saying "
                "when to retry)")
        say(f"pre-warm: make prewarm PODS=<n> UNTIL=<time> DIR={self.prewarm_dir}")
        say(f"{READY} grpc {SERVICE_IP}:8001 http {SERVICE_IP}:8000 pods {self.pods_dir}")

    def _wait_ready_at_zero(self, stop: threading.Event) -> None:
        """With no GPU pod, ready once every gateway pod is ready (its own probe: a call on
        the clients' ports would count as demand and start a GPU pod), the Service lists them,
        Serve runs the application and the policy answers the gateway (admission.py)."""
        with self._lock:
            cluster = self.clusters[self.active]
        head = self.built.head.containers["ray-head"]
        port = self._container_env(head).get(ADMISSION_PORT_ENV, "")
        if not port:
            raise SystemExit(f"the Ray head has no {ADMISSION_PORT_ENV}: the gateway would "
                             "never hear that a GPU pod is on its way")

        def control_plane() -> object:
            if stop.is_set():
                raise SystemExit("stopped while starting")
            with self._lock:
                gateways = sorted(p.ip for n, p in self.pods.items()
                                  if n.startswith("gateway-") and p.ready)
            if len(gateways) < self.settings.gateways:
                return f"{len(gateways)} of {self.settings.gateways} gateway pods ready"
            if self.service.endpoints != gateways:
                return f"the Service lists {self.service.endpoints}"
            running = ray_cluster.applications_running(cluster.dashboard, cluster.token)
            if running is not True:
                return running
            return ray_cluster.policy_answers(cluster.head.ip, port)

        until("the gateway pods and the control plane (no GPU pod at min_replicas 0)",
              control_plane, READY_TIMEOUT_S, every_s=0.5, note=say)

    def stop(self) -> None:
        if not self.network.owned:
            shutil.rmtree(self.workdir, ignore_errors=True)
            return
        say("stopping")
        with self._lock:
            pods = list(self.pods.values())
        threads = [threading.Thread(target=p.kill, daemon=True) for p in pods]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        self._stop.set()
        for cluster in list(self.clusters.values()):
            cluster.head.kill()
        self.dns.stop()
        self.service.stop()
        self.network.stop()
        if self._made_etc_envoy:
            with contextlib.suppress(OSError):
                Path("/etc/envoy").rmdir()
        shutil.rmtree(self.workdir, ignore_errors=True)
        say("stopped")


def main() -> int:
    set_parent_death_signal()
    network.require_root()
    # A container's open-file limit (containerd's default), for the pods' processes: a gateway
    # pod holds thousands of client connections.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    built = manifests.read(manifests.build())
    stack = ClusterStack(built, ClusterSettings.from_env(built))

    def run(stop: threading.Event) -> None:
        stack.start(stop)
        while not stop.wait(1.0):
            pass

    return run_until_signalled(run, stack.stop, say, (network.NetworkError, TimeoutError))
