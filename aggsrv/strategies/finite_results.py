"""Refusing an update whose result would not be finite (:class:`NonFiniteResult`).

The rule every strategy here follows: before its first change of state, ``_apply`` checks each
value it is about to keep (a new cache row, a running sum, a version) and the model it would
publish if its aggregation ran now, so an aggregation that a later update or timer triggers
publishes a value that was checked already. On a sharded server each check sums over the shards
(``reduce``), so the shards refuse together.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from aggsrv.finite import count_non_finite
from aggsrv.strategies.errors import NonFiniteResult
from aggsrv.strategies.norms import Reduce

__all__ = ["FLOAT32_SAFE_MAX", "checked_absmax", "require_finite", "require_finite_chunks"]

# Below float32's largest value by a margin for the rounding of the arithmetic that a bound on a
# step's reach stands for (strategies refuse an update whose step could reach past it).
FLOAT32_SAFE_MAX = float(torch.finfo(torch.float32).max) * (1.0 - 1e-3)


def _refusal(what: str, bad: str) -> NonFiniteResult:
    return NonFiniteResult(
        f"applying this update would make {what} non-finite ({bad}: a float32 overflow); it "
        "was refused and nothing changed. Send a smaller update."
    )


def absmax(t: torch.Tensor, reduce: Reduce) -> float:
    """max |t|; on a sharded server the sum of the shards' maxima (a bound every shard computes
    alike). NaN in, NaN out; Inf in, Inf out."""
    lo, hi = torch.aminmax(t) if t.numel() else (torch.zeros(()), torch.zeros(()))
    value = max(-float(lo), float(hi))
    if reduce is not None:
        value = float(reduce(torch.tensor([value], dtype=torch.float64)))
    return value


def checked_absmax(t: torch.Tensor, what: str, reduce: Reduce) -> float:
    """:func:`absmax`, refusing (NonFiniteResult) a ``t`` that holds NaN/Inf."""
    value = absmax(t, reduce)
    if not math.isfinite(value):
        raise _refusal(what, "NaN/Inf")
    return value


def require_reach(reach: float, what: str) -> None:
    """Refuse (NonFiniteResult) when a bound on the values a step could produce is past
    float32's range (:data:`FLOAT32_SAFE_MAX`)."""
    if not reach < FLOAT32_SAFE_MAX:
        raise NonFiniteResult(
            f"with this update {what} could reach {reach:.3g}, past float32's range; it "
            "was refused and nothing changed. Send a smaller update."
        )


def require_finite(t: torch.Tensor, what: str, reduce: Reduce) -> None:
    """Refuse (NonFiniteResult) unless every element of ``t`` is finite."""
    bad = count_non_finite(t)
    if reduce is not None:
        bad = int(reduce(torch.tensor([float(bad)], dtype=torch.float64)).item())
    if bad:
        raise _refusal(what, f"{bad} NaN/Inf values")


def require_finite_chunks(
    compute: Callable[[slice], torch.Tensor],
    what: str,
    dim: int,
    device: torch.device,
    reduce: Reduce,
    chunk: int = 1 << 18,
) -> None:
    """:func:`require_finite` of a [dim] value given chunk by chunk (``compute(s)`` returns the
    elements ``s`` of the value), so a candidate is checked without a [dim] temporary.

    Each chunk's float32 sum stays on the device (one synchronisation in all, not one per
    chunk); a chunk whose sum is not finite is computed again and counted exactly (a sum of
    finite values can overflow)."""
    parts = [slice(start, min(start + chunk, dim)) for start in range(0, dim, chunk)]
    sums = torch.zeros(len(parts), dtype=torch.float32, device=device)
    for i, part in enumerate(parts):
        sums[i] = compute(part).sum()
    suspects = (~torch.isfinite(sums)).nonzero().flatten().tolist()
    bad = sum(count_non_finite(compute(parts[i])) for i in suspects)
    if reduce is None:
        if bad:
            raise _refusal(what, f"{bad} NaN/Inf values")
        return
    require_finite(torch.full((1,), math.nan if bad else 0.0), what, reduce)
