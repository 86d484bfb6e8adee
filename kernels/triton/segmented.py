"""Segmented reductions over the flat layout: layer_dots, project_out, orthogonal_calibrate.

Every kernel walks a tile table (segments cut into tiles of at most `tile` elements): pass 1
writes one partial sum per (tile, row), `seg_reduce` sums each segment's tiles in a fixed order
(deterministic, no atomics), and the elementwise pass 2 reads its segment's coefficient per tile.
With `reduce` (a sharded server) the segment sums are upcast to float64 and summed over the
shards by one `reduce` call before the coefficients are formed (in float64, then rounded to the
accumulation dtype for pass 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._partials import Reduce
from ._common import acc_dtype, config, next_pow2, tile_table
from ._streams import column_block, copy_span, entry_span, tile_and_row


@triton.jit
def _dots_partial_kernel(
    a_ptr, b_ptr, part_ptr, t_start_ptr, t_end_ptr, stride_a, stride_b, K,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """part[t, k] = sum over tile t of a[k] * b[k] (b broadcast when stride_b == 0)."""
    t, k, start, end = tile_and_row(t_start_ptr, t_end_ptr)
    acc_ty = part_ptr.dtype.element_ty
    a_row = a_ptr + k.to(tl.int64) * stride_a
    b_row = b_ptr + k.to(tl.int64) * stride_b
    acc = tl.zeros([BLOCK], dtype=acc_ty)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        # Convert right after the load: half arithmetic is not what we want (and bfloat16 is
        # wrong under the interpreter).
        a = tl.load(a_row + idx, mask=m, other=0.0).to(acc_ty)
        b = tl.load(b_row + idx, mask=m, other=0.0).to(acc_ty)
        acc += a * b
    tl.store(part_ptr + t.to(tl.int64) * K + k, tl.sum(acc, axis=0))


@triton.jit
def _seg_reduce_kernel(
    part_ptr, seg_tile_ptr, out_ptr, W, stride_ol, stride_ow,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    """out[l, w] = sum of part[t, w] over the tiles t of segment l, in tile order."""
    l = tl.program_id(0)
    cols, m = column_block(1, W, BLOCK_W)
    t0, t1 = entry_span(seg_tile_ptr, l)
    acc = tl.zeros([BLOCK_W], dtype=out_ptr.dtype.element_ty)
    for t in range(t0, t1):
        acc += tl.load(part_ptr + t * W + cols, mask=m, other=0.0)
    tl.store(out_ptr + l * stride_ol + cols * stride_ow, acc, mask=m)


@triton.jit
def _project_apply_kernel(
    g_ptr, b_ptr, out_ptr, coef_ptr, t_start_ptr, t_end_ptr, t_seg_ptr,
    stride_g, stride_o, L,
    SKIP_ZERO: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[k] = g[k] - c[k, seg] * b on tile t; a zero coefficient copies g bit for bit."""
    t, k, start, end = tile_and_row(t_start_ptr, t_end_ptr)
    seg = tl.load(t_seg_ptr + t)
    c = tl.load(coef_ptr + k * L + seg)
    acc_ty = coef_ptr.dtype.element_ty
    g_row = g_ptr + k.to(tl.int64) * stride_g
    o_row = out_ptr + k.to(tl.int64) * stride_o
    if c == 0:
        # Untouched segment: with out = g there is nothing to write at all.
        if not SKIP_ZERO:
            copy_span(g_row, o_row, start, end, BLOCK)
    else:
        for off in range(start, end, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < end
            g = tl.load(g_row + idx, mask=m, other=0.0).to(acc_ty)
            b = tl.load(b_ptr + idx, mask=m, other=0.0).to(acc_ty)
            tl.store(o_row + idx, (g - c * b).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _calib_loads(x_ptr, sent_ptr, w_ptr, snap_ptr, idx, m, acc_ty: tl.constexpr):
    """ORTHOFL's four vectors (x, sent, w, snap) on one block, in the accumulation dtype."""
    x = tl.load(x_ptr + idx, mask=m, other=0.0).to(acc_ty)
    s = tl.load(sent_ptr + idx, mask=m, other=0.0).to(acc_ty)
    w = tl.load(w_ptr + idx, mask=m, other=0.0).to(acc_ty)
    p = tl.load(snap_ptr + idx, mask=m, other=0.0).to(acc_ty)
    return x, s, w, p


@triton.jit
def _calib_partial_kernel(
    x_ptr, sent_ptr, w_ptr, snap_ptr, part_ptr, cal_ptr, t_start_ptr, t_end_ptr, t_seg_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """part[t] = (<dg, dm>, <dm, dm>) over tile t, dm = x - sent, dg = w - snap."""
    t = tl.program_id(0)
    acc_ty = part_ptr.dtype.element_ty
    start = tl.load(t_start_ptr + t)
    end = tl.load(t_end_ptr + t)
    cal = tl.load(cal_ptr + tl.load(t_seg_ptr + t))
    acc_gm = tl.zeros([BLOCK], dtype=acc_ty)
    acc_mm = tl.zeros([BLOCK], dtype=acc_ty)
    # A segment that is not calibrated gets coefficient 0 whatever its dots: skip its bytes.
    if cal != 0:
        for off in range(start, end, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < end
            x, s, w, p = _calib_loads(x_ptr, sent_ptr, w_ptr, snap_ptr, idx, m, acc_ty)
            dm = x - s
            dg = w - p
            acc_gm += dg * dm
            acc_mm += dm * dm
    tl.store(part_ptr + t * 2, tl.sum(acc_gm, axis=0))
    tl.store(part_ptr + t * 2 + 1, tl.sum(acc_mm, axis=0))


@triton.jit
def _calib_apply_kernel(
    x_ptr, sent_ptr, w_ptr, snap_ptr, ma_ptr, y_ptr, ma_out_ptr, coef_ptr, cal_ptr, par_ptr,
    t_start_ptr, t_end_ptr, t_seg_ptr,
    Y_IS_X: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """y = x + (dg - c dm) on calibrated segments (x bitwise elsewhere); ma' = (1-b) ma + b x."""
    t = tl.program_id(0)
    acc_ty = coef_ptr.dtype.element_ty
    start = tl.load(t_start_ptr + t)
    end = tl.load(t_end_ptr + t)
    seg = tl.load(t_seg_ptr + t)
    cal = tl.load(cal_ptr + seg)
    c = tl.load(coef_ptr + seg)
    # beta and 1 - beta come in a device tensor so float64 data keeps a float64 beta.
    beta = tl.load(par_ptr)
    omb = tl.load(par_ptr + 1)
    # Every load of a block precedes its stores: ma may be w, out_ma may be ma, out_y may be x.
    if cal != 0:
        for off in range(start, end, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < end
            x, s, w, p = _calib_loads(x_ptr, sent_ptr, w_ptr, snap_ptr, idx, m, acc_ty)
            ma = tl.load(ma_ptr + idx, mask=m, other=0.0).to(acc_ty)
            y = x + ((w - p) - c * (x - s))
            tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=m)
            tl.store(
                ma_out_ptr + idx, (omb * ma + beta * x).to(ma_out_ptr.dtype.element_ty), mask=m
            )
    else:
        for off in range(start, end, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < end
            xr = tl.load(x_ptr + idx, mask=m, other=0.0)
            ma = tl.load(ma_ptr + idx, mask=m, other=0.0).to(acc_ty)
            if not Y_IS_X:
                tl.store(y_ptr + idx, xr, mask=m)
            x = xr.to(acc_ty)
            tl.store(
                ma_out_ptr + idx, (omb * ma + beta * x).to(ma_out_ptr.dtype.element_ty), mask=m
            )


def seg_reduce(part: torch.Tensor, tt, out: torch.Tensor) -> None:
    """Sum the [T, W] partials of each segment's tiles into out[L, W] (out may be a transposed
    view: only its strides are used)."""
    L = tt.num_segs
    W = part.shape[1]
    if L == 0 or W == 0:
        return
    block_w = min(1024, next_pow2(W))
    grid = (L, triton.cdiv(W, block_w))
    _seg_reduce_kernel[grid](
        part, tt.seg_tile, out, W, out.stride(0), out.stride(1), BLOCK_W=block_w
    )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def layer_dots(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    """[K, L] per-segment dots of paired rows (b broadcast when it has one row), in acc dtype;
    with `reduce`, their float64 sum over the shards."""
    out = _layer_dots(a, b, offs)
    return out if reduce is None else reduce(out.to(torch.float64).contiguous())


def _layer_dots(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    K = a.shape[0]
    cfg = config(a)
    tt = tile_table(offs, cfg.tile, a.device)
    acc = acc_dtype(a)
    out = torch.zeros(K, tt.num_segs, dtype=acc, device=a.device)
    if tt.num_tiles == 0 or K == 0:
        return out
    part = torch.empty(tt.num_tiles, K, dtype=acc, device=a.device)
    stride_b = 0 if b.shape[0] == 1 else b.stride(0)
    _dots_partial_kernel[(tt.num_tiles, K)](
        a, b, part, tt.start, tt.end, a.stride(0), stride_b, K,
        BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip
    # out is [K, L]; reduce into its transpose so partials stay [T, K] (coalesced over K).
    seg_reduce(part, tt, out.t())
    return out


def project_out(
    g: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    only_conflicting: bool,
    eps: float,
    out: torch.Tensor,
    reduce: Reduce | None = None,
) -> None:
    """out = g - c b per segment with c = <g,b>/<b,b> (0 for a tiny basis, <= 0 if asked)."""
    K = g.shape[0]
    cfg = config(g)
    tt = tile_table(offs, cfg.tile, g.device)
    if (tt.num_tiles == 0 or K == 0) and reduce is None:
        return
    gb = _layer_dots(g, b, offs)  # [K, L]
    bb = _layer_dots(b, b, offs)[0]  # [L]: one row, cheap next to the K rows of g
    if reduce is not None:
        # One reduce of the [K+1, L] dots; c is formed in float64 and rounded once for pass 2.
        sums = reduce(torch.cat([gb, bb[None]]).to(torch.float64).contiguous())
        gb, bb = sums[:K], sums[K]
        if tt.num_tiles == 0 or K == 0:
            return
    ok = bb > eps
    c = torch.where(ok, gb / torch.where(ok, bb, torch.ones_like(bb)), torch.zeros_like(gb))
    if only_conflicting:
        c = torch.clamp(c, max=0.0)
    c = c.to(acc_dtype(g)).contiguous()
    _project_apply_kernel[(tt.num_tiles, K)](
        g, b, out, c, tt.start, tt.end, tt.seg, g.stride(0), out.stride(0), tt.num_segs,
        SKIP_ZERO=_same_view(g, out), BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip


def orthogonal_calibrate(
    x: torch.Tensor,
    sent: torch.Tensor,
    w: torch.Tensor,
    snap: torch.Tensor,
    ma: torch.Tensor,
    offs: torch.Tensor,
    beta: float,
    calibrate: torch.Tensor,
    eps: float,
    out_y: torch.Tensor,
    out_ma: torch.Tensor,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    """ORTHOFL in two passes: per-segment coefficients, then y and the moving average."""
    cfg = config(x)
    acc = acc_dtype(x)
    tt = tile_table(offs, cfg.tile, x.device)
    L = tt.num_segs
    coeffs = torch.zeros(L, dtype=acc, device=x.device)
    if tt.num_tiles == 0 and reduce is None:
        return coeffs
    cal = calibrate.to(device=x.device, dtype=torch.int32)
    dots = torch.zeros(L, 2, dtype=acc, device=x.device)
    if tt.num_tiles:
        part = torch.empty(tt.num_tiles, 2, dtype=acc, device=x.device)
        _calib_partial_kernel[(tt.num_tiles,)](
            x, sent, w, snap, part, cal, tt.start, tt.end, tt.seg,
            BLOCK=cfg.block, num_warps=cfg.num_warps,
        )  # fmt: skip
        seg_reduce(part, tt, dots)
    num, den = dots[:, 0], dots[:, 1]
    if reduce is not None:
        # One reduce of the [2, L] sums (0 where calibrate is False: those tiles are skipped);
        # the coefficients are formed in float64 and returned so, rounded once for pass 2.
        num, den = reduce(dots.T.to(torch.float64).contiguous())
        coeffs = coeffs.to(torch.float64)
    ok = (den > eps) & (cal != 0)
    coeffs = torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), coeffs)
    if tt.num_tiles == 0:
        return coeffs
    c_acc = coeffs.to(acc)
    par = torch.tensor([beta, 1.0 - beta], dtype=torch.float64).to(device=x.device, dtype=acc)
    _calib_apply_kernel[(tt.num_tiles,)](
        x, sent, w, snap, ma, out_y, out_ma, c_acc, cal, par, tt.start, tt.end, tt.seg,
        Y_IS_X=_same_view(x, out_y), BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip
    return coeffs
