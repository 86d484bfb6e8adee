"""FedBuff (Nguyen et al. 2022): buffer M client deltas, then step the global model once.

As the paper's Algorithm 1, the server keeps the running sum of the buffered deltas, not the
deltas themselves: each accepted update's delta (client weights minus the weights its job
started from) is added on arrival with weight ``w = 1`` (or ``1 / sqrt(1 + s)`` with
``staleness_weighting``, ``s`` the staleness at arrival) into one float64 [D] accumulator, so
memory is two rows whatever M is and the sum is as exact as a float64 reduction. When the M-th
delta arrives: ``x <- x + server_lr * sum_i w_i delta_i / M`` (the paper's division by M, not
by the sum of weights, so stale buffers move the model less), one fused pass.

``aggregator`` (docs/robust.md; default ``mean``: the running sum above, unchanged): any other
rule keeps the M rows ``w_i * delta_i`` (float32, [M, D]) instead of the sum, and the rule's
aggregate of them (uniform row weights: the ``w_i`` are in the rows) replaces ``sum / M``, which
is exactly what ``mean`` computes. Centered clipping's centre is the previous aggregate.

Outcomes: BUFFERED(current version) for the first M-1 deltas of a buffer (the version they will
be applied to), APPLIED(new version) for the M-th.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from aggsrv import kernels
from aggsrv.aggregators import AGGREGATOR_HELP, RowBuffer
from aggsrv.config_check import Count
from aggsrv.strategies.base import Strategy
from aggsrv.strategies.config import StrategyConfig
from aggsrv.strategies.finite_results import require_reach
from aggsrv.strategies.job import Job
from aggsrv.strategies.privacy import PrivacyConfig
from aggsrv.strategies.robust import (
    check_aggregator,
    check_pending_rows,
    load_kept_rows,
)
from aggsrv.values import Outcome, Status, Update, UpdateKind

__all__ = ["BufferedConfig", "FedBuff", "FedBuffConfig"]

logger = logging.getLogger(__name__)


@dataclass
class BufferedConfig(StrategyConfig):
    """A buffer of M updates and a server learning rate (FedBuff, CA2FL)."""

    HELP: ClassVar[Mapping[str, str]] = {
        "buffer_size": "updates buffered per server step (M)",
        "server_lr": "server learning rate",
        "aggregator": AGGREGATOR_HELP,
    }

    buffer_size: Count = 10
    server_lr: float = 1.0
    aggregator: str = "mean"

    def __post_init__(self) -> None:
        """Check ranges."""
        super().__post_init__()
        if not self.server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {self.server_lr}")
        check_aggregator(self.aggregator, self.buffer_size, "buffer_size")


@dataclass
class FedBuffConfig(BufferedConfig, PrivacyConfig):
    """FedBuff settings: buffer size M, server learning rate, optional staleness weighting,
    and differential privacy (the ``dp_`` keys, :mod:`aggsrv.strategies.privacy`)."""

    HELP: ClassVar[Mapping[str, str]] = {
        "staleness_weighting": "weight each buffered update by 1 / sqrt(1 + staleness)",
    }

    staleness_weighting: bool = False

    def __post_init__(self) -> None:
        """Check ranges, and the dp_ keys against the aggregator."""
        super().__post_init__()
        self.check_privacy(self.aggregator)


class FedBuff(Strategy[FedBuffConfig], name="fedbuff"):
    """FedBuff: asynchronous arrivals, synchronous-looking server steps every M deltas."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Allocate the float64 [D] running sum on the strategy's device."""
        super().__init__(*args, **kwargs)
        self._sum = self._running_sum(torch.float64)  # a robust rule keeps rows w_i delta_i
        self._weights: list[float] = []  # one per buffered delta, in arrival order
        self._rows = RowBuffer(self.dim, self.device) if self._robust is not None else None
        self._row_absmax: list[float] = []  # derived from the rows, not saved
        self._aggregate: torch.Tensor | None = None  # the robust aggregate's [D] row

    def folds_quantized_updates(self, kind: UpdateKind) -> bool:
        """A DELTA's codes go into the float64 running sum in one pass, when nothing else reads
        the delta first: no differential privacy, update filter, norm bound or robust rule, a
        CPU model."""
        return (
            kind is UpdateKind.DELTA
            and self.privacy is None
            and self.update_filters is None
            and self.config.max_update_norm is None
            and self._rows is None
            and self.device.type == "cpu"
        )

    @property
    def buffered(self) -> int:
        """How many deltas wait in the buffer."""
        return len(self._weights)

    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        w = 1.0 / math.sqrt(1.0 + staleness) if self.config.staleness_weighting else 1.0
        if self._rows is not None:
            return self._apply_robust(update, job, w)
        if update.quantized is not None:
            return self._apply_codes(update, w)
        m = self.config.buffer_size
        step = self.config.server_lr / m
        base = job.weights if update.kind is UpdateKind.WEIGHTS else None
        privacy = self.privacy
        # Under DP the delta is clipped by scaling its weight: w f (u - base), |.| <= w C.
        wf = w if privacy is None else w * privacy.clip_factor_of(update, job)

        def summed(s: slice) -> torch.Tensor:
            """The running sum with this update's w (u - base) added, elements ``s`` (float64)."""
            acc = update.tensor[s].double().mul_(wf)
            if self._weights:
                acc.add_(self._sum[s])
            return acc if base is None else acc.sub_(base[s], alpha=wf)

        if len(self._weights) + 1 < m:
            # Buffered: the sum (float64) cannot overflow, but the flush it leads to could. Check
            # the model a flush would publish now, so the flush that comes is a checked one.
            self._require_finite_chunks(
                lambda s: torch.add(self._model[s], summed(s), alpha=step).float(),
                "the model the buffer's flush would publish",
            )
            # The staging slot goes straight into the sum (no copy of the delta is kept); a
            # WEIGHTS update adds w (u - base) as two in-place passes, without a [D] temporary.
            # kernels.accumulate, not add_: float32 into float64 costs torch ~14x more.
            if not self._weights:
                self._sum.zero_()
            kernels.accumulate(self._sum, update.tensor, wf)
            if base is not None:
                kernels.accumulate(self._sum, base, -wf)
            self._weights.append(w)
            if privacy is not None:
                privacy.contribute(update.client_id, w, wf / w)
            if update.buffers is not None:
                self.float_buffers.add(update.buffers, w)
            return Outcome(Status.BUFFERED, self.version)
        # The M-th delta: x + (lr / M) * sum, in float64 and rounded once to float32, written
        # straight into the next version (the sum itself is not touched until it is published).
        # Under DP the sum gets its noise once, here: x + (lr / M) (sum + N(0, (z C)^2)).
        if privacy is not None:
            privacy.require_budget(update.client_id, w)
        new = self._stepped_version(summed, step, extra=1)
        if update.buffers is not None:
            self.float_buffers.add(update.buffers, w)
        self._weights.clear()
        if privacy is not None:
            privacy.contribute(update.client_id, w, wf / w)
        version = self._publish(new)
        self._released()
        logger.debug("fedbuff: applied %d deltas -> v%d", m, version)
        return Outcome(Status.APPLIED, version)

    def _apply_codes(self, update: Update, w: float) -> Outcome:
        """A DELTA as the wire's codes (:meth:`folds_quantized_updates`): the running sum gains
        ``w delta`` with each value decoded where it is added, in float64; the check of the
        flush to come and the flush decode the codes chunk by chunk, with no [D] float32 copy."""
        q = update.quantized
        assert q is not None and update.kind is UpdateKind.DELTA
        m = self.config.buffer_size
        step = self.config.server_lr / m
        chunk = q.chunk_elements(1 << 18)
        squares = torch.zeros(1, dtype=torch.float64)
        chunk_squares: list[float] = []  # the flush's, chunk by chunk: the update's norm

        def summed(s: slice) -> torch.Tensor:
            """The running sum with this update's w delta added, elements ``s`` (float64)."""
            codes, scales = q.span(s.start, s.stop)
            if self._weights:
                acc = torch.empty(s.stop - s.start, dtype=torch.float64)
                base = self._sum[s]
            else:
                acc = torch.zeros(s.stop - s.start, dtype=torch.float64)
                base = None
            kernels.quantized_accumulate(
                acc, codes, scales, q.block, w, bits=q.bits, base=base, squares=squares,
                backend="cpu",
            )  # fmt: skip
            chunk_squares.append(float(squares))
            return acc

        if len(self._weights) + 1 < m:
            self._require_finite_chunks(
                lambda s: torch.add(self._model[s], summed(s), alpha=step).float(),
                "the model the buffer's flush would publish",
                chunk,
            )
            if not self._weights:
                self._sum.zero_()
            # Its norm (for the server's metrics) in the pass that adds it.
            kernels.quantized_accumulate(
                self._sum, q.codes, q.scales, q.block, w, bits=q.bits, squares=squares,
                backend="cpu",
            )  # fmt: skip
            q.note_squared_norm(float(squares))
            self._weights.append(w)
            if update.buffers is not None:
                self.float_buffers.add(update.buffers, w)
            return Outcome(Status.BUFFERED, self.version)
        new = self._stepped_version(summed, step, extra=1, chunk=chunk)
        q.note_squared_norm(math.fsum(chunk_squares))  # each chunk once, in order
        if update.buffers is not None:
            self.float_buffers.add(update.buffers, w)
        self._weights.clear()
        version = self._publish(new)
        self._released()
        logger.debug("fedbuff: applied %d deltas -> v%d", m, version)
        return Outcome(Status.APPLIED, version)

    def _apply_robust(self, update: Update, job: Job, w: float) -> Outcome:
        """:meth:`_apply` with a robust rule: the row ``w (u - base)`` (float32) is staged,
        checked, and counted; the M-th row triggers ``x + server_lr * rule(rows)``."""
        assert self._rows is not None and self._robust is not None
        row = self.client_delta(update, job, out=self._rows.slot())
        if w != 1.0:
            row.mul_(w)
        absmax = self._checked_absmax(row, "the update's weighted delta w (u - base)")
        lr = self.config.server_lr
        if len(self._weights) + 1 < self.config.buffer_size:
            # The bound every rule meets (aggsrv/strategies/robust.py): |rule(rows)| <= B.
            bound = self._robust.bound(max([absmax, *self._row_absmax]))
            require_reach(
                self.model_absmax() + lr * bound, "the model the buffer's flush would publish"
            )
            self._rows.commit(w)
            self._row_absmax.append(absmax)
            self._weights.append(w)
            if update.buffers is not None:
                self.float_buffers.add(update.buffers, w)
            return Outcome(Status.BUFFERED, self.version)
        rows, _ = self._rows.with_slot(w)
        if self._aggregate is None:
            self._aggregate = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        agg = self._aggregate
        info = self._robust.combine(rows, [1.0] * rows.shape[0], reduce=self.reduce, out=agg)
        self._require_finite(agg, f"the buffer's {self._robust.aggregator.rule} aggregate")
        new = torch.add(self._model, agg, alpha=lr, out=self._new_model_buffer())
        self._check_version(new)
        if update.buffers is not None:
            self.float_buffers.add(update.buffers, w)
        self._robust.commit(agg, info, lambda t: self._checked_absmax(t, "the aggregate"))
        self._rows.clear()
        self._row_absmax = []
        self._weights.clear()
        version = self._publish(new)
        logger.debug("fedbuff: %s of %d rows -> v%d", info.rule, rows.shape[0], version)
        return Outcome(Status.APPLIED, version)

    def _extra_state(self) -> dict[str, Any]:
        n = len(self._weights)
        if self._rows is not None:
            assert self._robust is not None
            robust = {**self._robust.state(), **self._rows.state()}
            return {"sum": self._sum[:0], "weights": list(self._weights), "robust": robust}
        return {"sum": self._sum if n else self._sum[:0], "weights": list(self._weights),
                "robust": None}  # fmt: skip

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        weights = [float(w) for w in state["weights"]]
        total = state["sum"]
        if len(weights) >= self.config.buffer_size:
            raise ValueError(
                f"saved buffer holds {len(weights)} deltas; buffer_size={self.config.buffer_size}"
                " would have applied them"
            )
        robust = state.get("robust")
        check_pending_rows(self, robust, len(weights))
        if self._rows is not None:
            assert self._robust is not None
            self._row_absmax = load_kept_rows(self, self._rows, self._robust, robust)
            self._weights = weights
            return
        if weights and tuple(total.shape) != (self.dim,):
            raise ValueError(f"saved running sum has shape {tuple(total.shape)}, D={self.dim}")
        if weights:
            self._sum.copy_(total)
        self._weights = weights
