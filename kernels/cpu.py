"""CPU backend: fused numba passes for the bandwidth-bound kernels (thin cross Gram matrices
included), BLAS for the other Gram matrices (one Gram pass shared by the cosine, Gram and
distance kernels).

Arguments arrive validated and normalised (BACKENDS.md). Work is cut into tiles that never span
two segments, so one parallel pass handles any number of segments; each tile's partial sums are
stored and combined per segment in tile order, which makes every result independent of thread
scheduling (bitwise reproducible, no atomics). Elementwise arithmetic and tile sums run in
float64: on this memory-bound path the extra precision costs nothing measurable.

Half-precision inputs take one conversion pass to float32 (numba has no float16/bfloat16
arithmetic); the speed targets are for float32.

With `reduce` (a sharded server, docs/kernels.md "Sharded use") the kernels run their phases
apart: partial sums, one `reduce` of all of them packed into a float64 tensor, then the
coefficients, cosines or distances and any elementwise pass. Without it the fused paths run.
"""

from __future__ import annotations

import functools

import numba as nb
import numpy as np
import torch

from . import _cpu_distance, _cpu_order
from ._partials import Reduce, mirror_upper, summed, summed_grams
from ._tiles import offsets_key, tile_table

# Tile length in elements: large enough to amortise the per-tile overhead and keep the
# hardware prefetcher busy, small enough that a tile of a shared vector (the basis `b`) stays in
# L2 while every row streams past it, and that D = 4M gives a few hundred tiles for 2 threads.
TILE = 16384
# A cross Gram X Y^T with at most this many entries (K x M) is summed by the tiled kernel
# (memory-bound, thin); larger ones are GEMMs, where BLAS wins.
CROSS_DOTS_MAX = 64 * 64
CROSS_TILE = 2048
# With fewer than SMALL_GEMM rows on either side, BLAS (MKL here) multiplies float32 rows as a
# gemv: one float32 sum along all of D, off by up to 5e-5 relative at D = 4M, and 3-4x slower
# than its blocked kernel (K = 15: 128 ms against 19 ms at K = 16). Such products over rows
# longer than GRAM_CHUNK are cut into chunks of that length, multiplied by one batched call and
# summed in float64: below 1e-6 at D = 4M, about as fast as one read of the rows. From
# SMALL_GEMM rows on, one sgemm: its blocked kernel measured 1.3e-6 to 2.8e-6 at D = 4M to 11M.
SMALL_GEMM = 16
GRAM_CHUNK = 65536

# reassoc lets LLVM vectorise the reductions; no `nnan`/`ninf`, so NaN and Inf keep IEEE
# semantics (a NaN update must stay visible to the validation that follows).
_FM = {"reassoc", "nsz", "contract", "arcp"}
_jit = functools.partial(nb.njit, cache=True, nogil=True, fastmath=_FM)
_pjit = functools.partial(nb.njit, cache=True, nogil=True, fastmath=_FM, parallel=True)


def _tiles(offs: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tile start, tile end, tile segment, first tile of each segment [L+1]) of a table."""
    return tile_table(offsets_key(offs), TILE)


def _np(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a float32/float64 CPU tensor (half types are converted first)."""
    return t.detach().numpy()


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _as_work(t: torch.Tensor) -> torch.Tensor:
    """float32/float64 tensors pass through; half types take one conversion pass to float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


# --------------------------------------------------------------------------------------------
# numba kernels
# --------------------------------------------------------------------------------------------


@_pjit
def _tile_dots(A, B, ts, te, P):  # pragma: no cover - compiled
    """P[k, t] = sum over tile t of A[k] * B[k or 0] (B broadcast when it has one row)."""
    # Row slices are 1-D contiguous arrays to numba, which is what lets LLVM vectorise. With a
    # broadcast B, four rows share each load and conversion of B: that is what reaches the
    # bandwidth floor (one row at a time is ~1.3x slower).
    K = A.shape[0]
    bcast = B.shape[0] == 1
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        k = 0
        if bcast:
            b = B[0, s:e]
            while k + 4 <= K:
                a0, a1, a2, a3 = A[k, s:e], A[k + 1, s:e], A[k + 2, s:e], A[k + 3, s:e]
                c0 = 0.0
                c1 = 0.0
                c2 = 0.0
                c3 = 0.0
                for i in range(e - s):
                    bi = np.float64(b[i])
                    c0 += np.float64(a0[i]) * bi
                    c1 += np.float64(a1[i]) * bi
                    c2 += np.float64(a2[i]) * bi
                    c3 += np.float64(a3[i]) * bi
                P[k, t] = c0
                P[k + 1, t] = c1
                P[k + 2, t] = c2
                P[k + 3, t] = c3
                k += 4
        while k < K:
            a = A[k, s:e]
            b = B[0 if bcast else k, s:e]
            acc = 0.0
            for i in range(e - s):
                acc += np.float64(a[i]) * np.float64(b[i])
            P[k, t] = acc
            k += 1


@_pjit
def _tile_dots2(A, B, C, E, ts, te, P):  # pragma: no cover - compiled
    """Two fused dots of differences over each tile: P[0,t] = <A-B, C-E>, P[1,t] = |C-E|^2.

    Used by ORTHOFL with A=w, B=snap, C=x, E=sent: one read of four vectors.
    """
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        a, b, c, f = A[0, s:e], B[0, s:e], C[0, s:e], E[0, s:e]
        num = 0.0
        den = 0.0
        for i in range(e - s):
            dg = np.float64(a[i]) - np.float64(b[i])
            dm = np.float64(c[i]) - np.float64(f[i])
            num += dg * dm
            den += dm * dm
        P[0, t] = num
        P[1, t] = den


@_jit
def _reduce_tiles(P, seg_tile_start, out):  # pragma: no cover - compiled
    """out[k, l] = sum of P[k, t] over the tiles of segment l, in tile order."""
    K = P.shape[0]
    L = seg_tile_start.shape[0] - 1
    for k in range(K):
        for l in range(L):
            acc = 0.0
            for t in range(seg_tile_start[l], seg_tile_start[l + 1]):
                acc += P[k, t]
            out[k, l] = acc


@_pjit
def _apply_projection(G, B, C, tile_seg, ts, te, out, in_place):  # pragma: no cover - compiled
    """out[k] = G[k] - C[k, seg] * B per tile; a zero coefficient copies (or skips) the tile."""
    K = G.shape[0]
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        seg = tile_seg[t]
        b = B[0, s:e]
        for k in range(K):
            c = C[k, seg]
            g = G[k, s:e]
            o = out[k, s:e]
            if c == 0.0:
                if not in_place:
                    o[:] = g
            else:
                for i in range(e - s):
                    o[i] = np.float64(g[i]) - c * np.float64(b[i])


@_pjit
def _apply_calibration(
    X, S, W, N, M, C, cal, beta, tile_seg, ts, te, Y, MA, y_in_place
):  # pragma: no cover - compiled
    """Pass 2 of ORTHOFL: Y = X + (dg - c*dm) on calibrated segments (X elsewhere) and
    MA = (1-beta)*M + beta*X, all from one read of X, S(ent), W, N (snap) and M (ma)."""
    one_minus = 1.0 - beta
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        seg = tile_seg[t]
        c = C[seg]
        xs, ss, ws, ns, ms = X[0, s:e], S[0, s:e], W[0, s:e], N[0, s:e], M[0, s:e]
        ys, mas = Y[0, s:e], MA[0, s:e]
        if cal[seg]:
            for i in range(e - s):
                x = np.float64(xs[i])
                dg = np.float64(ws[i]) - np.float64(ns[i])
                dm = x - np.float64(ss[i])
                m = np.float64(ms[i])
                ys[i] = x + (dg - c * dm)
                mas[i] = one_minus * m + beta * x
        else:
            if not y_in_place:
                ys[:] = xs
            for i in range(e - s):
                mas[i] = one_minus * np.float64(ms[i]) + beta * np.float64(xs[i])


@nb.njit(inline="always", fastmath=_FM)
def _start(acc, i, v, first):  # pragma: no cover - compiled
    """A pass's first addition: v alone on a group's first pass, else the tile's sum + v."""
    return v if first else acc[i] + v


@nb.njit(inline="always", fastmath=_FM)
def _store(acc, o, i, v, last, alpha, beta):  # pragma: no cover - compiled
    """A pass's result: to the tile accumulator, or, on a group's last pass, to the output."""
    if not last:
        acc[i] = v
        return
    # One store of a selected value: LLVM vectorises it (a store in each branch of an if/else
    # measured 1.2x the floor for group_means at K = 16, D = 11.2M, against 1.0x this way).
    o[i] = alpha * v if beta == 0.0 else beta * np.float64(o[i]) + alpha * v


@_pjit
def _rows_combination(X, rows, coef, group_start, ts, te, out, alpha, beta):  # pragma: no cover
    """out[g, i] = beta*out[g, i] + alpha * sum_{r in group g} coef[r] * X[rows[r], i].

    One read of every included row: passes of eight rows, then four, then the last one to
    three, each adding to a float64 tile accumulator (in L2). A group's first pass starts the
    sum instead of reading a zeroed tile, and its last pass writes the output instead of the
    tile, so a group of up to eight rows (or 8 + 3) never round-trips the tile. The order of the
    additions does not depend on that: the same bits as one accumulator zeroed first.
    """
    G = group_start.shape[0] - 1
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        n = e - s
        acc = np.empty(n, dtype=np.float64)
        for g in range(G):
            r0, r1 = group_start[g], group_start[g + 1]
            o = out[g, s:e]
            if r0 == r1:
                for i in range(n):
                    _store(acc, o, i, 0.0, True, alpha, beta)
                continue
            r = r0
            while r + 8 <= r1:
                x0, x1 = X[rows[r], s:e], X[rows[r + 1], s:e]
                x2, x3 = X[rows[r + 2], s:e], X[rows[r + 3], s:e]
                x4, x5 = X[rows[r + 4], s:e], X[rows[r + 5], s:e]
                x6, x7 = X[rows[r + 6], s:e], X[rows[r + 7], s:e]
                c0, c1, c2, c3 = coef[r], coef[r + 1], coef[r + 2], coef[r + 3]
                c4, c5, c6, c7 = coef[r + 4], coef[r + 5], coef[r + 6], coef[r + 7]
                first, last = r == r0, r + 8 == r1
                for i in range(n):
                    v = (
                        c0 * np.float64(x0[i])
                        + c1 * np.float64(x1[i])
                        + c2 * np.float64(x2[i])
                        + c3 * np.float64(x3[i])
                    ) + (
                        c4 * np.float64(x4[i])
                        + c5 * np.float64(x5[i])
                        + c6 * np.float64(x6[i])
                        + c7 * np.float64(x7[i])
                    )
                    _store(acc, o, i, _start(acc, i, v, first), last, alpha, beta)
                r += 8
            while r + 4 <= r1:
                x0, x1 = X[rows[r], s:e], X[rows[r + 1], s:e]
                x2, x3 = X[rows[r + 2], s:e], X[rows[r + 3], s:e]
                c0, c1, c2, c3 = coef[r], coef[r + 1], coef[r + 2], coef[r + 3]
                first, last = r == r0, r + 4 == r1
                for i in range(n):
                    v = (c0 * np.float64(x0[i]) + c1 * np.float64(x1[i])) + (
                        c2 * np.float64(x2[i]) + c3 * np.float64(x3[i])
                    )
                    _store(acc, o, i, _start(acc, i, v, first), last, alpha, beta)
                r += 4
            # The last one to three rows, added one after another, in one pass.
            left, first = r1 - r, r == r0
            if left == 3:
                x0, x1, x2 = X[rows[r], s:e], X[rows[r + 1], s:e], X[rows[r + 2], s:e]
                c0, c1, c2 = coef[r], coef[r + 1], coef[r + 2]
                for i in range(n):
                    v = _start(acc, i, c0 * np.float64(x0[i]), first) + c1 * np.float64(x1[i])
                    _store(acc, o, i, v + c2 * np.float64(x2[i]), True, alpha, beta)
            elif left == 2:
                x0, x1 = X[rows[r], s:e], X[rows[r + 1], s:e]
                c0, c1 = coef[r], coef[r + 1]
                for i in range(n):
                    v = _start(acc, i, c0 * np.float64(x0[i]), first) + c1 * np.float64(x1[i])
                    _store(acc, o, i, v, True, alpha, beta)
            elif left == 1:
                x0, c0 = X[rows[r], s:e], coef[r]
                for i in range(n):
                    _store(acc, o, i, _start(acc, i, c0 * np.float64(x0[i]), first), True,
                           alpha, beta)  # fmt: skip


@_jit
def _project_out_fused(
    G, B, ts, te, tile_seg, seg_tile_start, only_conf, eps, out, in_place
):  # pragma: no cover
    """Both passes of project_out in one compiled call (small models pay one dispatch)."""
    K, T, L = G.shape[0], ts.shape[0], seg_tile_start.shape[0] - 1
    P = np.empty((K, T))
    Pb = np.empty((1, T))
    _tile_dots(G, B, ts, te, P)
    _tile_dots(B, B, ts, te, Pb)
    gb = np.empty((K, L))
    bb = np.empty((1, L))
    _reduce_tiles(P, seg_tile_start, gb)
    _reduce_tiles(Pb, seg_tile_start, bb)
    coef = np.zeros((K, L))
    for l in range(L):
        if bb[0, l] > eps:
            for k in range(K):
                c = gb[k, l] / bb[0, l]
                if only_conf and c > 0.0:
                    c = 0.0
                coef[k, l] = c
    _apply_projection(G, B, coef, tile_seg, ts, te, out, in_place)


@_jit
def _calibrate_fused(
    X, S, W, N, M, cal, eps, beta, ts, te, tile_seg, seg_tile_start, Y, MA, y_in_place, coef
):  # pragma: no cover - compiled
    """Both passes of orthogonal_calibrate in one compiled call; writes the coefficients."""
    L = seg_tile_start.shape[0] - 1
    P = np.empty((2, ts.shape[0]))
    _tile_dots2(W, N, X, S, ts, te, P)
    sums = np.empty((2, L))
    _reduce_tiles(P, seg_tile_start, sums)
    for l in range(L):
        coef[l] = sums[0, l] / sums[1, l] if cal[l] and sums[1, l] > eps else 0.0
    _apply_calibration(X, S, W, N, M, coef, cal, beta, tile_seg, ts, te, Y, MA, y_in_place)


@_jit
def _projection_coefs(sums, eps, only_conf):  # pragma: no cover - compiled
    """[K, L] c = sums[k] / sums[K] (0 where sums[K] <= eps, min(c, 0) when only_conf) from the
    [K+1, L] dots <g_k, b> and <b, b>: the arithmetic of `_project_out_fused`."""
    K, L = sums.shape[0] - 1, sums.shape[1]
    coef = np.zeros((K, L))
    for l in range(L):
        if sums[K, l] > eps:
            for k in range(K):
                c = sums[k, l] / sums[K, l]
                if only_conf and c > 0.0:
                    c = 0.0
                coef[k, l] = c
    return coef


@_jit
def _calibration_coefs(sums, cal, eps, coef):  # pragma: no cover - compiled
    """coef[l] = <dg,dm> / <dm,dm> from the [2, L] sums (0 where <dm,dm> <= eps or not cal):
    the arithmetic of `_calibrate_fused`."""
    for l in range(sums.shape[1]):
        coef[l] = sums[0, l] / sums[1, l] if cal[l] and sums[1, l] > eps else 0.0


# --------------------------------------------------------------------------------------------
# Backend functions (BACKENDS.md)
# --------------------------------------------------------------------------------------------


@_jit
def _tile_sq_norms(X, s, e, out):  # pragma: no cover - compiled
    """out[k] = float64 sum of X[k, s:e] squared."""
    for k in range(X.shape[0]):
        x = X[k, s:e]
        acc = 0.0
        for i in range(e - s):
            acc += np.float64(x[i]) * np.float64(x[i])
        out[k] = acc


@_pjit
def _tile_cross_dots(A, B, ts, te, P, NA, NB):  # pragma: no cover - compiled
    """P[k, j, t] = sum over tile t of A[k] * B[j], NA[k, t] and NB[j, t] the rows' squared
    norms over the tile, all in float64.

    Blocks of 4 rows of A by 4 rows of B: each loaded element feeds four products, so the
    [K, M] dots of a thin cross Gram (FedHist: K = 10 local rows against h = 52 history rows)
    come from one read of both row sets, about twice as fast as MKL's sgemm on such shapes
    (bench/test_bench_seed_algorithms.py), with float64 sums.
    """
    K = A.shape[0]
    M = B.shape[0]
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        n = e - s
        # The squared norms first: they bring the tile into cache for the products below.
        _tile_sq_norms(A, s, e, NA[:, t])
        _tile_sq_norms(B, s, e, NB[:, t])
        for j in range(0, M, 4):
            for k in range(0, K, 4):
                if k + 4 <= K and j + 4 <= M:
                    a0, a1, a2, a3 = A[k, s:e], A[k + 1, s:e], A[k + 2, s:e], A[k + 3, s:e]
                    b0, b1, b2, b3 = B[j, s:e], B[j + 1, s:e], B[j + 2, s:e], B[j + 3, s:e]
                    c00 = 0.0
                    c01 = 0.0
                    c02 = 0.0
                    c03 = 0.0
                    c10 = 0.0
                    c11 = 0.0
                    c12 = 0.0
                    c13 = 0.0
                    c20 = 0.0
                    c21 = 0.0
                    c22 = 0.0
                    c23 = 0.0
                    c30 = 0.0
                    c31 = 0.0
                    c32 = 0.0
                    c33 = 0.0
                    for i in range(n):
                        x0 = np.float64(a0[i])
                        x1 = np.float64(a1[i])
                        x2 = np.float64(a2[i])
                        x3 = np.float64(a3[i])
                        y0 = np.float64(b0[i])
                        y1 = np.float64(b1[i])
                        y2 = np.float64(b2[i])
                        y3 = np.float64(b3[i])
                        c00 += x0 * y0
                        c01 += x0 * y1
                        c02 += x0 * y2
                        c03 += x0 * y3
                        c10 += x1 * y0
                        c11 += x1 * y1
                        c12 += x1 * y2
                        c13 += x1 * y3
                        c20 += x2 * y0
                        c21 += x2 * y1
                        c22 += x2 * y2
                        c23 += x2 * y3
                        c30 += x3 * y0
                        c31 += x3 * y1
                        c32 += x3 * y2
                        c33 += x3 * y3
                    P[k + 0, j + 0, t] = c00
                    P[k + 0, j + 1, t] = c01
                    P[k + 0, j + 2, t] = c02
                    P[k + 0, j + 3, t] = c03
                    P[k + 1, j + 0, t] = c10
                    P[k + 1, j + 1, t] = c11
                    P[k + 1, j + 2, t] = c12
                    P[k + 1, j + 3, t] = c13
                    P[k + 2, j + 0, t] = c20
                    P[k + 2, j + 1, t] = c21
                    P[k + 2, j + 2, t] = c22
                    P[k + 2, j + 3, t] = c23
                    P[k + 3, j + 0, t] = c30
                    P[k + 3, j + 1, t] = c31
                    P[k + 3, j + 2, t] = c32
                    P[k + 3, j + 3, t] = c33
                else:
                    for kk in range(k, min(k + 4, K)):
                        a = A[kk, s:e]
                        for jj in range(j, min(j + 4, M)):
                            b = B[jj, s:e]
                            acc = 0.0
                            for i in range(n):
                                acc += np.float64(a[i]) * np.float64(b[i])
                            P[kk, jj, t] = acc


def _segment_dots(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> np.ndarray:
    """[K, L] float64 per-segment dots of work-dtype rows."""
    ts, te, _, seg_tile_start = _tiles(offs)
    K = a.shape[0]
    P = np.empty((K, ts.shape[0]), dtype=np.float64)
    if ts.shape[0]:
        _tile_dots(_np(a), _np(b), ts, te, P)
    res = np.empty((K, seg_tile_start.shape[0] - 1), dtype=np.float64)
    _reduce_tiles(P, seg_tile_start, res)
    return res


def layer_dots(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    res = torch.from_numpy(_segment_dots(_as_work(a), _as_work(b), offs))
    return summed(reduce, res).to(_work_dtype(a))


def project_out(
    g: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    only_conflicting: bool,
    eps: float,
    out: torch.Tensor,
    reduce: Reduce | None = None,
) -> None:
    gw, bw = _as_work(g), _as_work(b)
    ts, te, tile_seg, seg_tile_start = _tiles(offs)
    if reduce is not None:
        # Sharded: the [K+1, L] dots <g_k, b> and <b, b>, one reduce, then the coefficients.
        sums = np.concatenate([_segment_dots(gw, bw, offs), _segment_dots(bw, bw, offs)])
        sums = reduce(torch.from_numpy(sums)).numpy()
        coef = _projection_coefs(sums, eps, only_conflicting)
    if not ts.shape[0]:
        if out.data_ptr() != g.data_ptr():
            out.copy_(g)
        return
    direct = out.dtype == gw.dtype
    target = out if direct else torch.empty_like(gw)
    in_place = direct and target.data_ptr() == gw.data_ptr()
    if reduce is not None:
        _apply_projection(_np(gw), _np(bw), coef, tile_seg, ts, te, _np(target), in_place)
    else:
        _project_out_fused(
            _np(gw), _np(bw), ts, te, tile_seg, seg_tile_start, only_conflicting, eps,
            _np(target), in_place,
        )  # fmt: skip
    if not direct:
        out.copy_(target)


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
    xw, sw, ww, nw = (_as_work(t) for t in (x, sent, w, snap))
    mw = ww if ma is w else _as_work(ma)
    ts, te, tile_seg, seg_tile_start = _tiles(offs)
    coef = np.zeros(seg_tile_start.shape[0] - 1)
    direct = x.dtype == xw.dtype
    y_t = out_y if direct else torch.empty_like(xw)
    ma_t = out_ma if direct else torch.empty_like(xw)
    y_in_place = direct and y_t.data_ptr() == xw.data_ptr()
    if reduce is not None:
        # Sharded: pass 1 (<dg, dm>, <dm, dm> per segment), one reduce, the coefficients, then
        # pass 2. Pass 1 has read everything before pass 2 writes (the aliases stay safe).
        P = np.zeros((2, ts.shape[0]))
        if ts.shape[0]:
            _tile_dots2(_np(ww), _np(nw), _np(xw), _np(sw), ts, te, P)
        sums = np.empty((2, coef.shape[0]))
        _reduce_tiles(P, seg_tile_start, sums)
        sums = reduce(torch.from_numpy(sums)).numpy()
        _calibration_coefs(sums, calibrate.numpy(), eps, coef)
        if ts.shape[0]:
            _apply_calibration(
                _np(xw), _np(sw), _np(ww), _np(nw), _np(mw), coef, calibrate.numpy(), float(beta),
                tile_seg, ts, te, _np(y_t), _np(ma_t), y_in_place,
            )  # fmt: skip
    elif ts.shape[0]:
        _calibrate_fused(
            _np(xw), _np(sw), _np(ww), _np(nw), _np(mw), calibrate.numpy(), eps, float(beta),
            ts, te, tile_seg, seg_tile_start, _np(y_t), _np(ma_t), y_in_place, coef,
        )  # fmt: skip
    if not direct:
        out_y.copy_(y_t)
        out_ma.copy_(ma_t)
    return torch.from_numpy(coef).to(_work_dtype(x))


def _mm(X: torch.Tensor, Y: torch.Tensor | None, out: torch.Tensor) -> None:
    """out (float64 [K, M]) = X Y^T (Y = X when None) via BLAS: one GEMM, or for float32 rows
    longer than GRAM_CHUNK with fewer than SMALL_GEMM rows on a side, one batched GEMM over
    chunks of GRAM_CHUNK elements whose products are summed in float64."""
    Yv = X if Y is None else Y
    D = X.shape[1]
    small = 0 < min(X.shape[0], Yv.shape[0]) < SMALL_GEMM
    if X.dtype == torch.float64 or D <= GRAM_CHUNK or not small:
        out.copy_(torch.mm(X, Yv.T))
        return
    T = D // GRAM_CHUNK
    n = T * GRAM_CHUNK
    # [T, K, GRAM_CHUNK] views of the rows (strides (GRAM_CHUNK, row stride, 1)): no copy.
    A = X[:, :n].unflatten(1, (T, GRAM_CHUNK)).transpose(0, 1)
    B = A if Y is None else Y[:, :n].unflatten(1, (T, GRAM_CHUNK)).transpose(0, 1)
    torch.sum(torch.bmm(A, B.transpose(1, 2)), dim=0, dtype=torch.float64, out=out)
    if n < D:
        out += torch.mm(X[:, n:], Yv[:, n:].T)


def _gram_blocks(
    X: torch.Tensor, Y: torch.Tensor | None, offs: torch.Tensor, layerwise: bool
) -> torch.Tensor:
    """float64 Gram matrices per segment ([L, K, M]) or of the whole rows ([1, K, M]), via
    BLAS (`_mm`)."""
    o = offs.tolist() if layerwise else [0, X.shape[1]]
    K = X.shape[0]
    M = K if Y is None else Y.shape[0]
    grams = torch.empty(len(o) - 1, K, M, dtype=torch.float64)
    for l in range(len(o) - 1):
        s, e = o[l], o[l + 1]
        _mm(X[:, s:e], None if Y is None else Y[:, s:e], grams[l])
    return grams


def _cross_dots(
    X: torch.Tensor, Y: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """([K, M] dots of the rows of X and Y, ([1, K], [1, M]) squared row norms), float64, from
    one tiled pass (tile sums combined in order). Tiles of CROSS_TILE elements keep the tile of
    all K + M rows in L2 between the norm and the product loops."""
    D = X.shape[1]
    ts = np.arange(0, D, CROSS_TILE, dtype=np.int64)
    te = np.minimum(ts + CROSS_TILE, D)
    T = max(ts.shape[0], 1)
    P = np.zeros((X.shape[0], Y.shape[0], T), dtype=np.float64)
    NA = np.zeros((X.shape[0], T), dtype=np.float64)
    NB = np.zeros((Y.shape[0], T), dtype=np.float64)
    if ts.shape[0]:
        _tile_cross_dots(_np(X), _np(Y), ts, te, P, NA, NB)
    sq_norms = (torch.from_numpy(NA.sum(axis=1))[None], torch.from_numpy(NB.sum(axis=1))[None])
    return torch.from_numpy(P.sum(axis=2)), sq_norms


def _row_sq_norms(X: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[L, K] float64 per-segment squared row norms from one fused pass."""
    return torch.from_numpy(_segment_dots(X, X, offs)).T.contiguous()


SqNorms = tuple[torch.Tensor, torch.Tensor]


def _grams(
    X: torch.Tensor, Y: torch.Tensor | None, offs: torch.Tensor, layerwise: bool, norms: bool
) -> tuple[torch.Tensor, SqNorms | None]:
    """The Gram pass shared by the cosine, Gram and distance kernels.

    Returns the Gram matrices of the rows of X (as given) against Y (X itself when None), per
    segment [L, K, M] or of the whole rows [1, K, M], and, when Y is given and `norms` is set,
    the squared row norms ([L, K], [L, M], float64) of both sides (None otherwise: a self Gram
    holds them on its diagonal). Thin cross products (not layerwise, K x M <= CROSS_DOTS_MAX)
    come from one tiled numba pass with float64 sums (norms included, whatever `norms`); the
    others from BLAS (`_mm`: float32 sums for float32 and half inputs, over chunks of GRAM_CHUNK
    elements added in float64 when a side has fewer than SMALL_GEMM rows) plus, for the norms,
    one fused pass per side. The Gram matrices are float64 either way. A self Gram is returned
    as BLAS computed it: callers read its upper triangle only (`_mirror_upper`), which makes
    their results exactly symmetric.
    """
    Xw = _as_work(X)
    Yw = None if Y is None else _as_work(Y)
    if Yw is not None and not layerwise and X.shape[0] * Yw.shape[0] <= CROSS_DOTS_MAX:
        dots, sq = _cross_dots(Xw, Yw)
        return dots.unsqueeze(0), sq
    grams = _gram_blocks(Xw, Yw, offs, layerwise)
    if Yw is None or not norms:
        return grams, None
    seg = offs if layerwise else _whole(X)
    return grams, (_row_sq_norms(Xw, seg), _row_sq_norms(Yw, seg))


def _cosines(grams: torch.Tensor, sq_norms: SqNorms | None) -> torch.Tensor:
    """Cosines from Gram matrices [L, K, M] in float64; the self case is mirrored exactly."""
    G = grams.to(torch.float64)
    if sq_norms is None:
        G = torch.triu(G, diagonal=1)
        diag = torch.sqrt(grams.diagonal(dim1=1, dim2=2).to(torch.float64).clamp_min(0.0))
        nr, nc = diag, diag
    else:
        nr, nc = sq_norms[0].sqrt(), sq_norms[1].sqrt()
    denom = nr[:, :, None] * nc[:, None, :]
    ok = denom > 0
    cos = torch.where(ok, G / torch.where(ok, denom, 1.0), 0.0).clamp_(-1.0, 1.0)
    if sq_norms is None:
        cos = cos + cos.transpose(1, 2)
        cos.diagonal(dim1=1, dim2=2).copy_((nr > 0).to(torch.float64))
    return cos


def _whole(X: torch.Tensor) -> torch.Tensor:
    return torch.tensor([0, X.shape[1]], dtype=torch.int64)


def _summed_grams(
    grams: torch.Tensor, sq_norms: SqNorms | None, reduce: Reduce, squeeze: bool = False
) -> tuple[torch.Tensor, SqNorms | None]:
    """`_grams`' output summed over the shards by one `reduce` (`summed_grams`' packing; a
    self Gram is the one without norms)."""
    sx, sy = sq_norms if sq_norms is not None else (None, None)
    G, sx, sy = summed_grams(reduce, grams, sx, sy, self_gram=sq_norms is None, squeeze=squeeze)
    return G, None if sx is None or sy is None else (sx, sy)


def cosine_matrix(
    X: torch.Tensor,
    offs: torch.Tensor,
    other: torch.Tensor | None,
    layerwise: bool,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    grams, sq_norms = _grams(X, other, offs, layerwise, norms=True)
    if reduce is not None:
        grams, sq_norms = _summed_grams(grams, sq_norms, reduce)
    cos = _cosines(grams, sq_norms)
    cos = cos if layerwise else cos[0]
    return cos.to(_work_dtype(X))


def gram_matrix(
    X: torch.Tensor, other: torch.Tensor | None, reduce: Reduce | None = None
) -> torch.Tensor:
    G = _grams(X, other, _whole(X), False, norms=False)[0][0]
    if other is None:
        G = mirror_upper(G)
    return summed(reduce, G).to(_work_dtype(X))


def pairwise_sq_distances(
    X: torch.Tensor, other: torch.Tensor | None, reduce: Reduce | None = None
) -> torch.Tensor:
    """max(n_i + m_j - 2 G_ij, 0) formed in float64 from the Gram (float64 sums on the thin
    path, BLAS float32 otherwise) and squared norms; self: norms from the mirrored Gram's
    diagonal, so the result is exactly symmetric, and an exactly zero diagonal."""
    grams, sq_norms = _grams(X, other, _whole(X), False, norms=True)
    if reduce is not None:
        grams, sq_norms = _summed_grams(grams, sq_norms, reduce, squeeze=True)
    G = grams[0].to(torch.float64)
    if sq_norms is None:
        G = mirror_upper(G)
        n = m = G.diagonal()
    else:
        n, m = sq_norms[0][0], sq_norms[1][0]
    dist = (n[:, None] + m[None, :] - 2.0 * G).clamp_min_(0.0)
    if sq_norms is None:
        dist.fill_diagonal_(0.0)
    return dist.to(_work_dtype(X))


def layer_normalized_cosine(
    X: torch.Tensor, offs: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    K = X.shape[0]
    if reduce is None:
        nonempty = (offs[1:] > offs[:-1]).nonzero().flatten()
        if nonempty.numel() == 0:
            return torch.zeros(K, K, dtype=_work_dtype(X))
        cos = _cosines(_gram_blocks(_as_work(X), None, offs, True)[nonempty], None)
    else:
        # Every segment's Gram (zeros where this slice has none of it) and this slice's segment
        # lengths in one reduce: a segment is non-empty when its whole-model length is > 0.
        grams = mirror_upper(_gram_blocks(_as_work(X), None, offs, True))
        L = grams.shape[0]
        lengths = (offs[1:] - offs[:-1]).to(torch.float64)[:, None]
        sums = reduce(torch.cat([grams.reshape(L, K * K), lengths], dim=1))
        nonempty = (sums[:, K * K] > 0).nonzero().flatten()
        if nonempty.numel() == 0:
            return torch.zeros(K, K, dtype=_work_dtype(X))
        cos = _cosines(sums[:, : K * K].reshape(L, K, K)[nonempty], None)
    # Added one segment at a time: every (i, j) entry sums in the same fixed order, so the
    # result is deterministic and exactly symmetric (a torch reduction over dim 0 is neither).
    total = torch.zeros_like(cos[0])
    for mat in cos:
        total += mat
    return (total / nonempty.numel()).to(_work_dtype(X))


def _whole_tiles(D: int) -> tuple[np.ndarray, np.ndarray]:
    ts, te, _, _ = _tiles(torch.tensor([0, D], dtype=torch.int64))
    return ts, te


def group_means(X: torch.Tensor, groups: torch.Tensor, num_groups: int, out: torch.Tensor) -> None:
    D = X.shape[1]
    gr = groups.numpy()
    included = np.flatnonzero(gr >= 0)
    order = included[np.argsort(gr[included], kind="stable")]
    counts = np.bincount(gr[included], minlength=num_groups)
    group_start = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(counts, out=group_start[1:])
    coef = (1.0 / np.maximum(counts, 1))[gr[order]] if order.size else np.zeros(0)
    if X.dtype in (torch.float32, torch.float64):
        Xw = X
    else:
        # Convert only the rows that are read: excluded rows may hold anything.
        Xw = torch.zeros(X.shape, dtype=torch.float32)
        if order.size:
            idx = torch.from_numpy(order)
            Xw[idx] = X[idx].to(torch.float32)
    target = out if out.dtype == Xw.dtype else torch.empty(num_groups, D, dtype=Xw.dtype)
    ts, te = _whole_tiles(D)
    if ts.shape[0] and num_groups:
        _rows_combination(
            _np(Xw), order.astype(np.int64), coef.astype(np.float64), group_start, ts, te,
            _np(target), 1.0, 0.0,
        )  # fmt: skip
    if target is not out:
        out.copy_(target)


def weighted_sum(
    X: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, alpha: float, beta: float
) -> None:
    Xw = _as_work(X)
    D = X.shape[1]
    direct = out.dtype == Xw.dtype
    target = out if direct else (_as_work(out) if beta != 0.0 else torch.empty(D, dtype=Xw.dtype))
    ts, te = _whole_tiles(D)
    if ts.shape[0]:
        rows = np.arange(X.shape[0], dtype=np.int64)
        group_start = np.array([0, X.shape[0]], dtype=np.int64)
        _rows_combination(
            _np(Xw), rows, weights.numpy(), group_start, ts, te, _np(target).reshape(1, D),
            float(alpha), float(beta),
        )  # fmt: skip
    if not direct:
        out.copy_(target)


@_pjit
def _tile_nnz(X, ts, te, P):  # pragma: no cover - compiled
    """P[k, t] = non-zero elements of row k in tile t (NaN counts: it is not zero)."""
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        for k in range(X.shape[0]):
            row = X[k, s:e]
            c = 0
            for i in range(e - s):
                c += row[i] != 0
            P[k, t] = c


@nb.njit(cache=True, nogil=True)  # no fastmath: a contracted FMA would round differently
def _scatter_add(out, idx, vals, weight):  # pragma: no cover - compiled
    # Indices are strictly increasing (validated), so the order of the writes does not matter;
    # a serial loop: sparse updates are small and the accesses random. Product then sum, two
    # float64 roundings, exactly as the reference computes it.
    for j in range(idx.shape[0]):
        i = idx[j]
        out[i] = np.float64(out[i]) + weight * np.float64(vals[j])


@nb.njit(cache=True, nogil=True)  # no fastmath: a contracted FMA would round differently
def _accumulate(acc, x, weight):  # pragma: no cover - compiled
    # Serial, on the calling thread: one streaming pass is bandwidth-bound on one core already,
    # and a busy server's thread pool only adds waits (aggsrv/finite.py says why).
    for i in range(acc.shape[0]):
        acc[i] = np.float64(acc[i]) + weight * np.float64(x[i])


# Elements of a half-precision x widened to float32 at a time (a temporary that stays in cache).
_WIDEN_CHUNK = 1 << 16


def accumulate(acc: torch.Tensor, x: torch.Tensor, weight: float) -> None:
    a = _np(acc)
    if x.dtype in (torch.float32, torch.float64):
        _accumulate(a, _np(x), float(weight))
        return
    for start in range(0, x.shape[0], _WIDEN_CHUNK):
        end = min(start + _WIDEN_CHUNK, x.shape[0])
        _accumulate(a[start:end], _np(x[start:end].to(torch.float32)), float(weight))


def nnz_per_layer(
    X: torch.Tensor, offs: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    Xw = X if X.dtype in (torch.float32, torch.float64) else X.to(torch.float32)
    ts, te, _, seg_tile_start = _tiles(offs)
    K = X.shape[0]
    P = np.zeros((K, ts.shape[0]), dtype=np.int64)
    if ts.shape[0] and K:
        _tile_nnz(_np(Xw), ts, te, P)
    C = np.zeros((K, P.shape[1] + 1), dtype=np.int64)
    np.cumsum(P, axis=1, out=C[:, 1:])
    counts = C[:, seg_tile_start[1:]] - C[:, seg_tile_start[:-1]]  # empty segments: 0
    if reduce is not None:
        # float64 holds counts exactly (up to 2^53).
        summed = reduce(torch.from_numpy(np.ascontiguousarray(counts, dtype=np.float64)))
        return summed.round().to(torch.int64)
    return torch.from_numpy(counts)


def sparse_accumulate(
    out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, weight: float
) -> None:
    if indices.numel() == 0:
        return
    direct = out.dtype in (torch.float32, torch.float64)
    target = out if direct else out.to(torch.float32)
    vals = values if values.dtype in (torch.float32, torch.float64) else values.to(torch.float32)
    _scatter_add(_np(target), indices.numpy(), _np(vals), float(weight))
    if not direct:
        out.copy_(target)


# Blocks of quantization per parallel task: a task's work stays large next to its overhead.
_Q_TASK_BLOCKS = 256


# With ``squares`` (a float64 [tasks] array, else an empty one), each task also writes the sum of
# scale_b^2 * sum code^2 over its blocks there: the values' squared norm from their codes, in the
# same read of them (integer squares of a block fit 32 bits: |code| <= 128, block <= 65536). The
# caller adds the tasks' sums in order, so it is the same whatever the number of threads.


@nb.njit(cache=True, nogil=True, inline="always")
def _q8_block(o, x, c, s, weight, want):  # pragma: no cover - compiled
    """One block of o = x + weight * values; sum code^2 when ``want`` (else 0)."""
    acc = np.int32(0)
    if want:
        for j in range(o.shape[0]):
            cj = c[j]
            o[j] = np.float64(x[j]) + weight * np.float64(np.float32(cj) * s)
            ci = np.int32(cj)
            acc += ci * ci
    else:
        for j in range(o.shape[0]):
            o[j] = np.float64(x[j]) + weight * np.float64(np.float32(c[j]) * s)
    return acc


@nb.njit(cache=True, nogil=True, inline="always")
def _q8_block_in_place(o, c, s, weight, want):  # pragma: no cover - compiled
    """_q8_block with x = o: its own loop, as o aliasing x keeps LLVM from vectorising."""
    acc = np.int32(0)
    if want:
        for j in range(o.shape[0]):
            cj = c[j]
            o[j] = np.float64(o[j]) + weight * np.float64(np.float32(cj) * s)
            ci = np.int32(cj)
            acc += ci * ci
    else:
        for j in range(o.shape[0]):
            o[j] = np.float64(o[j]) + weight * np.float64(np.float32(c[j]) * s)
    return acc


@nb.njit(cache=True, nogil=True, parallel=True)  # no fastmath: FMA would round differently
def _q8_accumulate(out, codes, scales, block, weight, base, squares):  # pragma: no cover
    # out = base + weight * values, base never out itself (an alias would keep LLVM from
    # vectorising: `_q8_accumulate_in_place`). Per block: its scale read once; the product in
    # float32 (the wire's binary32 decode), then product and sum in float64, as the reference.
    n = out.shape[0]
    nblocks = scales.shape[0]
    want = squares.shape[0] > 0
    for t in nb.prange((nblocks + _Q_TASK_BLOCKS - 1) // _Q_TASK_BLOCKS):
        total = 0.0
        for b in range(t * _Q_TASK_BLOCKS, min(nblocks, (t + 1) * _Q_TASK_BLOCKS)):
            s = scales[b]
            lo = b * block
            hi = min(n, lo + block)
            acc = _q8_block(out[lo:hi], base[lo:hi], codes[lo:hi], s, weight, want)
            total += np.float64(s) * np.float64(s) * np.float64(acc)
        if want:
            squares[t] = total


@nb.njit(cache=True, nogil=True, parallel=True)  # no fastmath, as _q8_accumulate
def _q8_accumulate_in_place(out, codes, scales, block, weight, squares):  # pragma: no cover
    n = out.shape[0]
    nblocks = scales.shape[0]
    want = squares.shape[0] > 0
    for t in nb.prange((nblocks + _Q_TASK_BLOCKS - 1) // _Q_TASK_BLOCKS):
        total = 0.0
        for b in range(t * _Q_TASK_BLOCKS, min(nblocks, (t + 1) * _Q_TASK_BLOCKS)):
            s = scales[b]
            lo = b * block
            hi = min(n, lo + block)
            acc = _q8_block_in_place(out[lo:hi], codes[lo:hi], s, weight, want)
            total += np.float64(s) * np.float64(s) * np.float64(acc)
        if want:
            squares[t] = total


@nb.njit(cache=True, nogil=True, inline="always")
def _nibble(byte, high):  # pragma: no cover - compiled
    nib = (byte >> 4) if high else (byte & 15)
    return nib - 16 if nib >= 8 else nib


@nb.njit(cache=True, nogil=True, parallel=True)
def _q4_accumulate(out, packed, scales, block, weight, base, squares):  # pragma: no cover
    # out = base + weight * values, base never out itself (see _q8_accumulate).
    # As _q8_accumulate, two values a byte: an odd first or last value of a block (blocks of
    # of odd size) alone, the pairs in between in one vectorisable loop.
    n = out.shape[0]
    nblocks = scales.shape[0]
    want = squares.shape[0] > 0
    for t in nb.prange((nblocks + _Q_TASK_BLOCKS - 1) // _Q_TASK_BLOCKS):
        total = 0.0
        for b in range(t * _Q_TASK_BLOCKS, min(nblocks, (t + 1) * _Q_TASK_BLOCKS)):
            s = scales[b]
            i = b * block
            hi = min(n, i + block)
            acc = np.int32(0)
            if i & 1 and i < hi:
                code = _nibble(np.int32(packed[i >> 1]), True)
                out[i] = np.float64(base[i]) + weight * np.float64(np.float32(code) * s)
                acc += code * code
                i += 1
            pairs = (hi - i) >> 1
            o = out[i : i + 2 * pairs]
            x = base[i : i + 2 * pairs]
            p = packed[i >> 1 : (i >> 1) + pairs]
            for k in range(pairs):
                byte = np.int32(p[k])
                lo4 = byte & 15
                hi4 = byte >> 4
                c0 = lo4 - ((lo4 >> 3) << 4)
                c1 = hi4 - ((hi4 >> 3) << 4)
                o[2 * k] = np.float64(x[2 * k]) + weight * np.float64(np.float32(c0) * s)
                o[2 * k + 1] = np.float64(x[2 * k + 1]) + weight * np.float64(np.float32(c1) * s)
                acc += c0 * c0 + c1 * c1
            i += 2 * pairs
            if i < hi:
                code = _nibble(np.int32(packed[i >> 1]), False)
                out[i] = np.float64(base[i]) + weight * np.float64(np.float32(code) * s)
                acc += code * code
            total += np.float64(s) * np.float64(s) * np.float64(acc)
        if want:
            squares[t] = total


@nb.njit(cache=True, nogil=True, parallel=True)
def _q4_accumulate_in_place(out, packed, scales, block, weight, squares):  # pragma: no cover
    # As _q8_accumulate_in_place, two values a byte: an odd first or last value of a block (blocks
    # of odd size) alone, the pairs in between in one vectorisable loop.
    n = out.shape[0]
    nblocks = scales.shape[0]
    want = squares.shape[0] > 0
    for t in nb.prange((nblocks + _Q_TASK_BLOCKS - 1) // _Q_TASK_BLOCKS):
        total = 0.0
        for b in range(t * _Q_TASK_BLOCKS, min(nblocks, (t + 1) * _Q_TASK_BLOCKS)):
            s = scales[b]
            i = b * block
            hi = min(n, i + block)
            acc = np.int32(0)
            if i & 1 and i < hi:
                code = _nibble(np.int32(packed[i >> 1]), True)
                out[i] = np.float64(out[i]) + weight * np.float64(np.float32(code) * s)
                acc += code * code
                i += 1
            pairs = (hi - i) >> 1
            o = out[i : i + 2 * pairs]
            p = packed[i >> 1 : (i >> 1) + pairs]
            for k in range(pairs):
                byte = np.int32(p[k])
                lo4 = byte & 15
                hi4 = byte >> 4
                c0 = lo4 - ((lo4 >> 3) << 4)
                c1 = hi4 - ((hi4 >> 3) << 4)
                o[2 * k] = np.float64(o[2 * k]) + weight * np.float64(np.float32(c0) * s)
                o[2 * k + 1] = np.float64(o[2 * k + 1]) + weight * np.float64(np.float32(c1) * s)
                acc += c0 * c0 + c1 * c1
            i += 2 * pairs
            if i < hi:
                code = _nibble(np.int32(packed[i >> 1]), False)
                out[i] = np.float64(out[i]) + weight * np.float64(np.float32(code) * s)
                acc += code * code
            total += np.float64(s) * np.float64(s) * np.float64(acc)
        if want:
            squares[t] = total


@nb.njit(cache=True, nogil=True, parallel=True)
def _q8_decode(out, codes, scales, block):  # pragma: no cover - compiled
    n = out.shape[0]
    nblocks = scales.shape[0]
    for t in nb.prange((nblocks + _Q_TASK_BLOCKS - 1) // _Q_TASK_BLOCKS):
        for b in range(t * _Q_TASK_BLOCKS, min(nblocks, (t + 1) * _Q_TASK_BLOCKS)):
            s = scales[b]
            lo = b * block
            hi = min(n, lo + block)
            o = out[lo:hi]
            c = codes[lo:hi]
            for j in range(hi - lo):
                o[j] = np.float32(c[j]) * s


@nb.njit(cache=True, nogil=True, parallel=True)
def _q4_decode(out, packed, scales, block):  # pragma: no cover - compiled
    n = out.shape[0]
    nblocks = scales.shape[0]
    for t in nb.prange((nblocks + _Q_TASK_BLOCKS - 1) // _Q_TASK_BLOCKS):
        for b in range(t * _Q_TASK_BLOCKS, min(nblocks, (t + 1) * _Q_TASK_BLOCKS)):
            s = scales[b]
            i = b * block
            hi = min(n, i + block)
            if i & 1 and i < hi:
                out[i] = np.float32(_nibble(np.int32(packed[i >> 1]), True)) * s
                i += 1
            pairs = (hi - i) >> 1
            o = out[i : i + 2 * pairs]
            p = packed[i >> 1 : (i >> 1) + pairs]
            for k in range(pairs):
                byte = np.int32(p[k])
                lo4 = byte & 15
                hi4 = byte >> 4
                o[2 * k] = np.float32(lo4 - ((lo4 >> 3) << 4)) * s
                o[2 * k + 1] = np.float32(hi4 - ((hi4 >> 3) << 4)) * s
            i += 2 * pairs
            if i < hi:
                out[i] = np.float32(_nibble(np.int32(packed[i >> 1]), False)) * s


@nb.njit(cache=True, nogil=True, inline="always")
def _block_squares8(codes):  # pragma: no cover - compiled
    """sum code^2 over one block (|code| <= 128 and block <= 65536: within 32 bits), a loop of
    its own over a slice so that LLVM vectorises it."""
    acc = np.int32(0)
    for i in range(codes.shape[0]):
        c = np.int32(codes[i])
        acc += c * c
    return acc


@nb.njit(cache=True, nogil=True, inline="always")
def _block_squares4(pairs):  # pragma: no cover - compiled
    """sum code^2 over both nibbles of each byte of ``pairs`` (sign-extended: (v ^ 8) - 8)."""
    acc = np.int32(0)
    for i in range(pairs.shape[0]):
        b = np.int32(pairs[i])
        lo = ((b & 0x0F) ^ 8) - 8
        hi = ((b >> 4) ^ 8) - 8
        acc += lo * lo + hi * hi
    return acc


# Not parallel: it may run beside another thread's kernels, which some numba threading layers
# (workqueue) refuse; one read of the codes at about 25 GB/s is fast enough where it is used.
@nb.njit(cache=True, nogil=True)
def _code_squares(body, n, scales, block, bits):  # pragma: no cover - compiled
    total = 0.0
    codes = body.view(np.int8)
    for b in range(scales.shape[0]):
        if bits == 8:
            acc = _block_squares8(codes[b * block : min(n, (b + 1) * block)])
        elif block % 2 == 0:  # whole bytes; a last odd value's padding nibble is masked below
            half = block // 2
            acc = _block_squares4(body[b * half : min(body.shape[0], (b + 1) * half)])
            if n % 2 and (b + 1) * block >= n:
                pad = ((np.int32(body[body.shape[0] - 1]) >> 4) ^ 8) - 8
                acc -= pad * pad
        else:  # odd INT4 blocks split bytes: value by value
            acc = np.int32(0)
            for i in range(b * block, min(n, (b + 1) * block)):
                c = np.int32(((body[i >> 1] >> ((i & 1) * 4)) & 0x0F) ^ 8) - 8
                acc += c * c
        s = np.float64(scales[b])
        total += s * s * np.float64(acc)
    return total


def code_squares(codes: torch.Tensor, scales: torch.Tensor, block: int, bits: int, n: int) -> float:
    body = codes.numpy().view(np.uint8)
    return float(_code_squares(body, int(n), scales.numpy(), int(block), int(bits)))


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block: int, bits: int, out: torch.Tensor
) -> None:
    direct = out.dtype in (torch.float32, torch.float64)
    target = out if direct else torch.empty(out.shape, dtype=torch.float32)
    kernel = _q8_decode if bits == 8 else _q4_decode
    kernel(_np(target), codes.numpy(), scales.numpy(), int(block))
    if not direct:
        out.copy_(target)


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
    direct = out.dtype in (torch.float32, torch.float64)
    target = out if direct else torch.empty(out.shape, dtype=torch.float32)
    args = (codes.numpy(), scales.numpy(), int(block), float(weight))
    tasks = -(-scales.shape[0] // _Q_TASK_BLOCKS)
    parts = np.zeros(tasks if squares is not None else 0)
    if base is out:  # out += weight * values; a half out is worked on in float32
        if not direct:
            target.copy_(out)
        kernel = _q8_accumulate_in_place if bits == 8 else _q4_accumulate_in_place
        kernel(_np(target), *args, parts)
    else:
        kernel = _q8_accumulate if bits == 8 else _q4_accumulate
        kernel(_np(target), *args, _np(_as_work(base)), parts)
    if not direct:
        out.copy_(target)
    if squares is not None:
        total = 0.0
        for part in parts.tolist():  # in order: the same sum whatever the threads
            total += part
        squares.fill_(total)


def average_linkage(condensed: np.ndarray) -> np.ndarray:
    from .linkage import average_linkage_cpu

    return average_linkage_cpu(condensed)


# --------------------------------------------------------------------------------------------
# Robust aggregation (kernels/robust.py). Interim: torch passes, to be replaced by fused numba.
# --------------------------------------------------------------------------------------------


def coordinate_median(X: torch.Tensor, out: torch.Tensor) -> None:
    """One fused numba pass (_cpu_order.py), as trimmed_mean."""
    _cpu_order.coordinate_median(X, out)


def mean_around_median(X: torch.Tensor, keep: int, out: torch.Tensor) -> None:
    """The sorting network's exact order around the middle, then the walk (_cpu_order.py)."""
    _cpu_order.mean_around_median(X, keep, out)


def trimmed_mean(X: torch.Tensor, cut: int, out: torch.Tensor) -> None:
    _cpu_order.trimmed_mean(X, cut, out)


def sq_distances_to(
    X: torch.Tensor, point: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    """float64 [K] sum over d of (x_kd - p_d)^2: one parallel pass over the differences, tile
    sums added in tile order (`_cpu_distance`), then one `reduce` of the [K] vector."""
    ts, te = _whole_tiles(X.shape[1])
    sq = _cpu_distance.sq_distance_partials(_np(_as_work(X)), _np(_as_work(point)), ts, te)
    return summed(reduce, torch.from_numpy(sq))


def clip_rows(
    X: torch.Tensor, max_norm: float, out: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    """Pass 1: float64 squared row norms (one `reduce` of the [K] vector); pass 2: out = x *
    max_norm / |x| for the rows above the bound, a bitwise copy of the others (nothing written
    for them when out is X). Returns the float64 [K] norms."""
    Xw = _as_work(X)
    ts, te = _whole_tiles(X.shape[1])
    sq = summed(reduce, torch.from_numpy(_cpu_distance.sq_norm_partials(_np(Xw), ts, te)))
    norms, scale = _cpu_distance.clip_scales(sq.numpy(), max_norm)
    direct = out.dtype == Xw.dtype
    target = out if direct else torch.empty_like(Xw)
    in_place = direct and _same_rows(target, Xw)
    _cpu_distance.scale_rows(_np(Xw), scale, ts, te, _np(target), in_place)
    if not direct:
        out.copy_(target)
    return torch.from_numpy(norms)


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


# --------------------------------------------------------------------------------------------
# Quantized rows (kernels/quantized_rows.py)
# --------------------------------------------------------------------------------------------


@nb.njit(cache=True, nogil=True, parallel=True)  # no fastmath: both divisions are binary32's
def _q8_quantize_rows(X, block, codes, scales):  # pragma: no cover - compiled
    K, D = X.shape
    nblocks = scales.shape[1]
    total = K * nblocks
    for t in nb.prange((total + _Q_TASK_BLOCKS - 1) // _Q_TASK_BLOCKS):
        for j in range(t * _Q_TASK_BLOCKS, min(total, (t + 1) * _Q_TASK_BLOCKS)):
            k = j // nblocks
            b = j - k * nblocks
            lo = b * block
            hi = min(D, lo + block)
            x = X[k, lo:hi]
            m = np.float32(0.0)
            for i in range(hi - lo):
                a = abs(np.float32(x[i]))
                if a > m or a != a:  # a NaN stays: the caller refuses the row by its scale
                    m = a
            s = m / np.float32(127.0)
            scales[k, b] = s
            c = codes[k, lo:hi]
            if s > 0 and s < np.inf:
                for i in range(hi - lo):
                    q = np.rint(np.float32(x[i]) / s)
                    c[i] = np.int8(min(max(q, -127.0), 127.0))
            else:
                c[:] = 0


def quantize_rows(X: torch.Tensor, block: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    _q8_quantize_rows(_np(_as_work(X)), int(block), codes.numpy(), scales.numpy())


def _quantized_tile(block: int) -> int:
    """Columns per parallel task: whole quantization blocks, about TILE of them."""
    return block * max(1, TILE // block)


@_pjit
def _q8_rows_combination(
    codes, scales, block, tile, rows, coef, group_start, out, alpha, beta
):  # pragma: no cover - compiled
    """out[g] = beta*out[g] + alpha * sum_{r in g} coef[r] * decode(row r), by column tiles of
    whole blocks; four rows at a time share each pass over the float64 tile accumulator."""
    G = group_start.shape[0] - 1
    D = codes.shape[1]
    for t in nb.prange((D + tile - 1) // tile):
        s0 = t * tile
        e0 = min(D, s0 + tile)
        acc = np.empty(e0 - s0, dtype=np.float64)
        for g in range(G):
            acc[:] = 0.0
            r0, r1 = group_start[g], group_start[g + 1]
            j = r0
            while j < r1:
                four = j + 4 <= r1
                for b in range(s0 // block, (e0 + block - 1) // block):
                    lo = b * block
                    hi = min(e0, lo + block)
                    a = acc[lo - s0 : hi - s0]
                    if four:
                        ra, rb, rc, rd = rows[j], rows[j + 1], rows[j + 2], rows[j + 3]
                        sa, sb = scales[ra, b], scales[rb, b]
                        sc, sd = scales[rc, b], scales[rd, b]
                        ca, cb = codes[ra, lo:hi], codes[rb, lo:hi]
                        cc, cd = codes[rc, lo:hi], codes[rd, lo:hi]
                        wa, wb, wc, wd = coef[j], coef[j + 1], coef[j + 2], coef[j + 3]
                        for i in range(hi - lo):
                            a[i] += (
                                wa * np.float64(np.float32(ca[i]) * sa)
                                + wb * np.float64(np.float32(cb[i]) * sb)
                            ) + (
                                wc * np.float64(np.float32(cc[i]) * sc)
                                + wd * np.float64(np.float32(cd[i]) * sd)
                            )
                    else:
                        r = rows[j]
                        sr, cr, wr = scales[r, b], codes[r, lo:hi], coef[j]
                        for i in range(hi - lo):
                            a[i] += wr * np.float64(np.float32(cr[i]) * sr)
                j += 4 if four else 1
            o = out[g, s0:e0]
            if beta == 0.0:
                for i in range(e0 - s0):
                    o[i] = alpha * acc[i]
            else:
                for i in range(e0 - s0):
                    o[i] = beta * np.float64(o[i]) + alpha * acc[i]


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
    if out.shape[1] == 0:
        return
    _q8_rows_combination(
        codes.numpy(), scales.numpy(), int(block), _quantized_tile(int(block)), rows, coef,
        group_start, _np(out), float(alpha), float(beta),
    )  # fmt: skip


@nb.njit(cache=True, nogil=True, parallel=True)
def _q8_decode_columns(codes, scales, block, c0, out):  # pragma: no cover - compiled
    """out[k, i] = decode(codes[k, c0 + i]) for the columns out covers (c0 on a block edge);
    tasks of _Q_TASK_BLOCKS blocks of one row."""
    K, n = out.shape
    per_row = (n + block - 1) // block
    tasks = (per_row + _Q_TASK_BLOCKS - 1) // _Q_TASK_BLOCKS
    for j in nb.prange(K * tasks):
        k = j // tasks
        t = j - k * tasks
        for b in range(t * _Q_TASK_BLOCKS, min(per_row, (t + 1) * _Q_TASK_BLOCKS)):
            lo = b * block
            hi = min(n, lo + block)
            s = scales[k, c0 // block + b]
            c = codes[k, c0 + lo : c0 + hi]
            o = out[k, lo:hi]
            for i in range(hi - lo):
                o[i] = np.float32(c[i]) * s


# Bytes of the float32 buffer a quantized Gram decodes columns into: it stays in the last-level
# cache, and fewer, longer chunks amortise each chunk's two calls (measured: 8 MB is 10-15 %
# faster than 2 MB at K = 16 and 64, D = 4M).
_GRAM_DECODE_BYTES = 8 << 20


def quantized_gram(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    K, D = codes.shape
    G = torch.zeros(K, K, dtype=torch.float64)
    if K == 0 or D == 0:
        return G.to(torch.float32)
    cols = block * max(1, _GRAM_DECODE_BYTES // (4 * K * block))
    buf = torch.empty(K, min(cols, D), dtype=torch.float32)
    part = torch.empty(K, K, dtype=torch.float32)
    c_np, s_np = codes.numpy(), scales.numpy()
    for c0 in range(0, D, cols):
        chunk = buf[:, : min(cols, D - c0)]
        _q8_decode_columns(c_np, s_np, int(block), c0, _np(chunk))
        torch.mm(chunk, chunk.T, out=part)
        G += part
    return mirror_upper(G).to(torch.float32)
