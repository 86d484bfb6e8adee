"""Tensor codec shared by the aggsrv server and client (no grpc or protobuf imports).

Works on (tensor name, byte offset, bytes) chunks; the server and client wrap them into messages.
Wire rules (docs/design.md): little-endian float32 / float16 / bfloat16 values, chunks of whole
elements at most the negotiated size, CRC-32C over all payload bytes in order in the trailer.
"""

# The package's names are its modules' public ones (each module's __all__), listed once there.
from . import crc, crossing, decoder, dtypes, encoder, errors, quantized, sparse
from .crc import *  # noqa: F403
from .crossing import *  # noqa: F403
from .decoder import *  # noqa: F403
from .dtypes import *  # noqa: F403
from .encoder import *  # noqa: F403
from .errors import *  # noqa: F403
from .quantized import *  # noqa: F403
from .sparse import *  # noqa: F403

__all__ = [
    *crc.__all__,
    *crossing.__all__,
    *decoder.__all__,
    *dtypes.__all__,
    *encoder.__all__,
    *errors.__all__,
    *quantized.__all__,
    *sparse.__all__,
]
