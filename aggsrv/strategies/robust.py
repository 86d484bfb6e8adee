"""What a strategy needs to aggregate with a robust rule (docs/robust.md): the config key's
check and :class:`RobustCombiner`, the aggregator at one place a strategy combines rows, with
the centred-clipping centre it carries from one aggregation to the next.

The rows themselves live in the strategy (:class:`aggsrv.aggregators.RowBuffer`, or a cache it
keeps anyway). A strategy refuses an update when what the next aggregation could publish may
leave float32's range; with a robust rule it cannot afford the aggregate at every arrival, so
it uses the bound every rule meets: the aggregate lies in the coordinate-wise hull of its rows
(and of the centre for centered clipping), so ``|aggregate| <= max(max |row|, max |centre|)``
elementwise (:meth:`RobustCombiner.bound`). The real aggregate is checked before it is
published.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from aggsrv.aggregators import AggregateInfo, Aggregator, parse_aggregator, warm_up
from aggsrv.kernels import Reduce

__all__ = ["RobustCombiner", "check_aggregator", "check_pending_rows"]

logger = logging.getLogger(__name__)


def check_aggregator(text: Any, rows: int | None = None, what: str = "") -> Aggregator:
    """The config's ``aggregator`` parsed (ValueError naming the key); with ``rows`` (a row
    count the config fixes, named ``what``) also refused when too small for the rule."""
    spec = parse_aggregator(text, "aggregator")
    if rows is not None and not spec.is_mean:
        spec.check_rows(rows, what)
    return spec


class RobustCombiner:
    """The strategy's aggregator at one place it combines rows: :meth:`combine` computes
    without changing anything, :meth:`commit` keeps what the aggregation changes (the centre
    of centered clipping: the last aggregate, zero before the first; the fallback count)."""

    def __init__(
        self, aggregator: Aggregator, name: str, device: torch.device | str | None = None
    ) -> None:
        """With ``device``, the rule's kernels are compiled now (:func:`warm_up`), not inside
        the first aggregation."""
        self.aggregator = aggregator
        self.name = name  # for logs and error messages
        if device is not None:
            warm_up(aggregator, device)
        self.center: torch.Tensor | None = None
        self.center_absmax = 0.0  # max |centre| (0 for the zero centre); derived, not saved
        self.fallbacks = 0  # aggregations that fell back to the median (too few rows)
        self.last_info: AggregateInfo | None = None

    @classmethod
    def for_config(
        cls, text: Any, name: str, device: torch.device | str | None = None
    ) -> RobustCombiner | None:
        """The combiner of a strategy config's ``aggregator`` key, None for the mean (a
        strategy then keeps a running sum instead of rows)."""
        spec = check_aggregator(text)
        return None if spec.is_mean else cls(spec, name, device)

    @property
    def uses_center(self) -> bool:
        return self.aggregator.rule == "centered_clipping"

    def combine(
        self,
        X: torch.Tensor,
        weights: Sequence[float] | torch.Tensor,
        *,
        reduce: Reduce | None,
        out: torch.Tensor,
    ) -> AggregateInfo:
        """The aggregate of ``X`` into ``out``; changes nothing (see :meth:`commit`)."""
        center = self.center if self.uses_center else None
        if self.uses_center and center is None:
            center = torch.zeros(X.shape[1], dtype=X.dtype, device=X.device)
        _, info = self.aggregator.combine(X, weights, center=center, reduce=reduce, out=out)
        return info

    def commit(
        self, aggregate: torch.Tensor, info: AggregateInfo, absmax: Callable[[torch.Tensor], float]
    ) -> None:
        """Keep what the aggregation that produced ``aggregate`` (checked finite) changes;
        ``absmax`` measures a [D] tensor the strategy's way (shard-consistent)."""
        if self.uses_center:
            if self.center is None:
                self.center = aggregate.clone()
            else:
                self.center.copy_(aggregate)
            self.center_absmax = absmax(self.center)
        if info.fallback:
            self.fallbacks += 1
        self.last_info = info
        logger.debug("%s: robust aggregate %s", self.name, info.as_dict())

    def bound(self, row_absmax: float) -> float:
        """A bound on max |aggregate| from the largest max |row| of its rows."""
        return max(row_absmax, self.center_absmax if self.uses_center else 0.0)

    def state(self) -> dict[str, Any]:
        return {
            "aggregator": str(self.aggregator),
            "center": self.center if self.uses_center else None,
            "fallbacks": self.fallbacks,
        }

    def load(
        self,
        state: Mapping[str, Any] | None,
        restore: Callable[[torch.Tensor], torch.Tensor],
        absmax: Callable[[torch.Tensor], float],
    ) -> None:
        """Restore :meth:`state` (None: a state saved with the mean, a fresh start)."""
        self.center, self.center_absmax, self.fallbacks = None, 0.0, 0
        if state is None:
            return
        if state.get("aggregator") != str(self.aggregator):
            logger.warning(
                "%s: resuming with aggregator %r; the state was saved with %r",
                self.name, str(self.aggregator), state.get("aggregator"),
            )  # fmt: skip
        if self.uses_center and state.get("center") is not None:
            self.center = restore(state["center"])
            self.center_absmax = absmax(self.center)
        self.fallbacks = int(state.get("fallbacks", 0))


def load_kept_rows(
    strategy: Any,
    rows: Any,
    combiner: RobustCombiner,
    robust: Mapping[str, Any] | None,
    what: str = "rows",
) -> list[float]:
    """Restore a strategy's kept rows (a :class:`~aggsrv.aggregators.RowBuffer`) and its
    combiner from a saved ``robust`` state; returns each row's max |value| (checked finite),
    what the strategy's overflow bound needs."""
    rows.load(robust, what)
    combiner.load(
        robust, lambda t: strategy._restore(t, shared=False),
        lambda t: strategy._checked_absmax(t, "the saved centre"),
    )  # fmt: skip
    return [strategy._checked_absmax(r, "a saved row") for r in rows.rows]


def check_pending_rows(strategy: Any, robust: Mapping[str, Any] | None, pending: int) -> None:
    """Refuse (ValueError) a state saved part-way through an aggregation with the mean (a
    running sum) into a strategy with a robust rule (it needs the rows), or the other way
    round: the rows of one cannot become the other. Between aggregations (``pending`` 0) any
    aggregator resumes, and rows saved with one robust rule serve any other."""
    mine = strategy.config.aggregator  # type: ignore[attr-defined]
    has_rows = getattr(strategy, "_robust", None) is not None
    if has_rows and robust is not None and len(robust["weights"]) != pending:
        raise ValueError(
            f"saved rows ({len(robust['weights'])}) do not match the {pending} contributions "
            "pending"
        )
    if not pending or has_rows == (robust is not None):
        return
    saved = "mean" if robust is None else robust["aggregator"]
    raise ValueError(
        f"the state was saved with aggregator {saved!r} part-way through an aggregation "
        f"({pending} contributions pending); {strategy.name} now has aggregator {mine!r}, "
        "which cannot take over its running sum or rows: resume with the saved aggregator, "
        "or from a state saved between aggregations"
    )
