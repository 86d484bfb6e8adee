"""Plug-in strategies that fail the way a bug or an exhausted allocator does (the server's
fail-stop tests). tests/ is not a package: a server in this process names them
"fault_strategies:HalfApplies"; an `aggsrv serve` process needs tests/ on its PYTHONPATH."""

from __future__ import annotations

import torch

from aggsrv.strategies.fedasync import FedAsync

# An update with this many samples breaks the strategy half-way through it.
TRIGGER_SAMPLES = 7919


class HalfApplies(FedAsync):
    """FedAsync, except that an update with num_samples == TRIGGER_SAMPLES publishes a new
    version (the model plus one) and then raises MemoryError: the strategy is left half-changed
    (its job retired, its version moved, nothing in the ledger), as when allocating the next
    version fails mid-update."""

    def _apply(self, update, job, staleness, now):  # noqa: ANN001, ANN201 - Strategy's signature
        if update.num_samples == TRIGGER_SAMPLES:
            broken = self._new_model_buffer()
            torch.add(self._model, 1.0, out=broken)
            self._publish(broken)
            raise MemoryError("injected: out of memory half-way through an update")
        return super()._apply(update, job, staleness, now)
