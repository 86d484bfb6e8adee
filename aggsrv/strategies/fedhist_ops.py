"""FedHist's per-round arithmetic (shared/specs/fedhist.md 1.2 and 1.4), as functions over
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

The cosine matrix and the weighted sum are :mod:`aggsrv.kernels` calls.
"""

from __future__ import annotations

import math

import torch

from aggsrv import kernels

__all__ = [
    "egs_fuse",
    "haa_weights",
    "hindsight_utility",
    "ina_combine",
    "temporal_weight",
    "utility_ema",
]

_LOG_E_OVER_2 = 1.0 - math.log(2.0)  # log(e / 2)


def temporal_weight(tau: float) -> float:
    """TWAFL's ``(e/2)^(-tau)`` in float64."""
    return math.exp(-tau * _LOG_E_OVER_2)


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
    # argmin over the reversed rows picks the most recent of tied minima.
    h = history.shape[0]
    chosen = (h - 1) - torch.argmin(cos.flip(1), dim=1)
    return torch.add(local, history[chosen], alpha=alpha), chosen


def haa_weights(
    taus: list[int] | torch.Tensor, utilities: list[float] | torch.Tensor, lam: float
) -> torch.Tensor:
    """Normalised float64 aggregation weights of Eq. 8 (clamped, with the spec's fallback)."""
    tau = torch.as_tensor(taus, dtype=torch.float64)
    util = torch.as_tensor(utilities, dtype=torch.float64)
    if tau.dim() != 1 or tau.shape != util.shape or tau.numel() == 0:
        raise ValueError("taus and utilities must be two non-empty lists of the same length")
    if bool((tau < 1).any()):
        raise ValueError("staleness tau must be >= 1 (tau = r - v)")
    raw = torch.exp(-tau * _LOG_E_OVER_2) + lam * util
    raw = raw.clamp(min=0.0)
    if float(raw.sum()) <= 0.0:
        raw = torch.exp(-(tau - tau.min()) * _LOG_E_OVER_2)
    return raw / raw.sum()


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
