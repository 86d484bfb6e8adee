"""Where the first refused code of a quantized values section lies (docs/wire.md "Quantized
values": INT8 code -128, INT4 nibble 0b1000), in one read of the codes and no allocation.

Compiled by numba and imported lazily by the decoder: a server's check, never loaded by a client
that only encodes. The bytes are read eight at a time as 64-bit words: XOR with the refused
pattern turns a refused byte (nibble) into a zero one, and the classic "has a zero byte" test,
``(v - 0x01..01) & ~v & 0x80..80`` (per nibble: 0x1..1 and 0x8..8), is non-zero exactly when a
word holds one. The loop has no branch LLVM cannot vectorize; spans of words are tested in
parallel, and only a span whose test fired is searched byte by byte.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_SPAN = 4096  # bytes: the least a parallel span reads
_SPANS = 64  # parallel spans of a large section

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


@nb.njit(cache=True, nogil=True, parallel=True)
def _fired_spans(words, ones, high, spans):  # pragma: no cover - compiled
    """Per span of words (``spans`` equal parts, in parallel): whether its test fired."""
    nw = words.shape[0]
    fired = np.zeros(spans, dtype=np.uint8)
    for k in nb.prange(spans):
        if _fired(words[k * nw // spans : (k + 1) * nw // spans], ones, high) != 0:
            fired[k] = 1
    return fired


@nb.njit(cache=True, nogil=True)
def _first_in(body, start, end, bits):  # pragma: no cover - compiled
    """The first refused value in bytes [start, end), byte by byte, or -1."""
    for i in range(start, end):
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


@nb.njit(cache=True, nogil=True)
def _first(body, bits):  # pragma: no cover - compiled
    n = body.shape[0]
    whole = n - n % 8
    words = body[:whole].view(np.uint64)
    ones = _ONES8 if bits == 8 else _ONES4
    high = _HIGH8 if bits == 8 else _HIGH4
    nw = words.shape[0]
    spans = max(1, min(_SPANS, nw * 8 // _SPAN))
    fired = _fired_spans(words, ones, high, spans)
    for k in range(spans):  # in order: the first span that fired holds the first refused code
        if fired[k]:
            at = _first_in(body, k * nw // spans * 8, (k + 1) * nw // spans * 8, bits)
            if at >= 0:
                return at
    return _first_in(body, whole, n, bits)  # the tail past the last whole word


def first_refused_code(body: np.ndarray, bits: int) -> int:
    """The index of the first value whose code the format refuses, or -1: ``body`` the uint8
    code bytes of an INT8 (``bits`` 8) or INT4 (4) section."""
    return int(_first(np.ascontiguousarray(body), bits))


# The blocks are summed in this many fixed parts (in parallel), then the parts in order: the
# same float64 sum whatever the number of threads.
_PARTS = 64


@nb.njit(cache=True, nogil=True, inline="always")
def _block_squares8(codes):  # pragma: no cover - compiled
    """sum code^2 over one block (|code| <= 128 and block <= 65536 keep it within 32 bits): a
    loop over a slice of its own, with no branch, so that LLVM vectorises it."""
    acc = np.int32(0)
    for i in range(codes.shape[0]):
        c = np.int32(codes[i])
        acc += c * c
    return acc


@nb.njit(cache=True, nogil=True, inline="always")
def _block_squares4(pairs):  # pragma: no cover - compiled
    """sum code^2 over the two nibbles of each byte of ``pairs`` (sign-extended: (v ^ 8) - 8)."""
    acc = np.int32(0)
    for i in range(pairs.shape[0]):
        b = np.int32(pairs[i])
        lo = ((b & 0x0F) ^ 8) - 8
        hi = ((b >> 4) ^ 8) - 8
        acc += lo * lo + hi * hi
    return acc


@nb.njit(cache=True, nogil=True, parallel=True)
def _squares(body, n, scales, block, bits):  # pragma: no cover - compiled
    nblocks = scales.shape[0]
    totals = np.zeros(_PARTS)
    codes = body.view(np.int8)
    for part in nb.prange(_PARTS):
        total = 0.0
        for b in range(part * nblocks // _PARTS, (part + 1) * nblocks // _PARTS):
            if bits == 8:
                acc = _block_squares8(codes[b * block : min(n, (b + 1) * block)])
            elif block % 2 == 0:  # whole bytes (a last odd value's high nibble is 0)
                half = block // 2
                acc = _block_squares4(body[b * half : min(body.shape[0], (b + 1) * half)])
            else:  # odd INT4 blocks split bytes: value by value
                acc = np.int32(0)
                for i in range(b * block, min(n, (b + 1) * block)):
                    c = np.int32(((body[i >> 1] >> ((i & 1) * 4)) & 0x0F) ^ 8) - 8
                    acc += c * c
            s = np.float64(scales[b])
            total += s * s * np.float64(acc)
        totals[part] = total
    total = 0.0
    for part in range(_PARTS):
        total += totals[part]
    return total


def code_squares(body: np.ndarray, n: int, scales: np.ndarray, block: int, bits: int) -> float:
    """``sum_b scale_b^2 * sum_{i in b} code_i^2`` in float64 of the ``n`` values of a quantized
    section, in one read of the codes: their squared L2 norm (the exact squares of ``code *
    scale``, before each decoded value's rounding to binary32). ``body``: the uint8 code bytes
    (an INT4 padding nibble 0); ``scales``: float32."""
    body = np.ascontiguousarray(body)
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    return float(_squares(body, n, scales, block, bits))
