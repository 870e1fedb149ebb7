"""Keys fetched from the identity provider (SONIC_RAY_JWKS_URI, gateway/jwt.py), no stack:
jwt_authn's config naming the gateway's `jwks` cluster, bad settings refused by name, a site
giving both a URI and a key file refused, and this machine's gateway dialling JWKS_URI's host
with JWKS_CA_FILE's CA."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gateway import jwt, routes
from local_stack.gateway_config import local_config
from local_stack.settings import Settings

URI = "https://cms-auth.web.cern.ch/jwk"


def test_a_uri_makes_jwt_authn_fetch_the_keys_through_the_gateways_cluster() -> None:
    settings = jwt.JwtSettings.from_env({jwt.ISSUER_ENV: "https://idp", jwt.AUDIENCES_ENV: "a",
                                         jwt.JWKS_URI_ENV: URI, jwt.JWKS_CACHE_ENV: "30"})
    assert settings is not None
    provider = jwt.filter_config(settings)["providers"][jwt.PROVIDER]
    assert "local_jwks" not in provider
    remote = provider["remote_jwks"]
    assert remote["http_uri"] == {"uri": URI, "cluster": jwt.JWKS_CLUSTER, "timeout": "5s"}
    assert remote["cache_duration"] == "30s"
    envoy = yaml.safe_load(routes.ENVOY_CONFIG.read_text())
    cluster = routes.named(envoy, "clusters", jwt.JWKS_CLUSTER)
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"]["address"] == jwt.JWKS_PROVIDER_SERVICE


@pytest.mark.parametrize(("env", "says"), [
    ({jwt.JWKS_URI_ENV: "http://idp/jwk"}, "SONIC_RAY_JWKS_URI='http://idp/jwk': an https://"),
    ({jwt.JWKS_URI_ENV: "https:///jwk"}, "host and path"),
    ({jwt.JWKS_URI_ENV: URI, jwt.JWKS_TIMEOUT_ENV: "600"}, "SONIC_RAY_JWKS_TIMEOUT_S='600'"),
    ({jwt.JWKS_URI_ENV: URI, jwt.JWKS_CACHE_ENV: "soon"}, "SONIC_RAY_JWKS_CACHE_S='soon'"),
])
def test_bad_key_settings_are_refused_by_name(env: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        jwt.JwtSettings.from_env({jwt.ISSUER_ENV: "https://idp", jwt.AUDIENCES_ENV: "a", **env})


def test_a_site_with_a_uri_and_a_key_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "jwt.env").write_text(f"{jwt.ISSUER_ENV}=https://idp\n{jwt.AUDIENCES_ENV}=a\n"
                                      f"{jwt.JWKS_URI_ENV}={URI}\n")
    (tmp_path / "jwks.json").write_text('{"keys": [{"kty": "RSA"}]}')
    with pytest.raises(SystemExit, match=re.escape("SONIC_RAY_JWKS_URI and jwks.json")):
        jwt.render_site(tmp_path)
    (tmp_path / "jwks.json").unlink()
    assert "remote_jwks" in jwt.render_site(tmp_path)


def test_this_machines_gateway_dials_the_uris_host_with_its_ca(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    settings = Settings.from_env({"JWKS_URI": "https://localhost:8443/keys",
                                  "JWKS_CA_FILE": str(ca), "JWT_ISSUER": "i",
                                  "JWT_AUDIENCE": "a"})
    config = local_config(settings, tmp_path / "endpoints.json",
                          tmp_path / "endpoints-http.json")
    cluster = routes.named(config, "clusters", jwt.JWKS_CLUSTER)
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": "localhost", "port_value": 8443}
    context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    assert context["validation_context"]["trusted_ca"] == {"filename": str(ca)}


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
