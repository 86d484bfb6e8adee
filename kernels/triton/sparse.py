"""Updates folded into rows: nnz_per_layer (tile counts, summed per segment in tile order),
sparse_accumulate (one program per block of strictly increasing indices: no two programs touch
the same element, so no atomics are needed) and accumulate (the dense case, a block each)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._partials import Reduce
from ._common import acc_dtype, config, tile_table
from ._streams import tile_and_row
from .segmented import seg_reduce


@triton.jit
def _nnz_partial_kernel(
    x_ptr, part_ptr, ts_ptr, te_ptr, stride_x, K, BLOCK: tl.constexpr,
):  # fmt: skip
    """part[t, k] = number of non-zero elements of row k in tile t (as float64, exact)."""
    t, k, s, e = tile_and_row(ts_ptr, te_ptr)
    row = x_ptr + k.to(tl.int64) * stride_x
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(s, e, BLOCK):
        idx = b + tl.arange(0, BLOCK)
        m = idx < e
        # Converted right after the load: the interpreter's bfloat16 arithmetic is wrong
        # (docs/design.md "Measured platform facts").
        v = tl.load(row + idx, mask=m, other=0.0).to(tl.float32)
        acc += (v != 0).to(tl.int32)
    tl.store(part_ptr + t.to(tl.int64) * K + k, tl.sum(acc, axis=0).to(tl.float64))


@triton.jit
def _sparse_acc_kernel(
    out_ptr, idx_ptr, val_ptr, w_ptr, n, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[idx[j]] += weight * val[j] for the j of this block, in w_ptr's dtype."""
    pid = tl.program_id(0)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    m = j < n
    acc_ty = w_ptr.dtype.element_ty
    # The weight comes from memory: a Python float argument would be a float32 on the GPU.
    weight = tl.load(w_ptr)
    i = tl.load(idx_ptr + j, mask=m, other=0).to(tl.int64)
    v = tl.load(val_ptr + j, mask=m, other=0.0)
    o = tl.load(out_ptr + i, mask=m, other=0.0)
    r = o.to(acc_ty) + weight * v.to(acc_ty)
    tl.store(out_ptr + i, r.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dense_acc_kernel(acc_ptr, x_ptr, w_ptr, n, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """acc[i] += weight * x[i] for the i of this block, in float64, rounded once to acc's."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    weight = tl.load(w_ptr)  # float64 from memory: a Python float would be a float32 here
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    if HALF:  # the interpreter's bfloat16 arithmetic is wrong: widen right after the load
        x = x.to(tl.float32)
    a = tl.load(acc_ptr + i, mask=m, other=0.0).to(tl.float64)
    tl.store(acc_ptr + i, (a + weight * x.to(tl.float64)).to(acc_ptr.dtype.element_ty), mask=m)


def accumulate(acc: torch.Tensor, x: torch.Tensor, weight: float) -> None:
    n = acc.numel()
    cfg = config(acc)
    w = torch.tensor([weight], dtype=torch.float64, device=acc.device)
    half = x.dtype in (torch.float16, torch.bfloat16)
    # No fused multiply-add: the product and the sum are each rounded, as on the CPU.
    _dense_acc_kernel[(triton.cdiv(n, cfg.block),)](
        acc, x, w, n, HALF=half, BLOCK=cfg.block, num_warps=cfg.num_warps,
        enable_fp_fusion=False,
    )  # fmt: skip


def nnz_per_layer(
    X: torch.Tensor,
    offs: torch.Tensor,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    """[K, L] int64 counts; with `reduce`, the float64 counts (exact) summed over the shards."""
    K, D = X.shape
    L = offs.numel() - 1
    cfg = config(X)
    tt = tile_table(offs, cfg.tile, X.device)
    sums = torch.zeros(K, L, dtype=torch.float64, device=X.device)
    if tt.num_tiles and K:
        part = torch.empty(tt.num_tiles, K, dtype=torch.float64, device=X.device)
        _nnz_partial_kernel[(tt.num_tiles, K)](
            X, part, tt.start, tt.end, X.stride(0), K,
            BLOCK=cfg.block, num_warps=cfg.num_warps,
        )  # fmt: skip
        seg_reduce(part, tt, sums.T)  # [L, K] view: segments whose tiles are none stay 0
    if reduce is not None:
        sums = reduce(sums)
    return sums.round().to(torch.int64)


def sparse_accumulate(
    out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, weight: float
) -> None:
    n = indices.numel()
    if n == 0:
        return
    cfg = config(out)
    block = cfg.block
    w = torch.tensor([weight], dtype=torch.float64).to(device=out.device, dtype=acc_dtype(out))
    _sparse_acc_kernel[(triton.cdiv(n, block),)](
        out, indices, values, w, n, BLOCK=block, num_warps=cfg.num_warps,
    )  # fmt: skip
