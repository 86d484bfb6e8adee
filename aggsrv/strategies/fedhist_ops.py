"""FedHist's per-round arithmetic (docs/algorithms/fedhist.md 1.2 and 1.4), as functions over
[K, D] gradient rows, for the ``fedhist`` strategy (and TWAFL, its reduction) to call:

* EGS (Eqs. 6-7): each local gradient is fused with the *least* similar cached global gradient,
  ``g~_i = g_i + alpha * G[argmin_j cos(g_i, G_j)]``; ties go to the most recent row (spec 1.4
  step 2; rows are passed oldest first).
* HAA (Eq. 8, reconstructed by the spec): ``p^_i = (e/2)^(-tau_i) + lambda * Ubar_i``, clamped
  at 0, normalised; if every weight clamps to 0, the fallback ``(e/2)^(-(tau_i - min tau))``
  (spec 5 A2). float64 throughout: ``(e/2)^-tau`` leaves float32's normal range near tau 285.
* INA (Eq. 14): the weighted aggregate's direction with the mean norm of the fused inputs
  (``rescale=False`` keeps the aggregate itself: TWAFL).
* Hindsight utility (Eqs. 11-13): ``Util = (s - sim_T) * p_his * |S|`` with the reward or penalty
  factor of Eq. 12, and the EMA of Eq. 13.

The cosine matrix and the weighted sum are :mod:`aggsrv.kernels` calls. :func:`egs_fuse` and
:func:`ina_combine` materialise the fused rows (the readable reference); the strategy calls
:func:`aggregate_round`, which computes the same global gradient without them (spec section 4):
``sum_i p_i g~_i = sum_i p_i g_i + alpha * sum_j c_j G_j`` with ``c_j`` the summed weights of the
clients that chose row j, and ``||g~_i||^2 = ||g_i||^2 + 2 alpha <g_i, G_j> + alpha^2 ||G_j||^2``
from the cosine pass and cached norms, so a round reads the K local rows, the history once for
the cosines and only the chosen history rows for the sum.

:func:`robust_round` is the same round with a robust rule (docs/robust.md) in place of the
weighted sum: it materialises the fused rows (they are what the rule compares) and takes
``a = (sum_i p_i) * rule(g~, p)``, then INA to the median of the norms (the mean of the norms
would hand the step's length to whoever sends the largest row).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from aggsrv import kernels

__all__ = [
    "RoundInputs",
    "RoundResult",
    "aggregate_round",
    "egs_fuse",
    "haa_weights",
    "hindsight_utility",
    "ina_combine",
    "robust_round",
    "temporal_weight",
    "utility_ema",
]

_LOG_E_OVER_2 = 1.0 - math.log(2.0)  # log(e / 2)


def temporal_weight(tau: float) -> float:
    """TWAFL's ``(e/2)^(-tau)`` in float64."""
    return math.exp(-tau * _LOG_E_OVER_2)


# Cosines within this of the row minimum are ties: float32 Gram sums can put two identical
# history rows an ulp apart depending on their position, and the spec breaks ties by recency.
TIE_TOLERANCE = 1e-6


def _most_recent_minimum(cos: torch.Tensor) -> torch.Tensor:
    """Per row of [K, h] cosines (columns oldest first) the last column within
    TIE_TOLERANCE of the row's minimum (spec 1.4 step 2: ties go to the most recent row)."""
    c = cos.to(torch.float64)
    tied = c <= c.min(dim=1, keepdim=True).values + TIE_TOLERANCE
    return (c.shape[1] - 1) - torch.argmax(tied.flip(1).to(torch.int8), dim=1)


def egs_fuse(
    local: torch.Tensor, history: torch.Tensor | None, alpha: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fused [K, D], chosen history row per client or None) for Eqs. 6-7.

    ``history`` is [h, D], oldest row first; None or zero rows means no fusion (warm-up).
    """
    if local.dim() != 2:
        raise ValueError(f"local gradients must be [K, D], got {tuple(local.shape)}")
    if history is None or history.shape[0] == 0 or alpha == 0:
        return local.clone(), None
    if history.dim() != 2 or history.shape[1] != local.shape[1]:
        raise ValueError(f"history must be [h, {local.shape[1]}], got {tuple(history.shape)}")
    cos = kernels.cosine_matrix(local, other=history)  # [K, h]
    chosen = _most_recent_minimum(cos)
    # A zero local gradient is not fused (spec 5 A7): chosen -1.
    nonzero = torch.linalg.vector_norm(local, dim=1) > 0
    chosen = torch.where(nonzero, chosen, -1)
    fused = torch.add(local, history[chosen.clamp(min=0)] * nonzero.unsqueeze(1), alpha=alpha)
    return fused, chosen


def haa_weights(
    taus: list[int] | torch.Tensor, utilities: list[float] | torch.Tensor, lam: float
) -> torch.Tensor:
    """Normalised float64 aggregation weights of Eq. 8 (clamped, with the spec's fallback)."""
    return _haa(taus, utilities, lam)[0]


def _haa(
    taus: list[int] | torch.Tensor, utilities: list[float] | torch.Tensor, lam: float
) -> tuple[torch.Tensor, int, bool]:
    """(weights, how many raw weights were clamped, whether the fallback was used)."""
    tau = torch.as_tensor(taus, dtype=torch.float64)
    util = torch.as_tensor(utilities, dtype=torch.float64)
    if tau.dim() != 1 or tau.shape != util.shape or tau.numel() == 0:
        raise ValueError("taus and utilities must be two non-empty lists of the same length")
    if bool((tau < 1).any()):
        raise ValueError("staleness tau must be >= 1 (tau = r - v)")
    raw = torch.exp(-tau * _LOG_E_OVER_2) + lam * util
    clamped = int((raw < 0).sum())
    raw = raw.clamp(min=0.0)
    fallback = float(raw.sum()) <= 0.0
    if fallback:
        raw = torch.exp(-(tau - tau.min()) * _LOG_E_OVER_2)
    return raw / raw.sum(), clamped, fallback


def ina_combine(
    fused: torch.Tensor,
    weights: torch.Tensor,
    *,
    rescale: bool = True,
    norms_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """The global gradient: ``a = sum_i p_i g~_i`` rescaled to the mean input norm (Eq. 14).

    ``norms_of`` (default ``fused``) are the rows whose mean norm the result takes (the spec's
    flag for raw gradients); a zero aggregate stays zero.
    """
    a = kernels.weighted_sum(fused, weights.to(torch.float64).tolist())
    if not rescale:
        return a
    rows = fused if norms_of is None else norms_of
    # float64 accumulation without a float64 copy of the rows
    target = float(torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64).mean())
    norm = float(torch.linalg.vector_norm(a, dtype=torch.float64))
    if norm == 0.0:
        return torch.zeros_like(a)
    return a * (target / norm)


def hindsight_utility(similarity: float, tau_his: int, sim_t: float, set_size: int) -> float:
    """Eqs. 11-12: ``(s - sim_T) * p_his * |S|``; ``p_his`` rewards agreement more the staler
    the gradient was, and penalises disagreement less."""
    decay = temporal_weight(tau_his)
    p_his = 1.0 - decay if similarity >= sim_t else decay
    return (similarity - sim_t) * p_his * set_size


def utility_ema(previous: float, utility: float, gamma: float) -> float:
    """Eq. 13: ``(1 - gamma) * Ubar + gamma * Util``."""
    return (1.0 - gamma) * previous + gamma * utility


@dataclass(frozen=True)
class RoundResult:
    """What :func:`aggregate_round` decided, for logs and tests."""

    weights: torch.Tensor  # float64 [K], the normalised HAA weights
    chosen: torch.Tensor | None  # [K] index into ``history`` per client (None: no fusion)
    fused_norms: torch.Tensor  # float64 [K], ||g~_i||
    scale: float  # INA's factor m / ||a|| (1.0 without rescaling)
    clamped: int  # raw weights clamped at 0
    fallback: bool  # every weight clamped: staleness-only weights used


@dataclass(frozen=True)
class RoundInputs:
    """What one FedHist round aggregates: :func:`aggregate_round` and :func:`robust_round` take it.

    ``local`` [K, D] are the raw local gradients and ``local_norms`` their float64 L2 norms.
    ``history`` [H, D] holds cached global gradients in any row order; ``recency`` lists the
    valid rows oldest first (the others are never read into the result), ``history_norms``
    [H] their float64 norms. ``taus`` and ``utilities`` are the K clients' staleness and
    utility EMA; ``alpha`` and ``lam`` weigh EGS's fusion and HAA's utility term. ``raw_norms``:
    INA takes the norms of the raw rows instead of the fused ones (the spec's flag).
    ``reduce`` sums partial results over shards (docs/sharding.md): ``local``, ``history`` and
    the output are then one shard's slices, the norms the whole vectors'.
    """

    local: torch.Tensor
    local_norms: torch.Tensor
    history: torch.Tensor | None
    history_norms: torch.Tensor | None
    recency: Sequence[int]
    taus: Sequence[int]
    utilities: Sequence[float]
    alpha: float
    lam: float
    rescale: bool = True
    raw_norms: bool = False
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


def aggregate_round(inputs: RoundInputs, *, out: torch.Tensor) -> RoundResult:
    """FedHist's EGS, HAA and INA for one round: ``out`` [D] <- the global gradient (``out``
    must not alias ``local`` or ``history``)."""
    weights, clamped, fallback, chosen, norms, fused_norms, coeff = _egs_haa(inputs)
    kernels.weighted_sum(inputs.local, weights.tolist(), out=out)
    history = inputs.history
    for j, c in sorted(coeff.items()):
        kernels.weighted_sum(history[j : j + 1], [c], out=out, beta=1.0)  # type: ignore[index]
    rescale = inputs.rescale
    target = float((norms if inputs.raw_norms else fused_norms).mean()) if rescale else 0.0
    scale = _ina(out, target, rescale, inputs.reduce)
    return RoundResult(weights, chosen, fused_norms, scale, clamped, fallback)


def _ina(
    out: torch.Tensor,
    target: float,
    rescale: bool,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None,
) -> float:
    """INA in place: ``out`` scaled to norm ``target`` (a zero aggregate stays zero); returns
    the factor (1.0 without rescaling)."""
    scale = 1.0
    if rescale:
        norm_t = torch.linalg.vector_norm(out, dtype=torch.float64)
        if reduce is not None:  # the whole aggregate's norm from the shards' squared norms
            norm_t = reduce(norm_t.square().reshape(1)).sqrt()[0]
        norm = float(norm_t)
        scale = target / norm if norm > 0.0 else 0.0
        out.mul_(scale)
    return scale


def _egs_haa(
    inputs: RoundInputs,
) -> tuple[torch.Tensor, int, bool, torch.Tensor | None, torch.Tensor, torch.Tensor,
           dict[int, float]]:  # fmt: skip
    """HAA weights and EGS choices of a round: (weights, clamped, fallback, chosen, raw norms,
    fused norms, history row -> summed ``alpha p_i`` of the clients that chose it)."""
    local, history, history_norms = inputs.local, inputs.history, inputs.history_norms
    taus, utilities, alpha = inputs.taus, inputs.utilities, inputs.alpha
    k = local.shape[0]
    if local.dim() != 2 or k == 0 or len(taus) != k or len(utilities) != k:
        raise ValueError("need K >= 1 local rows with one tau and one utility each")
    weights, clamped, fallback = _haa(list(taus), list(utilities), inputs.lam)
    norms = inputs.local_norms.to(torch.float64)
    fused_norms = norms
    chosen = None
    coeff: dict[int, float] = {}
    if alpha != 0 and history is not None and len(inputs.recency) > 0:
        assert history_norms is not None
        order = torch.as_tensor(list(inputs.recency), dtype=torch.int64)
        cos = kernels.cosine_matrix(local, other=history, reduce=inputs.reduce)
        # [K, H] cosines on the host, where the indices, norms and weights live (on a GPU the
        # kernel's result is on the device).
        cos = cos.to("cpu", torch.float64)[:, order]
        pos = _most_recent_minimum(cos)
        # A zero local gradient is not fused (spec 5 A7): chosen -1.
        chosen = torch.where(norms > 0, order[pos], -1)
        picked_cos = cos.gather(1, pos.unsqueeze(1)).squeeze(1)
        h_norms = torch.where(chosen >= 0, history_norms.to(torch.float64)[order[pos]], 0.0)
        sq = norms**2 + 2 * alpha * picked_cos * norms * h_norms + alpha**2 * h_norms**2
        fused_norms = sq.clamp(min=0.0).sqrt()
        for i, j in enumerate(chosen.tolist()):
            if j >= 0:
                coeff[j] = coeff.get(j, 0.0) + alpha * float(weights[i])
    return weights, clamped, fallback, chosen, norms, fused_norms, coeff


def robust_round(
    inputs: RoundInputs,
    *,
    combine: Callable[[torch.Tensor, list[float], torch.Tensor], None],
    fused: torch.Tensor | None,
    aggregate: torch.Tensor,
    out: torch.Tensor,
) -> RoundResult:
    """:func:`aggregate_round` with a robust rule: ``combine(rows, p, into)`` writes the rule's
    aggregate of the fused rows ``g~_i`` with the HAA weights ``p`` into ``aggregate`` [D];
    ``out`` <- ``(sum_i p_i) * aggregate``, then INA to the *median* of the input norms (the
    mean would let one row of huge norm set the step's length). The fused rows are built in
    ``fused`` [>= K, D] when some row is fused (the local rows themselves otherwise; ``fused``
    may then be None)."""
    weights, clamped, fallback, chosen, norms, fused_norms, coeff = _egs_haa(inputs)
    local, history = inputs.local, inputs.history
    rows = local
    if coeff:
        assert fused is not None and history is not None and chosen is not None
        rows = fused[: local.shape[0]]
        rows.copy_(local)
        for i, j in enumerate(chosen.tolist()):
            if j >= 0:
                rows[i].add_(history[j], alpha=inputs.alpha)
    combine(rows, weights.tolist(), aggregate)
    torch.mul(aggregate, float(weights.sum()), out=out)
    # INA's target is the median of the norms, not their mean: one huge row would otherwise
    # set the step's length whatever direction the rule chose.
    rescale = inputs.rescale
    target = np.median((norms if inputs.raw_norms else fused_norms).numpy()) if rescale else 0.0
    scale = _ina(out, float(target), rescale, inputs.reduce)
    return RoundResult(weights, chosen, fused_norms, scale, clamped, fallback)
