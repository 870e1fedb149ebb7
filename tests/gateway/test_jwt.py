"""OIDC / WLCG tokens at the gateway, on a gateway of its own (tests/support/lone_gateway.py:
the shipped config as `make local JWKS_FILE=... JWT_ISSUER=... JWT_AUDIENCE=...` writes it,
with a required scope and a static token beside, in front of a stand-in Triton that records
the headers reaching it): tokens minted here (PyJWT) with keys of our own, real tritonclient
clients. A JWT's check is the gateway's alone (the Serve path has none), so no stack is
started for it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import pytest
import tritonclient.grpc as tc
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from local_stack.gateway_config import jwt_folder
from local_stack.polling import until
from local_stack.stack import JwksFollower
from tests.support.callers import lines_since
from tests.support.echo import echo_inputs, infer_with_token
from tests.support.lone_gateway import CHECKS, LoneGateway, lone_gateway
from tests.support.raw_http import request

ISSUER = "https://idp.sonic-ray.test"
AUDIENCE = "sonic-ray"
SCOPE = "compute.read"
STATIC = "tok-static-4b1d"
# jwt_authn's counts of the tokens it looked at: each is looked up in its cache of verified
# ones first (its count of calls, `allowed`, counts the calls no rule gave it too).
LOOKED_AT = ("jwt_authn.jwt_cache_hit", "jwt_authn.jwt_cache_miss")


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _jwks(*keys: tuple[str, rsa.RSAPrivateKey]) -> str:
    found = []
    for kid, key in keys:
        jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
        jwk.update(kid=kid, alg="RS256", use="sig")
        found.append(jwk)
    return json.dumps({"keys": found})


@dataclass
class JwtStack:
    url: str
    http_url: str
    jwks_file: Path
    keys: dict[str, rsa.RSAPrivateKey]
    workdir: Path
    access_log: Path
    lone: LoneGateway
    follower: JwksFollower


@pytest.fixture(scope="module")
def jwt_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JwtStack]:
    folder = tmp_path_factory.mktemp("jwt")
    keys = {"k1": _key(), "k2": _key()}
    jwks_file = folder / "jwks.json"
    jwks_file.write_text(_jwks(("k1", keys["k1"])))
    tokens_file = folder / "tokens"
    tokens_file.write_text(f"{STATIC}\n")
    gateway = folder / "gateway"
    gateway.mkdir()
    with lone_gateway(gateway, {
        "JWKS_FILE": str(jwks_file), "JWT_ISSUER": ISSUER, "JWT_AUDIENCE": AUDIENCE,
        "SONIC_RAY_JWT_SCOPE": SCOPE, "SONIC_RAY_AUTH_TOKENS_FILE": str(tokens_file),
        "SONIC_RAY_TENANT_CLAIM": "wlcg.groups",
    }, ready_headers={"authorization": f"Bearer {STATIC}"}) as lone:
        # What `make local` runs twice a second beside Envoy: the token checks rewritten
        # when JWKS_FILE changes (local_stack/stack.py).
        follower = JwksFollower(lone.settings, jwt_folder(gateway / "endpoints.json"))
        follower.follow()
        yield JwtStack(lone.grpc, f"localhost:{lone.settings.http_port}", jwks_file, keys,
                       gateway, lone.access_log, lone, follower)


def _token(stack: JwtStack, kid: str = "k1", key: rsa.RSAPrivateKey | None = None,
           **changes: Any) -> str:
    now = int(time.time())
    claims: dict[str, Any] = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "iat": now,
                              "nbf": now - 10, "exp": now + 600, "scope": f"openid {SCOPE}"}
    claims.update(changes)
    claims = {k: v for k, v in claims.items() if v is not None}
    return jwt.encode(claims, key or stack.keys[kid], algorithm="RS256", headers={"kid": kid})


def _unsigned(claims: dict[str, Any]) -> str:
    return jwt.encode(claims, None, algorithm="none")  # type: ignore[arg-type]


def test_a_valid_token_passes_and_never_reaches_triton(jwt_stack: JwtStack) -> None:
    token = _token(jwt_stack)
    client = tc.InferenceServerClient(jwt_stack.url)
    try:
        client.infer("echo_headers", echo_inputs(), client_timeout=30,
                     headers={"authorization": f"Bearer {token}", "x-sonic-job": "jwt"})
    finally:
        client.close()
    seen_by_triton = jwt_stack.lone.seen.headers_of("/ModelInfer")[-1]
    assert seen_by_triton.get("x-sonic-job") == "jwt", seen_by_triton
    assert "authorization" not in seen_by_triton
    assert not any(token in value for value in seen_by_triton.values())


def test_a_tokens_caller_is_its_subject_and_its_tenant_the_claim(jwt_stack: JwtStack) -> None:
    """SONIC_RAY_TENANT_CLAIM=wlcg.groups: the tenant is the first group; without the claim, a
    JWT's caller falls to "other"."""
    since = time.time()
    groups: dict[str, Any] = {"wlcg.groups": ["/cms", "/cms/production"]}
    grouped = _token(jwt_stack, sub="bob", **groups)
    assert infer_with_token(jwt_stack.url, grouped) == "OK"
    assert infer_with_token(jwt_stack.url, _token(jwt_stack)) == "OK"
    lines = lines_since(jwt_stack.access_log, since, 2)
    assert [(line["identity"], line["tenant"]) for line in lines] == [
        ("jwt:bob", "/cms"), ("jwt:alice", "other")], lines


def test_a_static_token_still_suffices_beside_jwts(jwt_stack: JwtStack) -> None:
    assert infer_with_token(jwt_stack.url, STATIC) == "OK"


def test_static_tokens_are_checked_by_envoys_own_filters_and_jwts_by_the_lua(
        jwt_stack: JwtStack) -> None:
    """Beside a JWT issuer, a call with a static token runs no Lua (gateway/callers.sh's
    matcher names it) nor jwt_authn (a credential without a dot cannot be a JWT: the rule of
    gateway/jwt.py); a JWT, or a credential that is neither, goes to the client checks' Lua
    inside the callers filter, once, and a JWT to jwt_authn."""
    lone = jwt_stack.lone
    assert "calls with a static token are checked and named by Envoy's own filters" in (
        lone.log.read_text())
    before, jwt_before = lone.executions(), sum(lone.counted(*LOOKED_AT).values())
    assert infer_with_token(jwt_stack.url, STATIC) == "OK"
    static, jwt_static = lone.executions(), sum(lone.counted(*LOOKED_AT).values())
    assert static[CHECKS] == before[CHECKS], (before, static)
    assert jwt_static == jwt_before, "jwt_authn looked at a static token"
    assert infer_with_token(jwt_stack.url, _token(jwt_stack)) == "OK"
    assert sum(lone.counted(*LOOKED_AT).values()) == jwt_static + 1
    assert infer_with_token(jwt_stack.url, "neither").startswith("StatusCode.UNAUTHENTICATED")
    after = lone.executions()
    assert after[CHECKS] == static[CHECKS] + 2, (static, after)


@pytest.mark.parametrize(("case", "says"), [
    ("expired", "expired"),
    ("not yet valid", "not yet valid"),
    ("wrong issuer", "issuer"),
    ("wrong audience", "audience"),
    ("bad signature", "verification"),
    ("alg none", "invalid token"),
    ("not a JWT", "invalid token"),
])
def test_a_token_that_fails_a_check_is_unauthenticated_saying_why(
        jwt_stack: JwtStack, case: str, says: str) -> None:
    now = int(time.time())
    makers: dict[str, Callable[[], str]] = {
        "expired": lambda: _token(jwt_stack, exp=now - 300, nbf=now - 900, iat=now - 900),
        "not yet valid": lambda: _token(jwt_stack, nbf=now + 600),
        "wrong issuer": lambda: _token(jwt_stack, iss="https://another.idp"),
        "wrong audience": lambda: _token(jwt_stack, aud="another-service"),
        "bad signature": lambda: _token(jwt_stack, key=_key()),
        "alg none": lambda: _unsigned({"iss": ISSUER, "aud": AUDIENCE, "exp": now + 600,
                                       "scope": SCOPE}),
        "not a JWT": lambda: "tok-not-known",
    }
    token = makers[case]()
    outcome = infer_with_token(jwt_stack.url, token)
    assert outcome.startswith("StatusCode.UNAUTHENTICATED"), (case, outcome)
    assert says.lower() in outcome.lower(), (case, outcome)


def test_no_token_is_unauthenticated(jwt_stack: JwtStack) -> None:
    outcome = infer_with_token(jwt_stack.url, None)
    assert outcome.startswith("StatusCode.UNAUTHENTICATED") and "Bearer" in outcome, outcome


def test_a_token_without_the_required_scope_is_refused_naming_it(jwt_stack: JwtStack) -> None:
    outcome = infer_with_token(jwt_stack.url, _token(jwt_stack, scope="openid storage.read"))
    assert outcome.startswith("StatusCode.PERMISSION_DENIED") and SCOPE in outcome, outcome


def test_http_refusals_carry_rfc_6750_challenges(jwt_stack: JwtStack) -> None:
    now = int(time.time())
    expired = _token(jwt_stack, exp=now - 300, nbf=now - 900, iat=now - 900)
    status, headers, body = request(jwt_stack.http_url, "GET", "/v2/health/ready",
                                    headers={"Authorization": f"Bearer {expired}"})
    assert status == 401, (status, body)
    challenge = headers.get("www-authenticate", "")
    assert challenge.startswith('Bearer error="invalid_token", error_description="'), challenge
    assert "expired" in json.loads(body)["error"].lower()
    status, headers, body = request(
        jwt_stack.http_url, "GET", "/v2/health/ready",
        headers={"Authorization": f"Bearer {_token(jwt_stack, scope='openid')}"})
    assert status == 403 and headers.get("www-authenticate") == (
        'Bearer error="insufficient_scope"'), (status, headers, body)
    status, _, body = request(jwt_stack.http_url, "GET", "/v2/health/ready",
                              headers={"Authorization": f"Bearer {_token(jwt_stack)}"})
    assert status == 200, (status, body)


def test_no_token_is_in_any_log(jwt_stack: JwtStack) -> None:
    tokens = [_token(jwt_stack), STATIC]
    for token in tokens:
        assert infer_with_token(jwt_stack.url, token) == "OK"
    for log in jwt_stack.workdir.glob("*.log"):
        text = log.read_text(errors="replace")
        leaked = [t[:12] for t in tokens if t in text]
        assert not leaked, f"{log} holds a token: {leaked}"


def test_a_rotated_key_set_takes_effect_without_a_restart(jwt_stack: JwtStack) -> None:
    """The identity provider drops k1 and signs with k2: the JWKS file rewritten, as the
    provider publishes it; tokens of k2 pass, tokens of k1 stop passing."""
    assert infer_with_token(jwt_stack.url, _token(jwt_stack, kid="k2")).startswith(
        "StatusCode.UNAUTHENTICATED")
    staged = jwt_stack.jwks_file.with_name("jwks.new")
    staged.write_text(_jwks(("k2", jwt_stack.keys["k2"])))
    staged.replace(jwt_stack.jwks_file)
    jwt_stack.follower.follow()
    until("tokens of the new key to pass",
          lambda: infer_with_token(jwt_stack.url, _token(jwt_stack, kid="k2")) == "OK" or "refused", 30)
    old = infer_with_token(jwt_stack.url, _token(jwt_stack, kid="k1"))
    assert old.startswith("StatusCode.UNAUTHENTICATED"), old


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
