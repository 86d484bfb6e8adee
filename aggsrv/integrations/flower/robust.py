"""aggsrv's robust aggregators on Flower's own strategies' replies.

``robust(FedAvg, aggregator="krum:f=2")`` (any Flower strategy built on ``FedAvg``: ``FedAvg``,
``FedProx``, ``FedAvgM``, ``FedAdam``, ``FedYogi``, ``FedAdagrad``) returns an instance whose
``aggregate_train`` combines the reply records with an aggsrv aggregator (docs/robust.md)
instead of the weighted mean, and leaves everything else to the Flower strategy: sampling,
configuration, metrics, and the server optimiser of the FedOpt family, which then steps on the
robust aggregate (the class is inserted just above ``FedAvg`` in the method resolution order,
so ``FedOpt.aggregate_train``'s call to ``FedAvg.aggregate_train`` reaches it).

The replies are read into one [K, D] float32 buffer kept across rounds (zero-copy NPY reads,
one copy each, see :mod:`.arrays`) and the aggregator runs on it with the aggsrv kernels. The
rows are the clients' weights, as Flower's Krum, MultiKrum, Bulyan, FedMedian and FedTrimmedAvg
aggregate them: every aggregator here commutes with shifting all rows by one vector, so this is
the same as aggregating the updates and adding the global model. ``mean`` reproduces Flower's
weighted mean. Centered clipping's centre is the previous round's aggregate; the first round,
without one, starts from the coordinate-wise median of the replies. Float buffers (BatchNorm
statistics) are the weighted mean of the replies, integer arrays the first reply's.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from aggsrv import kernels
from aggsrv.aggregators import Aggregator, warm_up
from aggsrv.integrations.flower.arrays import (
    flat_to_record,
    layout_of,
    record_to_buffers,
    record_to_flat,
)
from aggsrv.layout import ModelLayout

__all__ = ["RobustAggregation", "robust"]

log = logging.getLogger(__name__)


class RobustAggregation(FedAvg):
    """``FedAvg.aggregate_train`` with an aggsrv aggregator (use :func:`robust` to build one on
    any FedAvg-family strategy)."""

    aggregator: Aggregator

    def _robust_setup(self, aggregator: str | Aggregator) -> None:
        self.aggregator = (
            aggregator if isinstance(aggregator, Aggregator) else Aggregator.parse(aggregator)
        )
        self._layout: ModelLayout | None = None
        self._rows = torch.empty(0, 0)
        self._centre: torch.Tensor | None = None
        self.last_info: Any = None  # what the aggregator reported on the last round
        warm_up(self.aggregator, "cpu")  # compiled now, not inside the first round

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The replies' arrays combined by the aggregator, and Flower's metric aggregation."""
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        contents = [msg.content for msg in valid]
        records = [content[self.arrayrecord_key] for content in contents]
        if self._layout is None:
            self._layout = layout_of(records[0])
        layout = self._layout
        rows = self._buffer(len(records), layout.numel)
        for k, record in enumerate(records):
            record_to_flat(record, layout, out=rows[k])
        weights = torch.tensor(
            [float(content[self.weighted_by_key_record(content)][self.weighted_by_key])
             for content in contents],
            dtype=torch.float64,
        )  # fmt: skip
        centred = self.aggregator.rule == "centered_clipping"
        if centred and self._centre is None:
            self._centre = kernels.coordinate_median(rows)
        aggregate, self.last_info = self.aggregator.combine(rows, weights, center=self._centre)
        if centred:
            self._centre = aggregate.clone()
        known = {*layout.names, *layout.buffer_names}
        arrays = flat_to_record(
            aggregate, layout, buffers=self._mean_buffers(records, weights, layout),
            extra={name: records[0][name] for name in records[0] if name not in known},
        )  # fmt: skip
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        return arrays, metrics

    def weighted_by_key_record(self, content: Any) -> str:
        """The name of the reply's MetricRecord that holds ``weighted_by_key``."""
        for name, record in content.metric_records.items():
            if self.weighted_by_key in record:
                return name
        raise ValueError(f"a reply has no metric {self.weighted_by_key!r} to weight it by")

    def _buffer(self, K: int, D: int) -> torch.Tensor:
        """The [K, D] rows, kept across rounds (grown when a round has more replies)."""
        if self._rows.shape[0] < K or self._rows.shape[1] != D:
            self._rows = torch.empty(K, D, dtype=torch.float32)
        return self._rows[:K]

    @staticmethod
    def _mean_buffers(
        records: list[ArrayRecord], weights: torch.Tensor, layout: ModelLayout
    ) -> torch.Tensor | None:
        if not layout.buffer_numel:
            return None
        stacked = torch.stack([record_to_buffers(r, layout) for r in records])
        return kernels.weighted_sum(stacked, weights / weights.sum())


def _require_chain_to_fedavg(strategy_class: type[FedAvg]) -> None:
    """Refuse a strategy whose own ``aggregate_train`` combines the replies without calling
    FedAvg's (Flower's Krum, FedMedian, ...): ours would never run."""
    for cls in strategy_class.__mro__:
        if cls in (FedAvg, RobustAggregation):
            return
        method = cls.__dict__.get("aggregate_train")
        if method is None:
            continue
        try:
            source = inspect.getsource(method)
        except (OSError, TypeError):  # no source to read: trust the class
            continue
        if "super().aggregate_train(" not in source:
            raise TypeError(
                f"{cls.__name__}.aggregate_train combines the replies itself, so no aggregator "
                "can replace its mean; use robust() with FedAvg, FedProx, FedAvgM or a FedOpt "
                "strategy (FedAdam, FedYogi, FedAdagrad), e.g. robust(FedAvg, 'krum:f=2') for "
                "Krum"
            )


def robust(strategy_class: type[FedAvg], aggregator: str | Aggregator, **kwargs: Any) -> FedAvg:
    """An instance of ``strategy_class`` (``FedAvg`` or a subclass) whose replies are combined
    by ``aggregator`` (``"median"``, ``"krum:f=2"``, ... docs/robust.md); ``kwargs`` go to the
    Flower strategy's constructor."""
    if not (isinstance(strategy_class, type) and issubclass(strategy_class, FedAvg)):
        raise TypeError(
            f"robust() takes a Flower strategy class built on FedAvg, got {strategy_class!r}"
        )
    _require_chain_to_fedavg(strategy_class)
    if issubclass(strategy_class, RobustAggregation):
        cls: type[FedAvg] = strategy_class
    elif strategy_class is FedAvg:
        cls = type("RobustFedAvg", (RobustAggregation,), {})
    else:
        # Above FedAvg in the MRO: the subclass's own aggregate_train runs first and its call
        # to FedAvg.aggregate_train (FedOpt's server step on the aggregate) reaches ours.
        cls = type(f"Robust{strategy_class.__name__}", (strategy_class, RobustAggregation), {})
    instance = cls(**kwargs)
    instance._robust_setup(aggregator)  # type: ignore[attr-defined]
    return instance
