"""quantized_accumulate (out = base + weight * (float32(code) * scale), base usually out) and
dequantize (out = float32(code) * scale), one pass over the codes: one program per BLOCK of
elements, each reading its scales by index, so quantization blocks of any size work."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import code_squares
from ._common import acc_dtype, config


@triton.jit
def _codes(codes_ptr, i, m, BITS: tl.constexpr):
    """The signed codes of elements i (int32)."""
    if BITS == 8:
        q = tl.load(codes_ptr + i, mask=m, other=0).to(tl.int32)
    else:
        byte = tl.load(codes_ptr + (i >> 1), mask=m, other=0).to(tl.int32)
        nib = tl.where((i & 1) == 1, byte >> 4, byte & 15)
        q = tl.where(nib >= 8, nib - 16, nib)
    return q


@triton.jit
def _dequantize_kernel(out_ptr, codes_ptr, scales_ptr, n, block, BITS: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(scales_ptr + i // block, mask=m, other=0.0)
    v = _codes(codes_ptr, i, m, BITS).to(tl.float32) * s
    tl.store(out_ptr + i, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _quantized_acc_kernel(
    out_ptr, base_ptr, codes_ptr, scales_ptr, w_ptr, n, block, BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    acc_ty = w_ptr.dtype.element_ty
    # The weight comes from memory: a Python float argument would be a float32 on the GPU.
    weight = tl.load(w_ptr)
    q = _codes(codes_ptr, i, m, BITS)
    s = tl.load(scales_ptr + i // block, mask=m, other=0.0)
    v = q.to(tl.float32) * s  # the wire's binary32 decode
    o = tl.load(base_ptr + i, mask=m, other=0.0)  # base is out itself for out += ...
    r = o.to(acc_ty) + weight * v.to(acc_ty)
    tl.store(out_ptr + i, r.to(out_ptr.dtype.element_ty), mask=m)


def quantized_accumulate(
    out: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    weight: float,
    bits: int,
    base: torch.Tensor,
    squares: torch.Tensor | None = None,
) -> None:
    n = out.numel()
    if squares is not None:  # a separate pass of torch operations (not fused on the GPU)
        squares.copy_(code_squares(codes, scales, block, bits, n))
    cfg = config(out)
    w = torch.tensor([weight], dtype=torch.float64).to(device=out.device, dtype=acc_dtype(out))
    _quantized_acc_kernel[(triton.cdiv(n, cfg.block),)](
        out, base, codes, scales, w, n, block, BITS=bits, BLOCK=cfg.block,
        num_warps=cfg.num_warps,
    )  # fmt: skip


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block: int, bits: int, out: torch.Tensor
) -> None:
    n = out.numel()
    cfg = config(out)
    _dequantize_kernel[(triton.cdiv(n, cfg.block),)](
        out, codes, scales, n, block, BITS=bits, BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip
