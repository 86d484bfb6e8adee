"""Byzantine-robust aggregation kernels: the public half, validated like the rest of
`aggsrv.kernels` (this module's functions are re-exported there; docs/robust.md says what each
aggregator assumes and costs).

Two kinds of functions:

* passes over the [K, D] rows, with ``backend=`` like every kernel: `coordinate_median`,
  `trimmed_mean` (order statistics per coordinate, one pass), `sq_distances_to` (each row's
  squared distance to one point), `clip_rows` (norm bounding), `geometric_median` (smoothed
  Weiszfeld) and `centered_clip` (Karimireddy et al. 2021), the last two iterating a distance
  pass and a weighted sum;
* selections on the small [K, K] matrix of squared distances (`krum_scores`, `krum_select`,
  `bulyan_select`): plain float64 torch on that matrix's device, from one
  `pairwise_sq_distances` (Gram) pass.

Inputs are assumed finite (a strategy validates every update before it reaches a row); a NaN in
a row makes the result of the coordinates (order statistics) or of the whole call (the
distance-based ones) undefined.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from . import _backend, _data, _finite, _is_alias, _out, _overlaps, _reduce, _rows, _same_kind
from ._partials import Reduce

__all__ = [
    "GeometricMedian",
    "bulyan_select",
    "centered_clip",
    "clip_rows",
    "coordinate_median",
    "geometric_median",
    "krum_scores",
    "krum_select",
    "mean_around_median",
    "sq_distances_to",
    "trimmed_mean",
    "trimmed_count",
]


def _row_out(name: str, out: Any, X: torch.Tensor) -> torch.Tensor:
    """A [D] result buffer in X's dtype on X's device (fresh when `out` is None)."""
    like = X[0] if X.shape[0] else X.new_empty(X.shape[1])
    if out is None:
        return torch.empty(X.shape[1], dtype=X.dtype, device=X.device)
    return _out(name, out, like, {"X": X})


def _per_coordinate(
    kernel: str, X: torch.Tensor, args: tuple[int, ...], out: Any, backend: str
) -> torch.Tensor:
    """The backend's order-statistics `kernel` over the checked rows X, written to the [D]
    result buffer (`_row_out`), which it returns."""
    out = _row_out("out", out, X)
    getattr(_backend(backend, X.device), kernel)(_rows(X), *args, out)
    return out


def _nonempty(X: torch.Tensor, what: str) -> None:
    if X.shape[0] == 0:
        raise ValueError(f"{what} of zero rows is undefined (X has shape {tuple(X.shape)})")


def _int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if int(value) < lo:
        raise ValueError(f"{name} must be >= {lo}, got {int(value)}")
    return int(value)


# --------------------------------------------------------------------------------------------
# Order statistics per coordinate
# --------------------------------------------------------------------------------------------


def coordinate_median(
    X: torch.Tensor, *, out: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """[D] median of the K rows, coordinate by coordinate (`np.median(X, axis=0)`).

    Odd K: the middle value; even K: the mean of the two middle values, formed in the
    accumulation dtype (float32, float64 for float64 data) and rounded once, so a tie of the two
    is that value exactly. One pass over X: each coordinate's K values are ordered in registers
    or cache, never by sorting [K, D] in memory.
    """
    _data("X", X, dims=(2,))
    _nonempty(X, "the median")
    return _per_coordinate("coordinate_median", X, (), out, backend)


def trimmed_count(K: int, trim: float) -> int:
    """Rows cut from each end of every coordinate by `trimmed_mean(X, trim)` with K rows:
    ``floor(trim * K)`` (scipy.stats.trim_mean's rule: a non-integer count cuts less)."""
    # The tiny slack keeps 0.1 * 30 = 3.0000000000000004 from becoming 3 by luck and 0.3 * 10
    # = 2.9999999999999996 from becoming 2.
    return int(math.floor(trim * K + 1e-9))


def trimmed_mean(
    X: torch.Tensor,
    trim: float | None = None,
    *,
    cut: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """[D] mean of each coordinate's K values without the `cut` smallest and `cut` largest.

    Give `trim`, a fraction in [0, 0.5) of the rows cut at each end (``cut = floor(trim * K)``,
    `scipy.stats.trim_mean`), or `cut` itself (Bulyan cuts f at each end). ``2 * cut < K``.
    Equal values are interchangeable, so ties need no rule: the K - 2 cut middle order
    statistics are summed in the accumulation dtype and divided by their count.
    """
    _data("X", X, dims=(2,))
    _nonempty(X, "the trimmed mean")
    K = X.shape[0]
    if (trim is None) == (cut is None):
        raise ValueError("give exactly one of trim (a fraction) and cut (a count of rows)")
    if trim is not None:
        t = _finite("trim", trim)
        if not 0.0 <= t < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {t}")
        c = trimmed_count(K, t)
    else:
        c = _int("cut", cut, 0)
    if 2 * c >= K:
        raise ValueError(f"cutting {c} rows at each end of {K} leaves none (need 2 * cut < K)")
    return _per_coordinate("trimmed_mean", X, (c,), out, backend)


def mean_around_median(
    X: torch.Tensor, keep: int, *, out: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """[D] mean of the `keep` values of each coordinate closest to that coordinate's median
    (Bulyan's coordinate-wise step, El Mhamdi et al. 2018, with keep = beta = theta - 2f).

    The chosen values are the ones a greedy walk outwards from the median takes: in sorted
    order, starting from the middle value (odd K) or between the two middle values (even K), it
    adds the nearer of the two next values, the lower one on a tie. With ``keep = K - 2 cut`` and
    values symmetric about the median this is `trimmed_mean(X, cut=cut)`; in general the window
    shifts towards the denser side. 1 <= keep <= K.
    """
    _data("X", X, dims=(2,))
    _nonempty(X, "the mean around the median")
    keep = _int("keep", keep, 1)
    if keep > X.shape[0]:
        raise ValueError(f"keep={keep} values of {X.shape[0]} rows")
    return _per_coordinate("mean_around_median", X, (keep,), out, backend)


# --------------------------------------------------------------------------------------------
# Distances to a point, norm bounding
# --------------------------------------------------------------------------------------------


def sq_distances_to(
    X: torch.Tensor,
    point: torch.Tensor,
    *,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """[K] squared distances |x_k - point|^2, float64, from one pass over the differences (no
    Gram: no cancellation when the rows are close to the point). `point` [D] may be a row of X.
    `reduce` gets this slice's float64 [K] partial sums and returns their sum over the shards.
    """
    _data("X", X, dims=(2,))
    _data("point", point, dims=(1,))
    _same_kind("X", X, point=point)
    if point.shape[0] != X.shape[1]:
        raise ValueError(f"point has length {point.shape[0]} but the rows have {X.shape[1]}")
    red = _reduce(reduce)
    impl = _backend(backend, X.device)
    return impl.sq_distances_to(_rows(X), _rows(point), reduce=red)


def clip_rows(
    X: torch.Tensor,
    max_norm: float,
    *,
    out: torch.Tensor | None = None,
    return_norms: bool = False,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rows scaled to norm at most `max_norm`: ``x_k * min(1, max_norm / |x_k|)`` [K, D].

    A row within the bound is copied bitwise (or left alone with ``out=X``, which is safe). With
    `return_norms`, also the float64 [K] norms before clipping. `reduce` gets the float64 [K]
    squared norms of this slice and returns their sums over the shards.
    """
    _data("X", X, dims=(2,))
    bound = _finite("max_norm", max_norm)
    if not bound > 0:
        raise ValueError(f"max_norm must be > 0, got {bound}")
    if out is None:
        out = torch.empty_like(X, memory_format=torch.contiguous_format)
    else:
        _out("out", out, X, {"X": X}, alias="X")
    red = _reduce(reduce)
    impl = _backend(backend, X.device)
    norms = impl.clip_rows(_rows(X), bound, out, reduce=red)
    return (out, norms) if return_norms else out


# --------------------------------------------------------------------------------------------
# Iterative aggregators: geometric median, centered clipping
# --------------------------------------------------------------------------------------------


class GeometricMedian(NamedTuple):
    """`geometric_median`'s result: the point, the iterations run, whether `tol` was met, and
    the objective sum_k w_k |x_k - z| at the point (float64)."""

    median: torch.Tensor
    iterations: int
    converged: bool
    objective: float


def _weights(weights: Any, K: int) -> torch.Tensor:
    """Non-negative finite float64 CPU weights [K] with a positive sum (None: all ones)."""
    if weights is None:
        return torch.ones(K, dtype=torch.float64)
    if isinstance(weights, torch.Tensor):
        w = weights.detach().to("cpu")
    else:
        # Not torch.as_tensor: it makes a list of Python floats float32 before float64.
        arr = np.asarray(weights)
        if arr.dtype.kind not in "fiu":
            raise TypeError(f"weights must be real numbers, got {arr.dtype}")
        w = torch.from_numpy(arr.astype(np.float64))
    if not (w.dtype.is_floating_point or w.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"weights must be real numbers, got {w.dtype}")
    w = w.to(torch.float64)
    if w.shape != (K,):
        raise ValueError(f"weights must have shape ({K},) (one per row), got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights must be finite and >= 0")
    if not float(w.sum()) > 0:
        raise ValueError("weights must not all be 0")
    return w


def geometric_median(
    X: torch.Tensor,
    weights: Any = None,
    *,
    iters: int = 100,
    tol: float = 1e-6,
    eps: float = 1e-8,
    init: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> GeometricMedian:
    """The (weighted) geometric median argmin_z sum_k w_k |x_k - z| by smoothed Weiszfeld
    (Pillutla et al., RFA): z <- sum_k b_k x_k / sum_k b_k with b_k = w_k / max(eps, |x_k - z|).

    Starts from `init` or the weighted mean. Each iteration is one weighted sum and one
    distance pass over X (`sq_distances_to`), whose distances give both the objective at the
    new z and the next step's weights (one more distance pass at the start); it stops after
    `iters` iterations or once the objective improved by at most ``tol`` times itself. The
    result is in X's dtype; the weights and the objective are float64. `reduce` sums each
    distance pass over the shards (``iterations + 1`` calls; every shard takes the same
    decisions from the same sums and updates its own slice of z). `out` may be `init` itself.
    """
    _data("X", X, dims=(2,))
    _nonempty(X, "the geometric median")
    K = X.shape[0]
    w = _weights(weights, K)
    iters = _int("iters", iters, 0)
    tol = _finite("tol", tol)
    eps = _finite("eps", eps)
    if tol < 0 or not eps > 0:
        raise ValueError(f"need tol >= 0 and eps > 0, got tol={tol}, eps={eps}")
    z = _row_out("out", out, X)
    if init is not None:
        _data("init", init, dims=(1,))
        _same_kind("X", X, init=init)
        if init.shape[0] != X.shape[1]:
            raise ValueError(f"init has length {init.shape[0]} but the rows have {X.shape[1]}")
        if _overlaps(z, init) and not _is_alias(z, init):
            raise ValueError("out overlaps init in memory (only out=init exactly is allowed)")
    red = _reduce(reduce)
    impl = _backend(backend, X.device)
    Xr = _rows(X)
    if init is None:
        impl.weighted_sum(Xr, (w / w.sum()).contiguous(), z, 1.0, 0.0)
    elif not _is_alias(z, init):
        z.copy_(init)
    # The distances at z serve twice: the objective at z, and the weights of the step from z.
    dist = impl.sq_distances_to(Xr, _rows(z), reduce=red).cpu().sqrt()
    objective = float((w * dist).sum())
    done, converged = 0, False
    while done < iters:
        b = w / dist.clamp_min(eps)
        impl.weighted_sum(Xr, (b / b.sum()).contiguous(), z, 1.0, 0.0)
        done += 1
        dist = impl.sq_distances_to(Xr, _rows(z), reduce=red).cpu().sqrt()
        new_objective = float((w * dist).sum())
        improved = objective - new_objective
        objective = new_objective
        if improved <= tol * objective:
            converged = True
            break
    return GeometricMedian(z, done, converged, objective)


def centered_clip(
    X: torch.Tensor,
    center: torch.Tensor,
    tau: float,
    *,
    iters: int = 1,
    weights: Any = None,
    out: torch.Tensor | None = None,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Centered clipping (Karimireddy, He and Jaggi 2021): from v = `center`, `iters` times
    v <- v + sum_k p_k (x_k - v) min(1, tau / |x_k - v|), with p the normalised `weights`
    (uniform by default). Each iteration is one distance pass and one weighted sum:
    v <- (1 - sum_k c_k) v + sum_k c_k x_k with c_k = p_k min(1, tau / |x_k - v|).

    `out` may be `center` itself (updated in place). Returns v in X's dtype. `reduce` sums
    each iteration's distance pass over the shards (`iters` calls).
    """
    _data("X", X, dims=(2,))
    _data("center", center, dims=(1,))
    _same_kind("X", X, center=center)
    _nonempty(X, "centered clipping")
    if center.shape[0] != X.shape[1]:
        raise ValueError(f"center has length {center.shape[0]} but the rows have {X.shape[1]}")
    t = _finite("tau", tau)
    if not t > 0:
        raise ValueError(f"tau must be > 0, got {t}")
    iters = _int("iters", iters, 1)
    p = _weights(weights, X.shape[0])
    p = p / p.sum()
    if out is None:
        v = torch.empty_like(center, memory_format=torch.contiguous_format)
    else:
        v = _out("out", out, center, {"X": X, "center": center}, alias="center")
    red = _reduce(reduce)
    impl = _backend(backend, X.device)
    if v.data_ptr() != center.data_ptr():
        v.copy_(center)
    Xr = _rows(X)
    for _ in range(iters):
        dist = impl.sq_distances_to(Xr, _rows(v), reduce=red).cpu().sqrt()
        scale = torch.where(dist > t, t / dist.clamp_min(1e-300), torch.ones_like(dist))
        c = p * scale
        impl.weighted_sum(Xr, c.contiguous(), v, 1.0, 1.0 - float(c.sum()))
    return v


# --------------------------------------------------------------------------------------------
# Krum, Multi-Krum, Bulyan: selections on the [K, K] squared distances
# --------------------------------------------------------------------------------------------


def _distances(D2: Any) -> torch.Tensor:
    if not isinstance(D2, torch.Tensor):
        raise TypeError(f"D2 must be a torch.Tensor, got {type(D2).__name__}")
    if D2.dim() != 2 or D2.shape[0] != D2.shape[1]:
        raise ValueError(f"D2 must be a square [K, K] matrix, got shape {tuple(D2.shape)}")
    if not D2.dtype.is_floating_point:
        raise TypeError(f"D2 must be floating point, got {D2.dtype}")
    d = D2.detach().to(torch.float64)
    if not bool(torch.isfinite(d).all()):
        raise ValueError("D2 must be finite")
    return d


def krum_scores(D2: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's score of each row (Blanchard et al. 2017): the sum of its squared distances to
    its K - f - 2 nearest other rows. float64 [K] on D2's device. Needs K >= f + 3."""
    d = _distances(D2)
    K = d.shape[0]
    f = _int("f", f, 0)
    n = K - f - 2
    if n < 1:
        raise ValueError(f"Krum needs K >= f + 3 rows (K - f - 2 neighbours), got K={K}, f={f}")
    # Each row's own zero is left out by giving the diagonal +inf before the selection.
    off = d.clone()
    off.fill_diagonal_(float("inf"))
    return off.topk(n, dim=1, largest=False, sorted=True).values.sum(dim=1)


def krum_select(D2: torch.Tensor, f: int, m: int = 1) -> torch.Tensor:
    """The m rows with the lowest Krum scores, best first (m = 1: Krum, m > 1: Multi-Krum),
    as int64 indices on CPU. Ties go to the lower index."""
    scores = krum_scores(D2, f).cpu()
    K = scores.shape[0]
    m = _int("m", m, 1)
    if m > K:
        raise ValueError(f"cannot select m={m} of {K} rows")
    # A stable sort on the scores: equal scores keep index order.
    return torch.sort(scores, stable=True).indices[:m].to(torch.int64)


def bulyan_select(D2: torch.Tensor, f: int) -> torch.Tensor:
    """Bulyan's selection (El Mhamdi et al. 2018): theta = K - 2f rows, each the Krum choice
    among the rows not chosen yet, with the same f. int64 CPU indices in the order chosen.
    Needs K >= 4f + 3. The coordinate-wise step is `mean_around_median(X[sel], theta - 2f)`."""
    d = _distances(D2).cpu()
    K = d.shape[0]
    f = _int("f", f, 0)
    if 4 * f + 3 > K:
        raise ValueError(f"Bulyan needs K >= 4f + 3 rows, got K={K}, f={f}")
    left = list(range(K))
    chosen: list[int] = []
    for _ in range(K - 2 * f):
        sub = d[left][:, left]
        if len(left) >= f + 3:
            pick = int(krum_select(sub, f)[0])
        else:  # fewer rows than Krum's neighbourhood: the row nearest to the others
            pick = int(torch.sort(sub.sum(dim=1), stable=True).indices[0])
        chosen.append(left.pop(pick))
    return torch.tensor(chosen, dtype=torch.int64)
