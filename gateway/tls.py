"""TLS on the gateway's client listeners (components/tls) and, on top, client certificates
(components/mtls). gateway/envoy.yaml holds the three filter chains of each client listener
(in clear, `tls`, `mtls`, sharing their filters); the container's SONIC_RAY_TLS picks one at
start (gateway/start.sh), so a component changes only the Deployment: that variable and the
secrets' volumes. The certificate and the CA come by SDS from files (one discovery document per
secret, in the gateway's ConfigMap, naming the Secret's files where the components mount them):
Envoy watches the files of a secret it got by SDS, and of no other, so a renewed Secret is
served to new connections without a restart while old ones finish.

`make gateway-config` writes the discovery documents (gateway/sds-server-certificate.yaml,
gateway/sds-client-ca.yaml); the checks refuse a stale one.

    python -m gateway.tls [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from gateway.routes import GRPC_LISTENER, HTTP_LISTENER, ROOT, named
from tools.generated import write_or_check

# Where the components mount the server's `kubernetes.io/tls` Secret (tls.crt, tls.key, what
# cert-manager writes) and the CA bundle that signs clients' certificates (ca.crt).
TLS_MOUNT = "/etc/sonic-ray/tls"
CLIENT_CA_MOUNT = "/etc/sonic-ray/client-ca"
SERVER_CERTIFICATE, CLIENT_CA = "server-certificate", "client-ca"
# Where the gateway's Deployment mounts its ConfigMap (gateway/gateway.yaml), discovery
# documents included.
MOUNTED_AT = "/etc/envoy"
# What the container's SONIC_RAY_TLS may say (gateway/start.sh), and the filter chain of each
# client listener it picks (gateway/envoy.yaml): the components set it.
TLS_ENV = "SONIC_RAY_TLS"
CHAIN_BY_MODE = {"": "clear", "server": "tls", "mutual": "mtls"}
MODE_BY_COMPONENT = {"tls": "server", "mtls": "mutual"}
SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
# What each listener offers in ALPN: gRPC needs HTTP/2; the HTTP listener speaks both.
ALPN = {GRPC_LISTENER: ["h2"], HTTP_LISTENER: ["h2", "http/1.1"]}


def sds_path(secret_name: str) -> Path:
    """Where `make gateway-config` writes a secret's discovery document."""
    return ROOT / "gateway" / sds_file_name(secret_name)


def sds_file_name(secret: str) -> str:
    return f"sds-{secret}.yaml"


def secret(name: str, folder: str) -> dict[str, Any]:
    """The files Envoy serves (the server's pair) or trusts (the CA). `watched_directory`:
    Kubernetes swaps a mounted Secret's files by renaming a symlink in the mount, the move
    Envoy reloads on (cert and key read together)."""
    if name == SERVER_CERTIFICATE:
        return {"name": name, "tls_certificate": {
            "certificate_chain": {"filename": f"{folder}/tls.crt"},
            "private_key": {"filename": f"{folder}/tls.key"},
            "watched_directory": {"path": folder}}}
    return {"name": name, "validation_context": {
        "trusted_ca": {"filename": f"{folder}/ca.crt"},
        "watched_directory": {"path": folder}}}


def sds_document(name: str, folder: str) -> dict[str, Any]:
    """A discovery response from the filesystem, what `path_config_source` reads."""
    return {"resources": [{"@type": SECRET_TYPE, **secret(name, folder)}]}


def chains(config: dict[str, Any], listener: str) -> dict[str, dict[str, Any]]:
    """A client listener's filter chains by name (an unnamed chain: `clear`)."""
    return {str(chain.get("name") or "clear"): chain
            for chain in named(config, "listeners", listener).get("filter_chains", [])}


def selected_chain(config: dict[str, Any], listener: str, mode: str) -> dict[str, Any] | None:
    """The filter chain a client listener serves under SONIC_RAY_TLS=`mode`: the one named
    for it where a matcher picks (gateway/envoy.yaml), else the listener's only chain; None
    where the mode is unknown or the listener has no such chain."""
    found = chains(config, listener)
    if "filter_chain_matcher" not in named(config, "listeners", listener):
        return next(iter(found.values()), None)
    return found.get(CHAIN_BY_MODE.get(mode, ""))


def sds_configs(config: dict[str, Any], chain_names: tuple[str, ...] | None = None
                ) -> list[dict[str, Any]]:
    """Every secret the client listeners' chains (those named, else all) take by SDS:
    {name, sds_config}, in place."""
    found = []
    for listener in ALPN:
        for name, chain in chains(config, listener).items():
            if chain_names is not None and name not in chain_names:
                continue
            common = ((chain.get("transport_socket") or {}).get("typed_config") or {}).get(
                "common_tls_context") or {}
            found += [item for item in [*common.get("tls_certificate_sds_secret_configs", []),
                                        common.get("validation_context_sds_secret_config")]
                      if item]
    return found


def sds_paths(config: dict[str, Any], chain_names: tuple[str, ...] | None = None
              ) -> dict[str, str]:
    """Secret name -> the discovery document's path, as the chains name them."""
    return {item["name"]: item["sds_config"]["path_config_source"]["path"]
            for item in sds_configs(config, chain_names)}


def render_sds(name: str) -> str:
    folder = TLS_MOUNT if name == SERVER_CERTIFICATE else CLIENT_CA_MOUNT
    return (f"# The secret `{name}` for the gateway's TLS config, by SDS from this file: written\n"
            "# by `make gateway-config` (gateway/tls.py).\n"
            + yaml.safe_dump(sds_document(name, folder), sort_keys=False))


def main(argv: list[str] | None = None) -> int:
    failed = 0
    for name in (SERVER_CERTIFICATE, CLIENT_CA):
        failed |= write_or_check(sds_path(name), render_sds(name), argv, __doc__,
                                 "make gateway-config")
    return failed


if __name__ == "__main__":
    sys.exit(main())
