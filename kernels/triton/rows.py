"""Row reductions over [K, D]: group_means and weighted_sum (one program per D-block, rows summed
in a fixed order, so results are deterministic without atomics)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import acc_dtype, config
from ._streams import column_block, entry_span


@triton.jit
def _group_means_kernel(
    x_ptr, out_ptr, rows_ptr, gstart_ptr, D, stride_x,
    ACC_F64: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[g, block] = mean of x[r, block] over the rows r of group g (zeros if it is empty)."""
    g = tl.program_id(1)
    idx, m = column_block(0, D, BLOCK)
    r0, r1 = entry_span(gstart_ptr, g)
    if ACC_F64:  # noqa: SIM108 - constexpr branch, the compiled kernel keeps one
        acc = tl.zeros([BLOCK], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    # Only the rows listed for the group are touched: excluded rows (-1) are never read.
    for r in range(r0, r1):
        row = tl.load(rows_ptr + r)
        acc += tl.load(x_ptr + row * stride_x + idx, mask=m, other=0.0).to(acc.dtype)
    n = r1 - r0
    mean = tl.where(n > 0, acc / tl.maximum(n, 1).to(acc.dtype), 0.0)
    tl.store(out_ptr + g.to(tl.int64) * D + idx, mean.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _weighted_sum_kernel(
    x_ptr, w_ptr, out_ptr, par_ptr, K, D, stride_x,
    READ_OUT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[block] = beta out[block] + alpha sum_k w_k x[k, block], rows in order 0..K-1."""
    acc_ty = w_ptr.dtype.element_ty
    idx, m = column_block(0, D, BLOCK)
    acc = tl.zeros([BLOCK], dtype=acc_ty)
    # A running row pointer keeps the row offset in 64-bit pointer arithmetic.
    x_row = x_ptr
    for k in range(0, K):
        wk = tl.load(w_ptr + k)
        xk = tl.load(x_row + idx, mask=m, other=0.0).to(acc_ty)
        acc += wk * xk
        x_row += stride_x
    alpha = tl.load(par_ptr)
    res = alpha * acc
    # beta == 0 must ignore the old content, NaN included, so out is not even read then.
    if READ_OUT:
        beta = tl.load(par_ptr + 1)
        res = beta * tl.load(out_ptr + idx, mask=m, other=0.0).to(acc_ty) + res
    tl.store(out_ptr + idx, res.to(out_ptr.dtype.element_ty), mask=m)


def group_means(X: torch.Tensor, groups: torch.Tensor, num_groups: int, out: torch.Tensor) -> None:
    """Write the [G, D] per-group row means into `out`; rows with group -1 are excluded."""
    K, D = X.shape
    if num_groups == 0 or D == 0:
        return
    g = groups.cpu().numpy().astype(np.int64)
    valid = np.nonzero(g >= 0)[0]
    # Rows sorted by group (stable: ascending row order inside a group, a fixed sum order).
    rows = valid[np.argsort(g[valid], kind="stable")]
    gstart = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(g[valid], minlength=num_groups), out=gstart[1:])
    # A dummy entry keeps the pointer valid when every row is excluded.
    table = torch.from_numpy(np.concatenate([gstart, rows, [0]]).astype(np.int64)).to(X.device)
    cfg = config(X)
    grid = (triton.cdiv(D, cfg.block), num_groups)
    _group_means_kernel[grid](
        X, out, table[num_groups + 1 :], table[: num_groups + 1], D, X.stride(0),
        ACC_F64=X.dtype == torch.float64, BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip


def weighted_sum(
    X: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, alpha: float, beta: float
) -> None:
    """out = beta out + alpha sum_k w_k X_k, accumulated in the acc dtype."""
    K, D = X.shape
    if D == 0:
        return
    acc = acc_dtype(X)
    # A trailing dummy weight keeps the pointer valid for K == 0.
    w = torch.cat([weights.to(torch.float64), weights.new_zeros(1, dtype=torch.float64)])
    w = w.to(device=X.device, dtype=acc)
    par = torch.tensor([alpha, beta], dtype=torch.float64).to(device=X.device, dtype=acc)
    cfg = config(X)
    _weighted_sum_kernel[(triton.cdiv(D, cfg.block),)](
        X, w, out, par, K, D, X.stride(0),
        READ_OUT=beta != 0.0, BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip
