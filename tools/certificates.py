"""Throw-away certificates for `make local TLS=1`: a CA, the gateway's server certificate (for
localhost and 127.0.0.1) and a client certificate it signed, as PEM files in the stack's
folder. The server's pair and the CA lie in folders written as the kubelet writes a mounted
Secret or ConfigMap (files behind a `..data` symlink swapped in one rename), so that a renewal
here reaches Envoy as it does in a pod. Tests mint more (expired, another CA's, another
subject) with the same functions, the CA's key beside its certificate."""

from __future__ import annotations

import datetime
import ipaddress
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The client certificate's subject as Envoy prints it (RFC 2253, last RDN first).
CLIENT_SUBJECT = "CN=local-client,O=sonic-ray"
SERVER_NAMES = ("localhost",)
SERVER_ADDRESSES = ("127.0.0.1",)


@dataclass(frozen=True)
class Issuer:
    name: x509.Name
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate


@dataclass(frozen=True)
class Files:
    """The paths `make local TLS=1` prints: the CA to trust, the client's certificate and key,
    and the server's pair the gateway serves."""
    ca: Path
    client_cert: Path
    client_key: Path
    server_cert: Path
    server_key: Path


def _name(common_name: str, organization: str = "sonic-ray") -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def certificate_authority(common_name: str = "sonic-ray local CA") -> Issuer:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256()))
    return Issuer(name, key, certificate)


def issue(issuer: Issuer, common_name: str, server: bool, organization: str = "sonic-ray",
          valid_from: datetime.timedelta = datetime.timedelta(minutes=-5),
          valid_for: datetime.timedelta = datetime.timedelta(days=30),
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate `issuer` signs, valid from now + `valid_from` for `valid_for`."""
    key = ec.generate_private_key(ec.SECP256R1())
    start = datetime.datetime.now(datetime.UTC) + valid_from
    builder = (
        x509.CertificateBuilder().subject_name(_name(common_name, organization))
        .issuer_name(issuer.name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + valid_for)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(n) for n in SERVER_NAMES]
            + [x509.IPAddress(ipaddress.ip_address(a)) for a in SERVER_ADDRESSES]),
            critical=False)
    return builder.sign(issuer.key, hashes.SHA256()), key


def write_pair(certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert_path: Path,
               key_path: Path) -> None:
    """Each file replaced by a rename: a reader never sees half of one."""
    for path, data in ((cert_path, pem(certificate)), (key_path, _pem_key(key))):
        staged = path.with_name(path.name + ".new")
        staged.write_bytes(data)
        staged.chmod(0o600)
        staged.replace(path)


def write_mounted(folder: Path, files: dict[str, bytes]) -> None:
    """Replaces a mounted volume's files as the kubelet does (its AtomicWriter): the new files
    in a fresh timestamped folder, then the `..data` symlink swapped to it by one rename, each
    name a symlink through `..data`."""
    folder.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix="..2026_", dir=folder))
    for name, data in files.items():
        (fresh / name).write_bytes(data)
        (fresh / name).chmod(0o644)
    link = folder / "..data_tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(fresh.name)
    old = (folder / "..data").resolve() if (folder / "..data").is_symlink() else None
    os.replace(link, folder / "..data")
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")
    if old is not None and old != fresh:
        for item in old.iterdir():
            item.unlink()
        old.rmdir()


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return _pem_key(key)


def renew_server(folder: Path, issuer: Issuer) -> x509.Certificate:
    """A new server certificate in the mounted folder, as cert-manager renews the Secret."""
    certificate, key = issue(issuer, "localhost", server=True)
    write_mounted(folder / "server", {"tls.crt": pem(certificate), "tls.key": key_pem(key)})
    return certificate


def load_issuer(folder: Path) -> Issuer:
    """The stack's CA, from the files write_local left in `folder`."""
    certificate = x509.load_pem_x509_certificate((folder / "client-ca" / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return Issuer(certificate.subject, key, certificate)


def write_local(folder: Path) -> tuple[Files, Issuer]:
    """The CA (its key in `folder`/ca.key, for tests), the server's pair in `folder`/server
    (named as in a kubernetes.io/tls Secret), the CA in `folder`/client-ca (as the
    triton-client-ca ConfigMap is mounted) and the client's pair in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = certificate_authority()
    files = Files(ca=folder / "client-ca" / "ca.crt", client_cert=folder / "client.crt",
                  client_key=folder / "client.key", server_cert=folder / "server" / "tls.crt",
                  server_key=folder / "server" / "tls.key")
    write_mounted(folder / "client-ca", {"ca.crt": pem(ca.certificate)})
    (folder / "ca.key").write_bytes(_pem_key(ca.key))
    (folder / "ca.key").chmod(0o600)
    renew_server(folder, ca)
    common_name = CLIENT_SUBJECT.split(",")[0].removeprefix("CN=")
    write_pair(*issue(ca, common_name, server=False), files.client_cert, files.client_key)
    return files, ca
