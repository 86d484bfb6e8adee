"""Codec errors, one class per gRPC status the server answers with.

Each class names its status in ``grpc_code_name`` (a string; ``"INVALID_ARGUMENT"`` unless the class
says otherwise) so that this package never imports grpc; the server maps it with
``grpc.StatusCode[exc.grpc_code_name]``.
Messages name the tensor, the offsets and the expected and received values, so that the person
reading the client's error can fix the client.
"""

from __future__ import annotations

__all__ = [
    "BadChunk",
    "ChecksumMismatch",
    "ChunkTooLarge",
    "CodecError",
    "NonFinite",
    "Truncated",
    "UnsupportedDtype",
    "WrongLength",
]


class CodecError(ValueError):
    """A received (or to-be-sent) payload breaks the wire rules; nothing of it may be applied."""

    grpc_code_name: str = "INVALID_ARGUMENT"

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class ChunkTooLarge(CodecError):
    """A chunk is larger than the negotiated chunk size."""

    grpc_code_name = "RESOURCE_EXHAUSTED"


class BadChunk(CodecError):
    """A chunk names an unknown tensor, is misaligned, out of order or holds a partial element."""


class WrongLength(CodecError):
    """A chunk runs past the end of its tensor."""


class UnsupportedDtype(CodecError):
    """A wire dtype (or a tensor's dtype) the codec does not carry."""


class NonFinite(CodecError):
    """The decoded payload holds NaN or Inf."""


class ChecksumMismatch(CodecError):
    """The trailer's CRC-32C differs from the CRC-32C of the payload received."""

    grpc_code_name = "DATA_LOSS"


class Truncated(CodecError):
    """The stream ended before every tensor was complete."""

    grpc_code_name = "DATA_LOSS"
