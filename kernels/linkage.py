"""UPGMA (average) hierarchical-clustering linkage in scipy's ``Z`` format.

Two backends receive validated float64 condensed distances (length n(n-1)/2, n >= 2, finite,
>= 0; see BACKENDS.md) and return a float64 ``[n-1, 4]`` array of rows
``[id_a, id_b, height, size]`` with ``id_a < id_b``; the cluster formed by row i gets id n + i.

- ``average_linkage_reference``: the textbook greedy algorithm, written for clarity.
- ``average_linkage_cpu``: scipy's nearest-neighbour chain compiled with numba on a square
  matrix, so the result equals ``scipy.cluster.hierarchy.linkage(condensed, "average")``.

``linkage_from_square`` and ``linkage_from_condensed`` are the public API's fast path: they check
the distances (finite, >= -1e-12, and for a square matrix symmetric with a zero diagonal) in the
same pass that builds the working matrix; ``linkage_from_similarity`` makes FedDGIC's distances
``1 - (S + S^T) / 2`` from similarities in that pass (numpy's four [n, n] temporaries and its
transposed read take longer than the linkage itself at n = 4096). All three answer None for input
that fails, so the caller raises its precise error from its own (slower) checks. The working
matrix is kept per thread for the next call of the same n (FedDGIC groups the same clients every
round): on this project's 2-core VM the page faults of a fresh 134 MB matrix (n = 4096) cost
most of a run.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

__all__ = [
    "average_linkage_cpu",
    "average_linkage_reference",
    "linkage_from_condensed",
    "linkage_from_similarity",
    "linkage_from_square",
]

# Distances down to this far below 0 are rounding (1 - cosine of near-parallel rows): clamped.
NEGATIVE_TOLERANCE = 1e-12
_PAD = 8  # columns of padding per row of the working matrix (see _new_work)
_scratch = threading.local()


def _num_obs(condensed: np.ndarray) -> int:
    """Number of observations n from a condensed length n(n-1)/2 (inputs are pre-validated)."""
    m = condensed.shape[0]
    n = int(round((1.0 + np.sqrt(1.0 + 8.0 * m)) / 2.0))
    return n


# --------------------------------------------------------------------------------------------
# Reference: greedy global-minimum merging.
# --------------------------------------------------------------------------------------------


def average_linkage_reference(condensed: np.ndarray) -> np.ndarray:
    """Textbook UPGMA (merge the closest pair, size-weighted mean update) as a readable oracle."""
    condensed = np.asarray(condensed, dtype=np.float64)
    n = _num_obs(condensed)
    # Square matrix with +inf on the diagonal and for retired clusters, so a plain minimum over
    # the whole matrix only ever sees pairs of distinct active clusters.
    dist = np.full((n, n), np.inf)
    iu, ju = np.triu_indices(n, k=1)
    dist[iu, ju] = condensed
    dist[ju, iu] = condensed

    ids = np.arange(n, dtype=np.int64)  # scipy cluster id held by each slot
    sizes = np.ones(n, dtype=np.int64)
    active = np.ones(n, dtype=bool)
    z = np.empty((n - 1, 4), dtype=np.float64)

    for step in range(n - 1):
        height = dist.min()
        ii, jj = np.nonzero(dist == height)
        upper = ii < jj
        ii, jj = ii[upper], jj[upper]
        # Tie rule (height, smaller id, larger id): a lexsort on the id pairs of the tied slots.
        lo = np.minimum(ids[ii], ids[jj])
        hi = np.maximum(ids[ii], ids[jj])
        pick = np.lexsort((hi, lo))[0]
        a, b = int(ii[pick]), int(jj[pick])
        na, nb = sizes[a], sizes[b]
        z[step] = (lo[pick], hi[pick], height, na + nb)

        # The merged cluster takes slot a; slot b is retired.
        merged = (na * dist[a] + nb * dist[b]) / (na + nb)
        active[b] = False
        merged[~active] = np.inf
        merged[a] = np.inf
        dist[a, :] = merged
        dist[:, a] = merged
        dist[b, :] = np.inf
        dist[:, b] = np.inf
        sizes[a] = na + nb
        ids[a] = n + step
    return z


# --------------------------------------------------------------------------------------------
# CPU: nearest-neighbour chain (scipy's _hierarchy.nn_chain) on a square matrix.
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _mirror_upper(d: np.ndarray, n: int) -> None:
    """Copy d's upper triangle onto its lower one, in tiles so the transposed reads stay in
    cache."""
    tile = 64
    for i0 in range(0, n, tile):
        i1 = min(i0 + tile, n)
        for j0 in range(0, i1, tile):
            j1 = min(j0 + tile, n)
            for i in range(i0, i1):
                for j in range(j0, min(j1, i)):
                    d[i, j] = d[j, i]


@njit(cache=True, nogil=True)
def _checked_from_condensed(condensed: np.ndarray, n: int, d: np.ndarray) -> bool:
    """Expand condensed distances into the square ``d`` with +inf on the diagonal, each value
    checked finite and >= -tolerance (tiny negatives clamped to 0); False at the first value
    that fails."""
    k = 0
    for i in range(n):
        d[i, i] = np.inf
        for j in range(i + 1, n):
            v = condensed[k]
            k += 1
            if not (v >= -NEGATIVE_TOLERANCE) or v == np.inf:  # NaN fails the first test
                return False
            d[i, j] = v if v > 0.0 else 0.0
    _mirror_upper(d, n)
    return True


@njit(cache=True, nogil=True)
def _checked_into_work(a: np.ndarray, n: int, d: np.ndarray, similarities: bool) -> bool:
    """Square ``a`` into the working matrix ``d`` with +inf on the diagonal, in 64 x 64 tiles
    so the transposed reads stay in cache; False at the first value that fails.

    ``a`` holds distances (``similarities`` False): they must be finite, symmetric bit for bit,
    >= -tolerance (tiny negatives clamped to 0), with a zero diagonal. Or ``a`` holds
    similarities: the distance of a pair is ``max(1 - (a[i, j] + a[j, i]) / 2, 0)``, the same
    operations in the same order as numpy's ``1.0 - (s + s.T) / 2.0`` then
    ``np.maximum(d, 0.0)`` (equal bit for bit), and must be finite (a similarity that is not,
    or a sum that overflows, fails); the diagonal must be finite."""
    tile = 64
    for i0 in range(0, n, tile):
        i1 = min(i0 + tile, n)
        for j0 in range(0, i1, tile):
            j1 = min(j0 + tile, n)
            for i in range(i0, i1):
                for j in range(j0, min(j1, i)):
                    lower = a[i, j]
                    if similarities:
                        v = 1.0 - (lower + a[j, i]) / 2.0
                        if not np.isfinite(v):
                            return False
                    else:
                        v = lower
                        if v != a[j, i]:  # NaN is unequal to itself: fails here
                            return False
                        if not (v >= -NEGATIVE_TOLERANCE) or v == np.inf:
                            return False
                    v = v if v > 0.0 else 0.0
                    d[i, j] = v
                    d[j, i] = v
    for i in range(n):
        ok = np.isfinite(a[i, i]) if similarities else a[i, i] == 0.0
        if not ok:
            return False
        d[i, i] = np.inf
    return True


def _new_work(n: int) -> np.ndarray:
    """A working matrix for n points. Its rows are padded by one cache line: with a
    power-of-two n the column walks would otherwise map every row to the same cache set and
    thrash (3x slower chains at n = 4096)."""
    return np.empty((n, n + _PAD), dtype=np.float64)


def _work(n: int) -> np.ndarray:
    """This thread's working matrix for n points, reused while n stays the same."""
    d = getattr(_scratch, "d", None)
    if d is None or d.shape != (n, n + _PAD):
        _scratch.d = None  # the old one goes before the new one is paged in
        d = _scratch.d = _new_work(n)
    return d


def _linkage_of_work(d: np.ndarray, n: int) -> np.ndarray:
    z = _nn_chain(d, n)
    # Stable, as scipy: equal heights keep the order in which the chain found them.
    z = z[np.argsort(z[:, 2], kind="stable")]
    _label(z, n)
    return z


def linkage_from_square(a: np.ndarray) -> np.ndarray | None:
    """UPGMA of square float64 distances [n, n] (n >= 2), or None when they are not finite,
    symmetric, >= -1e-12 with a zero diagonal (the caller says which)."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    n = a.shape[0]
    d = _work(n)
    return _linkage_of_work(d, n) if _checked_into_work(a, n, d, False) else None


def linkage_from_condensed(condensed: np.ndarray) -> np.ndarray | None:
    """UPGMA of condensed float64 distances (n >= 2 points), or None when they are not finite
    and >= -1e-12 (the caller says which)."""
    condensed = np.ascontiguousarray(condensed, dtype=np.float64)
    n = _num_obs(condensed)
    d = _work(n)
    return _linkage_of_work(d, n) if _checked_from_condensed(condensed, n, d) else None


def linkage_from_similarity(s: np.ndarray) -> np.ndarray | None:
    """UPGMA of the distances ``max(1 - (S + S^T) / 2, 0)`` (zero diagonal) of square float64
    similarities [n, n] (n >= 2), built straight into the working matrix; None when one of them
    is not finite (the caller says why, or takes the numpy path when a finite sum overflowed)."""
    s = np.ascontiguousarray(s, dtype=np.float64)
    n = s.shape[0]
    d = _work(n)
    return _linkage_of_work(d, n) if _checked_into_work(s, n, d, True) else None


@njit(cache=True, nogil=True)
def _nn_chain(d: np.ndarray, n: int) -> np.ndarray:
    """Nearest-neighbour chain on square distances d (modified in place); unsorted merges."""
    z = np.empty((n - 1, 4), dtype=np.float64)
    size = np.ones(n, dtype=np.int64)
    # Scans read the active slots only, through ``live`` (ascending): retired clusters are
    # never read, so nothing is written to mask them (a column write touches one cache line per
    # row), and each scan shrinks with the number of clusters left.
    live = np.arange(n)  # active slots, ascending
    n_live = n
    chain = np.empty(n, dtype=np.int64)
    chain_len = 0
    inf = np.inf
    for k in range(n - 1):
        if chain_len == 0:
            chain[0] = live[0]
            chain_len = 1
        # Follow nearest neighbours until two clusters are each other's nearest.
        while True:
            x = chain[chain_len - 1]
            row = d[x]
            # Starting from the previous chain element and replacing only on a strict
            # improvement is scipy's rule: it prevents cycles on ties and, with the ascending
            # scan, prefers the smaller index among equal distances.
            if chain_len > 1:
                y = chain[chain_len - 2]
                cur = row[y]
            else:
                y = -1
                cur = inf
            for j in range(n_live):
                i = live[j]
                v = row[i]
                if v < cur:
                    cur = v
                    y = i
            if chain_len > 1 and y == chain[chain_len - 2]:
                break
            chain[chain_len] = y
            chain_len += 1
        chain_len -= 2
        if x > y:
            x, y = y, x
        nx = size[x]
        ny = size[y]
        z[k, 0] = x
        z[k, 1] = y
        z[k, 2] = cur
        z[k, 3] = nx + ny
        size[x] = 0
        size[y] = nx + ny
        j = 0
        while live[j] != x:
            j += 1
        n_live -= 1
        live[j:n_live] = live[j + 1 : n_live + 1]
        # Lance-Williams average update, with scipy's operation order so the heights match
        # bitwise. Only active rows need their copy of column y; d[y, y] stays +inf because
        # d[y, y] was +inf.
        fx = np.float64(nx)
        fy = np.float64(ny)
        fs = np.float64(nx + ny)
        rx = d[x]
        ry = d[y]
        for j in range(n_live):
            i = live[j]
            v = (fx * rx[i] + fy * ry[i]) / fs
            ry[i] = v
            d[i, y] = v
    return z


@njit(cache=True, nogil=True)
def _find(parent: np.ndarray, x: np.int64) -> np.int64:
    """Root of x's set in the union-find `parent`, compressing the path from x to it."""
    root = x
    while parent[root] != root:
        root = parent[root]
    while parent[x] != root:
        nxt = parent[x]
        parent[x] = root
        x = nxt
    return root


@njit(cache=True, nogil=True)
def _label(z: np.ndarray, n: int) -> None:
    """Relabel height-sorted merges to scipy ids in place (scipy's LinkageUnionFind + label)."""
    parent = np.arange(2 * n - 1, dtype=np.int64)
    size = np.ones(2 * n - 1, dtype=np.int64)
    next_label = n
    for k in range(n - 1):
        x = np.int64(z[k, 0])
        y = np.int64(z[k, 1])
        rx = _find(parent, x)
        ry = _find(parent, y)
        if rx < ry:
            z[k, 0] = rx
            z[k, 1] = ry
        else:
            z[k, 0] = ry
            z[k, 1] = rx
        parent[rx] = next_label
        parent[ry] = next_label
        s = size[rx] + size[ry]
        size[next_label] = s
        z[k, 3] = s
        next_label += 1


def average_linkage_cpu(condensed: np.ndarray) -> np.ndarray:
    """UPGMA by nearest-neighbour chain in O(n^2), equal to scipy's ``linkage(method="average")``.

    Ties: when several clusters are at the same minimal distance from the chain's tip, the
    previous chain element is kept if it is among them, otherwise the smallest index wins (scipy's
    rule). Merges are then sorted by height with a stable sort and relabelled with a union-find,
    so the dendrogram has non-decreasing heights and is identical run to run; with the same
    floating-point operations in the same order, the heights equal scipy's bitwise.

    Works on a square copy (8 n (n + 8) bytes: 134 MB at n = 4096) so that every scan reads one
    contiguous row instead of scipy's strided condensed column. ``condensed`` is pre-validated
    (BACKENDS.md); a fresh working matrix every call.
    """
    condensed = np.ascontiguousarray(condensed, dtype=np.float64)
    n = _num_obs(condensed)
    d = _new_work(n)
    if not _checked_from_condensed(condensed, n, d):
        raise ValueError("condensed distances must be finite and >= 0")
    return _linkage_of_work(d, n)
