"""`@triton.jit` pieces the streaming kernels share: where a (tile, row) program works, and the
bitwise copy of a span (inlined into each kernel by the compiler)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_and_row(t_start_ptr, t_end_ptr):
    """(t, k, start, end) of a program of a (tile, row) grid: tile t covers [start, end) of
    row k."""
    t = tl.program_id(0)
    k = tl.program_id(1)
    return t, k, tl.load(t_start_ptr + t), tl.load(t_end_ptr + t)


@triton.jit
def copy_span(src, dst, start, end, BLOCK: tl.constexpr):
    """dst[start:end] = src[start:end], bit for bit (no conversion)."""
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)
