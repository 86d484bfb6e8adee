"""Running an :class:`~aggsrv.aggregators.spec.Aggregator` on [K, D] rows with their weights.

``combine`` returns the [D] aggregate and an :class:`AggregateInfo` for logs and metrics. What
each rule computes (docs/robust.md has the assumptions and costs):

* ``mean``: ``sum_k w_k x_k / sum_k w_k``;
* ``median``, ``trimmed_mean``: coordinate-wise, unweighted (order statistics have no weights);
* ``krum``: the row with the lowest Krum score, unweighted;
* ``multi_krum``: the ``m`` lowest-scored rows' weighted mean (``m`` unset: ``K - f``; an ``m``
  above ``K - f`` is lowered to it when fewer rows came than the config expected);
* ``bulyan``: Bulyan's ``K - 2f`` selected rows, then their trimmed mean cutting ``f`` at each
  end of every coordinate, unweighted;
* ``geometric_median``: the weighted geometric median (smoothed Weiszfeld from the weighted
  mean);
* ``centered_clipping``: from ``center`` (zero when None), ``iters`` clipped steps with the
  normalised weights; ``tau`` unset is the median of the rows' distances to the centre at this
  call, so the default adapts to the scale of the rows (no tuning).

Rows of weight 0 count in no rule (as in the weighted mean, where they carry nothing). With
``norm_bound`` every row is first scaled to norm at most ``max`` (into a copy: the caller's rows
are never written). Every rule's result lies in the coordinate-wise hull of its rows (and of
the centre for centered clipping), which is what strategies bound before they keep a row.

**Fallback.** A rule that needs more rows than came (Krum and Multi-Krum ``K >= f + 3``, Bulyan
``K >= 4f + 3``, a trimmed mean whose ``floor(trim K)`` is 0) does not stop the server: it
takes the coordinate-wise median of the rows there are (robust while fewer than half of them
are bad), logs a warning, and says why in ``AggregateInfo.fallback``.

**Sharded servers.** ``reduce`` goes to every kernel that sums over whole rows (the pairwise
distances, the distance passes of the geometric median and centered clipping, the norms of
``norm_bound``); the coordinate-wise rules need none. Every shard then selects the same rows.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from aggsrv import kernels
from aggsrv.kernels import Reduce

__all__ = ["AggregateInfo", "combine"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AggregateInfo:
    """What one :func:`combine` call did: the rule, the rows combined (weight > 0), the rows
    selected (Krum family; indices into the rows given), the iterations and convergence of the
    geometric median, the rows ``norm_bound`` scaled down, the ``tau`` centered clipping used,
    and why the fallback ran (None: it did not)."""

    rule: str
    rows: int
    selected: tuple[int, ...] | None = None
    iterations: int | None = None
    converged: bool | None = None
    clipped: int | None = None
    tau: float | None = None
    fallback: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields, the unset ones left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


class RuleSpec(Protocol):
    """What :func:`combine` reads of an :class:`~aggsrv.aggregators.spec.Aggregator` (the spec
    module builds on this one, not the other way round)."""

    rule: str
    params: Mapping[str, Any]
    norm_bound: float | None

    def min_rows(self) -> int: ...


def _checked_weights(weights: Any, K: int) -> torch.Tensor:
    w = torch.as_tensor(weights, dtype=torch.float64).detach().to("cpu").reshape(-1)
    if w.shape != (K,):
        raise ValueError(f"weights must have shape ({K},) (one per row), got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights must be finite and >= 0")
    if not float(w.sum()) > 0:
        raise ValueError("weights must not all be 0 (there is nothing to aggregate)")
    return w


def combine(
    spec: RuleSpec,
    X: torch.Tensor,
    weights: Any,
    *,
    center: torch.Tensor | None = None,
    reduce: Reduce | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AggregateInfo]:
    """The [D] aggregate of the rows X [K, D] with float64 ``weights`` [K] (>= 0, not all 0)
    under ``spec``, in ``out`` when given, and what the call did (module docstring)."""
    if not isinstance(X, torch.Tensor) or X.dim() != 2:
        raise ValueError(f"X must be a [K, D] tensor, got {getattr(X, 'shape', type(X))}")
    w = _checked_weights(weights, X.shape[0])
    index = None
    if bool((w == 0).any()):
        index = (w > 0).nonzero().flatten()
        X = X.index_select(0, index.to(X.device))
        w = w[index]
    if out is None:
        out = torch.empty(X.shape[1], dtype=X.dtype, device=X.device)
    clipped = None
    if spec.norm_bound is not None:
        X, norms = kernels.clip_rows(X, spec.norm_bound, return_norms=True, reduce=reduce)
        clipped = int((norms.cpu() > spec.norm_bound).sum())
    K, need = X.shape[0], spec.min_rows()
    if need > K:
        why = f"{K} rows, {spec.rule} needs {need}: took the coordinate-wise median"
        logger.warning("aggregator %s: %s", spec, why)
        kernels.coordinate_median(X, out=out)
        return out, AggregateInfo(spec.rule, K, clipped=clipped, fallback=why)
    info = _run(spec, X, w, center, reduce, out)
    if index is not None and info.selected is not None:
        info = dataclasses.replace(info, selected=tuple(int(index[i]) for i in info.selected))
    return out, dataclasses.replace(info, clipped=clipped)


def _run(
    spec: RuleSpec,
    X: torch.Tensor,
    w: torch.Tensor,
    center: torch.Tensor | None,
    reduce: Reduce | None,
    out: torch.Tensor,
) -> AggregateInfo:
    rule, p, K = spec.rule, spec.params, X.shape[0]
    if rule == "mean":
        kernels.weighted_sum(X, w / w.sum(), out=out)
    elif rule == "median":
        kernels.coordinate_median(X, out=out)
    elif rule == "trimmed_mean":
        kernels.trimmed_mean(X, p["trim"], out=out)
    elif rule in ("krum", "multi_krum"):
        f = p["f"]
        m = 1 if rule == "krum" else min(p["m"] or K - f, K - f)
        sel = kernels.krum_select(kernels.pairwise_sq_distances(X, reduce=reduce), f, m)
        if m == 1:
            out.copy_(X[int(sel[0])])
        else:  # the selected rows' weighted mean, one pass (the others weigh 0)
            picked = torch.zeros_like(w)
            picked[sel] = w[sel]
            kernels.weighted_sum(X, picked / picked.sum(), out=out)
        return AggregateInfo(rule, K, selected=tuple(sel.tolist()))
    elif rule == "bulyan":
        f = p["f"]
        sel = kernels.bulyan_select(kernels.pairwise_sq_distances(X, reduce=reduce), f)
        # beta = theta - 2f of each coordinate's values nearest its median (El Mhamdi et al.).
        chosen = X.index_select(0, sel.to(X.device))
        kernels.mean_around_median(chosen, chosen.shape[0] - 2 * f, out=out)
        return AggregateInfo(rule, K, selected=tuple(sel.tolist()))
    elif rule == "geometric_median":
        gm = kernels.geometric_median(
            X, w, iters=p["iters"], tol=p["tol"], eps=p["eps"], out=out, reduce=reduce
        )
        return AggregateInfo(rule, K, iterations=gm.iterations, converged=gm.converged)
    elif rule == "centered_clipping":
        c = torch.zeros_like(out) if center is None else center
        tau = p["tau"]
        if tau is None:
            dist = kernels.sq_distances_to(X, c, reduce=reduce).cpu().sqrt().numpy()
            tau = float(np.median(dist))
            if not tau > 0:  # half the rows sit on the centre: clip to the nearest other one
                positive = dist[dist > 0]
                if positive.size == 0:
                    out.copy_(c)
                    return AggregateInfo(rule, K, tau=0.0)
                tau = float(positive.min())
        kernels.centered_clip(X, c, tau, iters=p["iters"], weights=w, out=out, reduce=reduce)
        return AggregateInfo(rule, K, tau=tau)
    else:  # parse_aggregator admits no other rule
        raise AssertionError(rule)
    return AggregateInfo(rule, K)
