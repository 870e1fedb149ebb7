"""One HTTP request as a client sends it, and the answer as it arrives: status, headers (names
in lower case) and the body's bytes, compressed or not. No retries, no redirects."""

from __future__ import annotations

import http.client

Answer = tuple[int, dict[str, str], bytes]


def request(address: str, method: str, path: str, body: bytes = b"",
            headers: dict[str, str] | None = None, timeout: float = 120) -> Answer:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request(method, path, body=body or None, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()
