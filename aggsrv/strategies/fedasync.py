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

from aggsrv import kernels
from aggsrv.strategies.base import Strategy
from aggsrv.strategies.job import Job
from aggsrv.strategies.privacy import PrivacyConfig
from aggsrv.strategies.update_filters import FilteredConfig
from aggsrv.values import Outcome, Status, Update, UpdateKind

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
class FedAsyncConfig(FilteredConfig, PrivacyConfig):
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
        self.check_privacy()
        if self.private and self.update_filter:
            raise ValueError(
                "update_filter with the dp_ keys: a filter's state (the norms and centre of "
                "other clients' updates) decides how each update is clipped or whether it is "
                "accepted, so one client's data would move another's contribution; "
                "differential privacy's own clipping bounds every update (drop update_filter)"
            )


class FedAsync(Strategy[FedAsyncConfig], name="fedasync"):
    """FedAsync: every update is mixed in on arrival with a staleness-decayed weight."""

    buffer_rule = "own"  # the same moving average as the weights

    def mixing_weight(self, staleness: int) -> float:
        """``alpha_s = alpha * f(s)`` for an update of staleness ``s``."""
        c = self.config
        return c.alpha * staleness_weight(staleness, c.staleness, c.a, c.hinge_a, c.hinge_b)

    def folds_quantized_updates(self, kind: UpdateKind) -> bool:
        """A DELTA's codes are folded into the next version in one pass, when nothing else reads
        the delta first: no differential privacy, update filter or norm bound, a CPU model."""
        return (
            kind is UpdateKind.DELTA
            and self.privacy is None
            and self.update_filters is None
            and self.config.max_update_norm is None
            and self.device.type == "cpu"
        )

    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        a = self.mixing_weight(staleness)
        x = self._model
        if update.quantized is not None:
            return self._apply_codes(update, job, a)
        privacy = self.privacy
        # Under DP every update is a release: x <- (1-a) x + a (base + f delta + noise), with
        # the clip factor f = min(1, C / |delta|) and noise N(0, (z C)^2) scaled by a like it.
        f = 1.0
        if privacy is not None:
            privacy.require_budget(update.client_id, 1.0)
            f = privacy.clip_factor_of(update, job)
        with self._noise_for_release(extra=1) as noise:
            # The next version is another tensor (the current one is a published snapshot),
            # written in as few passes as possible: a clone followed by in-place passes cost
            # twice as much on a 64 MB model (bench/test_bench_ingest.py).
            new = self._new_model_buffer()
            if update.kind is UpdateKind.WEIGHTS and (f == 1.0 or job.weights is x):
                # x + a f (u - x): with f = 1, (1-a) x + a u; with base = x, the clipped delta.
                torch.lerp(x, update.tensor, a * f, out=new)
            elif update.kind is UpdateKind.WEIGHTS:
                # lerp(x, base, a) + a f (u - base), no [D] temporary.
                torch.lerp(x, job.weights, a, out=new)
                new.add_(update.tensor, alpha=a * f).sub_(job.weights, alpha=a * f)
            elif job.weights is x:
                # A fresh job (base = x): (1-a) x + a (x + delta) = x + a delta, in one pass.
                torch.add(x, update.tensor, alpha=a * f, out=new)
            else:
                # (1-a) x + a (base + delta) = lerp(x, base, a) + a delta, no [D] temporary.
                torch.lerp(x, job.weights, a, out=new)
                new.add_(update.tensor, alpha=a * f)
            if noise is not None:
                new.add_(noise, alpha=a)
                self._check_version(new)
        if update.buffers is not None:
            assert self.float_buffers.current is not None
            self.float_buffers.set(torch.lerp(self.float_buffers.current, update.buffers, a))
        if privacy is not None:
            privacy.contribute(update.client_id, 1.0, f)
        version = self._publish(new)
        self._released()
        logger.debug("fedasync: %s s=%d alpha=%.4g -> v%d", update.client_id, staleness, a, version)
        return Outcome(Status.APPLIED, version)

    def _apply_codes(self, update: Update, job: Job, a: float) -> Outcome:
        """A DELTA as the wire's codes (:meth:`folds_quantized_updates`): ``x + a delta`` (or
        ``lerp(x, base, a) + a delta``) with the delta decoded where it is added, each element
        computed in float64 and rounded once (aggsrv.kernels.quantized_accumulate)."""
        q = update.quantized
        assert q is not None and update.kind is UpdateKind.DELTA
        x = self._model
        new = self._new_model_buffer()
        if job.weights is x:
            base = x
        else:
            torch.lerp(x, job.weights, a, out=new)
            base = new
        squares = torch.zeros(1, dtype=torch.float64)  # its norm, for the server's metrics
        kernels.quantized_accumulate(
            new, q.codes, q.scales, q.block, a, bits=q.bits, base=base, squares=squares,
            backend="cpu",
        )  # fmt: skip
        q.note_squared_norm(float(squares))
        if update.buffers is not None:
            assert self.float_buffers.current is not None
            self.float_buffers.set(torch.lerp(self.float_buffers.current, update.buffers, a))
        version = self._publish(new)
        self._released()
        return Outcome(Status.APPLIED, version)
