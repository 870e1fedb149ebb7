"""What `make cluster` runs, read from the built overlays/local objects, never restated: the
worker pod's containers (Triton's flags, probes and preStop; Ray's start parameters and
environment), the gateway's Deployment and its Envoy config, the Services, the grace periods.

What KubeRay v1.7.0 adds to a RayService's pods itself is not in the build; it is written here
once, with where in KubeRay's source it comes from (WORKER_READINESS)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from local_stack.settings import ROOT

OVERLAY = ROOT / "overlays" / "local"
GATEWAY_COMPONENT = "gateway"
WORKER_COMPONENT = "triton-worker"


@dataclass(frozen=True)
class Probe:
    """A container probe as the kubelet runs it: an HTTP GET, a TCP connect or a command."""

    kind: str  # "http", "tcp" or "exec"
    port: int = 0
    path: str = "/"
    command: tuple[str, ...] = ()
    period_s: float = 10
    timeout_s: float = 1
    failure_threshold: int = 3
    success_threshold: int = 1
    initial_delay_s: float = 0


# KubeRay v1.7.0 gives a RayService's worker Ray container this readiness probe
# (ray-operator/controllers/ray/common/pod.go, initLivenessAndReadinessProbe; the values in
# controllers/ray/utils/constant.go: initial delay 10 s, timeout 2 s, period 5 s, and
# ServeReadinessProbeFailureThreshold 1): the raylet's health through the dashboard agent and
# the node's Serve proxy (BaseWgetHealthCommand, port 8000 when no port is named `serve`), so
# that a pod whose proxy drains (no replica left) leaves the Services at the first miss.
WORKER_READINESS = Probe(
    kind="exec",
    command=("/bin/bash", "-c",
             "wget -T 10 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
             " && wget -T 10 -q -O- http://localhost:8000/-/healthz | grep success"),
    period_s=5, timeout_s=2, failure_threshold=1, success_threshold=1, initial_delay_s=10)


def head_readiness(agent_port: int) -> Probe:
    """KubeRay v1.7.0's readiness probe of a RayService's head Ray container for Ray 2.60
    (initLivenessAndReadinessProbe, pod.go: the unified HTTP check of the dashboard agent's
    /api/healthz; head timeout 5 s, period 5 s, failure threshold 10, initial delay 10 s).
    KubeRay sends the Serve config only once the head is Ready (reconcileServe)."""
    return Probe(kind="http", port=agent_port, path="/api/healthz", period_s=5, timeout_s=5,
                 failure_threshold=10, success_threshold=1, initial_delay_s=10)


@dataclass(frozen=True)
class Container:
    name: str
    command: tuple[str, ...]
    env: dict[str, Any]
    ports: dict[str, int]
    readiness: Probe | None
    startup: Probe | None
    prestop: tuple[str, ...] | None


@dataclass(frozen=True)
class PodTemplate:
    containers: dict[str, Container]
    grace_s: float
    ray_start_params: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Built:
    worker: PodTemplate
    head: PodTemplate
    gateway: PodTemplate
    gateway_replicas: int
    envoy_files: dict[str, str]
    # KubeRay's head Service of the RayService (headless, published whether or not the head
    # is ready), pointed at the cluster it makes active (rayservice_controller.go).
    head_service: str
    serve_config: dict[str, Any]
    dns_ttl_s: int
    namespace: str
    # Service name -> {port: target port number}
    services: dict[str, dict[int, int]]
    worker_max_replicas: int
    idle_timeout_s: float
    # The pod templates' labels, as the endpoints controller matches them.
    labels: dict[str, dict[str, str]]
    # Headless Services the build ships (their names resolve to pod addresses): name -> selector.
    headless: dict[str, dict[str, str]]
    # Those of them with publishNotReadyAddresses: every selected pod, Ready or not.
    not_ready_published: frozenset[str]
    # spec.serveService's name when it is headless: KubeRay points it at the active cluster.
    serve_service: str | None
    exclude_head: bool
    deletion_delay_s: float


def build(overlay: Path = OVERLAY) -> list[dict[str, Any]]:
    kubectl = Path(sys.executable).with_name("kubectl")
    done = subprocess.run([str(kubectl), "kustomize", str(overlay)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"kubectl kustomize {overlay} failed: {done.stderr.strip()}")
    return [o for o in yaml.safe_load_all(done.stdout) if o]


def _probe(spec: dict[str, Any] | None, ports: dict[str, int]) -> Probe | None:
    if not spec:
        return None
    timing = {"period_s": spec.get("periodSeconds", 10), "timeout_s": spec.get("timeoutSeconds", 1),
              "failure_threshold": spec.get("failureThreshold", 3),
              "success_threshold": spec.get("successThreshold", 1),
              "initial_delay_s": spec.get("initialDelaySeconds", 0)}

    def port(value: Any) -> int:
        return ports[value] if isinstance(value, str) else int(value)

    if "httpGet" in spec:
        return Probe("http", port(spec["httpGet"]["port"]), spec["httpGet"].get("path", "/"),
                     **timing)
    if "tcpSocket" in spec:
        return Probe("tcp", port(spec["tcpSocket"]["port"]), **timing)
    if "exec" in spec:
        return Probe("exec", command=tuple(spec["exec"]["command"]), **timing)
    raise SystemExit(f"a probe of a kind make cluster does not run: {spec}")


def _container(spec: dict[str, Any], config_maps: dict[str, dict[str, Any]]) -> Container:
    ports = {p["name"]: int(p["containerPort"]) for p in spec.get("ports") or [] if "name" in p}
    prestop = ((spec.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command")
    # As the kubelet does: every envFrom ConfigMap in order, then env, which wins.
    env: dict[str, Any] = {}
    for source in spec.get("envFrom") or []:
        name = (source.get("configMapRef") or {}).get("name")
        if name is None or name not in config_maps:
            raise SystemExit(f"{spec['name']}: envFrom {source}: only ConfigMaps of the build "
                             "exist here")
        env |= dict(config_maps[name].get("data") or {})
    env |= {e["name"]: e.get("value", e.get("valueFrom")) for e in spec.get("env") or []}
    return Container(
        name=spec["name"],
        command=tuple(str(a) for a in (spec.get("command") or []) + (spec.get("args") or [])),
        env=env,
        ports=ports,
        readiness=_probe(spec.get("readinessProbe"), ports),
        startup=_probe(spec.get("startupProbe"), ports),
        prestop=tuple(prestop) if prestop else None,
    )


def _template(pod: dict[str, Any], config_maps: dict[str, dict[str, Any]],
              params: dict[str, Any] | None = None) -> PodTemplate:
    spec = pod["spec"]
    return PodTemplate({c["name"]: _container(c, config_maps) for c in spec["containers"]},
                       float(spec.get("terminationGracePeriodSeconds", 30)),
                       {k: str(v) for k, v in (params or {}).items()})


def read(objects: list[dict[str, Any]]) -> Built:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    (rayservice,) = by_kind["RayService"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    (group,) = [g for g in cluster["workerGroupSpecs"]
                if g["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
                == WORKER_COMPONENT]
    (gateway,) = [d for d in by_kind["Deployment"]
                  if d["metadata"]["labels"].get("app.kubernetes.io/component") == GATEWAY_COMPONENT]
    config_maps = {c["metadata"]["name"]: c for c in by_kind["ConfigMap"]}
    gateway_pod = gateway["spec"]["template"]
    (config_volume,) = [v for v in gateway_pod["spec"]["volumes"] if "configMap" in v
                        and "envoy.yaml" in config_maps[v["configMap"]["name"]]["data"]]
    services: dict[str, dict[int, int]] = {}
    pods = {"gateway": gateway_pod["spec"], "worker": group["template"]["spec"]}
    for service in by_kind["Service"]:
        selector = service["spec"].get("selector") or {}
        component = selector.get("app.kubernetes.io/component")
        spec = pods["gateway" if component == GATEWAY_COMPONENT else "worker"]
        named = {p["name"]: int(p["containerPort"]) for c in spec["containers"]
                 for p in c.get("ports") or [] if "name" in p}
        services[service["metadata"]["name"]] = {
            int(p["port"]): named[p["targetPort"]] if isinstance(p.get("targetPort"), str)
            else int(p.get("targetPort", p["port"])) for p in service["spec"]["ports"]}
    annotations = rayservice["metadata"].get("annotations") or {}
    serve_service = rayservice["spec"].get("serveService") or {}
    return Built(
        worker=_template(group["template"], config_maps, group.get("rayStartParams")),
        head=_template(cluster["headGroupSpec"]["template"], config_maps,
                       cluster["headGroupSpec"].get("rayStartParams")),
        gateway=_template(gateway_pod, config_maps),
        gateway_replicas=int(gateway["spec"].get("replicas", 1)),
        envoy_files=dict(config_maps[config_volume["configMap"]["name"]]["data"]),
        head_service=f"{rayservice['metadata']['name']}-head-svc",
        serve_config=yaml.safe_load(rayservice["spec"]["serveConfigV2"]),
        dns_ttl_s=int(annotations["sonic-ray.io/cluster-dns-ttl-seconds"]),
        namespace=rayservice["metadata"]["namespace"],
        services=services,
        worker_max_replicas=int(group["maxReplicas"]),
        idle_timeout_s=float((cluster.get("autoscalerOptions") or {}).get(
            "idleTimeoutSeconds", 60)),
        labels={kind: dict(template["metadata"].get("labels") or {}) for kind, template in
                (("worker", group["template"]), ("head", cluster["headGroupSpec"]["template"]),
                 ("gateway", gateway_pod))},
        headless={s["metadata"]["name"]: dict(s["spec"].get("selector") or {})
                  for s in by_kind["Service"] if s["spec"].get("clusterIP") == "None"},
        not_ready_published=frozenset(
            s["metadata"]["name"] for s in by_kind["Service"]
            if s["spec"].get("clusterIP") == "None" and s["spec"].get("publishNotReadyAddresses")),
        serve_service=(serve_service.get("metadata", {}).get("name")
                       if (serve_service.get("spec") or {}).get("clusterIP") == "None" else None),
        exclude_head=bool(rayservice["spec"].get("excludeHeadPodFromServeSvc", False)),
        # KubeRay v1.7.0's default (RayClusterDeletionDelayDuration, rayservice_controller.go).
        deletion_delay_s=float(rayservice["spec"].get("rayClusterDeletionDelaySeconds", 60)),
    )
