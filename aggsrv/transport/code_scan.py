"""Where the first refused code of a quantized values section lies (docs/wire.md "Quantized
values": INT8 code -128, INT4 nibble 0b1000), in one read of the codes and no allocation.

Compiled by numba and imported lazily by the decoder: a server's check, never loaded by a client
that only encodes. The bytes are read eight at a time as 64-bit words: XOR with the refused
pattern turns a refused byte (nibble) into a zero one, and the classic "has a zero byte" test,
``(v - 0x01..01) & ~v & 0x80..80`` (per nibble: 0x1..1 and 0x8..8), is non-zero exactly when a
word holds one. The loop has no branch LLVM cannot vectorize; only a span whose test fired is
searched byte by byte.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_SPAN = 4096  # bytes, a multiple of 8

_ONES8 = np.uint64(0x0101010101010101)
_HIGH8 = np.uint64(0x8080808080808080)
_ONES4 = np.uint64(0x1111111111111111)
_HIGH4 = np.uint64(0x8888888888888888)


@nb.njit(cache=True, nogil=True, inline="always")
def _fired(words, ones, high):  # pragma: no cover - compiled
    """Non-zero when a word of ``words`` XOR ``high`` has a zero byte (nibble)."""
    acc = np.uint64(0)
    for j in range(words.shape[0]):
        v = words[j] ^ high
        acc |= (v - ones) & ~v & high
    return acc


@nb.njit(cache=True, nogil=True)
def _first(body, bits):  # pragma: no cover - compiled
    n = body.shape[0]
    whole = n - n % 8
    words = body[:whole].view(np.uint64)
    ones = _ONES8 if bits == 8 else _ONES4
    high = _HIGH8 if bits == 8 else _HIGH4
    for s in range(0, n, _SPAN):
        e = min(n, s + _SPAN)
        w0, w1 = min(s, whole) // 8, min(e, whole) // 8
        if _fired(words[w0:w1], ones, high) == 0 and e <= whole:
            continue
        for i in range(s, e):  # a refused code here (or the tail past the last whole word)
            b = body[i]
            if bits == 8:
                if b == 0x80:
                    return i
            else:
                if (b & 0x0F) == 8:
                    return 2 * i
                if (b >> 4) == 8:
                    return 2 * i + 1
    return -1


def first_refused_code(body: np.ndarray, bits: int) -> int:
    """The index of the first value whose code the format refuses, or -1: ``body`` the uint8
    code bytes of an INT8 (``bits`` 8) or INT4 (4) section."""
    return int(_first(np.ascontiguousarray(body), bits))


@nb.njit(cache=True, nogil=True)
def _squares8(codes, scales, block):  # pragma: no cover - compiled
    n = codes.shape[0]
    total = 0.0
    for b in range(scales.shape[0]):
        acc = 0  # |code| <= 128 and block <= 65536: the block's sum fits 32 bits
        for i in range(b * block, min(n, (b + 1) * block)):
            c = np.int32(codes[i])
            acc += c * c
        s = np.float64(scales[b])
        total += s * s * acc
    return total


@nb.njit(cache=True, nogil=True)
def _squares4(body, n, scales, block):  # pragma: no cover - compiled
    total = 0.0
    for b in range(scales.shape[0]):
        acc = 0
        for i in range(b * block, min(n, (b + 1) * block)):
            nibble = np.int32((body[i >> 1] >> ((i & 1) * 4)) & 0x0F)
            c = nibble - 16 if nibble > 7 else nibble
            acc += c * c
        s = np.float64(scales[b])
        total += s * s * acc
    return total


def code_squares(body: np.ndarray, n: int, scales: np.ndarray, block: int, bits: int) -> float:
    """``sum_b scale_b^2 * sum_{i in b} code_i^2`` in float64: the squared L2 norm of the ``n``
    values of a quantized section taken from its codes (the exact squares of ``code * scale``,
    before each decoded value's rounding to binary32), in one read of the codes. ``body``: the
    uint8 code bytes; ``scales``: float32."""
    body = np.ascontiguousarray(body)
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    if bits == 8:
        return float(_squares8(body.view(np.int8), scales, block))
    return float(_squares4(body, n, scales, block))
