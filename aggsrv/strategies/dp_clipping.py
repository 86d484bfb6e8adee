"""What differential privacy does to one accepted update before a strategy folds it in: its
delta, clipped to C (in the strategy's accumulate, or here per layer), a NaN/Inf delta zeroed.

A delta holding NaN/Inf (sent so, or finite weights whose difference overflows float32) counts
as clipped to zero, its clip factor ``min(1, C / inf)`` being 0: it becomes a zero delta of norm
inf (``non_finite``), so the version is published as it would be for the zero-out neighbour
(that client's update all zeros) and the client alone is told (:data:`NON_FINITE_CLIPPED`).
Refusing it instead would tell everyone, by the version that then does not appear, that its
values were not finite.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from aggsrv.strategies.job import Job
from aggsrv.strategies.norms import Reduce, delta_norm, whole_norm
from aggsrv.values import Update, UpdateKind

__all__ = ["NON_FINITE_CLIPPED", "clip_norm_of", "clipped_per_layer", "private_delta"]

# What a client whose update held NaN/Inf reads under differential privacy (its answer's
# message; the update is clipped to zero instead of refused).
NON_FINITE_CLIPPED = (
    "the update's delta held NaN/Inf: under differential privacy it was clipped to zero (clip "
    "factor min(1, C/inf) = 0) and taken, so it moved nothing; check the client's training"
)


def private_delta(
    update: Update, job: Job, scratch: Callable[[], torch.Tensor], reduce: Reduce
) -> Update:
    """The update as a DELTA update: a WEIGHTS update's delta (client weights minus the job's,
    float32) is computed once, into ``scratch()``. A delta that is not finite becomes a zero
    delta of norm inf (``non_finite``). The finiteness comes from the delta's float64 norm (the
    decoder's for a DELTA upload, else one pass that clipping then reuses): finite only when
    every value is; on a shard, this slice's (the whole norm is summed again)."""
    if update.kind is UpdateKind.WEIGHTS:
        delta = scratch()
        torch.sub(update.tensor, job.weights, out=delta)
        update = dataclasses.replace(update, kind=UpdateKind.DELTA, tensor=delta, norm=None)
    norm = update.norm
    if norm is None:
        norm = float(torch.linalg.vector_norm(update.tensor, dtype=torch.float64))
        if reduce is None:
            update = dataclasses.replace(update, norm=norm)
    if math.isfinite(norm):
        return update
    zero = scratch().zero_()
    return dataclasses.replace(update, tensor=zero, norm=math.inf, non_finite=True)


def clipped_per_layer(
    update: Update,
    job: Job,
    out: torch.Tensor,
    segments: list[slice],
    layer_factors: Callable[[list[float]], list[float]],
    reduce: Reduce,
) -> Update:
    """Per-layer clipping (``dp_clip_layers``): the update's delta with each layout tensor
    (``segments``: this strategy's slice of each) scaled by ``layer_factors`` of the layers'
    squared norms, as a DELTA update in ``out``. One read and one write of D more than
    whole-model clipping, which folds its factor into the strategy's accumulate. Per-layer
    norms are the whole model's on a sharded server."""
    squares = torch.zeros(len(segments), dtype=torch.float64)
    for i, seg in enumerate(segments):
        part = out[seg]
        if update.kind is UpdateKind.WEIGHTS:
            torch.sub(update.tensor[seg], job.weights[seg], out=part)
        else:
            part.copy_(update.tensor[seg])
        squares[i] = torch.linalg.vector_norm(part, dtype=torch.float64) ** 2
    if update.non_finite:  # NaN/Inf somewhere (on some shard): every layer's factor is 0
        squares.fill_(math.inf)
    if reduce is not None:
        squares = reduce(squares)
    whole = squares.tolist()
    factors = layer_factors(whole)
    for seg, f in zip(segments, factors, strict=True):
        if f != 1.0:
            out[seg].mul_(f)
    norm = math.sqrt(sum(f * f * q for f, q in zip(factors, whole, strict=True) if f))
    return dataclasses.replace(
        update, kind=UpdateKind.DELTA, tensor=out, norm=norm, non_finite=False
    )


def clip_norm_of(update: Update, job: Job, delta: torch.Tensor | None, reduce: Reduce) -> float:
    """The norm an update's clip factor is computed from: the decoder's for a DELTA upload
    (:attr:`Update.norm`, float64) on one server, else the whole model's norm of ``delta`` (the
    update's delta, when the caller has built it already) or of the delta computed here."""
    norm = update.norm if update.kind is UpdateKind.DELTA and reduce is None else None
    if norm is not None:
        return norm
    if delta is not None:
        return whole_norm(delta, reduce, update.non_finite)
    return delta_norm(update, job, reduce)
