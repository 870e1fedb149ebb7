"""Client certificates' subjects (components/mtls, SONIC_RAY_CLIENT_SUBJECTS) on a gateway of
its own (tests/support/lone_gateway.py: the shipped config as `make local TLS=1 MTLS=1` writes
it, with a subject allow-list and a tenant by subject pattern, before a stand-in Triton): a
certificate the CA signed but whose subject the list does not name is refused by name, over
gRPC (PERMISSION_DENIED) and HTTP (403 in Triton's error shape), and never reaches Triton; a
subject a pattern names passes; each is recorded as its subject and tenant. The handshake's own
refusals (no certificate, another CA, expired) and Triton's example clients with their TLS
flags: tests/stack/test_tls.py."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from tests.support.callers import lines_since
from tests.support.lone_gateway import LoneGateway, lone_gateway
from tools import certificates

pytestmark = pytest.mark.processes

ALLOWED = f"{certificates.CLIENT_SUBJECT};CN=robot-*,O=sonic-ray"
REFUSED_SUBJECT = "CN=mallory,O=sonic-ray"


@dataclass
class Minted:
    cert: Path
    key: Path


@pytest.fixture(scope="module")
def mutual(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoneGateway, dict[str, Minted]]]:
    folder = tmp_path_factory.mktemp("subjects")
    with lone_gateway(folder / "gateway", {
        "TLS": "1", "MTLS": "1", "SONIC_RAY_CLIENT_SUBJECTS": ALLOWED,
        "SONIC_RAY_TENANTS": "robots=cert:CN=robot-*",
    }) as lone:
        issuer = certificates.load_issuer(folder / "gateway" / "certificates")
        minted = {}
        for name in ("mallory", "robot-42"):
            cert, key = certificates.issue(issuer, name, server=False)
            minted[name] = Minted(folder / f"{name}.crt", folder / f"{name}.key")
            certificates.write_pair(cert, key, minted[name].cert, minted[name].key)
        yield lone, minted


def _grpc(lone: LoneGateway, who: Minted) -> tuple[str, str]:
    assert lone.files is not None
    client = tc.InferenceServerClient(lone.grpc, ssl=True, root_certificates=str(lone.files.ca),
                                      private_key=str(who.key), certificate_chain=str(who.cert))
    try:
        client.get_model_repository_index()
        return "OK", ""
    except InferenceServerException as error:
        return str(error.status()), str(error.message())
    finally:
        client.close()


def _https(lone: LoneGateway, who: Minted, path: str) -> tuple[int, str]:
    assert lone.files is not None
    context = ssl.create_default_context(cafile=str(lone.files.ca))
    context.load_cert_chain(str(who.cert), str(who.key))
    url = f"https://localhost:{lone.settings.http_port}{path}"
    try:
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_subject_the_list_does_not_name_is_refused_by_name(
        mutual: tuple[LoneGateway, dict[str, Minted]]) -> None:
    lone, minted = mutual
    reached = len(lone.seen.calls)
    status, message = _grpc(lone, minted["mallory"])
    assert status == "StatusCode.PERMISSION_DENIED", (status, message)
    assert f'"{REFUSED_SUBJECT}"' in message and "not allowed" in message, message
    code, body = _https(lone, minted["mallory"], "/v2/models/any/config")
    assert code == 403, (code, body)
    said = json.loads(body)["error"]
    assert f'"{REFUSED_SUBJECT}"' in said and "SONIC_RAY_CLIENT_SUBJECTS" in said, said
    assert len(lone.seen.calls) == reached, lone.seen.calls[reached:]


def test_a_subject_a_pattern_names_passes_and_each_is_recorded(
        mutual: tuple[LoneGateway, dict[str, Minted]]) -> None:
    lone, minted = mutual
    since = time.time()
    assert _grpc(lone, minted["robot-42"]) == ("OK", "")
    assert _https(lone, minted["robot-42"], "/v2/models/any/config")[0] == 200
    assert _grpc(lone, minted["mallory"])[0] == "StatusCode.PERMISSION_DENIED"
    lines = lines_since(lone.access_log, since, 3)
    assert sorted((line["identity"], line["tenant"], line["protocol"]) for line in lines) == [
        (f"cert:{REFUSED_SUBJECT}", "other", "grpc"),
        ("cert:CN=robot-42,O=sonic-ray", "robots", "grpc"),
        ("cert:CN=robot-42,O=sonic-ray", "robots", "http")], lines
