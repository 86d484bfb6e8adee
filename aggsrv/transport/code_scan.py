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

import functools

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


def _fired_spans(parallel: bool):
    """A compiled ``(body, bits) -> fired``: per span of the whole 64-bit words (``_SPANS``
    equal parts of a large section), whether its test fired; the spans in parallel or in turn."""

    def fired_spans(body, bits):  # pragma: no cover - compiled
        n = body.shape[0]
        whole = n - n % 8
        words = body[:whole].view(np.uint64)
        ones = _ONES8 if bits == 8 else _ONES4
        high = _HIGH8 if bits == 8 else _HIGH4
        nw = words.shape[0]
        spans = max(1, min(_SPANS, nw * 8 // _SPAN))
        fired = np.zeros(spans, dtype=np.uint8)
        for k in nb.prange(spans):
            if _fired(words[k * nw // spans : (k + 1) * nw // spans], ones, high) != 0:
                fired[k] = 1
        return fired

    fired_spans.__qualname__ = fired_spans.__name__ = f"fired_spans_{parallel}"  # own cache
    return nb.njit(cache=True, nogil=True, parallel=parallel)(fired_spans)


# The spans in parallel where numba's threading layer lets two threads run parallel loops at
# once (the decoder runs on the event loop while the aggregation thread runs kernels), else in
# turn: its workqueue layer aborts the process on concurrent use.
_fired_spans_parallel = _fired_spans(True)
_fired_spans_serial = _fired_spans(False)


@functools.cache
def _parallel_is_threadsafe() -> bool:
    try:
        _fired_spans_parallel(np.zeros(8, dtype=np.uint8), 8)  # loads the threading layer
        return nb.threading_layer() in ("tbb", "omp")
    except Exception:  # no layer loads, or numba cannot say which: stay serial
        return False


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
def _first(body, bits, fired):  # pragma: no cover - compiled
    n = body.shape[0]
    whole = n - n % 8
    nw = whole // 8
    spans = fired.shape[0]
    for k in range(spans):  # in order: the first span that fired holds the first refused code
        if fired[k]:
            at = _first_in(body, k * nw // spans * 8, (k + 1) * nw // spans * 8, bits)
            if at >= 0:
                return at
    return _first_in(body, whole, n, bits)  # the tail past the last whole word


def first_refused_code(body: np.ndarray, bits: int) -> int:
    """The index of the first value whose code the format refuses, or -1: ``body`` the uint8
    code bytes of an INT8 (``bits`` 8) or INT4 (4) section."""
    body = np.ascontiguousarray(body)
    spans = _fired_spans_parallel if _parallel_is_threadsafe() else _fired_spans_serial
    return int(_first(body, bits, spans(body, bits)))
