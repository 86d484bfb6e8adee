"""CA2FL (Wang et al., ICLR 2024, "Tackling the Data Heterogeneity in Asynchronous Federated
Learning with Cached Update Calibration"): FedBuff with a cache of every client's latest update.

ORTHOFL's semi-asynchronous comparison baseline (docs/algorithms/orthofl.md, section 3.4). The
server caches ``h_i``, the latest update (client weights minus the job's start weights) of each
client, zero until the client first reports. A buffer collects ``K`` arrivals; at the first
arrival of a buffer the cache mean ``h_bar = (1/N) sum_i h_i`` is taken over the ``N`` clients
registered at that moment, and the buffer's accumulator starts as ``K * h_bar``. Each arrival
``i`` adds its calibrated update ``delta_i - h_i`` and then replaces ``h_i <- delta_i``. At the
``K``-th arrival: ``v = h_bar + (1/K) sum_buffer (delta_i - h_i)`` and ``x <- x + server_lr * v``.

``h_i`` in the correction is the client's cached update when it arrives. For the first arrival
of a client within a buffer that is the cache at the buffer's start, as in CA2FL's Algorithm 1;
a client that reports twice within one buffer contributes ``delta^(1) - h_i`` and then
``delta^(2) - delta^(1)`` (its two contributions telescope to ``delta^(2) - h_i``: its freshest
update replaces its stale cache once). Keeping the buffer-start value for the second arrival
would cost one more [D] row per repeating client; the paper does not treat this case.

With an all-zero cache (the first buffer) this is exactly FedBuff: ``x + lr * mean(delta)``.
No staleness weighting (CA2FL has none); ``max_staleness`` works as for every strategy.

``aggregator`` (docs/robust.md; default ``mean``, the arithmetic above, unchanged): any other
rule replaces both means. At a buffer's first arrival ``h_bar`` becomes the rule over the cache
rows of the clients that have reported (clients that never reported have no row and count in
no rule: a zero row is no evidence), zero while there are none; and ``(1/K) sum (delta_i - h_i)``
becomes the rule over the buffer's K calibrated rows ``delta_i - h_i``, kept as a float32
[K, D] buffer. So ``v = rule(cache) + rule(calibrated rows)``: a client that sends a crafted
update is outvoted in both the cache's estimate and the correction, and one robust estimate of
the cache per buffer costs one pass of the rule over the cache. Centered clipping's centres are
the previous ``h_bar`` and the previous correction.

Differential privacy (the ``dp_`` keys, docs/privacy.md): every delta is clipped to C before
it enters the buffer and the cache, so the cache holds clipped deltas, and the noise
``N(0, (z C)^2)`` goes on ``K v`` (the buffer's sum) once per flush. One client's influence on a
flush is not one arrival: its cached row is in ``h_bar`` at every flush after its first report.
Under zero-out neighbours (all of its deltas zero), with ``h`` its row at the buffer's start,
its part of ``K v`` is ``(K/N) h`` if it did not arrive in this buffer, and ``(K/N - 1) h + delta``
(its last delta; several arrivals telescope) if it did. So its sensitivity is ``K/N`` x C
without an arrival, ``1 + |1 - K/N|`` x C with one when it had a row, and 1 x C on its first
report. The accountant charges every client with a row at every flush accordingly.

Memory: the cache is ``clients x D x 4`` bytes in float32 (``cache_dtype``: 2 bytes a value in
bfloat16, about 1.03 in int8; rows allocated on a client's first report, in blocks that double up
to ``max_clients``), plus a float64 [D] accumulator and a [D] scratch row
for WEIGHTS updates. Outcomes as FedBuff: BUFFERED(version) for the first ``K - 1`` arrivals of a
buffer, APPLIED(new version) for the ``K``-th.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from aggsrv import kernels
from aggsrv.aggregators import RowBuffer
from aggsrv.config_check import Count
from aggsrv.strategies.base import Strategy
from aggsrv.strategies.cached_rows import (
    CACHE_DTYPE_HELP,
    CachedRows,
    RowCacheInfo,
    check_cache_dtype,
)
from aggsrv.strategies.fedbuff import BufferedConfig
from aggsrv.strategies.finite_results import require_reach
from aggsrv.strategies.job import Job
from aggsrv.strategies.privacy import PrivacyConfig
from aggsrv.strategies.robust import RobustCombiner, check_pending_rows
from aggsrv.values import Outcome, Status, Update, UpdateKind

__all__ = ["CA2FL", "CA2FLConfig"]

logger = logging.getLogger(__name__)


@dataclass
class CA2FLConfig(BufferedConfig, PrivacyConfig):
    """CA2FL settings: buffer size ``K`` and server learning rate ``eta``, and differential
    privacy (the ``dp_`` keys; see "Differential privacy" in the module docstring).

    Defaults follow the ORTHOFL spec's choice for FedBuff and CA2FL with up to 21 clients:
    ``buffer_size = 5`` (10 for 100 clients), ``server_lr = 1.0``.
    """

    HELP: ClassVar[Mapping[str, str]] = {"cache_dtype": CACHE_DTYPE_HELP}

    buffer_size: Count = 5
    cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        """Check ranges, and the dp_ keys against the aggregator and the cache."""
        super().__post_init__()
        self.check_privacy(self.aggregator)
        check_cache_dtype(self.cache_dtype)
        if self.private and self.cache_dtype != "float32":
            raise ValueError(
                "ca2fl with dp_ keys keeps its cache in float32: the accounting charges each "
                "cached row as a clipped delta, which a rounded row is not exactly; drop "
                "cache_dtype or the dp_ keys"
            )
        if self.private and self.dp_adaptive_quantile is not None:
            raise ValueError(
                "ca2fl does not support adaptive clipping (dp_adaptive_quantile): a release "
                "moves every cached client's contribution, not a count of arrivals; use a "
                "fixed dp_clip_norm"
            )


class CA2FL(Strategy[CA2FLConfig], name="ca2fl"):
    """CA2FL: buffered asynchronous aggregation calibrated with a cache of latest updates."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Allocate the float64 accumulator; cache rows come with clients' first reports."""
        super().__init__(*args, **kwargs)
        # A robust aggregator combines the buffer's calibrated rows (`_robust`) and, with its
        # own centre, the cache's estimate h_bar (`_robust_cache`, taken at a buffer's first
        # arrival into the spare row, then swapped in).
        text = self.config.aggregator
        self._robust_cache = RobustCombiner.for_config(text, f"{self.name} cache", self.device)
        self._acc = self._running_sum(torch.float64)  # a robust rule keeps rows instead
        self._cache = CachedRows(self.dim, self.config.cache_dtype, self.device)
        self._row: dict[str, int] = {}  # client id -> cache row
        self._count = 0  # arrivals in the current buffer
        self._n_mean = 0  # N the current buffer's cache mean was taken over
        # Differential privacy: the clients that arrived in this buffer, and those of them whose
        # first report it is (no row at the buffer's start).
        self._arrived: set[str] = set()
        self._first: set[str] = set()
        self._scratch: torch.Tensor | None = None
        self._decoded: torch.Tensor | None = None  # a compressed cache's row being replaced
        self._rows = RowBuffer(self.dim, self.device) if self._robust is not None else None
        self._row_absmax: list[float] = []  # derived from the rows, not saved
        self._hbar: torch.Tensor | None = None  # the buffer's robust h_bar (while _count > 0)
        self._hbar_absmax = 0.0
        self._hbar_spare: torch.Tensor | None = None
        self._aggregate: torch.Tensor | None = None

    @property
    def buffered(self) -> int:
        """How many updates wait in the buffer."""
        return self._count

    def cached_update(self, client_id: str) -> torch.Tensor:
        """The client's cached latest update ``h_i`` (zeros before its first report)."""
        row = self._row.get(client_id)
        if row is None:
            return torch.zeros(self.dim, dtype=torch.float32, device=self.device)
        return self._cache.read(row)

    def row_cache(self) -> RowCacheInfo:
        return self._cache.info(len(self._row))

    def _require_storable(self, delta: torch.Tensor) -> None:
        """Refuse a delta whose row, as a compressed cache stores it, could leave float32's
        range (a finite value near the top rounds to inf in bfloat16, or decodes to inf from
        int8): the cache would hold inf and refuse every later update. Nothing to check in
        float32 (the delta is finite by now)."""
        if self._cache.dtype != "float32":
            absmax = self._checked_absmax(delta, "the client's delta")
            require_reach(self._cache.bound(absmax), "the client's row as the cache stores it")

    def _cached_row(self, row: int) -> torch.Tensor:
        """Row ``row``'s values: the cache row itself in float32, else decoded into a scratch
        row (which the replacement of the row may then use)."""
        if self._cache.dtype == "float32":
            return self._cache.read(row)
        if self._decoded is None:
            self._decoded = self._row_vector()
        return self._cache.read(row, out=self._decoded)

    def _row_of(self, client_id: str) -> int:
        row = self._row.get(client_id)
        if row is not None:
            return row
        row = len(self._row)
        self._cache.ensure(row, row + 1, self.max_clients)
        self._row[client_id] = row
        return row

    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        if self._robust is not None:
            return self._apply_robust(update, job)
        k = self.config.buffer_size
        n_mean = self._n_mean
        if self._count == 0:
            # Buffer start: acc = K * h_bar over the registered clients (rows never reported
            # are zero and not stored). The accumulator holds nothing of the state until the
            # first update of the buffer is counted, so it may be written before the checks.
            n_mean = max(len(self._clients), 1)
            n = len(self._row)
            if n:
                self._cache.sum_into(n, self._acc)
                self._acc.mul_(k).div_(n_mean)
            else:
                self._acc.zero_()
        if update.kind is UpdateKind.WEIGHTS:
            if self._scratch is None:
                self._scratch = torch.empty(self.dim, dtype=torch.float32, device=self.device)
            delta = self.client_delta(update, job, out=self._scratch)
            self._require_finite(delta, "the client's delta (its weights minus the job's)")
        else:
            delta = update.tensor
        self._require_storable(delta)
        row = self._row.get(update.client_id)
        h = self._cached_row(row) if row is not None else None
        # Under DP the delta is clipped before it enters the sum and the cache.
        f = 1.0 if self.privacy is None else self.privacy.clip_factor_of(update, job, delta)
        releases = self._count + 1 >= k
        charges = None  # under DP, what the flush this update makes charges each client
        if releases and self.privacy is not None:
            charges = self._sensitivities(update.client_id, n_mean)
            self.privacy.require_budget_for(charges)

        def acc_after(s: slice) -> torch.Tensor:
            acc = torch.add(self._acc[s], delta[s], alpha=f)
            return acc if h is None else acc.sub_(h[s])

        if releases:  # x + (lr / K) * (acc with this update [+ noise]), checked
            new = self._stepped_version(acc_after, self.config.server_lr / k, extra=1)
        else:
            # The cache row becomes the delta, finite by now; check the model a flush would
            # publish, so the flush that comes is a checked one.
            self._require_finite_chunks(
                lambda s: torch.add(
                    self._model[s], acc_after(s), alpha=self.config.server_lr / k
                ).float(),
                "the model the buffer's flush would publish",
            )
        if self._count == 0:
            self._arrived, self._first = set(), set()
        if h is None:
            self._first.add(update.client_id)
        self._arrived.add(update.client_id)
        self._n_mean = n_mean
        if h is None:
            row = self._row_of(update.client_id)  # may grow the cache: read it afterwards
            h = self._cached_row(row)  # a zero row
        kernels.accumulate(self._acc, delta, f)  # float32 into float64: not torch's slow add_
        kernels.accumulate(self._acc, h, -1.0)
        if self._cache.dtype == "float32":
            torch.mul(delta, f, out=h)
        else:  # h is a decoded copy, no longer needed; the sums use the row as stored
            self._cache.write(row, delta if f == 1.0 else torch.mul(delta, f, out=h))
        self._count += 1
        if update.buffers is not None:
            self.float_buffers.add(update.buffers, 1.0)  # the buffer's uniform mean
        if not releases:
            return Outcome(Status.BUFFERED, self.version)
        self._count = 0
        if self.privacy is not None:
            assert charges is not None
            self.privacy.set_release(charges)
        version = self._publish(new)
        self._released()
        logger.debug("ca2fl: applied %d updates (N=%d) -> v%d", k, self._n_mean, version)
        return Outcome(Status.APPLIED, version)

    def _sensitivities(self, arriving: str | None, n_mean: int) -> dict[str, float]:
        """Each client's sensitivity (in units of C) in the flush of the current buffer, with
        ``arriving`` arriving now (the module docstring's "Differential privacy")."""
        k = self.config.buffer_size
        arrived = set(self._arrived) if self._count else set()
        first = set(self._first) if self._count else set()
        if arriving is not None:
            arrived.add(arriving)
            if arriving not in self._row:
                first.add(arriving)
        out = {c: k / n_mean for c in self._row if c not in arrived}
        for c in arrived:
            out[c] = 1.0 if c in first else 1.0 + abs(1.0 - k / n_mean)
        return out

    def _row_vector(self) -> torch.Tensor:
        return torch.empty(self.dim, dtype=torch.float32, device=self.device)

    def _apply_robust(self, update: Update, job: Job) -> Outcome:
        """:meth:`_apply` with a robust rule (module docstring): stage the calibrated row
        ``delta - h_i`` (and at a buffer's first arrival the cache's estimate), check, count."""
        assert self._rows is not None and self._robust is not None
        assert self._robust_cache is not None
        k, lr = self.config.buffer_size, self.config.server_lr
        cache_info = None
        if self._count == 0:
            # The buffer's h_bar, in the spare row (nothing of the state until counted).
            if self._hbar_spare is None:
                self._hbar_spare = self._row_vector()
            hbar, n = self._hbar_spare, len(self._row)
            if n:
                # A robust rule reads values: a compressed cache is decoded for it.
                cache_info = self._robust_cache.combine(
                    self._cache.decoded(n), [1.0] * n, reduce=self.reduce, out=hbar
                )
            else:
                hbar.zero_()
            hbar_absmax = self._checked_absmax(hbar, "the cache's robust estimate h_bar")
        else:
            assert self._hbar is not None
            hbar, hbar_absmax = self._hbar, self._hbar_absmax
        if update.kind is UpdateKind.WEIGHTS:
            if self._scratch is None:
                self._scratch = self._row_vector()
            delta = self.client_delta(update, job, out=self._scratch)
            self._require_finite(delta, "the client's delta (its weights minus the job's)")
        else:
            delta = update.tensor
        self._require_storable(delta)
        cached = self._row.get(update.client_id)
        calibrated = self._rows.slot()
        if cached is None:
            calibrated.copy_(delta)
        else:
            torch.sub(delta, self._cached_row(cached), out=calibrated)
        absmax = self._checked_absmax(calibrated, "the calibrated update delta - h_i")
        new = info = None
        if self._count + 1 < k:
            # The bound every rule meets (aggsrv/strategies/robust.py), for both estimates.
            bound = self._robust_cache.bound(hbar_absmax)
            bound += self._robust.bound(max([absmax, *self._row_absmax]))
            require_reach(
                self.model_absmax() + lr * bound, "the model the buffer's flush would publish"
            )
        else:
            rows, weights = self._rows.with_slot(1.0)
            if self._aggregate is None:
                self._aggregate = self._row_vector()
            agg = self._aggregate
            info = self._robust.combine(rows, weights, reduce=self.reduce, out=agg)
            self._require_finite(agg, f"the buffer's {self._robust.aggregator.rule} correction")
            new = self._new_model_buffer()
            torch.add(self._model, torch.add(hbar, agg), alpha=lr, out=new)
            self._check_version(new)
        # Checked: change the state.
        if self._count == 0:
            if cache_info is not None:
                self._robust_cache.commit(hbar, cache_info, self._robust_absmax)
            self._hbar, self._hbar_spare = hbar, self._hbar
            self._hbar_absmax = hbar_absmax
            self._n_mean = max(len(self._clients), 1)
        row = self._row_of(update.client_id)  # may grow the cache: read it afterwards
        self._cache.write(row, delta)
        self._rows.commit(1.0)
        self._row_absmax.append(absmax)
        self._count += 1
        if update.buffers is not None:
            self.float_buffers.add(update.buffers, 1.0)  # the buffer's uniform mean
        if new is None:
            return Outcome(Status.BUFFERED, self.version)
        assert info is not None
        self._robust.commit(self._aggregate, info, self._robust_absmax)  # type: ignore[arg-type]
        self._rows.clear()
        self._row_absmax = []
        self._count = 0
        version = self._publish(new)
        logger.debug("ca2fl: %s of %d updates -> v%d", info.rule, k, version)
        return Outcome(Status.APPLIED, version)

    def _robust_absmax(self, t: torch.Tensor) -> float:
        return self._checked_absmax(t, "a robust aggregate")

    def _extra_state(self) -> dict[str, Any]:
        n = len(self._row)
        robust = None
        if self._robust is not None:
            assert self._rows is not None and self._robust_cache is not None
            robust = {
                **self._robust.state(),
                **self._rows.state(),
                "hbar": self._hbar if self._count else None,
                "cache_center": self._robust_cache.state()["center"],
                "cache_fallbacks": self._robust_cache.fallbacks,
            }
        return {
            **self._cache.state(n),
            "rows": dict(self._row),
            "acc": self._acc if self._count and self._robust is None else self._acc[:0],
            "count": self._count,
            "n_mean": self._n_mean,
            "robust": robust,
            "arrived": sorted(self._arrived) if self._count else [],
            "first": sorted(self._first) if self._count else [],
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        rows = {str(c): int(r) for c, r in state["rows"].items()}
        cache = state["cache"]
        n = len(rows)
        if sorted(rows.values()) != list(range(n)) or tuple(cache.shape) != (n, self.dim):
            raise ValueError(
                f"saved cache has shape {tuple(cache.shape)} for {n} clients, D={self.dim}"
            )
        count = int(state["count"])
        if not 0 <= count < self.config.buffer_size:
            raise ValueError(
                f"saved buffer holds {count} updates; buffer_size={self.config.buffer_size}"
            )
        self._cache.load(state, n, self.max_clients)  # any saved cache dtype, converted
        self._row = rows
        self._count = count
        self._n_mean = int(state["n_mean"])
        self._arrived = set(state.get("arrived", []))
        self._first = set(state.get("first", []))
        robust = state.get("robust")
        check_pending_rows(self, robust, count)
        if self._robust is not None:
            assert self._rows is not None and self._robust_cache is not None
            self._rows.load(robust, "calibrated rows")
            self._row_absmax = [self._checked_absmax(r, "a saved row") for r in self._rows.rows]
            restore = lambda t: self._restore(t, shared=False)  # noqa: E731
            self._robust.load(robust, restore, self._robust_absmax)
            cache_state = None
            if robust is not None:
                cache_state = {
                    "aggregator": robust["aggregator"],
                    "center": robust["cache_center"],
                    "fallbacks": robust["cache_fallbacks"],
                }
            self._robust_cache.load(cache_state, restore, self._robust_absmax)
            self._hbar, self._hbar_absmax = None, 0.0
            if count:
                assert robust is not None
                self._hbar = restore(robust["hbar"])
                self._hbar_absmax = self._robust_absmax(self._hbar)
            return
        if count:
            self._acc.copy_(state["acc"])
