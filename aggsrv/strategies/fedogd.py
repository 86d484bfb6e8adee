"""Fed-OGD (Li et al.): cached pseudo-gradients, two group bases, cross-group client projection.

Spec: docs/algorithms/fedogd.md (section 2.4 is the canonical algorithm; "[rec]" choices below come
from it). The server keeps one cache row per client holding its newest pseudo-gradient
``Δw_k = -DELTA / lr`` (docs/design.md; the gradient-sign convention of spec G3), overwritten on
every arrival and reused in every later epoch (spec 2.12). Clients are in the active group A or the
straggler group S. At the close of each epoch (one version per epoch):

* ``b_A`` / ``b_S`` = the mean of the valid cache rows of each group (``kernels.group_means``;
  never-uploaded rows excluded unless ``count_empty_rows``; an empty group gives a zero basis);
* ``aggregation = "group_sum"`` (the algorithm box, default): ``w <- w - server_lr (b_A + b_S)``;
  ``"uniform_mean"`` (the proof and the authors' code): ``w <- w - server_lr * mean(valid rows)``.

Each job carries ``"weights"`` and ``"basis"`` = the OTHER group's basis as computed at the last
close (spec G1: active clients get ``b_S``, stragglers ``b_A``), and a recipe with
``projection`` (WHOLE: one inner product over the whole model, the paper; LAYERWISE: per tensor,
an opt-in deviation, spec 2.11; NONE: no basis is sent) and ``only_conflicting`` (True: Eq. 4,
remove the component only when ``<g, b> < 0``; False: the "traditional OGD" ablation).

Epochs (spec 2.6 deployment mode). An epoch opens once ``min_available`` clients are registered
and again right after each close. When it opens it dispatches every idle client (spec S1: every
registered client with no job in flight), and a client that registers while it is open is
dispatched at once; the A-clients among them are the ones the epoch waits for. This membership
is fixed by the registrations and the updates, never by when job requests arrive, so the same
events give the same model whatever order their RPCs reach the server in (a straggler's upload
that lands right after a close waits for the new epoch's A-clients instead of closing it).
``job_for`` hands every client that has not reported in the open epoch a job from the current
version (a client still running a job keeps it; asking again for a job from an older version
supersedes it, as the base class does, without making it a member). The epoch closes when every
A-client dispatched in it has reported and at least ``min_updates`` updates arrived in it, or at
``epoch start + epoch_timeout`` (``on_timer``) if ``min_updates`` arrived; otherwise the
deadline moves ``epoch_timeout`` on. An epoch that opens with no idle A-client closes at the
first ``min_updates`` arrivals. A client that reported waits (``job_for`` -> None) until
the next epoch (re-dispatch at t0 + P, spec 2.6). Updates arriving after the close of the epoch
their job came from are accepted and overwrite the row at any later epoch (stragglers), with no
staleness weighting; ``max_staleness`` still applies.

Groups. ``tiers`` maps client ids to a fixed reporting period P (simulation mode, spec 2.6: A iff
P == 1, never reclassified). Every other client is classified by deadline detection when
``detect`` (it starts in A; an A-client whose job dispatched in an epoch has not reported at its
close moves to S; a client with ``hysteresis`` consecutive updates that arrived in the epoch
they were dispatched in moves to A), or stays in A when not. A row that changes group moves with
it unchanged. Note that detection needs ``epoch_timeout`` shorter than the stragglers' job time:
without a deadline every epoch waits for all A-clients and nobody is ever late.

``send_differences`` (the paper's privacy variant, spec 2.14; off by default): a client uploads
a DELTA equal to its job delta minus its previous job's delta (zero before its first job), and
the server keeps float64 running group sums instead of the [K, D] cache (``b_i = Σ_i / n_i``).
Groups must be fixed (``detect = False``); WEIGHTS updates are refused. The bundled client
(``aggsrv.client.train``) sends plain deltas: this mode needs a client that keeps its last delta.

BatchNorm statistics (spec 2.13) are not part of the flat [D] update and are not handled here.
Outcomes: BUFFERED(current version) for an update that waits for the close, APPLIED(new version)
for the one that closed the epoch.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from aggsrv import kernels
from aggsrv.config_check import Count
from aggsrv.strategies.base import Strategy
from aggsrv.strategies.cached_rows import (
    CACHE_DTYPE_HELP,
    CachedRows,
    RowCacheInfo,
    check_cache_dtype,
)
from aggsrv.strategies.config import StrategyConfig
from aggsrv.strategies.errors import InvalidUpdate
from aggsrv.strategies.finite_results import require_reach
from aggsrv.strategies.job import Job
from aggsrv.strategies.update_filters import FilteredConfig
from aggsrv.values import Outcome, PendingReason, ProjectionMode, Recipe, Status, Update, UpdateKind

__all__ = ["CachedEpochConfig", "CachedEpochs", "FedOGD", "FedOGDConfig"]

logger = logging.getLogger(__name__)

ACTIVE, STRAGGLER = 0, 1


@dataclass
class CachedEpochConfig(StrategyConfig):
    """Epoch, group and cache settings shared by Fed-OGD and MIFA (see the module docstring).

    ``server_lr`` None (default) means "equal to ``learning_rate``": a close over one group is
    then FedAvg's step (server lr 1) over that group's cached rows. ``learning_rate`` defaults
    to 0.05, FedAvg's: an epoch waits for the active clients, so a run makes one step per
    slowest active job (docs/strategies.md, "Defaults that learn").
    """

    HELP: ClassVar[Mapping[str, str]] = {
        "server_lr": "server learning rate; unset = learning_rate",
        "count_empty_rows": "never-uploaded cache rows count as zero rows in the means",
        "epoch_timeout": "seconds before an epoch closes without late clients; unset = never",
        "min_updates": "updates an epoch needs before it may close",
        "min_available": "registered clients needed before the first epoch opens",
        "tiers": "client id -> fixed reporting period (1 = active); others are detected",
        "detect": "classify clients missing from tiers as stragglers by deadline",
        "hysteresis": "consecutive on-time updates that move a straggler back to active",
        "cache_dtype": CACHE_DTYPE_HELP,
    }

    learning_rate: float = 0.05
    server_lr: float | None = None
    count_empty_rows: bool = False
    epoch_timeout: float | None = 60.0
    min_updates: Count = 1
    min_available: Count = 1
    tiers: dict[str, Count] = field(default_factory=dict)
    detect: bool = True
    hysteresis: Count = 1
    cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        """Check ranges and the tier table."""
        super().__post_init__()
        check_cache_dtype(self.cache_dtype)
        if self.server_lr is not None and not self.server_lr > 0:
            raise ValueError(f"server_lr must be > 0 or None, got {self.server_lr}")
        if self.epoch_timeout is not None and not self.epoch_timeout > 0:
            raise ValueError(f"epoch_timeout must be > 0 or None, got {self.epoch_timeout}")
        self.tiers = dict(self.tiers)  # a copy: the config owns its table

    @property
    def effective_server_lr(self) -> float:
        """``server_lr``, or ``learning_rate`` when it is None."""
        return self.learning_rate if self.server_lr is None else self.server_lr


# docs/algorithms/fedogd.md (section 2.10 of the spec): the paper's settings and the released
# code's. Neither is the default: eta_g = 0.0015 moves the model 0.15 of a FedAvg step per
# epoch, which the active group closes once per slowest active job, so a short run barely
# learns (Fed-OGD's own comparison in bench/experiments/README.md: server lr = client lr wins).
FEDOGD_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "learning_rate": 0.01,
        "server_lr": 0.0015,
        "momentum": 0.0,
        "aggregation": "group_sum",
        "count_empty_rows": False,
        "projection": "whole",
        "only_conflicting": True,
    },
    "authors_code": {
        "momentum": 0.1,
        "aggregation": "uniform_mean",
        "count_empty_rows": True,
        "learning_rate": 0.01,
        "server_lr": 0.003,
    },
}


@dataclass
class FedOGDConfig(CachedEpochConfig, FilteredConfig):
    """Fed-OGD settings (module docstring). The defaults are the paper's algorithm (group_sum,
    whole-model conditional projection, plain SGD) with eta_l = eta_g = 0.05.

    ``preset = "paper"`` (docs/algorithms/fedogd.md 2.10) gives the paper's learning rates: eta_l =
    0.01, eta_g = 0.0015. ``preset = "authors_code"`` gives the released code's values: SGD momentum
    0.1, a uniform mean over all K rows with never-uploaded rows counting as zero,
    eta_l = 0.01, eta_g = 0.003. A preset only fills: a key given beside it wins.
    """

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = FEDOGD_PRESETS
    PRESET_NOTES: ClassVar[Mapping[str, str]] = {
        "paper": "the paper's eta_l 0.01, eta_g 0.0015: too slow for a short run (default "
        "scenario: 0.18-0.28)",
        "authors_code": "the released code: momentum 0.1, uniform mean with empty rows, "
        "eta_g 0.003 (default scenario: 0.32-0.47)",
    }
    HELP: ClassVar[Mapping[str, str]] = {
        "aggregation": "group_sum (w -= server_lr (b_A + b_S)) or uniform_mean over valid rows",
        "projection": "whole (one inner product), layerwise (per tensor) or none",
        "only_conflicting": "remove the basis component only when <g, b> < 0 (Eq. 4)",
        "send_differences": "clients upload delta differences (privacy variant; fixed groups)",
    }
    aggregation: str = "group_sum"
    projection: str = "whole"
    only_conflicting: bool = True
    send_differences: bool = False

    def __post_init__(self) -> None:
        """Check choices."""
        super().__post_init__()
        if self.aggregation not in ("group_sum", "uniform_mean"):
            raise ValueError(
                f"aggregation must be 'group_sum' or 'uniform_mean', got {self.aggregation!r}"
            )
        if self.projection not in ("whole", "layerwise", "none"):
            raise ValueError(
                f"projection must be 'whole', 'layerwise' or 'none', got {self.projection!r}"
            )
        if self.send_differences and self.detect:
            raise ValueError(
                "send_differences needs fixed groups: set detect = false (clients missing from "
                "tiers are then always active)"
            )
        if self.send_differences and self.update_filter and "centered_clip" in self.update_filter:
            raise ValueError(
                "update_filter 'centered_clip' clips deltas, but with send_differences clients "
                "upload differences of deltas: use the 'norm' filter only, or plain uploads"
            )

    @property
    def projection_mode(self) -> ProjectionMode:
        """The recipe's projection mode."""
        return {
            "whole": ProjectionMode.WHOLE,
            "layerwise": ProjectionMode.LAYERWISE,
            "none": ProjectionMode.NONE,
        }[self.projection]


# The config of a strategy built on the epoch machinery (MIFA, Fed-OGD).
EpochConfig = TypeVar("EpochConfig", bound=CachedEpochConfig)


class CachedEpochs(Strategy[EpochConfig]):
    """Latest-update cache per client, epochs closed by A-clients or a deadline, two groups.

    Subclasses define :meth:`_step` (the new model from the cache at a close). Public so that
    MIFA (``aggsrv.strategies.mifa``) shares the epoch machinery.
    """

    buffer_rule = "latest"  # the statistics' mean over every client's latest upload, like the cache

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Start with an empty cache, both bases zero and no epoch open."""
        super().__init__(*args, **kwargs)
        self._cache = CachedRows(self.dim, self.config.cache_dtype, self.device)
        self._row: dict[str, int] = {}  # client id -> cache row, in join order
        self._valid: list[bool] = []  # per row: uploaded at least once
        self._base_version: list[int] = []  # per row: version its newest update started from
        self._group: dict[str, int] = {}  # client id -> ACTIVE / STRAGGLER
        self._streak: dict[str, int] = {}  # consecutive on-time updates (detection)
        # The bases of the last close, [2, D] (b_A, b_S): a snapshot jobs share, never mutated.
        self._bases = torch.zeros(2, self.dim, dtype=torch.float32, device=self.device)
        self._open = False
        self._deadline: float | None = None
        # A-clients dispatched this epoch (idle when it opened, or joined during it) that have
        # not reported: the epoch closes when this is empty (and min_updates arrived).
        self._pending: dict[str, None] = {}
        self._arrivals: dict[str, bool] = {}  # reported this epoch -> on time (same epoch)
        # max |row| per cache row (derived from the cache, so not saved): bounds what a close
        # can publish without computing it at every update.
        self._row_absmax: list[float] = []
        self._candidate: torch.Tensor | None = None  # the next row of the updating client
        self._candidate_absmax = 0.0

    # --------------------------------------------------------------------------- views

    @property
    def bases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(b_A, b_S) as computed at the last close (zero before the first)."""
        return self._bases[ACTIVE], self._bases[STRAGGLER]

    def group_of(self, client_id: str) -> str:
        """The group of a registered client: "A" (active) or "S" (straggler)."""
        self._require_registered(client_id)
        return "AS"[self._group[client_id]]

    def _fixed(self, client_id: str) -> bool:
        return client_id in self.config.tiers or not self.config.detect

    # --------------------------------------------------------------------------- protocol

    def on_register(self, client_id: str, now: float) -> None:
        """Register, give the client a cache row and its group; maybe open the first epoch.

        A new client is idle: joining an open epoch it is dispatched in it at once (spec S1),
        so an active one is waited for like the members the epoch opened with."""
        known = client_id in self._clients
        super().on_register(client_id, now)
        if not known:
            p = self.config.tiers.get(client_id, 1)
            self._group[client_id] = ACTIVE if p == 1 else STRAGGLER
            self._streak[client_id] = 0
            self._add_row(client_id)
            if self._open and self._group[client_id] == ACTIVE:
                self._pending[client_id] = None
        self._maybe_open(now)

    def job_for(self, client_id: str, now: float) -> Job | None:
        """A job from the current version, unless the client already reported in this epoch.

        Asking for a job does not change who the epoch waits for (decided when it opened)."""
        self._require_registered(client_id)
        self._maybe_open(now)
        if not self._open:
            return self._no_job(PendingReason.NO_ROUND_OPEN)
        if client_id in self._arrivals:
            return self._no_job(PendingReason.ALREADY_REPORTED)
        return self._issue_job(client_id, deadline=None, now=now)

    def _next_deadline(self) -> float | None:
        """The open epoch's deadline."""
        return self._deadline if self._open else None

    def _on_timer(self, now: float) -> None:
        """At the deadline close the epoch if ``min_updates`` arrived, else extend it."""
        if not self._open or self._deadline is None or now < self._deadline:
            return
        if len(self._arrivals) >= self.config.min_updates:
            self._close(now)
        else:
            timeout = self.config.epoch_timeout
            assert timeout is not None  # a deadline exists only with a timeout
            self._deadline = now + timeout
            logger.info(
                "%s: epoch %d has %d of min_updates=%d updates at its deadline; extended to %.3f",
                self.name,
                self.version,
                len(self._arrivals),
                self.config.min_updates,
                self._deadline,
            )

    # --------------------------------------------------------------------------- updates

    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        cid = update.client_id
        # Checked before any change: the client's new row is finite, and whichever epoch close
        # comes next (this update's or a deadline's) publishes a finite model.
        self._candidate_absmax = self._prepare(update, job)
        bound = self._bound_with(cid, self._candidate_absmax)
        factor = 2.0 if self._sums_both_bases() else 1.0
        require_reach(
            self.model_absmax() + self.config.effective_server_lr * factor * bound,
            "the model an epoch close would publish",
        )
        self._ingest(update, job)
        if update.buffers is not None:
            self.float_buffers.remember(cid, update.buffers)
        row = self._row[cid]
        self._valid[row] = True
        self._base_version[row] = job.base_version
        self._arrivals[cid] = job.base_version == self.version and self._open
        self._pending.pop(cid, None)
        if self._open and not self._pending and len(self._arrivals) >= self.config.min_updates:
            return Outcome(Status.APPLIED, self._close(now))
        return Outcome(Status.BUFFERED, self.version)

    def _prepare(self, update: Update, job: Job) -> float:
        """The client's next row, the pseudo-gradient ``-DELTA / lr``, in a scratch row (not
        yet in the cache); its max |x| (NonFiniteResult if it is not finite)."""
        if self._candidate is None:
            self._candidate = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        dst = self._candidate
        lr = job.recipe.learning_rate
        if update.kind is UpdateKind.DELTA:
            torch.div(update.tensor, -lr, out=dst)
        else:
            torch.sub(job.weights, update.tensor, out=dst).div_(lr)
        # The bound of the row as the cache stores it (rounded to cache_dtype).
        return self._cache.bound(
            self._checked_absmax(dst, "the client's pseudo-gradient -DELTA / lr")
        )

    def _bound_with(self, client_id: str, absmax: float) -> float:
        """The largest max |row| over the cache with the client's row replaced."""
        mine = self._row[client_id]
        return max([absmax, *(m for r, m in enumerate(self._row_absmax) if r != mine)])

    def _sums_both_bases(self) -> bool:
        """Whether a close steps by the sum of two means (Fed-OGD's group_sum) rather than
        one mean: a bound on the step doubles."""
        return False

    def _ingest(self, update: Update, job: Job) -> None:
        """Make the prepared row (:meth:`_prepare`) the client's cache row."""
        assert self._candidate is not None
        row = self._row[update.client_id]
        self._cache.write(row, self._candidate)
        self._row_absmax[row] = self._candidate_absmax

    # --------------------------------------------------------------------------- epochs

    def _maybe_open(self, now: float) -> None:
        if self._open or len(self._clients) < self.config.min_available:
            return
        self._open = True
        self._note_side_effect()  # reachable from job_for: the server must log that call
        # Spec S1: every idle client (no job in flight) is dispatched when the epoch opens, and
        # the epoch waits for the active ones among them, whenever their job requests arrive.
        self._pending = {
            c: None
            for c in self._clients
            if self._group[c] == ACTIVE and self.outstanding_job(c) is None
        }
        timeout = self.config.epoch_timeout
        self._deadline = None if timeout is None else now + timeout
        logger.debug("%s: epoch %d opens at %.3f", self.name, self.version, now)

    def _close(self, now: float) -> int:
        """Reclassify, aggregate, step, publish; open the next epoch at once."""
        self._reclassify()
        new = self._step()
        self._pending = {}
        self._arrivals = {}
        self._open = False
        self._deadline = None
        version = self._publish(new)
        logger.debug("%s: epoch closed at %.3f -> v%d", self.name, now, version)
        self._maybe_open(now)
        return version

    def _reclassify(self) -> None:
        """Deadline detection (spec 2.6 S4) for clients without a fixed group."""
        h = self.config.hysteresis
        for cid in self._pending:  # dispatched as A in this epoch (idle at its opening or
            # joined during it), did not report in it
            if not self._fixed(cid):
                self._group[cid] = STRAGGLER
                self._streak[cid] = 0
        for cid, on_time in self._arrivals.items():
            if self._fixed(cid):
                continue
            self._streak[cid] = self._streak[cid] + 1 if on_time else 0
            if self._streak[cid] >= h:
                self._group[cid] = ACTIVE

    def _row_groups(self, merged: bool = False) -> torch.Tensor:
        """Group id per cache row for ``group_means`` (-1: excluded); one group if ``merged``."""
        ids = []
        for cid, row in self._row.items():
            if self._valid[row] or self.config.count_empty_rows:
                ids.append(0 if merged else self._group[cid])
            else:
                ids.append(-1)
        return torch.tensor(ids, dtype=torch.int64)

    def _add_row(self, client_id: str) -> None:
        n = len(self._row)
        self._cache.ensure(n, n + 1, self.max_clients)
        self._row[client_id] = n
        self._valid.append(False)
        self._base_version.append(-1)
        self._row_absmax.append(0.0)

    @abstractmethod
    def _step(self) -> torch.Tensor:
        """The next version's weights from the cache (a fresh buffer); may set the bases."""

    def _has_cache(self) -> bool:
        """Whether the strategy keeps the [K, D] cache rows (not in Fed-OGD's privacy variant)."""
        return True

    def row_cache(self) -> RowCacheInfo | None:
        return self._cache.info(len(self._row)) if self._has_cache() else None

    # --------------------------------------------------------------------------- state

    def _extra_state(self) -> dict[str, Any]:
        n = len(self._row) if self._has_cache() else 0
        return {
            **self._cache.state(n),
            "row": dict(self._row),
            "valid": list(self._valid),
            "base_version": list(self._base_version),
            "group": dict(self._group),
            "streak": dict(self._streak),
            "bases": self._bases,
            "open": self._open,
            "deadline": self._deadline,
            "pending": list(self._pending),
            "arrivals": dict(self._arrivals),
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        rows = {str(c): int(r) for c, r in state["row"].items()}
        n = len(rows) if self._has_cache() else 0
        # Saved in any cache dtype, stored in this config's; with the capacity the rows grew to
        # live, so a restored server holds what it held.
        self._cache.load(state, n, self.max_clients)
        self._row = rows
        self._row_absmax = [0.0] * len(rows)
        for r in range(n):
            self._row_absmax[r] = self._checked_absmax(self._cache.read(r), "a saved row")
        self._valid = [bool(v) for v in state["valid"]]
        self._base_version = [int(v) for v in state["base_version"]]
        self._group = {str(c): int(g) for c, g in state["group"].items()}
        self._streak = {str(c): int(s) for c, s in state["streak"].items()}
        # Shared with the saved jobs' "basis" tensors (one copy for all of them).
        self._bases = self._restore(state["bases"])
        self._open = bool(state["open"])
        self._deadline = state["deadline"]
        self._pending = dict.fromkeys(str(c) for c in state["pending"])
        self._arrivals = {str(c): bool(v) for c, v in state["arrivals"].items()}


class FedOGD(CachedEpochs[FedOGDConfig], name="fedogd"):
    """Fed-OGD: group bases of cached pseudo-gradients, cross-group projection on clients."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Allocate the running group sums in the privacy variant (no cache rows then)."""
        super().__init__(*args, **kwargs)
        self._sums: torch.Tensor | None = None
        self._sums_absmax = [0.0, 0.0]  # max |sum| per group (derived, not saved)
        if self.config.send_differences:
            self._sums = torch.zeros(2, self.dim, dtype=torch.float64, device=self.device)

    def make_recipe(self) -> Recipe:
        """The shared recipe plus the projection settings."""
        cfg = self.config
        return cfg.recipe(projection=cfg.projection_mode, only_conflicting=cfg.only_conflicting)

    def _job_tensors(self, client_id: str) -> dict[str, torch.Tensor]:
        """The current weights and, with a projection, the other group's basis (spec G1)."""
        tensors = {"weights": self._model}
        if self.config.projection_mode is not ProjectionMode.NONE:
            other = STRAGGLER if self._group[client_id] == ACTIVE else ACTIVE
            tensors["basis"] = self._bases[other]
        return tensors

    def _check(self, update: Update, job: Job, staleness: int, now: float) -> None:
        if self.config.send_differences and update.kind is not UpdateKind.DELTA:
            raise InvalidUpdate(
                "this server runs Fed-OGD with send_differences: upload a DELTA holding your "
                "job delta minus your previous job delta, not WEIGHTS"
            )

    def _has_cache(self) -> bool:
        return not self.config.send_differences

    def _add_row(self, client_id: str) -> None:
        if not self.config.send_differences:
            super()._add_row(client_id)
            return
        self._row[client_id] = len(self._row)  # bookkeeping only: no cache row
        self._valid.append(False)
        self._base_version.append(-1)
        self._row_absmax.append(0.0)

    def _sums_both_bases(self) -> bool:
        return self.config.aggregation != "uniform_mean"

    def _prepare(self, update: Update, job: Job) -> float:
        if self._sums is None:
            return super()._prepare(update, job)
        # Σ_group + Δb_k with Δb_k = -(delta_t - delta_{t-1}) / lr (spec 2.14, corrected G9),
        # in a float64 scratch row; a basis is this sum over the group's count (>= 1).
        if self._candidate is None or self._candidate.dtype != torch.float64:
            self._candidate = torch.empty(self.dim, dtype=torch.float64, device=self.device)
        g = self._group[update.client_id]
        torch.add(self._sums[g], update.tensor, alpha=-1.0 / job.recipe.learning_rate,
                  out=self._candidate)  # fmt: skip
        return self._checked_absmax(self._candidate, "the group's running sum")

    def _bound_with(self, client_id: str, absmax: float) -> float:
        if self._sums is None:
            return super()._bound_with(client_id, absmax)
        g = self._group[client_id]
        others = [self._sums_absmax[h] for h in (ACTIVE, STRAGGLER) if h != g]
        return max([absmax, *others]) if self._sums_both_bases() else absmax + sum(others)

    def _ingest(self, update: Update, job: Job) -> None:
        if self._sums is None:
            super()._ingest(update, job)
            return
        assert self._candidate is not None
        g = self._group[update.client_id]
        self._sums[g].copy_(self._candidate)
        self._sums_absmax[g] = self._candidate_absmax

    def _means(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new bases [2, D] and, for uniform_mean, the mean over all counted rows."""
        cfg = self.config
        uniform = cfg.aggregation == "uniform_mean"
        if self._sums is not None:
            counts = [0, 0]
            for cid, row in self._row.items():
                if self._valid[row] or cfg.count_empty_rows:
                    counts[self._group[cid]] += 1
            scale = torch.tensor([1.0 / c if c else 0.0 for c in counts], dtype=torch.float64)
            bases = (self._sums * scale.to(self.device).unsqueeze(1)).to(torch.float32)
            mean = None
            if uniform:
                total = counts[0] + counts[1]
                mean = self._sums.sum(0).mul_(1.0 / total if total else 0.0).to(torch.float32)
            return bases, mean
        n = len(self._row)
        bases = torch.empty(2, self.dim, dtype=torch.float32, device=self.device)
        self._cache.group_means(n, self._row_groups(), 2, out=bases)
        mean = None
        if uniform:
            mean = self._cache.group_means(n, self._row_groups(merged=True), 1)[0]
        return bases, mean

    def _step(self) -> torch.Tensor:
        """Spec 2.4 S5-S7: new bases (a fresh snapshot) and ``w - server_lr * Δ``."""
        bases, mean = self._means()
        self._bases = bases
        lr = self.config.effective_server_lr
        new = self._new_model_buffer().copy_(self._model)
        if mean is None:  # group_sum: Δ = b_A + b_S
            kernels.weighted_sum(bases, [1.0, 1.0], out=new, alpha=-lr, beta=1.0)
        else:
            kernels.weighted_sum(mean.unsqueeze(0), [1.0], out=new, alpha=-lr, beta=1.0)
        if logger.isEnabledFor(logging.DEBUG):
            cos = torch.nn.functional.cosine_similarity(bases[0], bases[1], dim=0)
            logger.debug("%s: cos(b_A, b_S) = %.4f", self.name, float(cos))
        return new

    def _extra_state(self) -> dict[str, Any]:
        state = super()._extra_state()
        state["sums"] = self._sums
        return state

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        super()._load_extra_state(state)
        sums = state["sums"]
        if (sums is None) != (self._sums is None):
            raise ValueError("saved state and config disagree about send_differences")
        if sums is not None:
            self._sums = sums.to(device=self.device, dtype=torch.float64, copy=True)
            self._sums_absmax = [self._checked_absmax(self._sums[g], "a saved sum") for g in (0, 1)]
