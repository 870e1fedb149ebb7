"""The gateway's config as `make local` runs it: gateway/envoy.yaml with this machine's ports,
the Tritons from files the stack rewrites (EDS from the filesystem), the control plane on the
Ray head's local port and the identity provider from JWKS_URI. gateway/local.py holds what the
shipped config's own check needs as well."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from gateway import jwt, routes, tenant_shares, tls
from gateway.local import (
    CONFIG,
    socket_of,
    with_certificates_at,
    with_files_here,
    write_endpoints,
)
from local_stack.settings import Settings
from triton_pod.access import ADMIN_KEY_ENV


def jwt_folder(endpoints_file: Path) -> Path:
    """A folder of its own: Envoy re-reads a discovered config on any move in its folder."""
    return endpoints_file.parent / "jwt"


def local_config(settings: Settings, endpoints_file: Path, http_endpoints_file: Path,
                 certificates: Path | None = None,
                 access_log: Path | None = None) -> dict[str, Any]:
    """`certificates`: the folder of tools/certificates.py's files, with TLS on. The
    token checks' config (gateway/jwt.py) is read from jwt_folder(endpoints_file), where the
    stack writes it. `access_log`: a file of its own for the access log, apart from Envoy's
    messages (the cluster's goes to the pod's log with them)."""
    config: dict[str, Any] = with_files_here(
        yaml.safe_load(CONFIG.read_text()), jwt_folder(endpoints_file))
    if access_log is not None:
        for log in routes.file_access_logs(config):
            log["path"] = str(access_log)
    if settings.tls:
        if certificates is None:
            raise ValueError("TLS is on: the certificates' folder is needed")
        with_certificates_at(config, certificates)
    socket_of(config["admin"]["address"])["port_value"] = settings.gateway_admin_port
    socket_of(routes.named(config, "listeners", routes.GRPC_LISTENER)["address"])["port_value"] = (
        settings.grpc_port)
    socket_of(routes.named(config, "listeners", routes.HTTP_LISTENER)["address"])["port_value"] = (
        settings.http_port)
    socket_of(routes.named(config, "listeners", "metrics")["address"])["port_value"] = (
        settings.gateway_metrics_port)
    admin = routes.named(config, "clusters", "envoy-admin")["load_assignment"]["endpoints"][0][
        "lb_endpoints"][0]
    socket_of(admin["endpoint"]["address"])["port_value"] = settings.gateway_admin_port
    # The control plane's answer on this machine's port of the Ray head.
    control_plane = routes.named(config, "clusters", routes.CONTROL_PLANE_CLUSTER)
    control_plane.pop("cluster_type", None)
    control_plane["type"] = "STATIC"
    socket_of(control_plane["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"]).update(address="127.0.0.1", port_value=settings.admission_port)
    _with_jwks_provider(config, settings)
    # Discovery from a file needs the node named.
    config["node"] = {"id": "local", "cluster": "sonic-ray-gateway"}
    for name, path in ((routes.GRPC_CLUSTER, endpoints_file),
                       (routes.HTTP_CLUSTER, http_endpoints_file)):
        cluster = routes.named(config, "clusters", name)
        for key in ("load_assignment", "cluster_type"):
            cluster.pop(key, None)
        cluster["type"] = "EDS"
        cluster["eds_cluster_config"] = {"eds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": str(path),
                                   "watched_directory": {"path": str(path.parent)}},
        }}
    return config


def _with_jwks_provider(config: dict[str, Any], settings: Settings) -> None:
    """The identity provider's host and port from JWKS_URI in place of the cluster's
    ExternalName Service, and JWKS_CA_FILE's CA in place of the image's bundle; with no
    JWKS_URI, this machine's name (nothing fetches)."""
    cluster = routes.named(config, "clusters", jwt.JWKS_CLUSTER)
    uri = settings.jwt.jwks_uri if settings.jwt is not None else None
    parsed = urllib.parse.urlsplit(uri or "https://localhost/")
    socket_of(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"]).update(address=parsed.hostname, port_value=parsed.port or 443)
    if settings.jwks_ca_file is not None:
        cluster["transport_socket"]["typed_config"]["common_tls_context"][
            "validation_context"]["trusted_ca"] = {"filename": str(settings.jwks_ca_file)}


def gateway_env(s: Settings, admin_key: str) -> dict[str, str]:
    """Envoy's environment: the admission and front-door settings its Lua reads, the admin
    key it adds to the restricted RPCs that pass (gateway/envoy.yaml), and the client listeners'
    transport as components/tls and components/mtls set it (gateway/start.sh), and the metrics
    listener's port, where gateway/gate-word.sh asks the control plane's word."""
    mode = tls.MODE_BY_COMPONENT["mtls" if s.mtls else "tls"] if s.tls else ""
    return {**os.environ, **s.admission_env(), **s.front_door_env(), ADMIN_KEY_ENV: admin_key,
            tls.TLS_ENV: mode, "GATEWAY_METRICS_PORT": str(s.gateway_metrics_port)}


def write_token_checks(s: Settings, path: Path) -> str | None:
    """jwt_authn's config (gateway/jwt.py) as JWT_ISSUER, JWT_AUDIENCE and JWKS_FILE or
    JWKS_URI set it, off without them; the JWKS text written, if any."""
    if s.jwt is not None and s.jwt.jwks_uri is not None:
        jwt.write(path, s.jwt)  # Envoy fetches the keys
        return None
    if s.jwt is None or s.jwks_file is None:
        jwt.write(path, None)
        return None
    text = s.jwks_file.read_text()
    jwt.write(path, s.jwt, text)
    return text


def write_lone_config(s: Settings, folder: Path, grpc_ports: list[int], http_ports: list[int],
                      shares: dict[str, int] | None = None,
                      certificates: Path | None = None) -> Path:
    """An Envoy of its own outside any stack (the tests' and benches'): the config for these
    settings in `folder`, its Tritons these ports, the token checks the settings give and the
    tenant shares given (else those of SONIC_RAY_TENANT_SHARES), with TLS on the certificates
    of tools/certificates.py in `certificates`; the config's path."""
    folder.mkdir(parents=True, exist_ok=True)
    endpoints, http_endpoints = folder / "endpoints.json", folder / "endpoints-http.json"
    write_endpoints(endpoints, grpc_ports)
    write_endpoints(http_endpoints, http_ports, routes.HTTP_CLUSTER)
    discovered = jwt_folder(endpoints)
    discovered.mkdir(parents=True, exist_ok=True)
    write_token_checks(s, discovered / jwt.JWT_AUTHN_FILE)
    tenant_shares.write(discovered / tenant_shares.SHARES_FILE,
                        s.tenant_shares() if shares is None else shares)
    path = folder / "envoy.yaml"
    path.write_text(yaml.safe_dump(local_config(s, endpoints, http_endpoints, certificates,
                                                folder / "access.log")))
    return path
