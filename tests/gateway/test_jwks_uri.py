"""Token checks with keys Envoy fetches from the identity provider (`make local JWKS_URI=...
JWKS_CA_FILE=...`, SONIC_RAY_JWKS_URI in a site; docs/front-door.md), on a gateway of its own
(tests/support/lone_gateway.py: the shipped config for these settings, a stand-in Triton): an
HTTPS JWKS server of the test's own (a CA it made, a certificate for localhost), down when the
gateway starts. While it is unreachable a JWT is refused at once saying the keys could not be
fetched, and a static token still passes; once it answers, tokens signed by its key pass; when
the provider rotates its key, the new key's tokens pass within the cache time and the old
key's are refused."""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from local_stack.polling import until
from local_stack.ports import free_ports
from tests.support.echo import infer_with_token
from tests.support.lone_gateway import lone_gateway
from tools import certificates

ISSUER = "https://idp.sonic-ray.test"
AUDIENCE = "sonic-ray"
STATIC = "tok-static-9c2e"
# How long the gateway keeps the keys (SONIC_RAY_JWKS_CACHE_S): short, so that a rotation
# shows within the test.
CACHE_S = 5
# A refusal is the gateway's answer, not a call held until the fetch gives up.
AT_ONCE_S = 1.0


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _jwks(kid: str, key: rsa.RSAPrivateKey) -> bytes:
    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update(kid=kid, alg="RS256", use="sig")
    return json.dumps({"keys": [jwk]}).encode()


@dataclass
class Provider:
    """The identity provider's JWKS endpoint over HTTPS, started and stopped by the test."""

    port: int
    files: certificates.Files
    document: bytes = b""
    fetches: int = 0
    _server: ThreadingHTTPServer | None = field(default=None, repr=False)

    def start(self) -> None:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                provider.fetches += 1
                self.send_response(200 if self.path == "/keys" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(provider.document)))
                self.end_headers()
                self.wfile.write(provider.document)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(self.files.server_cert), str(self.files.server_key))
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


@dataclass
class RemoteKeys:
    url: str
    provider: Provider
    keys: dict[str, rsa.RSAPrivateKey]


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteKeys]:
    folder = tmp_path_factory.mktemp("jwks-uri")
    files, _ = certificates.write_local(folder / "tls")
    (port,) = free_ports(1)
    provider = Provider(port, files)
    keys = {"k1": _key(), "k2": _key()}
    provider.document = _jwks("k1", keys["k1"])
    tokens_file = folder / "tokens"
    tokens_file.write_text(f"{STATIC}\n")
    try:
        with lone_gateway(folder / "gateway", {
            "JWKS_URI": f"https://localhost:{port}/keys", "JWKS_CA_FILE": str(files.ca),
            "JWT_ISSUER": ISSUER, "JWT_AUDIENCE": AUDIENCE,
            "SONIC_RAY_JWKS_CACHE_S": str(CACHE_S),
            "SONIC_RAY_AUTH_TOKENS_FILE": str(tokens_file),
        }, ready_headers={"authorization": f"Bearer {STATIC}"}) as running:
            yield RemoteKeys(running.grpc, provider, keys)
    finally:
        provider.stop()


def _token(remote: RemoteKeys, kid: str) -> str:
    now = int(time.time())
    return jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "iat": now,
                       "nbf": now - 10, "exp": now + 600}, remote.keys[kid], algorithm="RS256",
                      headers={"kid": kid})


def _timed(url: str, token: str) -> tuple[str, float]:
    started = time.monotonic()
    outcome = infer_with_token(url, token)
    return outcome, time.monotonic() - started


def test_keys_unreachable_refuse_jwts_at_once_saying_so_then_fetched_they_pass(
        remote: RemoteKeys) -> None:
    outcome, took = _timed(remote.url, _token(remote, "k1"))
    assert outcome.startswith("StatusCode.UNAUTHENTICATED") and "Jwks" in outcome, outcome
    assert took < AT_ONCE_S, f"a refusal took {took:.2f}s"
    assert infer_with_token(remote.url, STATIC) == "OK", "a static token needs no JWKS"
    remote.provider.start()
    until("a token signed by the provider's key to pass once it answers",
          lambda: (o := infer_with_token(remote.url, _token(remote, "k1"))) == "OK" or o,
          30, every_s=0.5)
    assert remote.provider.fetches >= 1


def test_a_rotated_key_is_used_within_the_cache_time(remote: RemoteKeys) -> None:
    assert infer_with_token(remote.url, _token(remote, "k1")) == "OK"
    remote.provider.document = _jwks("k2", remote.keys["k2"])
    rotated = time.monotonic()
    until("the new key's tokens to pass",
          lambda: (o := infer_with_token(remote.url, _token(remote, "k2"))) == "OK" or o,
          CACHE_S + 20, every_s=0.5)
    print(f"the new key used {time.monotonic() - rotated:.1f}s after the rotation "
          f"(cache {CACHE_S}s)")
    outcome = infer_with_token(remote.url, _token(remote, "k1"))
    assert outcome.startswith("StatusCode.UNAUTHENTICATED"), outcome


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
