"""The client listeners' transport as components/tls and components/mtls pick it: one Envoy with
the shipped config per mode, started as the gateway's container starts it (gateway/start.sh
reading SONIC_RAY_TLS), before the stand-in Triton. In clear no TLS handshake completes; with
TLS a client in clear gets no answer and a TLS client's call passes; with client certificates a
TLS client without one is refused during the handshake. An unknown mode stops the start."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from gateway import local as gateway
from gateway import tls
from tests.support.lone_gateway import LoneGateway, lone_gateway
from tools.certificates import Files

pytestmark = pytest.mark.processes

MODES = {"clear": {}, "server": {"TLS": "1"}, "mutual": {"TLS": "1", "MTLS": "1"}}


@pytest.fixture(scope="module", params=list(MODES))
def mode_gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 ) -> Iterator[tuple[str, LoneGateway]]:
    folder = tmp_path_factory.mktemp(f"tls-{request.param}")
    with lone_gateway(folder, MODES[request.param]) as lone:
        yield request.param, lone


def _handshake(port: int, files: Files | None, client_certificate: bool) -> str:
    """"done", or how a TLS handshake with the listener on `port` ended."""
    context = ssl.create_default_context(cafile=str(files.ca) if files else None)
    if files is None:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    elif client_certificate:
        context.load_cert_chain(str(files.client_cert), str(files.client_key))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("localhost", port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost") as wrapped:
                # TLS 1.3 sends the server's verdict on a client certificate after the
                # handshake: a read shows it.
                wrapped.settimeout(2)
                with contextlib.suppress(TimeoutError):
                    wrapped.recv(1)
                return f"done ({wrapped.version()}, {wrapped.selected_alpn_protocol()})"
        except (ssl.SSLError, ConnectionError, OSError) as error:
            return f"refused: {error}"


def _plain_call(lone: LoneGateway) -> str:
    client = tc.InferenceServerClient(lone.grpc)
    try:
        return "OK" if client.is_server_ready(client_timeout=5) else "not ready"
    except InferenceServerException as error:
        return f"{error.status()}: {error.message()}"
    finally:
        client.close()


def test_each_mode_serves_its_chain_and_no_other(mode_gateway: tuple[str, LoneGateway]) -> None:
    mode, lone = mode_gateway
    plain = _plain_call(lone)
    for port in (lone.settings.grpc_port, lone.settings.http_port):
        handshake = _handshake(port, lone.files, client_certificate=True)
        if mode == "clear":
            assert lone.files is None
            assert handshake.startswith("refused"), (port, handshake)
        else:
            assert handshake.startswith("done (TLSv1."), (port, handshake)
    if mode == "clear":
        assert plain == "OK"
        return
    assert plain.startswith("StatusCode.UNAVAILABLE"), plain
    client = lone.grpc_client()
    try:
        assert client.is_server_ready(client_timeout=5)
    finally:
        client.close()
    assert lone.seen.headers_of("/ServerReady"), "the TLS client's call never reached Triton"


def test_only_mutual_tls_refuses_a_client_without_a_certificate(
        mode_gateway: tuple[str, LoneGateway]) -> None:
    mode, lone = mode_gateway
    if mode == "clear":
        pytest.skip("no TLS in clear")
    client = lone.grpc_client(client_certificate=False)
    try:
        outcome = "OK" if client.is_server_ready(client_timeout=5) else "not ready"
    except InferenceServerException as error:
        outcome = f"{error.status()}: {error.message()}"
    finally:
        client.close()
    if mode == "server":
        assert outcome == "OK"
    else:
        assert outcome.startswith("StatusCode.UNAVAILABLE"), outcome


def test_an_unknown_mode_stops_the_start_naming_it(tmp_path: Path) -> None:
    done = subprocess.run(gateway.started(["--version"]), capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin", tls.TLS_ENV: "on"})
    assert done.returncode == 2, done
    assert "SONIC_RAY_TLS=on is not server, mutual or empty" in done.stderr
