"""Quantized rows: quantize_rows (one program per (row, quantization block): its absmax, then its
codes), the decoding row combination behind quantized_weighted_sum / quantized_group_means (one
program per column block and group, rows in a fixed order), and quantized_gram (columns decoded
a chunk at a time, multiplied by cuBLAS in float32, the chunks summed in float64)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .._partials import mirror_upper
from ._common import config
from ._streams import column_block, entry_span


@triton.jit
def _round_half_even(v):
    """v rounded to the nearest integer, ties to even (|v| < 2^23: every step exact)."""
    f = tl.floor(v)
    d = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, D, nblocks, stride_x, block,
                          BLOCK: tl.constexpr):  # fmt: skip
    # Blocks on grid axis 0 (up to 2^31 - 1 programs); rows on axis 1 (at most 65,535 there).
    b = tl.program_id(0)
    k = tl.program_id(1)
    lo = b.to(tl.int64) * block
    hi = tl.minimum(lo + block, D)
    row = x_ptr + k.to(tl.int64) * stride_x
    m = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(lo, hi, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < hi, other=0.0).to(tl.float32)
        a = tl.abs(x)
        m = tl.where((a > m) | (a != a), a, m)  # a NaN stays, and is refused by its scale
    amax = tl.max(m, axis=0)
    nan = tl.max((m != m).to(tl.int32), axis=0) > 0
    amax = tl.where(nan, float("nan"), amax)
    s = tl.div_rn(amax, 127.0)  # binary32 division, correctly rounded (plain / may not be)
    tl.store(scales_ptr + k.to(tl.int64) * nblocks + b, s)
    ok = (s > 0) & (s < float("inf"))
    safe = tl.where(ok, s, 1.0)
    out = codes_ptr + k.to(tl.int64) * D
    for off in range(lo, hi, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < hi, other=0.0).to(tl.float32)
        x = tl.where(ok, x, 0.0)  # a refused block's codes are 0, without arithmetic on Inf/NaN
        q = tl.clamp(_round_half_even(tl.div_rn(x, safe)), -127.0, 127.0)
        tl.store(out + idx, q.to(tl.int8), mask=idx < hi)


def quantize_rows(X: torch.Tensor, block: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    K, D = X.shape
    nblocks = scales.shape[1]
    cfg = config(X)
    BLOCK = min(cfg.block, triton.next_power_of_2(block))
    _quantize_rows_kernel[(nblocks, K)](
        X, codes, scales, D, nblocks, X.stride(0), block, BLOCK=BLOCK, num_warps=cfg.num_warps,
    )  # fmt: skip


@triton.jit
def _rows_combination_kernel(
    codes_ptr, scales_ptr, rows_ptr, coef_ptr, gstart_ptr, out_ptr, par_ptr, D, nblocks, block,
    READ_OUT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    acc_ty = coef_ptr.dtype.element_ty
    g = tl.program_id(1)
    idx, m = column_block(0, D, BLOCK)
    r0, r1 = entry_span(gstart_ptr, g)
    acc = tl.zeros([BLOCK], dtype=acc_ty)
    for j in range(r0, r1):
        r = tl.load(rows_ptr + j).to(tl.int64)
        w = tl.load(coef_ptr + j)
        q = tl.load(codes_ptr + r * D + idx, mask=m, other=0).to(tl.float32)
        s = tl.load(scales_ptr + r * nblocks + idx // block, mask=m, other=0.0)
        acc += w * (q * s).to(acc_ty)  # the wire's binary32 decode, then the acc dtype
    alpha = tl.load(par_ptr)
    res = alpha * acc
    out = out_ptr + g.to(tl.int64) * D + idx
    if READ_OUT:
        res = tl.load(par_ptr + 1) * tl.load(out, mask=m, other=0.0).to(acc_ty) + res
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=m)


def quantized_rows_combination(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    rows: np.ndarray,
    coef: np.ndarray,
    group_start: np.ndarray,
    out: torch.Tensor,
    alpha: float,
    beta: float,
) -> None:
    G, D = out.shape
    if G == 0 or D == 0:
        return
    dev = codes.device
    # Trailing dummy entries keep the pointers valid when no row is read.
    rows_t = torch.from_numpy(np.append(rows, 0).astype(np.int64)).to(dev)
    acc = out.dtype
    coef_t = torch.from_numpy(np.append(coef, 0.0)).to(device=dev, dtype=acc)
    start_t = torch.from_numpy(group_start.astype(np.int64)).to(dev)
    par = torch.tensor([alpha, beta], dtype=torch.float64).to(device=dev, dtype=acc)
    cfg = config(codes)
    _rows_combination_kernel[(triton.cdiv(D, cfg.block), G)](
        codes, scales, rows_t, coef_t, start_t, out, par, D, scales.shape[1], block,
        READ_OUT=beta != 0.0, BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip


@triton.jit
def _decode_columns_kernel(codes_ptr, scales_ptr, out_ptr, D, nblocks, block, c0, n,
                           BLOCK: tl.constexpr):  # fmt: skip
    k = tl.program_id(1).to(tl.int64)
    idx, m = column_block(0, n, BLOCK)
    col = c0 + idx
    q = tl.load(codes_ptr + k * D + col, mask=m, other=0).to(tl.float32)
    s = tl.load(scales_ptr + k * nblocks + col // block, mask=m, other=0.0)
    tl.store(out_ptr + k * n + idx, q * s, mask=m)


# Columns a quantized Gram decodes per chunk: a few MB of float32 per chunk for cuBLAS.
_GRAM_DECODE_BYTES = 16 << 20


def quantized_gram(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    K, D = codes.shape
    G = torch.zeros(K, K, dtype=torch.float64, device=codes.device)
    if K == 0 or D == 0:
        return G.to(torch.float32)
    cols = block * max(1, _GRAM_DECODE_BYTES // (4 * K * block))
    cfg = config(codes)
    buf = torch.empty(K * min(cols, D), dtype=torch.float32, device=codes.device)
    for c0 in range(0, D, cols):
        n = min(cols, D - c0)
        chunk = buf[: K * n].view(K, n)
        _decode_columns_kernel[(triton.cdiv(n, cfg.block), K)](
            codes, scales, chunk, D, scales.shape[1], block, c0, n,
            BLOCK=cfg.block, num_warps=cfg.num_warps,
        )  # fmt: skip
        G += torch.mm(chunk, chunk.T).to(torch.float64)
    return mirror_upper(G).to(torch.float32)
