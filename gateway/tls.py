"""The gateway's config with TLS on the clients' listeners (components/tls) and, on top,
client certificates (components/mtls): gateway/envoy.yaml with a TLS transport socket on the
gRPC and HTTP listeners. The certificate and the CA come by SDS from files (one discovery
document per secret, mounted with the config, naming the Secret's files): Envoy watches the
files of a secret it got by SDS, and of no other, so a renewed Secret is served to new
connections without a restart while old ones finish.

A component's files must lie in its own folder (Kustomize's load restrictor), so `make
gateway-config` writes each variant there from gateway/envoy.yaml; the checks refuse a stale one.

    python -m gateway.tls [--check]
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from gateway.routes import ENVOY_CONFIG, GRPC_LISTENER, HTTP_LISTENER, ROOT, named
from tools.generated import write_or_check

# Where the components mount the server's `kubernetes.io/tls` Secret (tls.crt, tls.key, what
# cert-manager writes) and the CA bundle that signs clients' certificates (ca.crt).
TLS_MOUNT = "/etc/sonic-ray/tls"
CLIENT_CA_MOUNT = "/etc/sonic-ray/client-ca"
SERVER_CERTIFICATE, CLIENT_CA = "server-certificate", "client-ca"
# Where the gateway's Deployment mounts its ConfigMap (gateway/gateway.yaml), discovery
# documents included.
MOUNTED_AT = "/etc/envoy"
# The variants, by component: whether each asks clients for a certificate.
VARIANTS = {"tls": False, "mtls": True}
# The discovery documents each component adds to the ConfigMap: mtls builds on tls.
SECRETS_BY_COMPONENT = {"tls": SERVER_CERTIFICATE, "mtls": CLIENT_CA}
SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
MINIMUM_VERSION = "TLSv1_2"
# What each listener offers in ALPN: gRPC needs HTTP/2; the HTTP listener speaks both.
ALPN = {GRPC_LISTENER: ["h2"], HTTP_LISTENER: ["h2", "http/1.1"]}
TLS_SOCKET = "envoy.transport_sockets.tls"
DOWNSTREAM_TLS = ("type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                  "DownstreamTlsContext")


def variant_path(component: str) -> Path:
    return ROOT / "components" / component / "envoy.yaml"


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


def _from_file(name: str, config_dir: str) -> dict[str, Any]:
    return {"name": name, "sds_config": {
        "resource_api_version": "V3",
        "path_config_source": {"path": f"{config_dir}/{sds_file_name(name)}"}}}


def sds_configs(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every secret the client listeners take by SDS: {name, sds_config}, in place."""
    found = []
    for listener in ALPN:
        for chain in named(config, "listeners", listener).get("filter_chains", []):
            common = ((chain.get("transport_socket") or {}).get("typed_config") or {}).get(
                "common_tls_context") or {}
            found += [item for item in [*common.get("tls_certificate_sds_secret_configs", []),
                                        common.get("validation_context_sds_secret_config")]
                      if item]
    return found


def sds_paths(config: dict[str, Any]) -> dict[str, str]:
    """Secret name -> the discovery document's path, as the client listeners name them."""
    return {item["name"]: item["sds_config"]["path_config_source"]["path"]
            for item in sds_configs(config)}


def transport_socket(listener: str, client_certificates: bool) -> dict[str, Any]:
    context: dict[str, Any] = {
        "tls_params": {"tls_minimum_protocol_version": MINIMUM_VERSION},
        "alpn_protocols": ALPN[listener],
        "tls_certificate_sds_secret_configs": [_from_file(SERVER_CERTIFICATE, MOUNTED_AT)],
    }
    tls: dict[str, Any] = {"@type": DOWNSTREAM_TLS, "common_tls_context": context}
    if client_certificates:
        # A certificate that does not verify against the CA ends the handshake.
        context["validation_context_sds_secret_config"] = _from_file(CLIENT_CA, MOUNTED_AT)
        tls["require_client_certificate"] = True
    return {"name": TLS_SOCKET, "typed_config": tls}


def with_tls(config: dict[str, Any], client_certificates: bool) -> dict[str, Any]:
    """A copy of the config whose client listeners speak only TLS: a plaintext client's
    bytes end the handshake at once (no plaintext filter chain is left)."""
    config = copy.deepcopy(config)
    for listener in ALPN:
        for chain in named(config, "listeners", listener)["filter_chains"]:
            chain["transport_socket"] = transport_socket(listener, client_certificates)
            if client_certificates:
                _checked_always(chain)
    return config


def _checked_always(chain: dict[str, Any]) -> None:
    """Every call passes the client checks: a certificate names its caller (`cert:<subject>`,
    tenant "other" or a SONIC_RAY_TENANTS pattern's), which only the checks record; the routes
    that may skip them (gateway/envoy.yaml, sonic_ray.calls_unchecked) are left out."""
    for network_filter in chain["filters"]:
        for host in network_filter["typed_config"]["route_config"]["virtual_hosts"]:
            host["routes"] = [route for route in host["routes"]
                              if "runtime_fraction" not in route["match"]]


def header(component: str) -> str:
    what = ("TLS on the clients' listeners, and a client certificate signed by the site's CA"
            if VARIANTS[component] else "TLS on the clients' listeners")
    return (f"# gateway/envoy.yaml with {what}: written by `make gateway-config`\n"
            "# (gateway/tls.py) from gateway/envoy.yaml; edit that, not this file.\n")


def render(component: str, base_text: str) -> str:
    config = with_tls(yaml.safe_load(base_text), VARIANTS[component])
    return header(component) + yaml.safe_dump(config, sort_keys=False, width=100)


def render_sds(component: str) -> str:
    name = SECRETS_BY_COMPONENT[component]
    folder = TLS_MOUNT if name == SERVER_CERTIFICATE else CLIENT_CA_MOUNT
    return (f"# The secret `{name}` for the gateway's TLS config, by SDS from this file: written\n"
            "# by `make gateway-config` (gateway/tls.py).\n"
            + yaml.safe_dump(sds_document(name, folder), sort_keys=False))


def main(argv: list[str] | None = None) -> int:
    base = ENVOY_CONFIG.read_text()
    failed = 0
    for component, secret_name in SECRETS_BY_COMPONENT.items():
        failed |= write_or_check(variant_path(component), render(component, base), argv,
                                 __doc__, "make gateway-config")
        failed |= write_or_check(variant_path(component).with_name(sds_file_name(secret_name)),
                                 render_sds(component), argv, __doc__, "make gateway-config")
    return failed


if __name__ == "__main__":
    sys.exit(main())
