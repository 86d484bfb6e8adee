"""Sparse wire encodings of a flat tensor: COO (indices + values) or bitmap + values.

FedEN's proximal step leaves exact zeros in its updates (docs/algorithms/feden.md 4.5); any
strategy's update may use these encodings. A sparse tensor's wire bytes are one section, chunked
like dense bytes (any chunk boundaries, at most the chunk size each) and covered by the same
CRC-32C:

- COO: ``nnz`` little-endian uint32 indices, strictly increasing, then ``nnz`` values;
- BITMAP: ``ceil(numel / 32)`` little-endian uint32 words, bit ``i % 32`` of word ``i // 32``
  set iff element ``i`` is stored (padding bits zero), then ``nnz`` values in element order.

Values are in the stream's wire dtype. Elements not stored are +0.0 (a -0.0 is sent as zero:
the sign of zero is the one thing not kept). The encoding is chosen by density d = nnz / numel
with 4-byte values and indices, as the spec's rule: d < 1/32 -> COO (8 nnz bytes beats
numel/8 + 4 nnz), d < 31/32 -> bitmap, else dense.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from .dtypes import WireDtype, from_wire, to_wire, wire_view
from .errors import BadChunk, WrongLength
from .quantized import Quantization, decode_quantized, quantized_nbytes

__all__ = [
    "Encoding",
    "choose_encoding",
    "decode_sparse",
    "encode_sparse",
    "encoded_nbytes",
    "index_section",
]


class Encoding(enum.Enum):
    DENSE = "dense"
    COO = "coo"
    BITMAP = "bitmap"

    @classmethod
    def parse(cls, value: Encoding | str) -> Encoding:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            known = ", ".join(e.value for e in cls)
            raise ValueError(f"unknown tensor encoding {value!r}; known: {known}") from None


def bitmap_nbytes(numel: int) -> int:
    return 4 * ((numel + 31) // 32)


def encoded_nbytes(
    encoding: Encoding,
    numel: int,
    nnz: int,
    wire_dtype: WireDtype,
    quantized: tuple[Quantization, int] | None = None,
) -> int:
    """Wire bytes of a tensor of ``numel`` elements with ``nnz`` stored values (all of them when
    dense), the values in the wire dtype or ``quantized`` (quantization, block size)."""
    stored = numel if encoding is Encoding.DENSE else nnz
    if quantized is not None:
        values = quantized_nbytes(quantized[0], stored, quantized[1])
    else:
        values = stored * wire_dtype.itemsize
    if encoding is Encoding.COO:
        return 4 * nnz + values
    if encoding is Encoding.BITMAP:
        return bitmap_nbytes(numel) + values
    return values


def choose_encoding(numel: int, nnz: int, wire_dtype: WireDtype = WireDtype.FLOAT32) -> Encoding:
    """The smallest of COO, bitmap and dense for ``nnz`` stored values of ``numel`` in the wire
    dtype (docs/algorithms/feden.md 4.5; at 4-byte values about COO below density 1/32, dense
    from 31/32), counted exactly as the receiver counts them (:func:`encoded_nbytes`): a sparse
    encoding only when strictly smaller than dense, bitmap on a tie with COO (the spec's COO is
    for density below 1/32)."""
    if numel == 0:
        return Encoding.DENSE
    sizes = {e: encoded_nbytes(e, numel, nnz, wire_dtype) for e in Encoding}
    best = min((Encoding.BITMAP, Encoding.COO), key=sizes.__getitem__)
    return best if sizes[best] < sizes[Encoding.DENSE] else Encoding.DENSE


def encode_sparse(
    flat: torch.Tensor, wire_dtype: WireDtype, encoding: Encoding
) -> tuple[memoryview, int]:
    """The wire bytes of ``flat`` (1-D, any float dtype, CPU) and the number of stored values."""
    if encoding is Encoding.DENSE:
        raise ValueError("encode_sparse encodes COO or BITMAP; dense tensors go through Encoder")
    flat = flat.detach().reshape(-1).cpu()
    mask = flat != 0  # NaN is stored (and then refused by the receiver), -0.0 is not
    idx = torch.nonzero(mask).flatten()
    values = wire_view(to_wire(flat[idx].float(), wire_dtype))
    return memoryview(index_section(mask, encoding) + bytes(values)), idx.numel()


def index_section(mask: torch.Tensor, encoding: Encoding) -> bytes:
    """The COO indices or the bitmap of the elements ``mask`` (1-D bool, CPU) stores."""
    if encoding is Encoding.COO:
        idx = torch.nonzero(mask).flatten()
        return idx.to(torch.int32).numpy().astype("<u4", copy=False).tobytes()
    bits = np.packbits(mask.numpy(), bitorder="little")
    words = np.zeros(bitmap_nbytes(mask.numel()), dtype=np.uint8)
    words[: bits.size] = bits
    return words.tobytes()


def decode_sparse(
    raw: memoryview,
    encoding: Encoding,
    numel: int,
    nnz: int,
    wire_dtype: WireDtype,
    out: torch.Tensor,
    name: str,
    quantized: tuple[Quantization, int] | None = None,
) -> None:
    """Write the dense float32 values of a section into ``out`` [numel]: a sparse one, or a
    dense one of quantized values (``quantized``: quantization, block size); BadChunk if the
    indices, bitmap or codes are malformed (out is then garbage: the caller applies nothing)."""
    if encoding is Encoding.DENSE:
        if quantized is None:
            raise ValueError("a dense section of plain values is decoded as it arrives")
        decode_quantized(raw, quantized[0], numel, quantized[1], name, out=out)
        return
    if encoding is Encoding.COO:
        head = 4 * nnz
        idx = np.frombuffer(raw[:head], dtype="<u4").astype(np.int64)
        if nnz and (idx[-1] >= numel or (nnz > 1 and not (np.diff(idx) > 0).all())):
            raise BadChunk(
                f"tensor {name!r}: COO indices must be strictly increasing and below {numel}",
                tensor=name,
            )
    else:
        head = bitmap_nbytes(numel)
        bits = np.unpackbits(np.frombuffer(raw[:head], dtype=np.uint8), bitorder="little")
        if bits[numel:].any():
            raise BadChunk(f"tensor {name!r}: bitmap padding bits must be zero", tensor=name)
        idx = np.flatnonzero(bits[:numel])
        if idx.size != nnz:
            raise WrongLength(
                f"tensor {name!r}: the bitmap marks {idx.size} elements, the header says nnz={nnz}",
                tensor=name,
            )
    if quantized is not None:
        values = decode_quantized(raw[head:], quantized[0], nnz, quantized[1], name)
    else:
        values = from_wire(raw[head:], wire_dtype) if nnz else torch.empty(0)
    out.zero_()
    if nnz:
        out[torch.from_numpy(idx)] = values.to(out.dtype)
