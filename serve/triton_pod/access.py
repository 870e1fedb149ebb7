"""Who may call through the forwarder, and the key that opens Triton's restricted RPCs.

Bearer tokens (optional, components/token-auth): when SONIC_RAY_AUTH_TOKENS_FILE names a file,
every call must carry `authorization: Bearer <token>` with one of its tokens (one a line, as
`<token>` or `<name> <token>`; the gateway records the name as the caller, docs/front-door.md);
the file is re-read when it changes, so a rotated Secret takes effect without a restart. Tokens
are never logged and never passed on to Triton.

Triton's restricted protocols (defence in depth): Triton refuses repository, shared-memory,
trace and logging RPCs unless the `sonic-ray-admin` key header carries SONIC_RAY_ADMIN_KEY (the
site's `triton-admin-key` Secret on the cluster, a random key under `make local`); only the
forwarder and the gateway know it, and each sends it only with the calls of those groups that
it passes on: the read-only ones
(RepositoryIndex, the shared-memory status calls) and the admin RPCs an operator allowed.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("ray.serve")

TOKENS_FILE_ENV = "SONIC_RAY_AUTH_TOKENS_FILE"
ADMIN_KEY_ENV = "SONIC_RAY_ADMIN_KEY"
# The key's name in Triton's --grpc-restricted-protocol and --http-restricted-api flags; Triton
# expects it in a gRPC header with this prefix.
ADMIN_KEY_NAME = "sonic-ray-admin"
ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_KEY_NAME}"
# ...and in an HTTP header named like the key itself.
HTTP_ADMIN_HEADER = ADMIN_KEY_NAME
AUTHORIZATION = "authorization"
# What a refused client reads (the gateway's Lua filter says the same).
UNAUTHENTICATED = "missing or invalid bearer token (send `authorization: Bearer <token>`)"
_RECHECK_S = 5.0


def parse_token_line(line: str, number: int, path: Path) -> tuple[str, str]:
    """A tokens file's line as (name, token): `<token>` (named "unnamed") or `<name> <token>`,
    as gateway/client-checks.lua reads it."""
    fields = line.split()
    if len(fields) == 1:
        return "unnamed", fields[0]
    if len(fields) == 2:
        return fields[0], fields[1]
    raise RuntimeError(f"{TOKENS_FILE_ENV}={path} line {number}: {len(fields)} fields; a line "
                       "is `<token>` or `<name> <token>`")


class TokenCheck:
    """Bearer-token check against a mounted file; `None` from `from_env` when auth is off."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._tokens: tuple[bytes, ...] = ()
        self._mtime = -1.0
        self._checked = 0.0
        self._failing = False
        # A replica that cannot read its tokens at start refuses to start: loud, not open.
        self._tokens, self._mtime = self._read()

    @classmethod
    def from_env(cls) -> TokenCheck | None:
        path = os.environ.get(TOKENS_FILE_ENV, "")
        return cls(Path(path)) if path else None

    def _read(self) -> tuple[tuple[bytes, ...], float]:
        try:
            mtime = self._path.stat().st_mtime
            lines = self._path.read_text().splitlines()
        except OSError as error:
            raise RuntimeError(
                f"{TOKENS_FILE_ENV}={self._path} cannot be read ({error.strerror}): "
                "token authentication is on, so no call could be let in"
            ) from None
        tokens = tuple(parse_token_line(line, number, self._path)[1].encode()
                       for number, line in enumerate(lines, 1)
                       if line.strip() and not line.strip().startswith("#"))
        if not tokens:
            raise RuntimeError(f"{TOKENS_FILE_ENV}={self._path} holds no token")
        return tokens, mtime

    def _reload(self) -> None:
        """Takes a changed file's tokens; a broken update keeps the last good ones (a Secret
        emptied by mistake must not lock every client out) and is logged once."""
        try:
            if self._path.stat().st_mtime == self._mtime:
                return
            self._tokens, self._mtime = self._read()
        except (OSError, RuntimeError) as error:
            if not self._failing:
                logger.error("keeping the last good client tokens: %s", error)
            self._failing = True
            return
        if self._failing:
            logger.warning("client tokens readable again from %s", self._path)
        self._failing = False

    def credentials(self) -> tuple[tuple[str, str], ...]:
        """Metadata that passes this check: for the local stack's own readiness call."""
        return ((AUTHORIZATION, "Bearer " + self._tokens[0].decode()),)

    def allows(self, metadata: list[tuple[str, object]]) -> bool:
        now = time.monotonic()
        if now - self._checked > _RECHECK_S:
            self._checked = now
            self._reload()
        presented = b""
        for key, value in metadata:
            if key == AUTHORIZATION and isinstance(value, str):
                scheme, _, credential = value.partition(" ")
                if scheme.lower() == "bearer":
                    presented = credential.strip().encode()
        if not presented:
            return False
        # Compare with every token, in constant time, so that timing tells nothing.
        matched = False
        for known in self._tokens:
            matched |= hmac.compare_digest(presented, known)
        return matched


def admin_key() -> str:
    return os.environ.get(ADMIN_KEY_ENV, "")
