"""`@triton.jit` pieces the kernels share (inlined into each by the compiler): where a program
of a (tile, row) grid or of a column-block grid works, the range of one entry of a table of
starts, and the bitwise copy of a span."""

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
def column_block(axis: tl.constexpr, n, BLOCK: tl.constexpr):
    """(idx, mask): the BLOCK column indices of this program along grid `axis`, those < n."""
    idx = tl.program_id(axis) * BLOCK + tl.arange(0, BLOCK)
    return idx, idx < n


@triton.jit
def entry_span(starts_ptr, i):
    """(starts[i], starts[i + 1]): the range of entry i of a table of starts."""
    return tl.load(starts_ptr + i), tl.load(starts_ptr + i + 1)


@triton.jit
def copy_span(src, dst, start, end, BLOCK: tl.constexpr):
    """dst[start:end] = src[start:end], bit for bit (no conversion)."""
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)
