"""The gateway's check of OIDC / WLCG tokens: Envoy's jwt_authn filter, whose config Envoy reads
by extension config discovery from a file beside envoy.yaml (JWT_AUTHN_FILE), so that a site's
issuer and keys change that file alone and a rewritten file takes effect without a restart.

jwt_authn checks the signature against the JWKS, `exp` and `nbf` with a clock skew, the issuer
and the audience, and never refuses by itself (allow_missing_or_failed): it leaves the verified
claims, or why the token failed, in the call's metadata, and client-checks.lua decides, so that
a static token (components/token-auth) still suffices beside a JWT, a required scope or group
is checked, and every refusal carries RFC 6750's `WWW-Authenticate` with the reason.

The settings, one home for the Lua and this file (SETTINGS; docs/front-door.md):
SONIC_RAY_JWT_ISSUER, SONIC_RAY_JWT_AUDIENCES (comma-separated), SONIC_RAY_JWT_SCOPE (a scope
the `scope` claim must hold), SONIC_RAY_JWT_GROUP (a group `wlcg.groups` must hold),
SONIC_RAY_JWT_CLOCK_SKEW_S; the keys are a JWKS document written into the file, or fetched by
Envoy from the identity provider: SONIC_RAY_JWKS_URI (https), kept SONIC_RAY_JWKS_CACHE_S
seconds and fetched again before they expire, each fetch given SONIC_RAY_JWKS_TIMEOUT_S. Envoy
reaches the provider through its cluster `jwks` (JWKS_CLUSTER, gateway/envoy.yaml), which dials
the name `jwks-provider`: the site's ExternalName Service naming the provider's host, whose
certificate Envoy checks against that host (auto SNI and SAN validation).

A site turns them on in its overlay with jwt.env (the settings, merged into the `front-door`
ConfigMap of gateway/front-door.env) and, without SONIC_RAY_JWKS_URI, jwks.json (its identity
provider's keys): `make gateway-config` writes the overlay's jwt-authn.yaml from them
(SITE_FILES), which the overlay merges into the gateway's ConfigMap.

    python -m gateway.jwt [--check]    # gateway/jwt-authn.yaml (off), and every site's
"""

from __future__ import annotations

import json
import sys
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.routes import ROOT
from tools.env_file import env_file
from tools.generated import write_or_check_sites

FILTER_NAME = "sonic-ray.jwt"
JWT_AUTHN_FILE = "jwt-authn.yaml"
SHIPPED = ROOT / "gateway" / JWT_AUTHN_FILE
PROVIDER = "site"
# Where the verified claims and a failure's status land in the call's metadata (the filter's
# namespace), for client-checks.lua.
METADATA_NAMESPACE = "envoy.filters.http.jwt_authn"
PAYLOAD_KEY, FAILURE_KEY = "payload", "failure"
JWT_AUTHN_TYPE = "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication"
EXTENSION_TYPE = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
ISSUER_ENV, AUDIENCES_ENV = "SONIC_RAY_JWT_ISSUER", "SONIC_RAY_JWT_AUDIENCES"
SCOPE_ENV, GROUP_ENV = "SONIC_RAY_JWT_SCOPE", "SONIC_RAY_JWT_GROUP"
CLOCK_SKEW_ENV = "SONIC_RAY_JWT_CLOCK_SKEW_S"
JWKS_URI_ENV, JWKS_CACHE_ENV = "SONIC_RAY_JWKS_URI", "SONIC_RAY_JWKS_CACHE_S"
JWKS_TIMEOUT_ENV = "SONIC_RAY_JWKS_TIMEOUT_S"
SETTINGS = (ISSUER_ENV, AUDIENCES_ENV, SCOPE_ENV, GROUP_ENV, CLOCK_SKEW_ENV, JWKS_URI_ENV,
            JWKS_CACHE_ENV, JWKS_TIMEOUT_ENV)
DEFAULT_CLOCK_SKEW_S = 60
DEFAULT_JWKS_CACHE_S, DEFAULT_JWKS_TIMEOUT_S = 600, 5
# The gateway's cluster to the identity provider (gateway/envoy.yaml), and the name it dials:
# the site's ExternalName Service naming the provider's host (invariant jwks-provider-named).
JWKS_CLUSTER, JWKS_PROVIDER_SERVICE = "jwks", "jwks-provider"
# What every JWT holds, so what a credential must hold for jwt_authn to check it
# (filter_config's rule).
JWT_MARK = "."


def _seconds(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name, "").strip() or str(default)
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ValueError(f"{name}={raw!r}: whole seconds, {low} to {high}")
    return int(raw)


def check_jwks_uri(uri: str, name: str = JWKS_URI_ENV) -> str:
    """The identity provider's JWKS address, or ValueError naming the variable `name` that
    gave it: https, with a host and a path."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme != "https" or not parsed.hostname or not parsed.path:
        raise ValueError(f"{name}={uri!r}: an https:// address of the identity "
                         "provider's keys (its jwks_uri), host and path")
    return uri


@dataclass(frozen=True)
class JwtSettings:
    issuer: str
    audiences: tuple[str, ...]
    clock_skew_s: int = DEFAULT_CLOCK_SKEW_S
    # Keys fetched from the provider (None: a JWKS document in the file).
    jwks_uri: str | None = None
    jwks_cache_s: int = DEFAULT_JWKS_CACHE_S
    jwks_timeout_s: int = DEFAULT_JWKS_TIMEOUT_S

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JwtSettings | None:
        """The settings, or None with no issuer (the checks off); bad ones raise ValueError
        naming the variable."""
        issuer = env.get(ISSUER_ENV, "").strip()
        if not issuer:
            if env.get(AUDIENCES_ENV, "").strip():
                raise ValueError(f"{AUDIENCES_ENV} is set without {ISSUER_ENV}")
            return None
        audiences = tuple(a.strip() for a in env.get(AUDIENCES_ENV, "").split(",") if a.strip())
        if not audiences:
            raise ValueError(f"{AUDIENCES_ENV} is empty: a token for another service would pass")
        uri = env.get(JWKS_URI_ENV, "").strip()
        return cls(issuer, audiences, _seconds(env, CLOCK_SKEW_ENV, DEFAULT_CLOCK_SKEW_S, 0, 300),
                   check_jwks_uri(uri) if uri else None,
                   _seconds(env, JWKS_CACHE_ENV, DEFAULT_JWKS_CACHE_S, 1, 86400),
                   _seconds(env, JWKS_TIMEOUT_ENV, DEFAULT_JWKS_TIMEOUT_S, 1, 60))


def check_jwks(text: str) -> dict[str, Any]:
    """The JWKS document, or ValueError saying why it is none."""
    try:
        jwks = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error}") from None
    if not isinstance(jwks, dict) or not isinstance(jwks.get("keys"), list) or not jwks["keys"]:
        raise ValueError('not a JWKS: no {"keys": [...]} with a key')
    return jwks


def filter_config(settings: JwtSettings | None, jwks_text: str = "") -> dict[str, Any]:
    """jwt_authn's config: no provider (every call passes untouched) without settings."""
    if settings is None:
        return {"@type": JWT_AUTHN_TYPE}
    if settings.jwks_uri is None:
        check_jwks(jwks_text)
        keys: dict[str, Any] = {"local_jwks": {"inline_string": jwks_text}}
    else:
        keys = {"remote_jwks": {
            "http_uri": {"uri": settings.jwks_uri, "cluster": JWKS_CLUSTER,
                         "timeout": f"{settings.jwks_timeout_s}s"},
            "cache_duration": f"{settings.jwks_cache_s}s",
            # Fetched at start and again before the cache expires, not on a call's path; a
            # failed fetch is tried again every second, and calls meanwhile fail their check
            # saying so (client-checks.lua) rather than wait.
            "async_fetch": {"failed_refetch_duration": "1s"},
        }}
    return {
        "@type": JWT_AUTHN_TYPE,
        "providers": {PROVIDER: {
            "issuer": settings.issuer,
            "audiences": list(settings.audiences),
            **keys,
            "from_headers": [{"name": "authorization", "value_prefix": "Bearer "}],
            # The token goes no further than the gateway: Triton never sees it.
            "forward": False,
            "clock_skew_seconds": settings.clock_skew_s,
            "payload_in_metadata": PAYLOAD_KEY,
            "failed_status_in_metadata": FAILURE_KEY,
        }},
        # Only a credential with a dot can be a JWT (Header.Payload.Signature): one without
        # (a static token of components/token-auth, on the checked path's every call) skips
        # the filter rather than be parsed and failed; client-checks.lua says for it what
        # jwt_authn would have said (NOT_A_JWT there).
        "rules": [{"match": {"prefix": "/", "headers": [
            {"name": "authorization", "string_match": {"contains": JWT_MARK}}]},
            "requires": {"requires_any": {"requirements": [
                {"provider_name": PROVIDER}, {"allow_missing_or_failed": {}}]}}}],
    }


def document(settings: JwtSettings | None, jwks_text: str = "") -> dict[str, Any]:
    """The discovery response Envoy reads from JWT_AUTHN_FILE."""
    return {"resources": [{"@type": EXTENSION_TYPE, "name": FILTER_NAME,
                           "typed_config": filter_config(settings, jwks_text)}]}


def write(path: Path, settings: JwtSettings | None, jwks_text: str = "") -> None:
    """Replaced by a rename, the move Envoy's watch on the folder reloads on."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(json.dumps(document(settings, jwks_text)))
    staged.replace(path)


def render_shipped() -> str:
    return ("# The gateway's token check, off: jwt_authn with no provider lets every call pass\n"
            "# (gateway/jwt.py writes it with `make gateway-config`; a site's own replaces it).\n"
            + yaml.safe_dump(document(None), sort_keys=False))


# A site's sources (in its overlay) and what is written from them beside them.
SITE_FILES = ("jwt.env", "jwks.json")


def render_site(folder: Path) -> str:
    env_path, jwks_path = (folder / name for name in SITE_FILES)
    try:
        settings = JwtSettings.from_env(env_file(env_path))
        if settings is None:
            raise ValueError(f"no {ISSUER_ENV}")
        if settings.jwks_uri is not None and jwks_path.exists():
            raise ValueError(f"{JWKS_URI_ENV} and {SITE_FILES[1]}: the keys come from one of "
                             "them; remove the other")
        config = document(settings, jwks_path.read_text() if settings.jwks_uri is None
                          else "")
    except (OSError, ValueError) as error:
        raise SystemExit(f"{folder}: {error}") from None
    sources = (f"{SITE_FILES[0]} and {SITE_FILES[1]} here; edit those" if settings.jwks_uri is None
               else f"{SITE_FILES[0]} here (the keys from {JWKS_URI_ENV}); edit that")
    return (f"# This site's token checks: written by `make gateway-config` (gateway/jwt.py) from\n"
            f"# {sources}, not this file. The keys'\n"
            "# numbers are long words.\n# yamllint disable rule:line-length\n"
            + yaml.safe_dump(config, sort_keys=False, width=100))


def main(argv: list[str] | None = None) -> int:
    return write_or_check_sites(SHIPPED, render_shipped, SITE_FILES[0], JWT_AUTHN_FILE,
                                render_site, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
