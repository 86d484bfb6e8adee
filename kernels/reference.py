"""Float64 torch reference backend: written for clarity, it is the oracle every other backend is
tested against. Arguments are validated and normalised by `aggsrv.kernels` (see BACKENDS.md).

With `reduce` (a sharded server, docs/kernels.md "Sharded use") a kernel packs its float64
partial sums into one tensor, calls `reduce` once and derives its results from what it returns.
"""

from __future__ import annotations

import numpy as np
import torch

from ._partials import Reduce, mirror_upper, summed, summed_grams

F64 = torch.float64


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _segments(offs: torch.Tensor) -> list[tuple[int, int]]:
    o = offs.tolist()
    return list(zip(o[:-1], o[1:], strict=True))


def _seg_dots(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[K, L] float64 per-segment dots of paired rows (b broadcast when it has one row)."""
    a64, b64 = a.to(F64), b.to(F64)
    cols = [(a64[:, s:e] * b64[:, s:e]).sum(dim=1) for s, e in _segments(offs)]
    if not cols:
        return torch.zeros(a.shape[0], 0, dtype=F64, device=a.device)
    return torch.stack(cols, dim=1)


def layer_dots(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    return summed(reduce, _seg_dots(a, b, offs)).to(_acc_dtype(a))


def project_out(
    g: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    only_conflicting: bool,
    eps: float,
    out: torch.Tensor,
    reduce: Reduce | None = None,
) -> None:
    K = g.shape[0]
    sums = summed(reduce, torch.cat([_seg_dots(g, b, offs), _seg_dots(b, b, offs)]))
    gb, bb = sums[:K], sums[K]
    for l, (s, e) in enumerate(_segments(offs)):
        c = torch.zeros_like(gb[:, l]) if bb[l] <= eps else gb[:, l] / bb[l]
        if only_conflicting:
            c = torch.clamp(c, max=0.0)
        seg = g[:, s:e]
        res = seg.to(F64) - c[:, None] * b[:, s:e].to(F64)
        # A zero coefficient leaves the segment bitwise untouched (no round trip through f64).
        keep = (c == 0)[:, None]
        out[:, s:e] = torch.where(keep, seg, res.to(g.dtype))


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
    x64, sent64, w64, snap64, ma64 = (t.to(F64) for t in (x, sent, w, snap, ma))
    dm = x64 - sent64
    dg = w64 - snap64
    num, den = summed(reduce, torch.cat([_seg_dots(dg, dm, offs), _seg_dots(dm, dm, offs)]))
    coeffs = torch.zeros(len(num), dtype=F64, device=x.device)
    y = x64.clone()
    for l, (s, e) in enumerate(_segments(offs)):
        if not bool(calibrate[l]):
            continue
        c = num[l] / den[l] if den[l] > eps else torch.zeros((), dtype=F64, device=x.device)
        coeffs[l] = c
        y[:, s:e] = x64[:, s:e] + (dg[:, s:e] - c * dm[:, s:e])
    new_ma = (1.0 - beta) * ma64 + beta * x64
    # Non-calibrated segments of y are x itself, bitwise.
    y_cast = y.to(x.dtype)
    for l, (s, e) in enumerate(_segments(offs)):
        if not bool(calibrate[l]):
            y_cast[:, s:e] = x[:, s:e]
    out_y.copy_(y_cast)
    out_ma.copy_(new_ma.to(ma.dtype))
    return coeffs.to(_acc_dtype(x))


def _cosines_from_gram(
    gram: torch.Tensor, n_rows: torch.Tensor, n_cols: torch.Tensor, symmetric: bool
) -> torch.Tensor:
    """cos = dot / (|x| |y|) where both norms are > 0, else 0; clamped; exact unit diagonal."""
    denom = n_rows[:, None] * n_cols[None, :]
    cos = torch.where(denom > 0, gram / torch.where(denom > 0, denom, 1.0), 0.0)
    cos = cos.clamp(-1.0, 1.0)
    if symmetric:
        upper = torch.triu(cos, diagonal=1)
        cos = upper + upper.T
        cos.diagonal().copy_((n_rows > 0).to(cos.dtype))
    return cos


def _segment_cosines(
    X: torch.Tensor, offs: torch.Tensor, other: torch.Tensor | None, reduce: Reduce | None = None
) -> torch.Tensor:
    """[L, K, M] float64 per-segment cosines."""
    X64 = X.to(F64)
    Y64 = X64 if other is None else other.to(F64)
    if reduce is not None:
        return _segment_cosines_summed(X64, Y64, offs, other is None, reduce)
    mats = []
    for s, e in _segments(offs):
        xs, ys = X64[:, s:e], Y64[:, s:e]
        gram = xs @ ys.T
        mats.append(
            _cosines_from_gram(gram, xs.norm(dim=1), ys.norm(dim=1), symmetric=other is None)
        )
    if not mats:
        return torch.zeros(0, X.shape[0], Y64.shape[0], dtype=F64, device=X.device)
    return torch.stack(mats)


def _segment_cosines_summed(
    X64: torch.Tensor, Y64: torch.Tensor, offs: torch.Tensor, symmetric: bool, reduce: Reduce
) -> torch.Tensor:
    """[L, K, M] per-segment cosines from partial sums summed by `reduce`: the mirrored Grams
    [L, K, K] (norms on the diagonal), or [L, K*M + K + M] (Grams, squared row norms of X, of
    Y) against another matrix."""
    segs = _segments(offs)
    L = len(segs)
    grams = torch.stack([X64[:, s:e] @ Y64[:, s:e].T for s, e in segs])
    if symmetric:
        G = summed_grams(reduce, grams, self_gram=True)[0]
        norms = [G[l].diagonal().clamp_min(0.0).sqrt() for l in range(L)]
        return torch.stack([_cosines_from_gram(G[l], norms[l], norms[l], True) for l in range(L)])
    nx = torch.stack([(X64[:, s:e] ** 2).sum(dim=1) for s, e in segs])
    ny = torch.stack([(Y64[:, s:e] ** 2).sum(dim=1) for s, e in segs])
    G, nx, ny = summed_grams(reduce, grams, nx, ny, self_gram=False)
    return torch.stack(
        [_cosines_from_gram(G[l], nx[l].sqrt(), ny[l].sqrt(), False) for l in range(L)]
    )


def cosine_matrix(
    X: torch.Tensor,
    offs: torch.Tensor,
    other: torch.Tensor | None,
    layerwise: bool,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    if layerwise:
        return _segment_cosines(X, offs, other, reduce).to(_acc_dtype(X))
    whole = torch.tensor([0, X.shape[1]], dtype=torch.int64)
    return _segment_cosines(X, whole, other, reduce)[0].to(_acc_dtype(X))


def gram_matrix(
    X: torch.Tensor, other: torch.Tensor | None, reduce: Reduce | None = None
) -> torch.Tensor:
    X64 = X.to(F64)
    if other is None:
        return summed(reduce, mirror_upper(X64 @ X64.T)).to(_acc_dtype(X))
    return summed(reduce, X64 @ other.to(F64).T).to(_acc_dtype(X))


def pairwise_sq_distances(
    X: torch.Tensor, other: torch.Tensor | None, reduce: Reduce | None = None
) -> torch.Tensor:
    """|x|^2 + |y|^2 - 2<x, y> in float64, clamped at 0; the self case with exact zeros on the
    diagonal, its norms from the Gram diagonal."""
    X64 = X.to(F64)
    if other is None:
        gram = summed(reduce, mirror_upper(X64 @ X64.T))
        nx = ny = gram.diagonal()
    else:
        Y64 = other.to(F64)
        gram = X64 @ Y64.T
        nx, ny = (X64 * X64).sum(dim=1), (Y64 * Y64).sum(dim=1)
        if reduce is not None:
            G, sx, sy = summed_grams(
                reduce, gram[None], nx[None], ny[None], self_gram=False, squeeze=True
            )
            gram, nx, ny = G[0], sx[0], sy[0]
    dist = (nx[:, None] + ny[None, :] - 2.0 * gram).clamp_min(0.0)
    if other is None:
        dist.fill_diagonal_(0.0)
    return dist.to(_acc_dtype(X))


def layer_normalized_cosine(
    X: torch.Tensor, offs: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    K = X.shape[0]
    if reduce is None:
        nonempty = (offs[1:] > offs[:-1]).nonzero().flatten().tolist()
        if not nonempty:
            return torch.zeros(K, K, dtype=_acc_dtype(X), device=X.device)
        per_layer = _segment_cosines(X, offs, None)[nonempty]
    else:
        # One reduce for the mirrored per-segment Grams and the segment lengths of this slice:
        # a segment is non-empty when its length over the whole model is > 0.
        X64 = X.to(F64)
        segs = _segments(offs)
        grams = torch.stack([mirror_upper(X64[:, s:e] @ X64[:, s:e].T) for s, e in segs])
        lengths = torch.tensor([[e - s] for s, e in segs], dtype=F64, device=X.device)
        sums = reduce(torch.cat([grams.reshape(len(segs), K * K), lengths], dim=1))
        nonempty = (sums[:, K * K] > 0).nonzero().flatten().tolist()
        if not nonempty:
            return torch.zeros(K, K, dtype=_acc_dtype(X), device=X.device)
        G = sums[:, : K * K].reshape(len(segs), K, K)
        per_layer = []
        for l in nonempty:
            n = G[l].diagonal().clamp_min(0.0).sqrt()
            per_layer.append(_cosines_from_gram(G[l], n, n, True))
    # Added one segment at a time so every (i, j) entry sums in the same order: exact symmetry.
    total = torch.zeros_like(per_layer[0])
    for mat in per_layer:
        total += mat
    return (total / len(nonempty)).to(_acc_dtype(X))


def group_means(X: torch.Tensor, groups: torch.Tensor, num_groups: int, out: torch.Tensor) -> None:
    means = torch.zeros(num_groups, X.shape[1], dtype=F64, device=X.device)
    for gid in range(num_groups):
        rows = (groups == gid).nonzero().flatten().tolist()
        if rows:
            means[gid] = X[rows].to(F64).mean(dim=0)
    out.copy_(means.to(X.dtype))


def weighted_sum(
    X: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, alpha: float, beta: float
) -> None:
    total = (weights.to(F64).to(X.device)[:, None] * X.to(F64)).sum(dim=0) * alpha
    if beta != 0.0:
        total = total + beta * out.to(F64)
    out.copy_(total.to(out.dtype))


def average_linkage(condensed: np.ndarray) -> np.ndarray:
    from .linkage import average_linkage_reference

    return average_linkage_reference(condensed)


def nnz_per_layer(
    X: torch.Tensor, offs: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    out = torch.zeros(X.shape[0], offs.numel() - 1, dtype=torch.int64, device=X.device)
    for l, (s, e) in enumerate(_segments(offs)):
        out[:, l] = (X[:, s:e] != 0).sum(dim=1)
    if reduce is not None:
        out = reduce(out.to(F64)).round().to(torch.int64)
    return out


def accumulate(acc: torch.Tensor, x: torch.Tensor, weight: float) -> None:
    acc.copy_((acc.to(F64) + weight * x.to(F64)).to(acc.dtype))


def sparse_accumulate(
    out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, weight: float
) -> None:
    idx = indices.to(torch.int64)
    res = out[idx].to(F64) + weight * values.to(F64)
    out[idx] = res.to(out.dtype)


def _codes(codes: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The n codes as int64 (4-bit ones unpacked and sign-extended)."""
    if bits == 8:
        return codes.to(torch.int64)
    b = codes.to(torch.int64)
    q = torch.stack([b & 0x0F, b >> 4], dim=1).reshape(-1)[:n]
    return torch.where(q >= 8, q - 16, q)


def _values(codes: torch.Tensor, scales: torch.Tensor, block: int, bits: int, n: int):
    """The float32 values of blockwise codes: float32(code) * scale, one binary32 product."""
    per = scales.repeat_interleave(block)[:n]
    q = _codes(codes, bits, n)
    return (q.to(F64) * per.to(F64)).to(torch.float32)  # exact in float64, rounded once


def code_squares(
    codes: torch.Tensor, scales: torch.Tensor, block: int, bits: int, n: int
) -> torch.Tensor:
    """``sum_b scale_b^2 * sum_{i in b} code_i^2`` as a float64 [1] tensor on the codes' device:
    the products code * scale are exact in float64, their squares rounded once each."""
    per = scales.repeat_interleave(block)[:n].to(F64)
    return (_codes(codes, bits, n).to(F64) * per).square().sum().reshape(1)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block: int, bits: int, out: torch.Tensor
) -> None:
    out.copy_(_values(codes, scales, block, bits, out.numel()).to(out.dtype))


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
    values = _values(codes, scales, block, bits, out.numel())
    if squares is not None:
        squares.copy_(code_squares(codes, scales, block, bits, out.numel()))
    res = base.to(F64) + weight * values.to(F64)
    out.copy_(res.to(out.dtype))


# --------------------------------------------------------------------------------------------
# Robust aggregation (kernels/robust.py)
# --------------------------------------------------------------------------------------------


def coordinate_median(X: torch.Tensor, out: torch.Tensor) -> None:
    """Sorted per coordinate in float64; even K averages the two middle values."""
    srt = X.to(F64).sort(dim=0).values
    K = srt.shape[0]
    med = srt[K // 2] if K % 2 else (srt[K // 2 - 1] + srt[K // 2]) / 2
    out.copy_(med.to(out.dtype))


def trimmed_mean(X: torch.Tensor, cut: int, out: torch.Tensor) -> None:
    srt = X.to(F64).sort(dim=0).values
    K = srt.shape[0]
    out.copy_(srt[cut : K - cut].mean(dim=0).to(out.dtype))


def sq_distances_to(
    X: torch.Tensor, point: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    diff = X.to(F64) - point.to(F64)
    return summed(reduce, (diff * diff).sum(dim=1))


def clip_rows(
    X: torch.Tensor, max_norm: float, out: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    """out = X scaled per row by min(1, max_norm/|x|); rows within the bound copied bitwise.
    Returns the float64 [K] norms before clipping."""
    X64 = X.to(F64)
    norms = summed(reduce, (X64 * X64).sum(dim=1)).sqrt()
    for k in range(X.shape[0]):
        if norms[k] > max_norm:
            out[k].copy_((X64[k] * (max_norm / norms[k])).to(out.dtype))
        elif out[k].data_ptr() != X[k].data_ptr():
            out[k].copy_(X[k])
    return norms


def mean_around_median(X: torch.Tensor, keep: int, out: torch.Tensor) -> None:
    """The greedy walk outwards from the median of each sorted column, one column at a time."""
    srt = X.to(F64).sort(dim=0).values.T.contiguous()
    K = srt.shape[1]
    res = torch.empty(srt.shape[0], dtype=F64)
    for d, col in enumerate(srt.tolist()):
        med = col[K // 2] if K % 2 else (col[K // 2 - 1] + col[K // 2]) / 2
        lo, hi = (K // 2, K // 2 + 1) if K % 2 else (K // 2, K // 2)  # window [lo, hi)
        while hi - lo < keep:
            if hi >= K or (lo > 0 and med - col[lo - 1] <= col[hi] - med):
                lo -= 1
            else:
                hi += 1
        res[d] = sum(col[lo:hi]) / keep
    out.copy_(res.to(device=out.device, dtype=out.dtype))


# --------------------------------------------------------------------------------------------
# Quantized rows (kernels/quantized_rows.py)
# --------------------------------------------------------------------------------------------


def quantize_rows(X: torch.Tensor, block: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Per block: scale = float32(absmax) / 127 and code = round(x / scale), both binary32
    divisions (the definition: rounding a float64 quotient could differ in the last place)."""
    K, D = X.shape
    nb = scales.shape[1]
    padded = torch.zeros(K, nb * block, dtype=torch.float32, device=X.device)
    padded[:, :D] = X.to(torch.float32)
    blocks = padded.view(K, nb, block)
    absmax = blocks.abs().amax(dim=2)
    nan = torch.isnan(blocks).any(dim=2)
    s = torch.where(nan, torch.full_like(absmax, float("nan")), absmax) / 127
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(blocks / safe[:, :, None]).clamp_(-127, 127)
    q = q.masked_fill_(~(s > 0)[:, :, None], 0)
    codes.copy_(q.reshape(K, -1)[:, :D].to(torch.int8))
    scales.copy_(s)


def _decoded_rows(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The rows' values in float64: each the binary32 product, exactly."""
    D = codes.shape[1]
    per = scales.repeat_interleave(block, dim=1)[:, :D]
    return (codes.to(F64) * per.to(F64)).to(torch.float32).to(F64)


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
    res = torch.zeros(G, D, dtype=F64, device=out.device)
    for g in range(G):
        for j in range(int(group_start[g]), int(group_start[g + 1])):
            r = int(rows[j])
            res[g] += float(coef[j]) * _decoded_rows(codes[r : r + 1], scales[r : r + 1], block)[0]
    res *= alpha
    if beta != 0.0:
        res += beta * out.to(F64)
    out.copy_(res.to(out.dtype))


def quantized_gram(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    X = _decoded_rows(codes, scales, block)
    return mirror_upper(X @ X.T).to(torch.float32)
