"""Gram-based kernels (cosine matrices, raw Gram matrices, squared distances): split-D Gram
partials, a fixed-order segment reduction, and one finalisation kernel (the mirrored triangle,
then cosines with norms, clamp, unit diagonal and optional mean over layers; or the Gram as is;
or squared distances with a zero diagonal).

With `reduce` (a sharded server) the reduced Gram (mirrored: exactly symmetric) and squared
norms are upcast to float64 and packed into one tensor, summed over the shards by one `reduce`
call, and the finalisation runs in float64 on the sums.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .._partials import Reduce, mirror_upper, summed, summed_grams
from ._common import acc_dtype, config, next_pow2, num_sms, tile_table
from .segmented import seg_reduce


@triton.jit
def _gram_partial_kernel(
    x_ptr, y_ptr, gpart_ptr, xn_ptr, yn_ptr, pair_i_ptr, pair_j_ptr, t_start_ptr, t_end_ptr,
    K, M, stride_x, stride_y,
    IS_SELF: tl.constexpr, IS_F64: tl.constexpr, NATIVE_HALF: tl.constexpr,
    BK: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """gpart[t, i, j] = <x_i, y_j> over tile t for one (BK x BM) block; with another matrix also
    the squared row norms of both sides (written by the first block column / row only)."""
    t = tl.program_id(0)
    p = tl.program_id(1)
    pi = tl.load(pair_i_ptr + p)
    pj = tl.load(pair_j_ptr + p)
    acc_ty = gpart_ptr.dtype.element_ty
    start = tl.load(t_start_ptr + t)
    end = tl.load(t_end_ptr + t)
    rows = pi * BK + tl.arange(0, BK)
    cols = pj * BM + tl.arange(0, BM)
    rm = rows < K
    cm = cols < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    y_rows = y_ptr + cols.to(tl.int64)[:, None] * stride_y
    acc = tl.zeros([BK, BM], dtype=acc_ty)
    xn = tl.zeros([BK], dtype=acc_ty)
    yn = tl.zeros([BM], dtype=acc_ty)
    for off in range(start, end, BD):
        d = off + tl.arange(0, BD)
        dm = d < end
        xt = tl.load(x_rows + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
        yt = tl.load(y_rows + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0)
        if IS_F64:
            # tl.dot has no float64: broadcast multiply and reduce along D.
            xf = xt.to(tl.float64)
            yf = yt.to(tl.float64)
            acc += tl.sum(xf[:, None, :] * yf[None, :, :], axis=2)
        elif NATIVE_HALF:
            # Half products are exact in float32, so tensor cores with a float32 accumulator
            # lose nothing against converting first.
            xf = xt.to(tl.float32)
            yf = yt.to(tl.float32)
            acc = tl.dot(xt, tl.trans(yt), acc, out_dtype=tl.float32)
        else:
            # ieee: the CUDA default tf32 costs about 1e-3 relative, too much for cosines.
            xf = xt.to(tl.float32)
            yf = yt.to(tl.float32)
            acc = tl.dot(xf, tl.trans(yf), acc, input_precision="ieee")
        if not IS_SELF:
            xn += tl.sum(xf * xf, axis=1)
            yn += tl.sum(yf * yf, axis=1)
    base = gpart_ptr + t.to(tl.int64) * K * M
    tl.store(base + rows[:, None] * M + cols[None, :], acc, mask=rm[:, None] & cm[None, :])
    if not IS_SELF:
        if pj == 0:
            tl.store(xn_ptr + t.to(tl.int64) * K + rows, xn, mask=rm)
        if pi == 0:
            tl.store(yn_ptr + t.to(tl.int64) * M + cols, yn, mask=cm)


# What the finalisation kernel writes from the Gram partial sums.
COSINE, GRAM, SQ_DIST = 0, 1, 2


@triton.jit
def _finalize_kernel(
    g_ptr, xn_ptr, yn_ptr, seg_len_ptr, out_ptr, K, M, L, count,
    IS_SELF: tl.constexpr, MEAN: tl.constexpr, KIND: tl.constexpr,
    BK: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """From the reduced Gram of segment l and the squared norms: cosines (or their mean over the
    non-empty segments), the Gram itself, or squared distances (KIND = COSINE, GRAM, SQ_DIST)."""
    pl = tl.program_id(0)
    pi = tl.program_id(1)
    pj = tl.program_id(2)
    acc_ty = g_ptr.dtype.element_ty
    rows = pi * BK + tl.arange(0, BK)
    cols = pj * BM + tl.arange(0, BM)
    rm = rows < K
    cm = cols < M
    m2 = rm[:, None] & cm[None, :]
    diag = rows[:, None] == cols[None, :]
    if MEAN:
        l0 = 0
        l1 = L
    else:
        l0 = pl
        l1 = pl + 1
    total = tl.zeros([BK, BM], dtype=acc_ty)
    for l in range(l0, l1):
        base = g_ptr + l * K * M
        if IS_SELF:
            # Only the upper triangle of the Gram was computed: reading G[min, max] mirrors it,
            # which makes the result exactly symmetric.
            lo = tl.minimum(rows[:, None], cols[None, :])
            hi = tl.maximum(rows[:, None], cols[None, :])
            dot = tl.load(base + lo * M + hi, mask=m2, other=0.0)
            ni2 = tl.load(base + rows * (M + 1), mask=rm, other=0.0)
            nj2 = tl.load(base + cols * (M + 1), mask=cm, other=0.0)
        else:
            dot = tl.load(base + rows[:, None] * M + cols[None, :], mask=m2, other=0.0)
            ni2 = tl.load(xn_ptr + l * K + rows, mask=rm, other=0.0)
            nj2 = tl.load(yn_ptr + l * M + cols, mask=cm, other=0.0)
        if KIND == 0:
            ni = tl.sqrt(ni2)
            nj = tl.sqrt(nj2)
            den = ni[:, None] * nj[None, :]
            ok = den > 0
            cos = tl.where(ok, dot / tl.where(ok, den, 1.0), 0.0)
            cos = tl.minimum(tl.maximum(cos, -1.0), 1.0)
            if IS_SELF:
                unit = tl.where(ni > 0, 1.0, 0.0).to(acc_ty)
                cos = tl.where(diag, unit[:, None], cos)
            if MEAN:
                nonempty = tl.load(seg_len_ptr + l) > 0
                total += tl.where(nonempty, cos, 0.0)
            else:
                total = cos
        elif KIND == 1:
            total = dot
        else:
            # n_i + n_j - 2 G_ij formed in float64 and rounded once; the two float32 sums
            # it cancels are exact in float64.
            n2 = ni2.to(tl.float64)[:, None] + nj2.to(tl.float64)[None, :]
            dist = tl.maximum(n2 - 2.0 * dot.to(tl.float64), 0.0)
            if IS_SELF:
                dist = tl.where(diag, 0.0, dist)
            total = dist.to(acc_ty)
    if MEAN:
        # A division (not a product with 1/count) keeps an all-ones diagonal exactly 1.
        total = total / count
    tl.store(out_ptr + pl * K * M + rows[:, None] * M + cols[None, :], total, mask=m2)


def _block_pairs(nb_i: int, nb_j: int, upper: bool, device: torch.device) -> torch.Tensor:
    """[2, P] (i, j) block pairs; the self case needs only the upper triangle (j >= i)."""
    ii, jj = np.meshgrid(np.arange(nb_i), np.arange(nb_j), indexing="ij")
    keep = (jj >= ii) if upper else np.ones_like(ii, dtype=bool)
    pairs = np.stack([ii[keep], jj[keep]]).astype(np.int64)
    return torch.from_numpy(pairs).to(device)


def _gram_blocks(X: torch.Tensor) -> tuple[int, int, int]:
    """(BK, BM, BD) for the Gram kernel."""
    if X.dtype == torch.float64:
        # The float64 path materialises a [BK, BM, BD] product: keep it small on a GPU.
        return (16, 16, 16) if X.is_cuda else (32, 32, 64)
    if X.is_cuda:
        return 64, 64, 32
    # The interpreter runs each tl.dot as one numpy matmul: few big steps are fastest.
    return 64, 64, 512


def _gram_tile(X: torch.Tensor, D: int, n_pairs: int, bd: int) -> int:
    """Elements per split-D tile: enough programs to fill the GPU, few for the interpreter."""
    if not X.is_cuda:
        return max(bd, config(X).tile * 4)
    target = 4 * num_sms(X.device)
    want_tiles = max(1, -(-target // max(1, n_pairs)))
    tile = -(-max(1, D) // want_tiles)
    return max(8 * bd, -(-tile // bd) * bd)


def _segment_grams(
    X: torch.Tensor, offs: torch.Tensor, Y: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-segment Gram [L, K, M] (upper blocks only when Y is None) and squared row norms
    [L, K], [L, M] (only when Y is given; otherwise the Gram diagonal holds them)."""
    is_self = Y is None
    Yt = X if is_self else Y
    K, D = X.shape
    M = Yt.shape[0]
    acc = acc_dtype(X)
    bk, bm, bd = _gram_blocks(X)
    bk = min(bk, max(16, next_pow2(K)))
    bm = min(bm, max(16, next_pow2(M)))
    if is_self:
        bm = bk  # one block grid, so mirrored pairs line up with whole blocks
    nb_i, nb_j = triton.cdiv(K, bk), triton.cdiv(M, bm)
    pairs = _block_pairs(nb_i, nb_j, is_self, X.device)
    tile = _gram_tile(X, D, pairs.shape[1], bd)
    tt = tile_table(offs, tile, X.device)
    L = tt.num_segs
    gram = torch.zeros(L, K, M, dtype=acc, device=X.device)
    xn = torch.zeros(L, K, dtype=acc, device=X.device)
    yn = torch.zeros(L, M, dtype=acc, device=X.device)
    if tt.num_tiles == 0 or K == 0 or M == 0:
        return gram, xn, yn
    gpart = torch.empty(tt.num_tiles, K * M, dtype=acc, device=X.device)
    if is_self:
        # Never written in the self case; gpart stands in so no null pointer reaches a launch.
        xpart = ypart = gpart
    else:
        xpart = torch.empty(tt.num_tiles, K, dtype=acc, device=X.device)
        ypart = torch.empty(tt.num_tiles, M, dtype=acc, device=X.device)
    half = X.dtype in (torch.float16, torch.bfloat16)
    _gram_partial_kernel[(tt.num_tiles, pairs.shape[1])](
        X, Yt, gpart, xpart, ypart, pairs[0], pairs[1], tt.start, tt.end,
        K, M, X.stride(0), Yt.stride(0),
        IS_SELF=is_self, IS_F64=X.dtype == torch.float64, NATIVE_HALF=half and X.is_cuda,
        BK=bk, BM=bm, BD=bd, num_warps=4,
    )  # fmt: skip
    seg_reduce(gpart, tt, gram.view(L, K * M))
    if not is_self:
        seg_reduce(xpart, tt, xn)
        seg_reduce(ypart, tt, yn)
    return gram, xn, yn


def _finalize(
    gram: torch.Tensor,
    xn: torch.Tensor,
    yn: torch.Tensor,
    seg_len: torch.Tensor,
    is_self: bool,
    mean_count: int,
    kind: int = COSINE,
) -> torch.Tensor:
    """Cosines per segment [L, K, M], or their mean over non-empty segments [K, M]; with
    `kind` GRAM or SQ_DIST (mean_count 0), the Gram or squared distances per segment."""
    L, K, M = gram.shape
    mean = mean_count > 0
    out = torch.empty(1 if mean else L, K, M, dtype=gram.dtype, device=gram.device)
    if out.numel() == 0:
        return out[0] if mean else out
    bk = min(64, max(16, next_pow2(K)))
    bm = min(64, max(16, next_pow2(M)))
    grid = (out.shape[0], triton.cdiv(K, bk), triton.cdiv(M, bm))
    _finalize_kernel[grid](
        gram, xn, yn, seg_len, out, K, M, L, max(1, mean_count),
        IS_SELF=is_self, MEAN=mean, KIND=kind, BK=bk, BM=bm, num_warps=4,
    )  # fmt: skip
    return out[0] if mean else out


def _summed_grams(
    gram: torch.Tensor,
    xn: torch.Tensor,
    yn: torch.Tensor,
    is_self: bool,
    reduce: Reduce,
    kind: int = COSINE,
    squeeze: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_segment_grams`' output in float64, summed over the shards by one `reduce` in
    `summed_grams`' packing; a Gram against another matrix without norms (`gram_matrix`) goes
    as the [K, M] Gram alone. ``squeeze``: the whole-row kernels' packing (no segment
    dimension)."""
    f64 = torch.float64
    if is_self or kind != GRAM:
        G, sx, sy = summed_grams(
            reduce, gram, None if is_self else xn, None if is_self else yn,
            self_gram=is_self, squeeze=squeeze,
        )  # fmt: skip
        if sx is None or sy is None:  # self: the Gram diagonal holds the norms
            return G, xn.to(f64), yn.to(f64)
        return G.contiguous(), sx.contiguous(), sy.contiguous()
    packed = (gram[0] if squeeze else gram).to(f64)
    return summed(reduce, packed).reshape(gram.shape), xn.to(f64), yn.to(f64)


def cosine_matrix(
    X: torch.Tensor,
    offs: torch.Tensor,
    other: torch.Tensor | None,
    layerwise: bool,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    """[K, K] / [K, M] cosine similarities, or per segment [L, K, K] / [L, K, M]."""
    if not layerwise:
        # The whole-vector Gram is the same number whatever the segmentation: one segment
        # lets tiles span layer boundaries.
        offs = torch.tensor([0, X.shape[1]], dtype=torch.int64)
    gram, xn, yn = _segment_grams(X, offs, other)
    if reduce is not None:
        gram, xn, yn = _summed_grams(gram, xn, yn, other is None, reduce)
    seg_len = (offs[1:] - offs[:-1]).to(X.device)
    cos = _finalize(gram, xn, yn, seg_len, other is None, 0)
    return cos if layerwise else cos[0]


def _whole_row(
    X: torch.Tensor, other: torch.Tensor | None, kind: int, reduce: Reduce | None
) -> torch.Tensor:
    """[K, K] / [K, M] Gram or squared distances of the whole rows (one segment)."""
    offs = torch.tensor([0, X.shape[1]], dtype=torch.int64)
    gram, xn, yn = _segment_grams(X, offs, other)
    if reduce is not None:
        gram, xn, yn = _summed_grams(gram, xn, yn, other is None, reduce, kind, squeeze=True)
    seg_len = (offs[1:] - offs[:-1]).to(X.device)
    return _finalize(gram, xn, yn, seg_len, other is None, 0, kind)[0]


def gram_matrix(
    X: torch.Tensor, other: torch.Tensor | None, reduce: Reduce | None = None
) -> torch.Tensor:
    """[K, K] / [K, M] inner products; the self Gram mirrored from its upper triangle."""
    return _whole_row(X, other, GRAM, reduce)


def pairwise_sq_distances(
    X: torch.Tensor, other: torch.Tensor | None, reduce: Reduce | None = None
) -> torch.Tensor:
    """[K, K] / [K, M] max(|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>, 0); self: zero diagonal."""
    return _whole_row(X, other, SQ_DIST, reduce)


def layer_normalized_cosine(
    X: torch.Tensor, offs: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    """[K, K] mean over non-empty segments of the per-segment cosine matrices."""
    K = X.shape[0]
    seg_len = (offs[1:] - offs[:-1]).to(X.device)
    if reduce is None:
        count = int((offs[1:] > offs[:-1]).sum())
        if count == 0:
            return torch.zeros(K, K, dtype=acc_dtype(X), device=X.device)
        gram, xn, yn = _segment_grams(X, offs, None)
        return _finalize(gram, xn, yn, seg_len, True, count)
    # One reduce of every segment's mirrored Gram (zeros where this slice has none of it) and
    # this slice's segment lengths: a segment is non-empty when its whole-model length is > 0.
    gram, xn, yn = _segment_grams(X, offs, None)
    L = gram.shape[0]
    f64 = torch.float64
    packed = [mirror_upper(gram).to(f64).reshape(L, K * K), seg_len[:, None].to(f64)]
    sums = reduce(torch.cat(packed, dim=1))
    seg_len = sums[:, K * K].contiguous()
    count = int((seg_len > 0).sum())
    if count == 0:
        return torch.zeros(K, K, dtype=f64, device=X.device)
    gram = sums[:, : K * K].reshape(L, K, K).contiguous()
    return _finalize(gram, xn.to(f64), yn.to(f64), seg_len, True, count)
