"""The refusals every strategy makes of an update before any of its state changes.

An update is checked in a fixed order (its form, its numbers, its job, its staleness, its norm),
so that a client hears the same refusal for the same update whichever strategy it meets. The
checks of its numbers alone (:meth:`UpdateChecks.numbers`) depend on nothing but the update, so
each shard of a sharded server runs them on its own slice before the shards vote.
"""

from __future__ import annotations

import bisect
import math

import torch

from aggsrv.finite import count_non_finite
from aggsrv.layout import ModelLayout
from aggsrv.sharding import Reducer
from aggsrv.strategies.config import StrategyConfig
from aggsrv.strategies.errors import (
    InvalidUpdate,
    NonFiniteUpdate,
    ShardsDisagree,
    TooManySamples,
    TooStale,
    UpdateNormTooLarge,
)
from aggsrv.strategies.job import Job
from aggsrv.strategies.norms import Reduce
from aggsrv.values import Update, UpdateKind

__all__ = ["UpdateChecks", "agree_on_branch"]


class UpdateChecks:
    """A strategy's checks of an update's form, numbers, staleness and norm (none change state)."""

    def __init__(
        self,
        layout: ModelLayout,
        dim: int,
        device: torch.device,
        config: StrategyConfig,
        buffer_numel: int,
        private: bool,
    ) -> None:
        """``private``: under differential privacy a NaN/Inf delta is clipped to zero instead of
        refused (so that its refusal does not tell everyone), so only float buffers are checked
        for finiteness."""
        self.layout = layout
        self.dim = dim
        self.device = device
        self.config = config
        self.buffer_numel = buffer_numel
        self.private = private
        # Elements that are variances (BatchNorm running_var): a negative one is refused.
        self.variance_index = torch.cat(
            [
                torch.arange(s.offset, s.end, device=device)
                for s in layout.buffer_specs
                if s.name.rpartition(".")[2] == "running_var"
            ]
            or [torch.zeros(0, dtype=torch.int64, device=device)]
        )

    def form(self, update: Update) -> None:
        """The update's shape, dtype, device and kind, and its sample and work counts."""
        t = update.tensor
        if t.dim() != 1 or t.numel() != self.dim or t.dtype != torch.float32:
            raise InvalidUpdate(
                f"update tensor must be flat float32 [{self.dim}], got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != self.device:
            raise InvalidUpdate(f"update tensor is on {t.device}, the strategy on {self.device}")
        if not isinstance(update.kind, UpdateKind):
            raise InvalidUpdate(f"update kind must be WEIGHTS or DELTA, got {update.kind!r}")
        if update.num_samples < 0 or not math.isfinite(update.work_done) or update.work_done < 0:
            raise InvalidUpdate(
                f"num_samples ({update.num_samples}) and work_done ({update.work_done}) must be "
                "finite and >= 0"
            )
        bound = self.config.max_num_samples
        if update.num_samples > bound:
            raise TooManySamples(
                f"num_samples {update.num_samples} is above max_num_samples={bound}: the update "
                "would outweigh the others by a count no client's data reaches; send the number "
                "of examples trained on, or raise max_num_samples in the strategy config"
            )

    def numbers(self, update: Update) -> None:
        """The update's values: finite (NaN/Inf refused, naming where; not under differential
        privacy), and its float buffers. Quantized values are finite by their scales
        (QuantizedValues), and an update the server's decoder read is proven finite
        (``Update.finite``): neither is counted again."""
        if not self.private and update.quantized is None and not update.finite:
            t = update.tensor
            bad = count_non_finite(t)
            if bad:
                index = int((~torch.isfinite(t)).nonzero()[0])
                raise NonFiniteUpdate(
                    f"the update holds {float(t[index])} at {self._locate(index)} ({bad} NaN/Inf "
                    "values in all): NaN/Inf updates are refused"
                )
        self.buffers(update.buffers)

    def _locate(self, index: int) -> str:
        """Where flat element ``index`` lies, for messages: "element 3 of 'fc.bias'"."""
        offsets = self.layout.offsets.tolist()
        layer = max(0, bisect.bisect_right(offsets, index) - 1)
        if layer < len(self.layout.names):
            return f"element {index - offsets[layer]} of {self.layout.names[layer]!r}"
        return f"element {index}"

    def buffers(self, b: torch.Tensor | None) -> None:
        """The update's float buffers: present exactly when the layout has some, [B] float32
        on the strategy's device, finite, and no negative variance."""
        n = self.buffer_numel
        if n == 0:
            if b is not None:
                raise InvalidUpdate("the update carries float buffers but the model has none")
            return
        if b is None:
            raise InvalidUpdate(
                f"the model has {n} float buffer elements (BatchNorm running statistics): the "
                'update must carry the client\'s as "buffers"'
            )
        if b.dim() != 1 or b.numel() != n or b.dtype != torch.float32 or b.device != self.device:
            raise InvalidUpdate(
                f"update buffers must be flat float32 [{n}] on {self.device}, got {b.dtype} "
                f"{tuple(b.shape)} on {b.device}"
            )
        if count_non_finite(b):
            raise NonFiniteUpdate("update buffers contain NaN or Inf")
        if self.variance_index.numel() and bool((b[self.variance_index] < 0).any()):
            raise InvalidUpdate("update buffers hold a negative running_var")

    def staleness(self, job: Job, version: int) -> None:
        """``max_staleness``: refuse an update more than that many versions behind."""
        s = version - job.base_version
        bound = self.config.max_staleness
        if bound is not None and s > bound:
            raise TooStale(
                f"update from version {job.base_version} is {s} versions behind the current "
                f"version {version} (max_staleness={bound}); ask for a new job"
            )

    def norm(self, norm: float) -> None:
        """``max_update_norm``: refuse a delta whose L2 norm (float64; on a sharded server the
        whole model's) is above it (call only when it is set)."""
        bound = self.config.max_update_norm
        assert bound is not None
        if not norm <= bound:
            raise UpdateNormTooLarge(
                f"the update's delta has L2 norm {norm:.6g}, above max_update_norm={bound:g}; "
                "clip it before sending, or raise max_update_norm in the strategy config"
            )


def agree_on_branch(reducer: Reducer, reduce: Reduce, duplicate: bool, refused: bool) -> None:
    """On a sharded server (``reduce`` set), check that every shard took the same branch for
    this update (a duplicate, refused, or to be applied) before the collectives that applying it
    makes: a shard whose state drifted would otherwise wait in a collective the others never
    enter. Shards that disagree raise ShardsDisagree (not a refusal: the federation stops)."""
    if reduce is None:
        return
    world, rank = reducer.world_size, reducer.rank
    # One slot per shard (0: applies it, 1: a duplicate, 2: refuses it), summed.
    branch = torch.zeros(world, dtype=torch.float64)
    branch[rank] = 2.0 if refused else float(duplicate)
    seen = [int(b) for b in reduce(branch).tolist()]
    if len(set(seen)) > 1:
        said = ("made it", "found it a duplicate", "refused it")
        raise ShardsDisagree(", ".join(f"rank {r} {said[b]}" for r, b in enumerate(seen)))
