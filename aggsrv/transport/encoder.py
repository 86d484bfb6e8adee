"""Encoder: named tensors -> (tensor name, byte offset, bytes) chunks plus a running CRC-32C.

Every value is converted to its wire bytes once (no copy at all for float32 on a little-endian
CPU), in memoryviews of whole elements, at most `chunk_bytes` long. The caller
wraps each chunk into a protobuf message and sends `crc32c` in the trailer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

import torch

from .crc import Crc32c
from .dtypes import WireDtype, is_wire_image, to_wire, wire_view

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MESSAGE_OVERHEAD_BYTES",
    "Chunk",
    "Encoder",
    "chunk_limit",
    "iter_chunks",
    "round_chunk_bytes",
]

#: 1 MiB: inside the 1-4 MiB range that streams fastest over gRPC (docs/design.md
# "Measured platform facts").
DEFAULT_CHUNK_BYTES = 1 << 20
#: Room left in a message for the tensor name, offset and framing (docs/design.md wire rules).
MESSAGE_OVERHEAD_BYTES = 64


class Chunk(NamedTuple):
    """One piece of a tensor's wire bytes: unpacks as (name, byte_offset, data)."""

    name: str
    byte_offset: int
    data: memoryview


def round_chunk_bytes(chunk_bytes: int, wire_dtype: WireDtype) -> int:
    """`chunk_bytes` rounded down to whole elements; ValueError below one element."""
    size = wire_dtype.itemsize
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise TypeError(f"chunk_bytes must be an int, got {type(chunk_bytes).__name__}")
    if chunk_bytes < size:
        raise ValueError(
            f"chunk_bytes={chunk_bytes} is smaller than one {wire_dtype.wire_name} element "
            f"({size} bytes)"
        )
    return chunk_bytes - chunk_bytes % size


def chunk_limit(
    receive_limit_bytes: int, wire_dtype: WireDtype, requested: int = DEFAULT_CHUNK_BYTES
) -> int:
    """The chunk size to negotiate: `requested`, capped below the peer's receive limit."""
    cap = receive_limit_bytes - MESSAGE_OVERHEAD_BYTES
    return round_chunk_bytes(min(requested, cap), wire_dtype)


def _named(
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs as a list; ValueError on a repeated name."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    seen: set[str] = set()
    for name, _ in items:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one upload")
        seen.add(name)
    return items


class Encoder:
    """Chunks named tensors in the wire dtype and keeps the CRC-32C of the bytes produced.

    Iterate `chunks()` to the end, then read `crc32c` (and `nbytes`) for the trailer. A float32
    CPU tensor is sliced without copying; other CPU sources are converted chunk by chunk; a GPU
    tensor is converted on its device, then copied once. Each yielded memoryview owns (or keeps
    alive) its memory, so callers may keep chunks.
    """

    def __init__(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        wire_dtype: WireDtype | str | torch.dtype = WireDtype.FLOAT32,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.wire_dtype = WireDtype.parse(wire_dtype)
        self.chunk_bytes = round_chunk_bytes(chunk_bytes, self.wire_dtype)
        self.tensors = _named(tensors)
        self._crc = Crc32c()
        self._done = False

    @property
    def total_bytes(self) -> int:
        """Wire bytes of the whole payload (known before encoding)."""
        return sum(t.numel() for _, t in self.tensors) * self.wire_dtype.itemsize

    def chunks(self) -> Iterator[Chunk]:
        """Yield every chunk in order (tensor by tensor, ascending offsets), updating the CRC."""
        self._crc.reset()
        self._done = False
        wd, step = self.wire_dtype, self.chunk_bytes
        elems = step // wd.itemsize
        for name, tensor in self.tensors:
            flat = tensor.detach().reshape(-1)
            if flat.device.type == "cpu" and not is_wire_image(flat, wd):
                # Convert chunk by chunk: a whole-tensor conversion would allocate a fresh
                # buffer per upload (page-fault bound above 32 MiB), and each small converted
                # piece is still in cache for the CRC and the caller's copy.
                for a in range(0, flat.numel(), elems):
                    piece = wire_view(to_wire(flat[a : a + elems], wd))
                    self._crc.update(piece)
                    yield Chunk(name, a * wd.itemsize, piece)
                continue
            # Zero copy (already the wire image), or a GPU tensor: convert on the device, then
            # one transfer of the wire-sized bytes.
            view = wire_view(to_wire(flat, wd))
            for start in range(0, view.nbytes, step):
                piece = view[start : start + step]
                # CRC now, while the piece is in cache for the caller's copy into a message.
                self._crc.update(piece)
                yield Chunk(name, start, piece)
        self._done = True

    __iter__ = chunks

    def _finished(self) -> Crc32c:
        if not self._done:
            raise RuntimeError("iterate Encoder.chunks() to the end before reading the trailer")
        return self._crc

    @property
    def crc32c(self) -> int:
        """CRC-32C of all payload bytes in order (after `chunks()` is exhausted)."""
        return self._finished().value

    @property
    def nbytes(self) -> int:
        """Payload bytes produced (after `chunks()` is exhausted)."""
        return self._finished().nbytes


def iter_chunks(
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    wire_dtype: WireDtype | str | torch.dtype = WireDtype.FLOAT32,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[Chunk]:
    """The chunks of `tensors` (use `Encoder` when the trailer's CRC is needed too)."""
    return Encoder(tensors, wire_dtype, chunk_bytes).chunks()
