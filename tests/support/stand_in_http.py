"""A stand-in HTTP server for unit tests of code that reads another process's HTTP answers
(Envoy's admin interface or its stats): GET answers 200 with the body a test gives."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serving(body: Callable[[str, str], bytes],
            addresses: tuple[str, ...] = ("127.0.0.1",)) -> Iterator[int]:
    """Serves `body(address, path)` on one port at each loopback address (as the pods of a
    headless Service answer at one port); yields the port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            address = self.server.server_address
            data = body(str(address[0]) if isinstance(address, tuple) else str(address), self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    first = ThreadingHTTPServer((addresses[0], 0), Handler)
    port = first.server_address[1]
    servers = [first, *(ThreadingHTTPServer((a, port), Handler) for a in addresses[1:])]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield port
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
