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

Epochs, deadlines, late updates and groups (which only decide when an epoch closes: it waits
for the active clients dispatched in it, or for ``epoch_timeout``) are Fed-OGD's, see
:mod:`aggsrv.strategies.fedogd`; the config keys are the same except Fed-OGD's projection,
aggregation and privacy keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aggsrv import kernels
from aggsrv.strategies.fedogd import CachedEpochConfig, CachedEpochs

__all__ = ["MIFA", "MIFAConfig"]


@dataclass
class MIFAConfig(CachedEpochConfig):
    """MIFA settings: Fed-OGD's epoch keys; the mean divides by all N clients by default."""

    count_empty_rows: bool = True


class MIFA(CachedEpochs):
    """MIFA: uniform mean of every client's newest cached update, one step per epoch."""

    name = "mifa"
    config_class = MIFAConfig
    config: MIFAConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The epoch machinery and cache of :class:`CachedEpochs`."""
        super().__init__(*args, **kwargs)

    def _step(self) -> torch.Tensor:
        """``w - server_lr * mean(counted rows)``; a zero step when no row counts."""
        n = len(self._row)
        mean = kernels.group_means(self._cache[:n], self._row_groups(merged=True), 1)
        new = self._new_model_buffer().copy_(self._model)
        lr = self.config.effective_server_lr
        kernels.weighted_sum(mean, [1.0], out=new, alpha=-lr, beta=1.0)
        return new
