"""Tensor codec shared by the aggsrv server and client (no grpc or protobuf imports).

Works on (tensor name, byte offset, bytes) chunks; the server and client wrap them into messages.
Wire rules (docs/design.md): little-endian float32 / float16 / bfloat16 values, chunks of whole
elements at most the negotiated size, CRC-32C over all payload bytes in order in the trailer.
"""

from .crc import HARDWARE_CRC, BytesLike, Crc32c, crc32c
from .decoder import Decoder, StagingSlot
from .dtypes import WireDtype, from_wire, is_wire_image, to_wire, wire_view
from .encoder import (
    DEFAULT_CHUNK_BYTES,
    MESSAGE_OVERHEAD_BYTES,
    Chunk,
    Encoder,
    chunk_limit,
    iter_chunks,
    round_chunk_bytes,
)
from .errors import (
    BadChunk,
    ChecksumMismatch,
    ChunkTooLarge,
    CodecError,
    NonFinite,
    Truncated,
    UnsupportedDtype,
    WrongLength,
)
from .sparse import Encoding, choose_encoding, decode_sparse, encode_sparse, encoded_nbytes

__all__ = [
    "Encoding",
    "choose_encoding",
    "decode_sparse",
    "encode_sparse",
    "encoded_nbytes",
    "DEFAULT_CHUNK_BYTES",
    "HARDWARE_CRC",
    "MESSAGE_OVERHEAD_BYTES",
    "BadChunk",
    "BytesLike",
    "ChecksumMismatch",
    "Chunk",
    "ChunkTooLarge",
    "CodecError",
    "Crc32c",
    "Decoder",
    "Encoder",
    "NonFinite",
    "StagingSlot",
    "Truncated",
    "UnsupportedDtype",
    "WireDtype",
    "WrongLength",
    "chunk_limit",
    "crc32c",
    "from_wire",
    "is_wire_image",
    "iter_chunks",
    "round_chunk_bytes",
    "to_wire",
    "wire_view",
]
