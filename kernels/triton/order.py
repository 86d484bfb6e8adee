"""Order statistics per coordinate: coordinate_median and trimmed_mean of [K, D] rows.

One program per block of columns holds the [BLOCK, K_pow2] tile (columns by rows; rows beyond K
masked off) in registers and gives every value its stable rank in its column,

    rank_i = #{j : x_j < x_i} + #{j < i : x_j == x_i}

(a permutation of 0..K-1, ties broken by row index, exactly the positions of a stable sort), then
sums the values whose rank lies in cut..K-cut-1, rows in index order, in the accumulation dtype:

    out[i] = (sum of order statistics cut..K-cut-1 of column i) / (K - 2 cut)

The median is the case cut = (K - 1) // 2 (one middle value for odd K; for even K the two, added
in the accumulation dtype and halved, then rounded once into the output dtype). Ranking costs
K * K_pow2 comparisons per column, all in registers. Measured on an H200 (float32, D = 4M,
2026-11-26): 0.49 ms at K = 16, 6.6 ms at K = 64, 26 ms at K = 128 (torch.median(X, dim=0):
4.4, 13.8, 65 ms); `tl.sort` of the same tile was slower there (2.2, 20, 41 ms) and takes tens
of seconds per call under the interpreter. Compute-bound: one read of X would take 0.1-0.5 ms.

Rows beyond MAX_SORT_ROWS would not fit in registers: such calls sort column chunks with torch
on the device instead (same arithmetic, bounded temporary memory), correct but not fused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import acc_dtype, config, next_pow2
from ._streams import column_block

# Most rows sorted in registers (K_pow2 values per column).
MAX_SORT_ROWS = 128
# Elements of one program's tile (BLOCK columns x K_pow2 rows): 32 per thread with 4 warps on a
# GPU; the interpreter prefers few, large programs.
TILE_ELEMENTS_CUDA = 4096
TILE_ELEMENTS_INTERP = 16384
# Bytes of the float tile the fallback sorts at a time.
FALLBACK_BYTES = 1 << 28


@triton.jit
def _column_tile(x_ptr, K, D, stride_x, KP: tl.constexpr, BLOCK: tl.constexpr):
    """This program's BLOCK columns and the KP row indices, their masks, and the [BLOCK, KP]
    tile of X they cut out (columns by rows, 0 where masked), in X's dtype."""
    cols, cm = column_block(0, D, BLOCK)
    rows = tl.arange(0, KP)
    rm = rows < K
    tile = tl.load(
        x_ptr + rows[None, :].to(tl.int64) * stride_x + cols[:, None],
        mask=cm[:, None] & rm[None, :],
        other=0.0,
    )
    return cols, rows, cm, rm, tile


@triton.jit
def _order_kernel(
    x_ptr, out_ptr, K, D, stride_x, cut,
    ACC_F64: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[cols] = mean of each column's order statistics cut..K-cut-1 (stable ranks)."""
    cols, rows, cm, rm, tile = _column_tile(x_ptr, K, D, stride_x, KP, BLOCK)
    if ACC_F64:  # noqa: SIM108 - constexpr branch, the compiled kernel keeps one
        tile = tile.to(tl.float64)
    else:
        tile = tile.to(tl.float32)
    total = tl.zeros([BLOCK], dtype=tile.dtype)
    x_row = x_ptr
    for i in range(0, K):
        # Row i again from cache: a column of the register tile cannot be indexed directly.
        xi = tl.load(x_row + cols, mask=cm, other=0.0).to(tile.dtype)
        below = (tile < xi[:, None]) | ((tile == xi[:, None]) & (rows[None, :] < i))
        rank = tl.sum((below & rm[None, :]).to(tl.int32), axis=1)
        keep = (rank >= cut) & (rank < K - cut)
        total += tl.where(keep, xi, 0.0)
        x_row += stride_x
    # An int divisor: a Python int argument equal to 1 arrives as a constexpr on a GPU.
    res = total / (K - 2 * cut)
    tl.store(out_ptr + cols, res.to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _window_kernel(
    x_ptr, med_ptr, out_ptr, K, D, stride_x, keep,
    KP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[cols] = mean of the `keep` values of each column nearest its median `med` (float64):
    a value is kept when fewer than `keep` values of its column come before it in the order
    (distance to the median, value, row), the greedy walk's choices (kernels/robust.py)."""
    cols, rows, cm, rm, tile = _column_tile(x_ptr, K, D, stride_x, KP, BLOCK)
    tile = tile.to(tl.float64)
    med = tl.load(med_ptr + cols, mask=cm, other=0.0)
    dist = tl.abs(tile - med[:, None])
    total = tl.zeros([BLOCK], dtype=tl.float64)
    x_row = x_ptr
    for i in range(0, K):
        xi = tl.load(x_row + cols, mask=cm, other=0.0).to(tl.float64)
        di = tl.abs(xi - med)
        nearer = dist < di[:, None]
        same = dist == di[:, None]
        before = nearer | (same & (tile < xi[:, None]))
        before = before | (same & (tile == xi[:, None]) & (rows[None, :] < i))
        rank = tl.sum((before & rm[None, :]).to(tl.int32), axis=1)
        total += tl.where(rank < keep, xi, 0.0)
        x_row += stride_x
    res = total / keep
    tl.store(out_ptr + cols, res.to(out_ptr.dtype.element_ty), mask=cm)


def _sorted_chunks(X: torch.Tensor, cut: int, out: torch.Tensor) -> None:
    """The fallback for K > MAX_SORT_ROWS: torch sorts of column chunks, same arithmetic."""
    K, D = X.shape
    acc = acc_dtype(X)
    step = max(1, FALLBACK_BYTES // (K * torch.finfo(acc).bits // 8))
    for s in range(0, D, step):
        srt = X[:, s : s + step].to(acc).sort(dim=0).values
        out[s : s + step] = (srt[cut : K - cut].sum(dim=0) / (K - 2 * cut)).to(out.dtype)


def _tile_shape(X: torch.Tensor) -> tuple[int, int]:
    """(rows of the register tile: K rounded up to a power of two, columns per program)."""
    KP = next_pow2(X.shape[0])
    tile = TILE_ELEMENTS_CUDA if X.is_cuda else TILE_ELEMENTS_INTERP
    return KP, max(16, tile // KP)


def _run(X: torch.Tensor, cut: int, out: torch.Tensor) -> None:
    K, D = X.shape
    if D == 0:
        return
    if K > MAX_SORT_ROWS:
        _sorted_chunks(X, cut, out)
        return
    KP, block = _tile_shape(X)
    _order_kernel[(triton.cdiv(D, block),)](
        X, out, K, D, X.stride(0), cut,
        ACC_F64=X.dtype == torch.float64, KP=KP, BLOCK=block, num_warps=config(X).num_warps,
    )  # fmt: skip


def coordinate_median(X: torch.Tensor, out: torch.Tensor) -> None:
    """The median is the trimmed mean that keeps one (odd K) or two (even K) middle values."""
    _run(X, (X.shape[0] - 1) // 2, out)


def trimmed_mean(X: torch.Tensor, cut: int, out: torch.Tensor) -> None:
    """out = mean of each column's order statistics cut..K-cut-1."""
    _run(X, cut, out)


def mean_around_median(X: torch.Tensor, keep: int, out: torch.Tensor) -> None:
    """out = mean of each column's `keep` values nearest its median, ranked in float64 (the
    median of two float32 values and the distances to it are exact there)."""
    K, D = X.shape
    if D == 0:
        return
    if K > MAX_SORT_ROWS:
        from .._cpu_median_window import mean_around_median as walk

        step = max(1, FALLBACK_BYTES // (K * 8))
        for s in range(0, D, step):
            walk(X[:, s : s + step], keep, out[s : s + step])
        return
    med = torch.empty(D, dtype=torch.float64, device=X.device)
    KP, block = _tile_shape(X)
    grid = (triton.cdiv(D, block),)
    warps = config(X).num_warps
    _order_kernel[grid](
        X, med, K, D, X.stride(0), (K - 1) // 2, ACC_F64=True, KP=KP, BLOCK=block,
        num_warps=warps,
    )  # fmt: skip
    _window_kernel[grid](X, med, out, K, D, X.stride(0), keep, KP=KP, BLOCK=block, num_warps=warps)
