"""Throw-away TLS certificates for tests (tests/ is not a package: `from tls_helpers import
make_pki`). Generated per test run, so no key material is committed and nothing expires in the
repository; ECDSA P-256 keeps generation to milliseconds."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Pki", "make_pki"]


@dataclass
class Pki:
    """PEM bytes of a CA, a server and a client certificate it signed, and a rogue client
    certificate signed by an unrelated CA (for refusal tests)."""

    ca_cert: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes
    other_ca_cert: bytes
    rogue_client_cert: bytes
    rogue_client_key: bytes
    # Holds ca.pem, server.pem, server.key, client.pem, client.key, other-ca.pem, rogue.pem,
    # rogue.key (for code that takes file paths, such as the server's config).
    directory: Path

    def path(self, name: str) -> str:
        """Path of one of the written files, e.g. ``pki.path("ca.pem")``."""
        path = self.directory / name
        if not path.is_file():
            raise FileNotFoundError(f"no {name} in {self.directory}")
        return str(path)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "aggsrv tests"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    # Backdated an hour so small clock differences between test processes never matter.
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def _make_ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    cert = (
        _builder(_name(cn), _name(cn), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _make_leaf(
    cn: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    usage: x509.ObjectIdentifier,
    san: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    builder = (
        _builder(_name(cn), ca_cert.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path, client_cn: str = "client-1", server_ips: Sequence[str] = ()) -> Pki:
    """Create a CA with server and client certificates (plus a rogue CA and client) and write
    them as PEM files into ``directory``.

    The server certificate names DNS ``localhost`` and IPs 127.0.0.1 and ::1, so clients verify
    it by either address without a target-name override, and ``server_ips`` besides (servers on
    other hosts' addresses); the client certificate's CN is ``client_cn`` (what a server mapping
    certificates to client ids would read).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _make_ca("aggsrv test CA")
    server_cert, server_key = _make_leaf(
        "localhost",
        ca_cert,
        ca_key,
        ExtendedKeyUsageOID.SERVER_AUTH,
        san=[
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
            *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips),
        ],
    )
    client_cert, client_key = _make_leaf(
        client_cn, ca_cert, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH
    )
    other_ca_cert, other_ca_key = _make_ca("unrelated test CA")
    rogue_cert, rogue_key = _make_leaf(
        client_cn, other_ca_cert, other_ca_key, ExtendedKeyUsageOID.CLIENT_AUTH
    )
    pki = Pki(
        ca_cert=_cert_pem(ca_cert),
        server_cert=_cert_pem(server_cert),
        server_key=_key_pem(server_key),
        client_cert=_cert_pem(client_cert),
        client_key=_key_pem(client_key),
        other_ca_cert=_cert_pem(other_ca_cert),
        rogue_client_cert=_cert_pem(rogue_cert),
        rogue_client_key=_key_pem(rogue_key),
        directory=directory,
    )
    files = {
        "ca.pem": pki.ca_cert,
        "server.pem": pki.server_cert,
        "server.key": pki.server_key,
        "client.pem": pki.client_cert,
        "client.key": pki.client_key,
        "other-ca.pem": pki.other_ca_cert,
        "rogue.pem": pki.rogue_client_cert,
        "rogue.key": pki.rogue_client_key,
    }
    for name, data in files.items():
        path = directory / name
        path.write_bytes(data)
        if name.endswith(".key"):
            path.chmod(0o600)  # servers and tools may refuse keys readable by others
    return pki
