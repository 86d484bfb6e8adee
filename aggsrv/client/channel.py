"""The client's gRPC channel: plaintext or TLS (mutual TLS with a client certificate), with the
bearer token attached to every call as ``authorization`` metadata."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path

import grpc


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call. Metadata rather than call
    credentials, so it also works on plaintext channels (gRPC refuses call credentials there)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready, details.compression,
        )  # fmt: skip

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def read_token(token: str | None, token_file: str | None) -> str | None:
    """The token given, or the first line of ``token_file``."""
    if token and token_file:
        raise ValueError("give a token or a token file, not both")
    if token_file:
        text = Path(token_file).read_text().strip()
        if not text:
            raise ValueError(f"token file {token_file} is empty")
        return text.splitlines()[0].strip()
    return token or None


def open_channel(
    address: str,
    *,
    options: Sequence[tuple[str, object]] = (),
    token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls: bool | None = None,
) -> tuple[grpc.Channel, grpc.Channel]:
    """(the raw channel to close, the channel to build stubs on).

    TLS is on when ``tls`` is True or any TLS file is given; without ``tls_ca`` the system's
    roots verify the server. ``tls_cert``/``tls_key`` present a client certificate (mutual TLS).
    """
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together")
    secure = tls if tls is not None else bool(tls_ca or tls_cert)
    if secure:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes() if tls_ca else None,
            private_key=Path(tls_key).read_bytes() if tls_key else None,
            certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
        )
        channel = grpc.secure_channel(address, creds, options=list(options))
    else:
        channel = grpc.insecure_channel(address, options=list(options))
    stubs_on = grpc.intercept_channel(channel, BearerToken(token)) if token else channel
    return channel, stubs_on
