"""L2 norms of whole-model vectors, which on a sharded server each shard holds a slice of.

Every shard must reach the same decision from a norm (a refusal, a clip factor), so a shard's
norm is the root of the squared norms summed over the shards (``reduce``; None on one server).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from aggsrv.strategies.job import Job
from aggsrv.values import Update, UpdateKind

__all__ = ["Reduce", "delta_norm", "whole_norm"]

# A sum over the shards of a sharded server (None on one server).
Reduce = Callable[[torch.Tensor], torch.Tensor] | None

# Elements per chunk of a WEIGHTS update's delta: its norm is computed without a [D] temporary.
_CHUNK = 1 << 18


def whole_norm(t: torch.Tensor, reduce: Reduce, non_finite: bool = False) -> float:
    """The L2 norm (float64) of the whole-model vector whose slice ``t`` is: on one server
    ``t``'s own norm; on a shard the root of the squared norms summed over the shards.
    ``non_finite``: ``t`` stands for a slice that held NaN/Inf (differential privacy's zero
    delta): its square counts as infinite, so every shard finds the whole norm infinite."""
    if reduce is None:
        return math.inf if non_finite else float(torch.linalg.vector_norm(t, dtype=torch.float64))
    sq = torch.linalg.vector_norm(t, dtype=torch.float64).square().reshape(1)
    if non_finite:
        sq.fill_(math.inf)
    return float(reduce(sq).sqrt())


def delta_norm(update: Update, job: Job, reduce: Reduce) -> float:
    """The L2 norm (float64) of the update's delta, client weights minus the job's start weights
    (on a shard the whole model's); chunk by chunk for a WEIGHTS update, so no [D] temporary."""
    if update.kind is UpdateKind.DELTA:
        return whole_norm(update.tensor, reduce, update.non_finite)
    u, w = update.tensor, job.weights
    sq = sum(
        float((u[i : i + _CHUNK].double() - w[i : i + _CHUNK]).square().sum())
        for i in range(0, u.numel(), _CHUNK)
    )
    if reduce is not None:
        sq = float(reduce(torch.tensor([sq], dtype=torch.float64)))
    return math.sqrt(sq)
