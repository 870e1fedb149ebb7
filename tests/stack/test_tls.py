"""The front door with TLS and client certificates (components/tls, components/mtls) end to
end: a stack of its own started as `make local TLS=1 MTLS=1` with a subject allow-list, the
files its ready lines name, Triton's HTTP and gRPC example clients unchanged with their TLS
flags, and tritonclient's gRPC client with the flags Triton's gRPC example passes on (ssl,
root_certificates, private_key, certificate_chain)."""

from __future__ import annotations

import datetime
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
from cryptography import x509
from tritonclient.utils import InferenceServerException

from local_stack.harness import TLS_LINE, processes_left_behind, running_stack
from local_stack.polling import until
from local_stack.triton_inputs import tensor
from tests.support.callers import lines_since
from tools import certificates

EXAMPLES = Path(__file__).resolve().parent.parent / "triton_examples"
# The allow-list the stack runs with: its own client's subject, and a pattern.
ALLOWED = f"{certificates.CLIENT_SUBJECT};CN=robot-*,O=sonic-ray"


@dataclass
class TlsStack:
    grpc_port: int
    http_port: int
    files: certificates.Files
    folder: Path
    issuer: certificates.Issuer
    access_log: Path


@pytest.fixture(scope="module")
def tls_stack() -> Iterator[TlsStack]:
    with running_stack({"TLS": "1", "MTLS": "1", "SONIC_RAY_CLIENT_SUBJECTS": ALLOWED,
                        "SONIC_RAY_TENANTS": "robots=cert:CN=robot-*"}) as running:
        found = running.process.wait_for_line(TLS_LINE, timeout_s=5)
        ca, cert, key = (Path(found.group(i)) for i in (1, 2, 3))
        folder = cert.parent
        files = certificates.Files(ca=ca, client_cert=cert, client_key=key,
                                   server_cert=folder / "server" / "tls.crt",
                                   server_key=folder / "server" / "tls.key")
        access_log = Path(running.process.wait_for_line(
            r"access log \(a JSON line per call\): (\S+)", 1).group(1))
        yield TlsStack(int(running.ports["GRPC_PORT"]), int(running.ports["HTTP_PORT"]),
                       files, folder, certificates.load_issuer(folder), access_log)
    assert not processes_left_behind(running.process)


def _client(stack: TlsStack, cert: Path | None, key: Path | None,
            ca: Path | None = None) -> tc.InferenceServerClient:
    return tc.InferenceServerClient(
        f"localhost:{stack.grpc_port}", ssl=True,
        root_certificates=str(ca or stack.files.ca),
        private_key=str(key) if key else None, certificate_chain=str(cert) if cert else None)


def _simple_inputs() -> list[tc.InferInput]:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    return [tensor("INPUT0", data, "INT32"), tensor("INPUT1", np.ones_like(data), "INT32")]


def _minted(stack: TlsStack, tmp_path: Path, common_name: str,
            issuer: certificates.Issuer | None = None,
            valid_from: datetime.timedelta = datetime.timedelta(minutes=-5),
            valid_for: datetime.timedelta = datetime.timedelta(days=1)) -> tuple[Path, Path]:
    certificate, key = certificates.issue(issuer or stack.issuer, common_name, server=False,
                                          valid_from=valid_from, valid_for=valid_for)
    paths = tmp_path / f"{common_name}.crt", tmp_path / f"{common_name}.key"
    certificates.write_pair(certificate, key, *paths)
    return paths


def _refusal(call: object) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        call()  # type: ignore[operator]
    except InferenceServerException as error:
        return str(error.status()), str(error.message()), time.monotonic() - started
    return "OK", "", time.monotonic() - started


def _example_flags(stack: TlsStack, client: str) -> list[str]:
    """Each example client's own TLS flags, with the files the ready line names."""
    f = stack.files
    if client == "http":
        return ["-u", f"localhost:{stack.http_port}", "--ssl", "--ca-certs", str(f.ca),
                "--cert-file", str(f.client_cert), "--key-file", str(f.client_key)]
    return ["-u", f"localhost:{stack.grpc_port}", "--ssl", "--root-certificates", str(f.ca),
            "--private-key", str(f.client_key), "--certificate-chain", str(f.client_cert)]


@pytest.mark.parametrize("client", ["http", "grpc"])
def test_tritons_example_client_passes_with_its_tls_flags(tls_stack: TlsStack,
                                                          client: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"simple_{client}_infer_client.py"),
         *_example_flags(tls_stack, client)],
        capture_output=True, text=True, timeout=120, check=False)
    # The gRPC example exits 0 even when it cannot create its channel: its last line says it
    # passed. The HTTP one exits 1 on any failure.
    passed = {"grpc": "PASS: infer"}.get(client, "")
    assert done.returncode == 0 and passed in done.stdout, (
        f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def test_grpc_with_the_printed_files_infers(tls_stack: TlsStack) -> None:
    client = _client(tls_stack, tls_stack.files.client_cert, tls_stack.files.client_key)
    assert client.is_server_ready()
    result = client.infer("simple", _simple_inputs())
    assert (result.as_numpy("OUTPUT0") == np.arange(16).reshape(1, 16) + 1).all()
    assert "simple" in {m.name for m in client.get_model_repository_index().models}


def test_a_plaintext_client_on_the_tls_ports_fails_fast(tls_stack: TlsStack) -> None:
    plain = tc.InferenceServerClient(f"localhost:{tls_stack.grpc_port}")
    status, message, took = _refusal(lambda: plain.is_server_ready(client_timeout=30))
    assert status == "StatusCode.UNAVAILABLE" and took < 5, (status, message, took)
    # HTTP/1.1 in clear: the handshake's first read fails and the connection closes.
    with socket.create_connection(("127.0.0.1", tls_stack.http_port), timeout=10) as raw:
        raw.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        answer = raw.recv(4096)
        assert not answer.startswith(b"HTTP/1.1 200"), answer
        assert time.monotonic() - started < 5


def test_without_a_client_certificate_the_handshake_is_refused(tls_stack: TlsStack) -> None:
    status, message, _ = _refusal(lambda: _client(tls_stack, None, None).is_server_ready(
        client_timeout=30))
    assert status == "StatusCode.UNAVAILABLE", (status, message)
    context = ssl.create_default_context(cafile=str(tls_stack.files.ca))
    # The alert, or the close after it when the client is still writing.
    with pytest.raises(ssl.SSLError, match=r"CERTIFICATE_REQUIRED|EOF"), socket.create_connection(
            ("localhost", tls_stack.http_port), timeout=10) as raw, context.wrap_socket(
            raw, server_hostname="localhost") as wrapped:
        wrapped.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        wrapped.recv(100)


def test_another_cas_certificate_is_refused(tls_stack: TlsStack, tmp_path: Path) -> None:
    cert, key = _minted(tls_stack, tmp_path, "local-client",
                        issuer=certificates.certificate_authority("not the site's CA"))
    status, message, _ = _refusal(lambda: _client(tls_stack, cert, key).is_server_ready(
        client_timeout=30))
    assert status == "StatusCode.UNAVAILABLE", (status, message)


def test_an_expired_certificate_is_refused(tls_stack: TlsStack, tmp_path: Path) -> None:
    cert, key = _minted(tls_stack, tmp_path, "local-client",
                        valid_from=datetime.timedelta(days=-2), valid_for=datetime.timedelta(days=1))
    status, message, _ = _refusal(lambda: _client(tls_stack, cert, key).is_server_ready(
        client_timeout=30))
    assert status == "StatusCode.UNAVAILABLE", (status, message)


def test_a_subject_not_allowed_is_refused_by_name_and_a_pattern_passes(
        tls_stack: TlsStack, tmp_path: Path) -> None:
    """...and each is recorded as its subject: the allowed robot under the tenant its pattern
    in SONIC_RAY_TENANTS names, the refused one under "other"."""
    since = time.time()
    cert, key = _minted(tls_stack, tmp_path, "mallory")
    client = _client(tls_stack, cert, key)
    status, message, _ = _refusal(lambda: client.infer("simple", _simple_inputs()))
    assert status == "StatusCode.PERMISSION_DENIED", (status, message)
    assert "CN=mallory,O=sonic-ray" in message and "not allowed" in message, message
    cert, key = _minted(tls_stack, tmp_path, "robot-42")
    assert _client(tls_stack, cert, key).infer("simple", _simple_inputs()).as_numpy("OUTPUT0") \
        is not None
    lines = lines_since(tls_stack.access_log, since, 2)
    assert [(line["identity"], line["tenant"], line["grpc_status"]) for line in lines] == [
        ("cert:CN=mallory,O=sonic-ray", "other", "PermissionDenied"),
        ("cert:CN=robot-42,O=sonic-ray", "robots", "OK")], lines


def _served_serial(stack: TlsStack) -> int:
    context = ssl.create_default_context(cafile=str(stack.files.ca))
    context.load_cert_chain(str(stack.files.client_cert), str(stack.files.client_key))
    with socket.create_connection(("localhost", stack.grpc_port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as wrapped:
        served = wrapped.getpeercert(True)
        assert served is not None, "the gateway served no certificate"
        return x509.load_der_x509_certificate(served).serial_number


def test_a_renewed_certificate_is_served_without_a_call_failing(tls_stack: TlsStack) -> None:
    """The Secret renewed as the kubelet swaps a mounted Secret's files, under load on
    connections opened before: new connections get the new certificate, 0 calls fail."""
    before = _served_serial(tls_stack)
    failures: list[str] = []
    calls = [0]
    stop = threading.Event()

    def load() -> None:
        client = _client(tls_stack, tls_stack.files.client_cert, tls_stack.files.client_key)
        while not stop.is_set():
            try:
                client.infer("simple", _simple_inputs(), client_timeout=30)
                calls[0] += 1
            except InferenceServerException as error:
                failures.append(str(error))

    workers = [threading.Thread(target=load) for _ in range(4)]
    for worker in workers:
        worker.start()
    try:
        until("calls before the renewal", lambda: calls[0] >= 20, 60)
        renewed = certificates.renew_server(tls_stack.folder, tls_stack.issuer)
        until("the renewed certificate on a new connection",
              lambda: _served_serial(tls_stack) == renewed.serial_number, 30)
        settled = calls[0]
        until("calls after the renewal", lambda: calls[0] >= settled + 20, 60)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    assert renewed.serial_number != before
    assert failures == [], failures[:5]
