"""The test PKI from tls_helpers works with real gRPC mutual TLS: the right client certificate
gets through, a certificate from another CA, no certificate, or plaintext is refused."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tls_helpers import Pki, make_pki

TIMEOUT = 5.0


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    creds = grpc.ssl_server_credentials(
        [(pki.server_key, pki.server_cert)], root_certificates=pki.ca_cert, require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    assert port
    server.start()
    try:
        yield pki, port
    finally:
        server.stop(grace=None)


def check(channel: grpc.Channel) -> health_pb2.HealthCheckResponse.ServingStatus:
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        check(channel)
    return info.value.code()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_client_with_ca_and_client_cert_succeeds(mtls_server, host: str) -> None:
    pki, port = mtls_server
    creds = grpc.ssl_channel_credentials(pki.ca_cert, pki.client_key, pki.client_cert)
    status = check(grpc.secure_channel(f"{host}:{port}", creds))
    assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "which", ["rogue client cert", "no client cert", "plaintext", "untrusted server"]
)
def test_refused(mtls_server, which: str) -> None:
    pki, port = mtls_server
    target = f"localhost:{port}"
    if which == "plaintext":
        channel = grpc.insecure_channel(target)
    else:
        root, key, cert = {
            "rogue client cert": (pki.ca_cert, pki.rogue_client_key, pki.rogue_client_cert),
            "no client cert": (pki.ca_cert, None, None),
            # The client side checks the server too: trusting only the other CA fails.
            "untrusted server": (pki.other_ca_cert, pki.client_key, pki.client_cert),
        }[which]
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root, key, cert))
    assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_pki_files_and_extensions(tmp_path) -> None:
    pki: Pki = make_pki(tmp_path, client_cn="site-9")
    for name in ["ca.pem", "server.pem", "server.key", "client.pem", "client.key"]:
        assert Path(pki.path(name)).read_bytes().startswith(b"-----BEGIN ")
    for name in ["other-ca.pem", "rogue.pem", "rogue.key"]:
        pki.path(name)
    assert Path(pki.path("client.key")).read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    with pytest.raises(FileNotFoundError):
        pki.path("nope.pem")

    ca = x509.load_pem_x509_certificate(pki.ca_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    server = x509.load_pem_x509_certificate(pki.server_cert)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    client = x509.load_pem_x509_certificate(pki.client_cert)
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site-9"
    eku = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    client.verify_directly_issued_by(ca)
    rogue = x509.load_pem_x509_certificate(pki.rogue_client_cert)
    rogue.verify_directly_issued_by(x509.load_pem_x509_certificate(pki.other_ca_cert))
    with pytest.raises(ValueError):  # issuer name differs
        rogue.verify_directly_issued_by(ca)
