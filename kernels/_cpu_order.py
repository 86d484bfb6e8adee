"""CPU order statistics per coordinate: `coordinate_median` and `trimmed_mean` of [K, D] rows.

One pass over X. The columns are cut into blocks of `block_width(K)` columns; a block's K row
slices are copied, row by row (sequential reads), into a [K, B] scratch tile that stays in L2,
and each of the block's B columns is ordered there. The median is the trimmed mean that keeps
one (odd K) or two (even K) middle values, cut = (K - 1) // 2, so both share one path:

* K <= NETWORK_MAX_K: a sorting network applied to the tile's rows. Each compare-exchange (a, b)
  is ``row_a, row_b = min(row_a, row_b), max(row_a, row_b)`` over the B columns at once:
  branch-free and vectorised. The network is Batcher's odd-even merge sort on the next power of
  two, with the padding (+inf wires) folded away and every compare-exchange that cannot change
  the result pruned (`order_network`: only the *set* of middle wires is needed), then paired
  into steps of two independent compare-exchanges (`paired`).
* larger K: each column is gathered from the tile into a [K] buffer and partially ordered by
  quickselect (Wirth's selection): position `cut` first (the cut smallest before it), then the
  K - 2 cut smallest of the rest, which are summed.

The result of a column is ``sum of the chosen values / count``, summed and divided in float64:
the median of odd K is the middle value itself, of even K (a + b) / 2 rounded once into the
output dtype (bitwise what the float64 reference gives: adding two float32 values in float64 is
exact); the trimmed mean is the float64 sum of the K - 2 cut middle values over K - 2 cut.

Half-precision inputs take one conversion to float32 first (numba has no half arithmetic) and
their results go through a float64 [D] buffer, so they are rounded once too. Columns are blocks
of tiles that never overlap, so the result does not depend on the thread count.
"""

from __future__ import annotations

import functools

import numba as nb
import numpy as np
import torch

# Columns per parallel task: enough blocks per task to amortise the scratch allocation, and
# D = 4M gives 256 tasks for the 2 threads.
TASK_COLUMNS = 16384
# Above this many rows the sorting network (O(K log^2 K) compare-exchanges per column) gives
# way to quickselect (O(K) expected per column, but branchy and scalar). Medians of D = 256K
# float32 columns, 2 threads: network 16.5 / 38.7 / 102 ms against quickselect 163 / 307 /
# 605 ms at K = 64 / 128 / 256.
NETWORK_MAX_K = 256
# Bytes of one scratch tile (in L2). Wide rows amortise each compare-exchange's loop overhead:
# at K = 64, D = 1M, B = 256 columns took 49 ms against 77 ms with B = 64.
TILE_BYTES = 65536

_jit = functools.partial(nb.njit, cache=True, nogil=True)
_pjit = functools.partial(nb.njit, cache=True, nogil=True, parallel=True)
# The inputs are finite (kernels/robust.py), so min/max may take the vector instructions' NaN and
# signed-zero rules; without these flags LLVM keeps IEEE max and turns the min into a masked
# store, several times slower on this machine's CPU.
_FINITE = {"nnan", "ninf", "nsz"}

# Wire labels of the backward pruning in `order_network`.
_DEAD, _LIVE, _SUMMED = 0, 1, 2


def block_width(K: int, itemsize: int) -> int:
    """Columns per scratch tile: a [K, B] tile of at most TILE_BYTES, 16 <= B <= 256 (a multiple
    of 16: whole vectors in the inner loops)."""
    B = TILE_BYTES // max(1, K * itemsize)
    return int(min(256, max(16, B - B % 16)))


# --------------------------------------------------------------------------------------------
# Sorting networks
# --------------------------------------------------------------------------------------------


def _batcher_pairs(n: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort on n = 2^p wires: compare-exchanges (i, j), i < j, min to i."""
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return pairs


@functools.lru_cache(maxsize=64)
def _sorting_network(K: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """A sorting network of K physical rows: (compare-exchanges (lo_row, hi_row) in order,
    the row holding the r-th smallest value at the end, r = 0..K-1).

    Batcher's network on n = next power of two >= K wires, the n - K extra wires holding +inf:
    a compare-exchange whose upper wire holds +inf does nothing, and one whose lower wire holds
    +inf (the upper a real value) only moves the real value down, which is a relabelling of rows,
    not work. What is left compares real rows only.
    """
    n = 1 << max(0, K - 1).bit_length()
    row = list(range(n))  # physical row currently on each wire (>= K: a +inf pad)
    kept = []
    for i, j in _batcher_pairs(n):
        if row[j] >= K:  # upper wire +inf: min(x, inf) = x stays put
            continue
        if row[i] >= K:  # lower wire +inf: the real value moves down, the pad up
            row[i], row[j] = row[j], row[i]
            continue
        kept.append((row[i], row[j]))
    return tuple(kept), tuple(row[:K])


@functools.lru_cache(maxsize=256)
def order_network(K: int, lo: int, hi: int, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The compare-exchanges that put the *set* of order statistics lo..hi-1 (0-based) of K
    values on known rows, and those rows: (int64 [C, 2] (min row, max row) pairs in execution
    order, int64 [hi - lo] rows).

    Only the sum of those order statistics is wanted (a trimmed mean; the median keeps one or
    two), so the network need not order them among themselves (with `exact`, it does: the
    rows then hold order statistics lo..hi-1 in order, for `mean_around_median`'s walk). Pruned
    backwards from the
    output: a wire is dead (its value reaches no output), summed (it goes untouched into the
    summed set) or live (its exact value matters). A compare-exchange of two dead wires, or of
    two summed ones (it only swaps two terms of the sum), is dropped; any other is kept and
    makes both wires live.
    """
    pairs, final = _sorting_network(K)
    label = [_DEAD] * K
    for r in range(lo, hi):
        label[final[r]] = _LIVE if exact else _SUMMED
    kept = []
    for a, b in reversed(pairs):
        la, lb = label[a], label[b]
        if la == lb and la != _LIVE:
            continue
        kept.append((a, b))
        label[a] = label[b] = _LIVE
    kept.reverse()
    net = np.array(kept, dtype=np.int64).reshape(-1, 2)
    rows = np.array(final[lo:hi], dtype=np.int64)
    return net, rows


def paired(net: np.ndarray) -> np.ndarray:
    """The compare-exchanges as int64 [C', 4] steps: two consecutive ones on four distinct rows
    share a step (one loop over the columns, twice the independent work per iteration: about
    15% faster at K = 64); a lone one has -1 in its last two slots. Order is kept."""
    steps = []
    i = 0
    while i < len(net):
        a, b = int(net[i, 0]), int(net[i, 1])
        if i + 1 < len(net) and len({a, b, int(net[i + 1, 0]), int(net[i + 1, 1])}) == 4:
            steps.append((a, b, int(net[i + 1, 0]), int(net[i + 1, 1])))
            i += 2
        else:
            steps.append((a, b, -1, -1))
            i += 1
    return np.array(steps, dtype=np.int64).reshape(-1, 4)


@functools.lru_cache(maxsize=256)
def _steps(K: int, cut: int) -> tuple[np.ndarray, np.ndarray]:
    net, rows = order_network(K, cut, K - cut)
    return paired(net), rows


# --------------------------------------------------------------------------------------------
# numba kernels
# --------------------------------------------------------------------------------------------


@functools.partial(_jit, fastmath=_FINITE)
def _sort_tile(tile, steps, n):  # pragma: no cover - compiled
    """Apply the network's compare-exchanges (`paired` steps) to columns :n of the tile."""
    for c in range(steps.shape[0]):
        ra = tile[steps[c, 0]]
        rb = tile[steps[c, 1]]
        if steps[c, 2] < 0:
            for i in range(n):
                x = ra[i]
                y = rb[i]
                ra[i] = -max(-x, -y)
                rb[i] = max(x, y)
        else:
            rc = tile[steps[c, 2]]
            rd = tile[steps[c, 3]]
            for i in range(n):
                x = ra[i]
                y = rb[i]
                u = rc[i]
                v = rd[i]
                ra[i] = -max(-x, -y)
                rb[i] = max(x, y)
                rc[i] = -max(-u, -v)
                rd[i] = max(u, v)


# The parallel passes: each task takes TASK_COLUMNS columns and a scratch tile of B columns,
# which it fills block by block and orders (inlined, so the passes compile as if written out).


@_jit
def _num_tasks(X):  # pragma: no cover - compiled
    return (X.shape[1] + TASK_COLUMNS - 1) // TASK_COLUMNS


@functools.partial(_jit, inline="always")
def _task_tile(X, task, B):  # pragma: no cover - compiled
    """(the task's scratch [K, B] tile, its first column, one past its last column)."""
    tile = np.empty((X.shape[0], B), dtype=X.dtype)
    return tile, task * TASK_COLUMNS, min(X.shape[1], (task + 1) * TASK_COLUMNS)


@functools.partial(_jit, inline="always")
def _load_block(X, s, end, tile):  # pragma: no cover - compiled
    """Copies columns s.. of X, as many as the tile holds and none from `end` on, into `tile`;
    returns their count."""
    n = min(tile.shape[1], end - s)
    for k in range(X.shape[0]):
        tile[k, :n] = X[k, s : s + n]
    return n


@functools.partial(_pjit, fastmath=_FINITE)
def _network_pass(X, steps, rows, div, B, out):  # pragma: no cover - compiled
    """out[i] = (sum over r in rows of T[r, i]) / div, T = the columns of X ordered by the
    network's `steps` (`paired`)."""
    R = rows.shape[0]
    for task in nb.prange(_num_tasks(X)):
        tile, t_start, t_end = _task_tile(X, task, B)
        acc = np.empty(B, dtype=np.float64)
        for s in range(t_start, t_end, B):
            n = _load_block(X, s, t_end, tile)
            _sort_tile(tile, steps, n)
            first = tile[rows[0]]
            for i in range(n):
                acc[i] = np.float64(first[i])
            for r in range(1, R):
                t = tile[rows[r]]
                for i in range(n):
                    acc[i] += np.float64(t[i])
            o = out[s : s + n]
            for i in range(n):
                o[i] = acc[i] / div


@_jit
def _select(a, lo, hi, k):  # pragma: no cover - compiled
    """Reorder a[lo:hi] so that a[k] is its (k - lo)-th smallest, nothing larger before it and
    nothing smaller after it (Wirth's selection; the values are finite)."""
    L = lo
    R = hi - 1
    while L < R:
        x = a[k]
        i = L
        j = R
        while i <= j:
            while a[i] < x:
                i += 1
            while x < a[j]:
                j -= 1
            if i <= j:
                t = a[i]
                a[i] = a[j]
                a[j] = t
                i += 1
                j -= 1
        if j < k:
            L = i
        if k < i:
            R = j


@_pjit
def _select_pass(X, cut, B, out):  # pragma: no cover - compiled
    """out[i] = mean of order statistics cut..K-cut-1 of column i, by quickselect."""
    K = X.shape[0]
    for task in nb.prange(_num_tasks(X)):
        tile, t_start, t_end = _task_tile(X, task, B)
        buf = np.empty(K, dtype=X.dtype)
        for s in range(t_start, t_end, B):
            n = _load_block(X, s, t_end, tile)
            for i in range(n):
                for k in range(K):
                    buf[k] = tile[k, i]
                # The cut smallest to the front, then the K - 2 cut smallest of the rest.
                _select(buf, 0, K, cut)
                _select(buf, cut, K, K - cut - 1)
                acc = 0.0
                for k in range(cut, K - cut):
                    acc += np.float64(buf[k])
                out[s + i] = acc / (K - 2 * cut)


@_pjit
def _window_pass(X, steps, rows, lo, keep, B, out):  # pragma: no cover - compiled
    """out[i] = mean of the `keep` values of column i nearest its median: the network puts order
    statistics lo.. on `rows` in order, then the greedy walk of kernels/robust.py, in float64
    (the median of two float32 values and every distance to it are exact there, so the walk
    takes the reference's choices)."""
    K = X.shape[0]
    half = K // 2
    for task in nb.prange(_num_tasks(X)):
        tile, t_start, t_end = _task_tile(X, task, B)
        for s in range(t_start, t_end, B):
            n = _load_block(X, s, t_end, tile)
            _sort_tile(tile, steps, n)
            for i in range(n):
                if K % 2:
                    m = np.float64(tile[rows[half - lo], i])
                    a, b, total = half, half + 1, m
                else:
                    m = (np.float64(tile[rows[half - 1 - lo], i])
                         + np.float64(tile[rows[half - lo], i])) / 2.0  # fmt: skip
                    a, b, total = half, half, 0.0
                while b - a < keep:
                    right = np.float64(tile[rows[b - lo], i]) if b < K else 0.0
                    if b >= K or (a > 0 and m - np.float64(tile[rows[a - 1 - lo], i]) <= right - m):
                        a -= 1
                        total += np.float64(tile[rows[a - lo], i])
                    else:
                        total += right
                        b += 1
                out[s + i] = total / keep


def _walk_sorted(X: torch.Tensor, keep: int, out: torch.Tensor) -> None:
    """The walk on torch-sorted columns, for K above the networks (bounded chunks)."""
    from ._cpu_median_window import mean_around_median as walk

    K, D = X.shape
    step = max(1, (1 << 26) // max(1, K))
    for s in range(0, D, step):
        walk(X[:, s : s + step], keep, out[s : s + step])


# --------------------------------------------------------------------------------------------
# Backend functions (kernels/BACKENDS.md)
# --------------------------------------------------------------------------------------------


def _run(X: torch.Tensor, cut: int, out: torch.Tensor) -> None:
    """out = mean of order statistics cut..K-cut-1 of every column of X (one pass)."""
    K, D = X.shape
    if D == 0:
        return
    Xw = X if X.dtype in (torch.float32, torch.float64) else X.to(torch.float32)
    # Half outputs take the float64 results and round them once.
    target = out if out.dtype == Xw.dtype else torch.empty(D, dtype=torch.float64)
    xs, ts = Xw.detach().numpy(), target.detach().numpy()
    B = block_width(K, Xw.element_size())
    if K <= NETWORK_MAX_K:
        steps, rows = _steps(K, cut)
        _network_pass(xs, steps, rows, float(K - 2 * cut), B, ts)
    else:
        _select_pass(xs, cut, B, ts)
    if target is not out:
        out.copy_(target)


def coordinate_median(X: torch.Tensor, out: torch.Tensor) -> None:
    """The median is the trimmed mean that keeps one (odd K) or two (even K) middle values."""
    _run(X, (X.shape[0] - 1) // 2, out)


def trimmed_mean(X: torch.Tensor, cut: int, out: torch.Tensor) -> None:
    _run(X, cut, out)


def mean_around_median(X: torch.Tensor, keep: int, out: torch.Tensor) -> None:
    """out = mean of each column's `keep` values nearest its median (Bulyan's step)."""
    K, D = X.shape
    if D == 0:
        return
    if K > NETWORK_MAX_K:
        _walk_sorted(X, keep, out)
        return
    Xw = X if X.dtype in (torch.float32, torch.float64) else X.to(torch.float32)
    target = out if out.dtype == Xw.dtype else torch.empty(D, dtype=torch.float64)
    # The walk visits sorted positions within keep of the middle.
    lo, hi = max(0, K // 2 - keep), min(K, K // 2 + keep + 1)
    net, rows = order_network(K, lo, hi, exact=True)
    B = block_width(K, Xw.element_size())
    _window_pass(Xw.detach().numpy(), paired(net), rows, lo, keep, B, target.detach().numpy())
    if target is not out:
        out.copy_(target)
