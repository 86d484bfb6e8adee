"""MIFA (Gu et al. 2021, "Fast Federated Learning in the Presence of Arbitrary Device
Unavailability"): the latest-update memory Fed-OGD compares against (docs/algorithms/fedogd.md E11).

The server stores every client's newest pseudo-gradient ``G_i = -DELTA / lr`` (docs/design.md), one
cache row each, overwritten on arrival and reused until the client uploads again, and at the
close of each epoch steps ``w <- w - server_lr * (1/N) * sum_i G_i``: the uniform mean over the
cached updates of all N registered clients. As in the original paper a client that never
uploaded counts as a zero row (``count_empty_rows = true``; false averages only the clients
that uploaded). ``server_lr`` None (default) uses the clients' ``learning_rate`` (0.05 by
default, as FedAvg's and Fed-OGD's), MIFA's single ``eta_t``. docs/algorithms/fedogd.md's
related-work formula with ``+ eta/|M| sum g_m`` has the wrong sign and is not used (E11). No
projection, no bases: jobs carry the weights only.

``aggregator`` (docs/robust.md; default ``mean``, the mean above with ``count_empty_rows``,
unchanged): any other rule combines the cached rows of the clients that have uploaded (uniform
weights; a client that never uploaded has no evidence to give, whatever ``count_empty_rows``
says) and steps ``w <- w - server_lr * rule(rows)``. The rows are the cache MIFA keeps anyway:
no memory beyond one [D] aggregate row (and the ``norm_bound`` and Bulyan copies while it runs).
Centered clipping's centre is the previous epoch's aggregate. A cache saved with one
aggregator resumes with any other.

Epochs, deadlines, late updates and groups (which only decide when an epoch closes: it waits
for the active clients dispatched in it, or for ``epoch_timeout``) are Fed-OGD's, see
:mod:`aggsrv.strategies.fedogd`; the config keys are the same except Fed-OGD's projection,
aggregation and privacy keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from aggsrv import kernels
from aggsrv.aggregators import AGGREGATOR_HELP, AggregateInfo
from aggsrv.strategies.fedogd import CachedEpochConfig, CachedEpochs
from aggsrv.strategies.robust import check_aggregator

__all__ = ["MIFA", "MIFAConfig"]


@dataclass
class MIFAConfig(CachedEpochConfig):
    """MIFA settings: Fed-OGD's epoch keys; the mean divides by all N clients by default."""

    HELP: ClassVar[Mapping[str, str]] = {"aggregator": AGGREGATOR_HELP}

    count_empty_rows: bool = True
    aggregator: str = "mean"

    def __post_init__(self) -> None:
        """Check the aggregator (an epoch's row count varies: no requirement on it here)."""
        super().__post_init__()
        check_aggregator(self.aggregator)


class MIFA(CachedEpochs[MIFAConfig], name="mifa"):
    """MIFA: uniform mean of every client's newest cached update, one step per epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The epoch machinery and cache of :class:`CachedEpochs`."""
        super().__init__(*args, **kwargs)
        self._aggregate: torch.Tensor | None = None
        self._pending_aggregate: tuple[torch.Tensor, AggregateInfo] | None = None

    def _bound_with(self, client_id: str, absmax: float) -> float:
        """The cache's bound, and the centre's for centered clipping (every rule's aggregate
        lies in the hull of its rows and the centre: aggsrv/strategies/robust.py)."""
        bound = super()._bound_with(client_id, absmax)
        return bound if self._robust is None else self._robust.bound(bound)

    def _close(self, now: float) -> int:
        """The epoch's close; the robust aggregate it published becomes the next centre."""
        self._pending_aggregate = None
        version = super()._close(now)
        pending = self._pending_aggregate
        if self._robust is not None and pending is not None:
            self._robust.commit(*pending, lambda t: self._checked_absmax(t, "the aggregate"))
        self._pending_aggregate = None
        return version

    def _robust_step(self) -> torch.Tensor:
        """``w - server_lr * rule(rows of the clients that uploaded)``; a zero step without."""
        assert self._robust is not None
        n = len(self._row)
        uploaded = [r for r in range(n) if self._valid[r]]
        new = self._new_model_buffer().copy_(self._model)
        if not uploaded:
            return new
        # A robust rule reads values: a compressed cache is decoded for it (docs/compression.md).
        rows = self._cache.decoded(n, uploaded if len(uploaded) < n else None)
        if self._aggregate is None:
            self._aggregate = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        info = self._robust.combine(
            rows, [1.0] * len(uploaded), reduce=self.reduce, out=self._aggregate
        )
        self._pending_aggregate = (self._aggregate, info)
        new.add_(self._aggregate, alpha=-self.config.effective_server_lr)
        return new

    def _extra_state(self) -> dict[str, Any]:
        state = super()._extra_state()
        state["robust"] = None if self._robust is None else self._robust.state()
        return state

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        super()._load_extra_state(state)
        if self._robust is not None:
            self._robust.load(
                state.get("robust"), lambda t: self._restore(t, shared=False),
                lambda t: self._checked_absmax(t, "the saved centre"),
            )  # fmt: skip

    def _step(self) -> torch.Tensor:
        """``w - server_lr * mean(counted rows)``; a zero step when no row counts."""
        if self._robust is not None:
            return self._robust_step()
        n = len(self._row)
        mean = self._cache.group_means(n, self._row_groups(merged=True), 1)
        new = self._new_model_buffer().copy_(self._model)
        lr = self.config.effective_server_lr
        kernels.weighted_sum(mean, [1.0], out=new, alpha=-lr, beta=1.0)
        return new
