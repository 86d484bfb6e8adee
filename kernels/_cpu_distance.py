"""CPU (numba) passes of the distance-based robust kernels: each row's squared distance to one
point and norm bounding (`clip_rows`); cpu.py's `sq_distances_to` and `clip_rows` call them.

Work is cut into tiles of the row length (cpu.py's TILE). A parallel pass writes one float64
partial sum per (row, tile); the partials of a row are then added in tile order, so every result
is independent of thread scheduling (bitwise reproducible, no atomics), as in cpu.py.

Distances are summed over the differences, never formed from a Gram matrix: a row close to the
point (|x - p| << |x|) keeps its relative accuracy, where |x|^2 + |p|^2 - 2 <x, p> cancels.
"""

from __future__ import annotations

import functools

import numba as nb
import numpy as np

# cpu.py's fastmath flags: reassoc lets LLVM vectorise the sums; no nnan/ninf, so NaN and Inf
# keep IEEE semantics (the scaling pass has one product per element: nothing to contract).
_FM = {"reassoc", "nsz", "contract", "arcp"}
_jit = functools.partial(nb.njit, cache=True, nogil=True, fastmath=_FM)
_pjit = functools.partial(nb.njit, cache=True, nogil=True, fastmath=_FM, parallel=True)


@_pjit
def _tile_sq_distances(X, p, ts, te, P):  # pragma: no cover - compiled
    """P[k, t] = sum over tile t of (X[k] - p)^2, in float64 (p is [1, D])."""
    # Four rows share each load and conversion of the point's tile (cpu.py's `_tile_dots`
    # measured one row at a time ~1.3x slower with a broadcast operand).
    K = X.shape[0]
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        q = p[0, s:e]
        k = 0
        while k + 4 <= K:
            a0, a1, a2, a3 = X[k, s:e], X[k + 1, s:e], X[k + 2, s:e], X[k + 3, s:e]
            c0 = 0.0
            c1 = 0.0
            c2 = 0.0
            c3 = 0.0
            for i in range(e - s):
                qi = np.float64(q[i])
                d0 = np.float64(a0[i]) - qi
                d1 = np.float64(a1[i]) - qi
                d2 = np.float64(a2[i]) - qi
                d3 = np.float64(a3[i]) - qi
                c0 += d0 * d0
                c1 += d1 * d1
                c2 += d2 * d2
                c3 += d3 * d3
            P[k, t] = c0
            P[k + 1, t] = c1
            P[k + 2, t] = c2
            P[k + 3, t] = c3
            k += 4
        while k < K:
            a = X[k, s:e]
            acc = 0.0
            for i in range(e - s):
                d = np.float64(a[i]) - np.float64(q[i])
                acc += d * d
            P[k, t] = acc
            k += 1


@_pjit
def _tile_sq_norms(X, ts, te, P):  # pragma: no cover - compiled
    """P[k, t] = sum over tile t of X[k]^2, in float64."""
    K = X.shape[0]
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        for k in range(K):
            a = X[k, s:e]
            acc = 0.0
            for i in range(e - s):
                v = np.float64(a[i])
                acc += v * v
            P[k, t] = acc


@_jit
def _row_sums(P):  # pragma: no cover - compiled
    """[K] sums of the [K, T] tile partials, each row added in tile order."""
    K = P.shape[0]
    out = np.zeros(K)
    for k in range(K):
        acc = 0.0
        for t in range(P.shape[1]):
            acc += P[k, t]
        out[k] = acc
    return out


@_pjit
def _scale_rows(X, scale, ts, te, out, in_place):  # pragma: no cover - compiled
    """out[k] = X[k] * scale[k] on every tile; a row whose scale is exactly 1 is copied (or, in
    place, not touched), so it stays bitwise what it was."""
    K = X.shape[0]
    for t in nb.prange(ts.shape[0]):
        s, e = ts[t], te[t]
        for k in range(K):
            c = scale[k]
            x = X[k, s:e]
            o = out[k, s:e]
            if c == 1.0:
                if not in_place:
                    o[:] = x
            else:
                for i in range(e - s):
                    o[i] = np.float64(x[i]) * c


@_jit
def _clip_scales(sq_norms, max_norm):  # pragma: no cover - compiled
    """(norms, scales): sqrt of the squared norms and min(1, max_norm / norm), exactly 1 for
    the rows within the bound (norm <= max_norm)."""
    K = sq_norms.shape[0]
    norms = np.sqrt(sq_norms)
    scale = np.ones(K)
    for k in range(K):
        if norms[k] > max_norm:
            scale[k] = max_norm / norms[k]
    return norms, scale


def sq_distance_partials(X: np.ndarray, p: np.ndarray, ts: np.ndarray, te: np.ndarray):
    """float64 [K] squared distances of the rows of X [K, D] to p [1, D] over the tiles."""
    P = np.zeros((X.shape[0], ts.shape[0]))
    if ts.shape[0] and X.shape[0]:
        _tile_sq_distances(X, p, ts, te, P)
    return _row_sums(P)


def sq_norm_partials(X: np.ndarray, ts: np.ndarray, te: np.ndarray) -> np.ndarray:
    """float64 [K] squared norms of the rows of X [K, D] over the tiles."""
    P = np.zeros((X.shape[0], ts.shape[0]))
    if ts.shape[0] and X.shape[0]:
        _tile_sq_norms(X, ts, te, P)
    return _row_sums(P)


def clip_scales(sq_norms: np.ndarray, max_norm: float) -> tuple[np.ndarray, np.ndarray]:
    """(float64 [K] norms, [K] scale factors) from the squared norms (`_clip_scales`)."""
    return _clip_scales(np.ascontiguousarray(sq_norms, dtype=np.float64), float(max_norm))


def scale_rows(
    X: np.ndarray, scale: np.ndarray, ts: np.ndarray, te: np.ndarray, out: np.ndarray, in_place
) -> None:
    """out = X * scale per row (rows with scale 1 copied bitwise, or skipped in place)."""
    if ts.shape[0] and X.shape[0]:
        _scale_rows(X, scale, ts, te, out, bool(in_place))
