"""Distances to one point and norm bounding: sq_distances_to, clip_rows.

Pass 1 runs one program per (tile, row) and writes that tile's sum of squared differences (or
squares) as one float64 partial; `seg_reduce` adds each row's partials in tile order
(deterministic, no atomics). Within a tile the sums run in the accumulation dtype (float32 for
float32 and half data: a tile is at most a few thousand elements), across tiles in float64.
With `reduce` (a sharded server) the float64 [K] sums go to one `reduce` call; clip_rows then
forms its scale factors in float64 and rounds them once to the accumulation dtype for pass 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._partials import Reduce, summed
from ._common import acc_dtype, config, tile_table
from ._streams import copy_span, tile_and_row
from .segmented import seg_reduce


@triton.jit
def _sq_partial_kernel(
    x_ptr, p_ptr, part_ptr, t_start_ptr, t_end_ptr, stride_x, K,
    HAS_POINT: tl.constexpr, ACC_F64: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """part[t, k] = sum over tile t of (x[k] - p)^2, or of x[k]^2 without a point (float64)."""
    t, k, start, end = tile_and_row(t_start_ptr, t_end_ptr)
    x_row = x_ptr + k.to(tl.int64) * stride_x
    if ACC_F64:  # noqa: SIM108 - constexpr branch, the compiled kernel keeps one
        acc = tl.zeros([BLOCK], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        # Converted right after the load: no half arithmetic (bfloat16 is wrong under the
        # interpreter). The difference is formed before squaring: no cancellation.
        d = tl.load(x_row + idx, mask=m, other=0.0).to(acc.dtype)
        if HAS_POINT:
            d -= tl.load(p_ptr + idx, mask=m, other=0.0).to(acc.dtype)
        acc += d * d
    tl.store(part_ptr + t.to(tl.int64) * K + k, tl.sum(acc, axis=0).to(tl.float64))


@triton.jit
def _scale_rows_kernel(
    x_ptr, out_ptr, scale_ptr, t_start_ptr, t_end_ptr, stride_x, stride_o,
    SKIP_ONE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[k] = x[k] * scale[k] on tile t; a scale of exactly 1 copies x bit for bit (and with
    out = x writes nothing)."""
    _, k, start, end = tile_and_row(t_start_ptr, t_end_ptr)
    c = tl.load(scale_ptr + k)
    acc_ty = scale_ptr.dtype.element_ty
    x_row = x_ptr + k.to(tl.int64) * stride_x
    o_row = out_ptr + k.to(tl.int64) * stride_o
    if c == 1:
        if not SKIP_ONE:
            copy_span(x_row, o_row, start, end, BLOCK)
    else:
        for off in range(start, end, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < end
            x = tl.load(x_row + idx, mask=m, other=0.0).to(acc_ty)
            tl.store(o_row + idx, (x * c).to(out_ptr.dtype.element_ty), mask=m)


def _row_sums(X: torch.Tensor, point: torch.Tensor | None) -> torch.Tensor:
    """float64 [K]: squared distances of the rows of X to point [1, D] (squared norms when
    point is None), from per-tile partials summed in tile order."""
    K, D = X.shape
    cfg = config(X)
    tt = tile_table(torch.tensor([0, D], dtype=torch.int64), cfg.tile, X.device)
    sums = torch.zeros(1, K, dtype=torch.float64, device=X.device)
    if tt.num_tiles == 0 or K == 0:
        return sums[0]
    part = torch.empty(tt.num_tiles, K, dtype=torch.float64, device=X.device)
    _sq_partial_kernel[(tt.num_tiles, K)](
        X, X if point is None else point, part, tt.start, tt.end, X.stride(0), K,
        HAS_POINT=point is not None, ACC_F64=X.dtype == torch.float64,
        BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip
    seg_reduce(part, tt, sums)
    return sums[0]


def sq_distances_to(
    X: torch.Tensor, point: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    """float64 [K] |x_k - point|^2 (summed over the shards by one `reduce`)."""
    return summed(reduce, _row_sums(X, point))


def clip_rows(
    X: torch.Tensor, max_norm: float, out: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    """out = x * min(1, max_norm / |x|) per row (rows within the bound copied bitwise);
    returns the float64 [K] norms before clipping."""
    K, D = X.shape
    norms = summed(reduce, _row_sums(X, None)).sqrt()
    # Exactly 1 for the rows within the bound: pass 2 copies those (or leaves them, in place).
    scale = torch.where(norms > max_norm, max_norm / norms.clamp_min(1e-300), 1.0)
    if K == 0 or D == 0:
        return norms
    cfg = config(X)
    tt = tile_table(torch.tensor([0, D], dtype=torch.int64), cfg.tile, X.device)
    same = out.data_ptr() == X.data_ptr() and out.stride() == X.stride()
    _scale_rows_kernel[(tt.num_tiles, K)](
        X, out, scale.to(acc_dtype(X)).contiguous(), tt.start, tt.end, X.stride(0),
        out.stride(0), SKIP_ONE=same, BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip
    return norms
