"""A gateway feature that is off costs no call anything: the token checks' and the tenant
shares' discovered filters are, while off as shipped, a filter that does nothing
(OFF_FILTER_TYPE, gateway/routes.py), not jwt_authn with no provider or local_ratelimit with
no bucket (15-20 us a call on a 16-core node); the chain accepts either, and a site that turns
a feature on gets the feature's own filter (the stacks of tests/stack/test_jwt.py and
tests/stack/test_fair_share.py serve with them)."""

from __future__ import annotations

import pytest
import yaml

from gateway import jwt, tenant_shares
from gateway import local as gateway
from gateway.routes import OFF_FILTER_TYPE, http_filters


def _discovered(name: str) -> list[list[str]]:
    """The type_urls the shipped chains allow the named discovered filter."""
    config = yaml.safe_load(gateway.CONFIG.read_text())
    return [f["config_discovery"]["type_urls"] for f in http_filters(config)
            if f.get("name") == name and "config_discovery" in f]


@pytest.mark.parametrize(("module", "feature_type"), [
    (jwt, jwt.JWT_AUTHN_TYPE), (tenant_shares, tenant_shares.LOCAL_RATELIMIT_TYPE)],
    ids=["tokens", "tenant-shares"])
def test_an_off_feature_is_a_filter_that_does_nothing(module: object, feature_type: str) -> None:
    shipped = yaml.safe_load(module.SHIPPED.read_text())  # type: ignore[attr-defined]
    (resource,) = shipped["resources"]
    assert resource["typed_config"] == {"@type": OFF_FILTER_TYPE}, module.SHIPPED  # type: ignore[attr-defined]
    chains = _discovered(resource["name"])
    assert chains, f"no discovered filter {resource['name']} in gateway/envoy.yaml"
    for allowed in chains:
        assert set(allowed) == {feature_type, OFF_FILTER_TYPE}, allowed


def test_a_feature_turned_on_is_its_own_filter() -> None:
    assert tenant_shares.filter_config({"cms": 10})["@type"] == (
        tenant_shares.LOCAL_RATELIMIT_TYPE)
    settings = jwt.JwtSettings.from_env({jwt.ISSUER_ENV: "https://idp.example",
                                         "SONIC_RAY_JWT_AUDIENCES": "sonic-ray",
                                         "SONIC_RAY_JWKS_URI": "https://idp.example/keys"})
    assert settings is not None
    assert jwt.filter_config(settings)["@type"] == jwt.JWT_AUTHN_TYPE
