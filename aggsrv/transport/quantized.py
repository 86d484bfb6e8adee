"""Blockwise absmax quantization of a tensor's values on the wire (docs/wire.md "Quantized
values", docs/compression.md).

A quantized values section holds ``n`` values (``n`` = numel for a dense tensor, nnz for a COO or
bitmap one) in blocks of ``block`` consecutive values, the last block possibly shorter:

- first ``ceil(n / block)`` little-endian IEEE 754 binary32 **scales**, one per block, each
  finite and not negative;
- then the **codes**: INT8 one signed byte per value (two's complement, -127..127; -128 is
  refused), INT4 two values per byte, value 2j in the low nibble of byte j and value 2j+1 in
  its high nibble, each nibble a 4-bit two's complement code in -7..7 (0b1000 is refused); when
  n is odd the last high nibble is 0.

Value i is ``float32(code_i) * scale_b`` with b = i // block, one binary32 multiplication rounded
to nearest even: that product is normative (every receiver decodes the same bits). How a sender
picks codes is its own business; this module's encoder takes scale_b = absmax_b / Q (Q = 127 for
INT8, 7 for INT4, the division in binary32) and code = round(x / scale_b) to nearest, ties to
even, or stochastically (floor(x / scale_b + u), u uniform in [0, 1)), clamped to [-Q, Q]; a
block of zeros has scale 0 and codes 0.
"""

from __future__ import annotations

import enum
import math
import warnings

import numpy as np
import torch

from aggsrv import kernels
from aggsrv.values import QuantizedValues, finite_scale_limit

from .errors import BadChunk, WrongLength

__all__ = [
    "DEFAULT_BLOCK",
    "MAX_BLOCK",
    "Quantization",
    "check_block",
    "decode_quantized",
    "quantize",
    "quantized_nbytes",
    "quantized_values",
]

# 128 values a scale: 4 bytes of scale per 128 values keep INT8 at 0.258x the float32 bytes and
# INT4 at 0.133x, while a block is small enough that one large value costs the others of its
# block little precision (docs/compression.md "Block size").
DEFAULT_BLOCK = 128
MAX_BLOCK = 1 << 16


class Quantization(enum.Enum):
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"

    @classmethod
    def parse(cls, value: Quantization | str) -> Quantization:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            known = ", ".join(q.value for q in cls)
            raise ValueError(f"unknown quantization {value!r}; known: {known}") from None

    @property
    def qmax(self) -> int:
        """The largest code magnitude."""
        return {Quantization.INT8: 127, Quantization.INT4: 7}[self]


def check_block(block: int) -> int:
    """``block`` if it is a valid block size (1..MAX_BLOCK), else ValueError."""
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"block size must be an integer in [1, {MAX_BLOCK}], got {block!r}")
    return block


def quantized_nbytes(quantization: Quantization, n: int, block: int) -> int:
    """Wire bytes of ``n`` values quantized in blocks of ``block``."""
    scales = 4 * math.ceil(n / block)
    if quantization is Quantization.INT8:
        return scales + n
    if quantization is Quantization.INT4:
        return scales + (n + 1) // 2
    raise ValueError(f"{quantization.value} is not a quantization of values")


def quantize(
    values: torch.Tensor,
    quantization: Quantization,
    block: int,
    generator: torch.Generator | None = None,
) -> tuple[bytes, torch.Tensor]:
    """The wire bytes of ``values`` (1-D, finite, CPU) and the float32 values a receiver decodes
    from them (what error feedback subtracts). ``generator``: stochastic rounding with it."""
    check_block(block)
    x = values.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("only finite values can be quantized")
    n, q = x.numel(), quantization.qmax
    nblocks = math.ceil(n / block)
    padded = torch.zeros(nblocks * block, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nblocks, block)
    scales = blocks.abs().amax(dim=1) / q if n else torch.zeros(0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    ratio = blocks / safe[:, None]
    if generator is None:
        codes = torch.round(ratio)  # to nearest, ties to even
    else:
        noise = torch.rand(ratio.shape, generator=generator, dtype=torch.float32)
        codes = torch.floor(ratio + noise)
    codes = codes.clamp_(-q, q).masked_fill_(scales[:, None] == 0, 0)
    flat_codes = codes.reshape(-1)[:n].to(torch.int8)
    scale_bytes = scales.numpy().astype("<f4").tobytes()
    if quantization is Quantization.INT8:
        body = flat_codes
    else:
        nibbles = flat_codes.numpy().astype(np.uint8) & 0x0F
        if n % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        body = torch.from_numpy(nibbles[0::2] | (nibbles[1::2] << 4))
    # What a receiver decodes: the same kernel the server decodes with.
    decoded = torch.empty(n, dtype=torch.float32)
    if n:
        bits = 8 if quantization is Quantization.INT8 else 4
        kernels.dequantize(body, scales, block, bits=bits, out=decoded, backend="cpu")
    return scale_bytes + body.numpy().tobytes(), decoded


def _tensor_view(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A torch view of a numpy array over the received bytes, without copying them: the kernels
    only read it, so a read-only buffer (the bytes of a gRPC message) is fine."""
    if not arr.flags.writeable:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(arr).view(dtype)
    return torch.from_numpy(arr).view(dtype)


def _checked_section(
    raw: memoryview | bytes, quantization: Quantization, n: int, block: int, name: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """(the uint8 code bytes, the float32 scales, bits) of a quantized section, views of ``raw``
    once its length, scales and codes passed the format's checks (see :func:`decode_quantized`)."""
    expected = quantized_nbytes(quantization, n, block)
    if len(raw) != expected:
        raise WrongLength(
            f"tensor {name!r}: {quantization.value} values of {n} elements in blocks of {block} "
            f"take {expected} bytes, the section has {len(raw)}",
            tensor=name,
        )
    nblocks = math.ceil(n / block)
    scales = np.frombuffer(raw, dtype="<f4", count=nblocks)
    bad = ~np.isfinite(scales) | (scales < 0)
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise BadChunk(
            f"tensor {name!r}: the scale of block {b} is {float(scales[b])!r}; scales are "
            "finite and not negative",
            tensor=name,
        )
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 * nblocks)
    bits = 8 if quantization is Quantization.INT8 else 4
    if bits == 4 and n % 2 and body[-1] >> 4:
        raise BadChunk(
            f"tensor {name!r}: the padding nibble after the last of {n} int4 values must be 0",
            tensor=name,
        )
    from .code_scan import first_refused_code  # numba: a receiver's check, never a sender's

    at = first_refused_code(body, bits) if n else -1
    if at >= 0:
        what = "code -128" if bits == 8 else "nibble 0b1000 (-8)"
        allowed = "int8 codes are -127..127" if bits == 8 else "int4 codes are -7..7"
        raise BadChunk(f"tensor {name!r}: {what} at value {at}; {allowed}", tensor=name)
    return body, scales, bits


def decode_quantized(
    raw: memoryview | bytes,
    quantization: Quantization,
    n: int,
    block: int,
    name: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``n`` float32 values of a quantized section, written into ``out`` (a float [n] CPU
    tensor with unit stride) when given; WrongLength when the bytes do not match ``n`` and
    ``block``, BadChunk for a scale that is not finite or negative or a code outside the format
    (-128, 0b1000, or a non-zero padding nibble)."""
    body, scales, bits = _checked_section(raw, quantization, n, block, name)
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    if n:
        codes = _tensor_view(body, torch.int8 if bits == 8 else torch.uint8)
        kernels.dequantize(
            codes, _tensor_view(scales, torch.float32), block, bits=bits, out=out, backend="cpu"
        )
    return out


def quantized_values(
    raw: memoryview | bytes, quantization: Quantization, n: int, block: int, name: str
) -> QuantizedValues | None:
    """The ``n`` values of a quantized section as codes over ``raw`` (no copy, no decoding),
    after :func:`decode_quantized`'s checks (the same errors); None when a scale is too large to
    prove every value finite without decoding (above FLT_MAX / 128, or / 8 for INT4): decode
    those (:func:`decode_quantized`) and check the values."""
    body, scales, bits = _checked_section(raw, quantization, n, block, name)
    if scales.size and float(scales.max()) > finite_scale_limit(bits):
        return None
    return QuantizedValues(
        _tensor_view(body, torch.int8 if bits == 8 else torch.uint8),
        _tensor_view(scales, torch.float32), block, bits, n,
    )  # fmt: skip
