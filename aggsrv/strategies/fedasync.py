"""FedAsync (Xie et al. 2019): mix every arriving client model into the global model at once.

``x <- (1 - alpha_s) x + alpha_s x_client`` with ``alpha_s = alpha * f(s)``, where ``s`` is the
update's staleness (``version - base_version``) and ``f`` is

* ``constant``: 1;
* ``polynomial``: ``(s + 1) ** -a``;
* ``hinge``: 1 if ``s <= hinge_b`` else ``1 / (hinge_a * (s - hinge_b) + 1)``.

A DELTA update is turned into ``x_client = base + delta`` with the weights its job started
from. Every accepted update makes a new version: APPLIED(version).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from aggsrv.strategies.base import (
    Job,
    Outcome,
    Status,
    Strategy,
    Update,
    UpdateKind,
)
from aggsrv.strategies.update_filters import FilteredConfig

__all__ = ["FedAsync", "FedAsyncConfig", "staleness_weight"]

logger = logging.getLogger(__name__)

STALENESS_FUNCTIONS = ("constant", "polynomial", "hinge")


def staleness_weight(
    s: int, kind: str, a: float = 0.5, hinge_a: float = 10.0, hinge_b: int = 4
) -> float:
    """FedAsync's staleness function f(s) for ``s >= 0`` (1 for fresh updates)."""
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((s + 1) ** -a)
    if kind == "hinge":
        return 1.0 if s <= hinge_b else 1.0 / (hinge_a * (s - hinge_b) + 1.0)
    raise ValueError(f"staleness must be one of {STALENESS_FUNCTIONS}, got {kind!r}")


@dataclass
class FedAsyncConfig(FilteredConfig):
    """FedAsync settings: mixing weight ``alpha`` and the staleness function with its knobs."""

    HELP: ClassVar[Mapping[str, str]] = {
        "alpha": "mixing weight of an update with no staleness, in (0, 1]",
        "staleness": f"staleness function: {', '.join(STALENESS_FUNCTIONS)}",
        "a": "exponent of the polynomial and hinge decays",
        "hinge_a": "slope of the hinge decay past hinge_b",
        "hinge_b": "staleness up to which the hinge weight is 1",
    }

    alpha: float = 0.6
    staleness: str = "polynomial"
    a: float = 0.5
    hinge_a: float = 10.0
    hinge_b: int = 4

    def __post_init__(self) -> None:
        """Check ranges."""
        super().__post_init__()
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.staleness not in STALENESS_FUNCTIONS:
            raise ValueError(
                f"staleness must be one of {STALENESS_FUNCTIONS}, got {self.staleness!r}"
            )
        if self.a < 0 or self.hinge_a < 0 or self.hinge_b < 0:
            raise ValueError("a, hinge_a and hinge_b must be >= 0")


class FedAsync(Strategy):
    """FedAsync: every update is mixed in on arrival with a staleness-decayed weight."""

    name = "fedasync"
    config_class = FedAsyncConfig
    config: FedAsyncConfig
    buffer_rule = "own"  # the same moving average as the weights

    def mixing_weight(self, staleness: int) -> float:
        """``alpha_s = alpha * f(s)`` for an update of staleness ``s``."""
        c = self.config
        return c.alpha * staleness_weight(staleness, c.staleness, c.a, c.hinge_a, c.hinge_b)

    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        a = self.mixing_weight(staleness)
        x = self._model
        # The next version is another tensor (the current one is a published snapshot), written
        # in as few passes as possible: a clone followed by in-place passes cost twice as much
        # on a 64 MB model (bench/test_bench_ingest.py).
        new = self._new_model_buffer()
        if update.kind is UpdateKind.WEIGHTS:
            torch.lerp(x, update.tensor, a, out=new)  # x + a (u - x) = (1-a) x + a u
        elif job.weights is x:
            # A fresh job (base = x): (1-a) x + a (x + delta) = x + a delta, in one pass.
            torch.add(x, update.tensor, alpha=a, out=new)
        else:
            # (1-a) x + a (base + delta) = lerp(x, base, a) + a delta, no [D] temporary.
            torch.lerp(x, job.weights, a, out=new)
            new.add_(update.tensor, alpha=a)
        if update.buffers is not None:
            assert self.float_buffers.current is not None
            self.float_buffers.set(torch.lerp(self.float_buffers.current, update.buffers, a))
        version = self._publish(new)
        logger.debug("fedasync: %s s=%d alpha=%.4g -> v%d", update.client_id, staleness, a, version)
        return Outcome(Status.APPLIED, version)
