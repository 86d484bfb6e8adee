"""The Strategy protocol of docs/design.md "Strategies" (the value types, errors, ledger and config
it uses live in aggsrv.values and the modules beside this one, and are re-exported here).

A strategy owns its state (device tensors, jobs it handed out, an RNG, the update ledger) and is
driven from one aggregation loop only, so it takes no locks. It reads time only from the ``now``
argument (seconds on the server's or the simulator's clock) and never imports gRPC.

Conventions every strategy here follows (the server is written against them):

* **Versions and snapshots.** ``version`` starts at 0 and grows by one whenever the global model
  changes. :meth:`Strategy.global_model` returns the [D] tensor of the current version; a strategy
  never writes into a tensor once it was published as a version (it builds the next version in a
  fresh tensor and swaps the reference), so the server may stream a snapshot to readers without
  copying or locking. A version may share its tensor with the previous one when nothing changed.
* **Jobs.** A client has at most one outstanding job. :meth:`Strategy.job_for` hands the same job
  again while the version it started from is still current (a reconnecting client gets the same
  job id), and otherwise issues a fresh job that supersedes the old one: an update for a
  superseded job is refused with :class:`JobSuperseded`. ``Job.tensors`` are shared read-only
  snapshots; each outstanding job holds a lease on them (the strategy derives deltas and client
  weights from them), given up when the job ends.
* **Leases.** A retired version's buffer is reused for a later one
  (:mod:`aggsrv.strategies.buffers`) once no lease on it is held, whoever still refers to it:
  whatever reads a version tensor after the call that handed it out returns (a stream, a host
  copy, a retained snapshot, a client that keeps its job) holds :meth:`Strategy.lease` on it.
* **Updates.** ``Update.tensor`` is a view of the server's validated staging slot, which is
  reused after :meth:`Strategy.on_update` returns: a strategy copies what it keeps.
* **Staleness** ``s = version - job.base_version`` at arrival: the version the update is applied
  to (a buffered update is folded into the current model when its buffer flushes).
  ``max_staleness`` refuses ``s > max_staleness`` with :class:`TooStale`.
* **Refusals.** Everything that can make an update fail is checked before any state changes, so a
  refused update leaves :meth:`Strategy.state_dict` bit-identical. Errors subclass
  :class:`StrategyError` and carry the gRPC status name the server maps them to.
* **Update filters.** A config with ``update_filter`` (the strategies that take one update at a
  time; :mod:`aggsrv.strategies.update_filters`) screens each update that passed every check:
  a refused one consumes its job and is answered ``FILTERED(version, reason)`` (recorded in the
  ledger, nothing else of the strategy changes); a clipped one is folded in as a DELTA holding
  the clipped delta. The filters' state is part of the state dict.
* **Duplicates.** :class:`UpdateLedger` remembers the outcome of the last 1,024 accepted updates
  of each client (FILTERED ones too). :meth:`Strategy.on_update` answers a replayed update id with
  ``DUPLICATE(original)`` without applying it again; the server may also consult
  ``strategy.ledger`` as soon as an update's header arrives and skip receiving the payload. The
  ledger is part of the strategy's state dict, so it survives checkpoints.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import math
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from aggsrv.finite import count_non_finite
from aggsrv.layout import ModelLayout
from aggsrv.sharding import LocalReducer, Reducer
from aggsrv.strategies.buffers import Lease, VersionBuffers
from aggsrv.strategies.config import (
    DEFAULT_JOB_LEASE_SECONDS,
    DEFAULT_MAX_NUM_SAMPLES,
    StrategyConfig,
)
from aggsrv.strategies.errors import (
    InvalidUpdate,
    JobSuperseded,
    NonFiniteResult,
    NonFiniteUpdate,
    NotRegistered,
    ShardsDisagree,
    StrategyError,
    TooManyClients,
    TooManySamples,
    TooStale,
    UpdateNormTooLarge,
)
from aggsrv.strategies.float_buffers import FloatBuffers
from aggsrv.strategies.job import Job
from aggsrv.strategies.ledger import LEDGER_SIZE, UpdateLedger
from aggsrv.strategies.privacy import GaussianPrivacy, PrivacyConfig
from aggsrv.strategies.state_copy import SharedCopies, clone_tensors, restore_tensor
from aggsrv.strategies.update_filters import Screening, UpdateFilters
from aggsrv.values import (
    Outcome,
    PendingReason,
    ProjectionMode,
    Recipe,
    Status,
    Update,
    UpdateKind,
)

__all__ = [
    "DEFAULT_JOB_LEASE_SECONDS",
    "DEFAULT_MAX_NUM_SAMPLES",
    "FLOAT32_SAFE_MAX",
    "LEDGER_SIZE",
    "InvalidUpdate",
    "Job",
    "JobSuperseded",
    "NonFiniteResult",
    "NonFiniteUpdate",
    "NotRegistered",
    "Outcome",
    "ProjectionMode",
    "PendingReason",
    "Recipe",
    "ShardsDisagree",
    "Status",
    "Strategy",
    "StrategyConfig",
    "StrategyError",
    "TooManyClients",
    "TooManySamples",
    "TooStale",
    "Update",
    "UpdateKind",
    "UpdateLedger",
    "UpdateNormTooLarge",
]

logger = logging.getLogger(__name__)

# What a client whose update held NaN/Inf reads under differential privacy (its answer's
# message; the update is clipped to zero instead of refused).
NON_FINITE_CLIPPED = (
    "the update's delta held NaN/Inf: under differential privacy it was clipped to zero (clip "
    "factor min(1, C/inf) = 0) and taken, so it moved nothing; check the client's training"
)

# Below float32's largest value by a margin for the rounding of the arithmetic that a bound on a
# step's reach stands for (strategies refuse an update whose step could reach past it).
FLOAT32_SAFE_MAX = float(torch.finfo(torch.float32).max) * (1.0 - 1e-3)


class Strategy(ABC):
    """Base class of every aggregation strategy: jobs, validation, ledger, snapshots, state.

    Subclasses set ``name`` and ``config_class`` and implement :meth:`_apply` (fold one accepted
    update in); they may override :meth:`job_for`, :meth:`_check` (extra refusals, no state
    change), :meth:`on_register`, :meth:`next_deadline`, :meth:`on_timer` and the
    ``_extra_state``/``_load_extra_state`` pair.
    """

    name: ClassVar[str] = "base"
    config_class: ClassVar[type[StrategyConfig]] = StrategyConfig
    # How clients' float buffers (BatchNorm statistics) fold into the global ones: see
    # aggsrv/strategies/float_buffers.py. "mean" strategies call self.float_buffers.add().
    buffer_rule: ClassVar[str] = "mean"

    def __init__(
        self,
        layout: ModelLayout,
        initial: torch.Tensor,
        config: StrategyConfig | Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        max_clients: int = 1024,
        initial_buffers: torch.Tensor | None = None,
        reducer: Reducer | None = None,
    ) -> None:
        """Start at version 0 from ``initial`` ([D], copied to float32 on ``device``) and, when
        the layout has float buffers, ``initial_buffers`` ([B]).

        On a shard of a sharded server (docs/sharding.md) ``layout`` is the shard's
        :class:`~aggsrv.sharding.ShardLayout`, ``initial`` its slice, and ``reducer`` sums
        partial results over the shards, so every shard takes the same decisions."""
        if isinstance(config, StrategyConfig):
            if not isinstance(config, self.config_class):
                raise TypeError(
                    f"{self.name} needs a {self.config_class.__name__}, got {type(config).__name__}"
                )
            self.config = config
        else:
            self.config = self.config_class.from_dict(config)
        if initial.dim() != 1 or initial.numel() != layout.numel:
            raise ValueError(
                f"initial must be a flat [{layout.numel}] tensor for this layout, "
                f"got shape {tuple(initial.shape)}"
            )
        if max_clients < 1:
            raise ValueError(f"max_clients must be >= 1, got {max_clients}")
        self.layout = layout
        self.max_clients = max_clients
        dev = torch.device(device) if device is not None else initial.device
        self._model = initial.detach().to(device=dev, dtype=torch.float32, copy=True)
        self.device = self._model.device  # normalised ("cuda" -> "cuda:0") for comparisons
        self.version = 0
        self._versions = VersionBuffers(layout.numel, self.device)
        self.float_buffers = FloatBuffers(
            initial_buffers, layout.buffer_numel, self.device, self.buffer_rule
        )
        # Elements that are variances (BatchNorm running_var): a negative one is refused.
        self._variance_index = torch.cat(
            [
                torch.arange(s.offset, s.end, device=self.device)
                for s in layout.buffer_specs
                if s.name.rpartition(".")[2] == "running_var"
            ]
            or [torch.zeros(0, dtype=torch.int64, device=self.device)]
        )
        # (version, max |x|): the version number, not the tensor, so no old version is kept.
        self._absmax: tuple[int, float] | None = None
        self.ledger = UpdateLedger()
        self._clients: dict[str, float] = {}  # client id -> registration time, in join order
        self._jobs: dict[int, Job] = {}  # outstanding jobs by id
        # Each outstanding job's lease on its tensors (their buffers are not reused meanwhile).
        self._job_leases: dict[int, Lease] = {}
        self._job_of: dict[str, int] = {}  # client id -> its outstanding job id
        # client id -> id of the last job whose update was accepted (for Heartbeat's COMPLETED)
        self._completed_job: dict[str, int] = {}
        self._next_job_id = 1
        self._now = 0.0  # the latest time a call brought (jobs issued without one take it)
        # Why the last job_for returned None (read right after it, on the same thread: the
        # server tells the client; not part of the state).
        self.pending_reason = PendingReason.UNSPECIFIED
        self._rng = torch.Generator(device="cpu")
        self._rng.manual_seed(int(self.config.seed))
        self._recipe = self.make_recipe()
        # Receives the strategy's events (FedDGIC's groupings, ...) as JSON-ready dicts: the
        # server and the simulator point it at their events.jsonl. Not part of the state.
        self.event_sink: Callable[[dict[str, Any]], None] | None = None
        self.reducer: Reducer = reducer if reducer is not None else LocalReducer()
        # What kernels get as reduce=: None on one server keeps their single-pass results.
        self.reduce = self.reducer.sum_ if self.reducer.world_size > 1 else None
        # The config's update_filter chain (only the configs of FilteredConfig have the key).
        text = getattr(self.config, "update_filter", None)
        self.update_filters = UpdateFilters(text, self.dim, self.device) if text else None
        # Differential privacy (the configs of DP_STRATEGIES have the dp_ keys).
        whole_offsets = getattr(layout, "whole", layout).offsets
        self.privacy = (
            GaussianPrivacy(
                self.config,
                self.dim,
                self.device,
                self.reducer.rank,
                self.reduce,
                layer_sizes=torch.diff(whole_offsets).tolist(),
            )  # fmt: skip
            if isinstance(self.config, PrivacyConfig) and self.config.private
            else None
        )
        self._layer_segments: list[slice] | None = None  # per-layer clipping's, made once
        self._dp_scratch: torch.Tensor | None = None  # differential privacy's delta buffer
        if self.privacy is not None and layout.buffer_numel:
            raise ValueError(
                f"differential privacy covers the model's weights, and this model has "
                f"{layout.buffer_numel} float buffer values (BatchNorm statistics) that would "
                "be published without noise: use a model without running statistics "
                "(GroupNorm or LayerNorm instead of BatchNorm) with the dp_ keys"
            )

    # --------------------------------------------------------------------------- public API

    def delta_norm(self, update: Update, job: Job) -> float:
        """The L2 norm (float64) of the update's delta, client weights minus the job's start
        weights (on a shard the whole model's, summed over the shards); chunk by chunk for a
        WEIGHTS update, so no [D] temporary."""
        if update.kind is UpdateKind.DELTA:
            return self.whole_norm(update.tensor, update.non_finite)
        u, w, step = update.tensor, job.weights, 1 << 18
        sq = sum(
            float((u[i : i + step].double() - w[i : i + step]).square().sum())
            for i in range(0, self.dim, step)
        )
        if self.reduce is not None:
            sq = float(self.reduce(torch.tensor([sq], dtype=torch.float64)))
        return math.sqrt(sq)

    def whole_norm(self, t: torch.Tensor, non_finite: bool = False) -> float:
        """The L2 norm (float64) of the whole-model vector whose slice ``t`` is: on one server
        ``t``'s own norm; on a shard the root of the squared norms summed over the shards.
        ``non_finite``: ``t`` stands for a slice that held NaN/Inf (differential privacy's
        zero delta, :meth:`_private_delta`): its square counts as infinite, so every shard
        finds the whole norm infinite."""
        if self.reduce is None:
            return (
                math.inf if non_finite else float(torch.linalg.vector_norm(t, dtype=torch.float64))
            )
        sq = torch.linalg.vector_norm(t, dtype=torch.float64).square().reshape(1)
        if non_finite:
            sq.fill_(math.inf)
        return float(self.reduce(sq).sqrt())

    @property
    def dim(self) -> int:
        """D, the length of the flat model."""
        return self._model.numel()

    @property
    def clients(self) -> tuple[str, ...]:
        """Registered client ids in the order they joined."""
        return tuple(self._clients)

    def global_model(self) -> torch.Tensor:
        """The current version's [D] weights: an immutable snapshot, never written again."""
        return self._model

    def global_buffers(self) -> torch.Tensor | None:
        """The current version's [B] float buffers (immutable snapshot), None without any."""
        return self.float_buffers.current

    def make_recipe(self) -> Recipe:
        """The recipe this strategy's jobs carry (FedProx adds its proximal term)."""
        return self.config.recipe()

    def on_register(self, client_id: str, now: float) -> None:
        """A client joined; registering again is a no-op."""
        self._now = float(now)
        if client_id in self._clients:
            return
        if len(self._clients) >= self.max_clients:
            raise TooManyClients(
                f"cannot register client {client_id!r}: the server holds max_clients="
                f"{self.max_clients} clients already; raise max_clients in the server config"
            )
        self._clients[client_id] = float(now)
        logger.debug("%s: client %s registered at %.3f", self.name, client_id, now)

    def job_for(self, client_id: str, now: float) -> Job | None:
        """The client's next job (default: always one, from the current version)."""
        self._require_registered(client_id)
        return self._issue_job(client_id, deadline=None, now=now)

    def on_update(self, update: Update, now: float) -> Outcome:
        """Fold one validated update in, or refuse it without changing any state.

        A replayed update id returns DUPLICATE with the original outcome and changes nothing.
        """
        prior = self.ledger.lookup(update.client_id, update.update_id)
        try:
            if prior is None:
                self._require_privacy_budget()
                job = self._validate(update)
                self._require_leased(job, now)
                s = self.version - job.base_version
                self._check(update, job, s, now)
        except StrategyError:
            self._agree_on_update(prior is not None, refused=True)
            raise
        self._agree_on_update(prior is not None, refused=False)
        if prior is not None:
            return Outcome(
                Status.DUPLICATE, prior.version, original=prior.status, staleness=prior.staleness,
                reason=prior.reason, detail=prior.detail,
            )  # fmt: skip
        screening = None
        if self.update_filters is not None:
            screening = self.update_filters.screen(update, job, self.delta_norm, self.whole_norm)
            if screening.refusal is not None:
                return self._filter_out(update, job, s, now, screening)
            update = screening.update
        clipped_before = self.privacy.clipped if self.privacy is not None else 0
        zeroed = False
        if self.privacy is not None:
            update = self._private_delta(update, job)
            zeroed = update.non_finite
            if self.privacy.layer_bounds is not None:
                update = self._clipped_per_layer(update, job)
        # The job's start weights are read while the next version is written: held until then
        # (retiring the job gives up its own lease).
        with self._versions.lease(*job.tensors.values()):
            self._retire_job(job)
            try:
                outcome = self._apply(update, job, s, now)
            except StrategyError:
                # _apply refuses only before its first change of state (see _require_finite),
                # so reopening the job restores the state exactly.
                self._reopen_job(job)
                self.float_buffers.discard()
                raise
        outcome = dataclasses.replace(outcome, staleness=s)
        if self.privacy is not None and self.privacy.clipped > clipped_before:
            # DP clipped it: the client hears so in its own answer (nobody else does).
            outcome = dataclasses.replace(outcome, clipped=True)
        if zeroed:
            outcome = dataclasses.replace(outcome, clipped=True, detail=NON_FINITE_CLIPPED)
        if screening is not None:
            assert self.update_filters is not None
            self.update_filters.commit(screening)
            outcome = dataclasses.replace(outcome, clipped=screening.clipped)
        self._now = float(now)
        self.ledger.record(update.client_id, update.update_id, outcome)
        self._completed_job[update.client_id] = job.job_id
        return outcome

    def _filter_out(
        self, update: Update, job: Job, staleness: int, now: float, screening: Screening
    ) -> Outcome:
        """An update the filters refused: its job is consumed (the client asks for a new one)
        and the answer, FILTERED(current version, reason), is remembered like an accepted
        update's; the model and the strategy's own state stay as they were."""
        assert self.update_filters is not None and screening.refusal is not None
        reason, detail = screening.refusal
        self._retire_job(job)
        self.update_filters.count_refusal(screening)
        outcome = Outcome(
            Status.FILTERED, self.version, staleness=staleness, reason=reason, detail=detail
        )
        self._now = float(now)
        self.ledger.record(update.client_id, update.update_id, outcome)
        self._completed_job[update.client_id] = job.job_id
        logger.info(
            "%s: update %s of %s filtered (%s): %s", self.name, update.update_id,
            update.client_id, reason.name, detail,
        )  # fmt: skip
        return outcome

    def _agree_on_update(self, duplicate: bool, refused: bool) -> None:
        """On a sharded server, check that every shard took the same branch for this update
        (a duplicate, refused, or to be applied) before the collectives that applying it makes:
        a shard whose state drifted would otherwise wait in a collective the others never
        enter. Shards that disagree raise ShardsDisagree (not a refusal: the federation stops)."""
        if self.reduce is None:
            return
        world, rank = self.reducer.world_size, self.reducer.rank
        # One slot per shard (0: applies it, 1: a duplicate, 2: refuses it), summed.
        branch = torch.zeros(world, dtype=torch.float64)
        branch[rank] = 2.0 if refused else float(duplicate)
        seen = [int(b) for b in self.reduce(branch).tolist()]
        if len(set(seen)) > 1:
            said = ("made it", "found it a duplicate", "refused it")
            raise ShardsDisagree(", ".join(f"rank {r} {said[b]}" for r, b in enumerate(seen)))

    def buffer_fill(self) -> tuple[int, int] | None:
        """(updates waiting in the buffer, the buffer's size) for a strategy that steps once
        its buffer is full (FedBuff, CA2FL, FedHist); None for the others. For the metrics."""
        buffered = getattr(self, "buffered", None)
        size = getattr(self.config, "buffer_size", None)
        if isinstance(buffered, int) and isinstance(size, int):
            return buffered, size
        return None

    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` wants to be called next (None: no timer): the strategy's own
        deadline (:meth:`_next_deadline`) or the first job lease to end, whichever is first."""
        own = self._next_deadline()
        expiry = self._next_expiry()
        if own is None or expiry is None:
            return own if expiry is None else expiry
        return min(own, expiry)

    def on_timer(self, now: float) -> None:
        """Retire the jobs whose lease ended by ``now``, then handle the strategy's own
        deadlines (:meth:`_on_timer`)."""
        self._now = float(now)
        self._expire_jobs(now)
        self._on_timer(now)

    def _next_deadline(self) -> float | None:
        """When the strategy's own timer is due (rounds, epochs; default: never)."""
        return None

    def _on_timer(self, now: float) -> None:
        """The strategy's own deadlines that passed by ``now`` (default: nothing)."""
        return None

    def staleness(self, job: Job) -> int:
        """``s = version - job.base_version`` if the job's update arrived now."""
        return self.version - job.base_version

    def outstanding_job(self, client_id: str) -> Job | None:
        """The client's outstanding job, if any."""
        job_id = self._job_of.get(client_id)
        return None if job_id is None else self._jobs[job_id]

    def job_state(self, client_id: str, job_id: int) -> str:
        """What became of ``job_id`` for ``client_id``: "current", "completed" (its update was
        accepted; the last such job per client is remembered), "superseded" (issued by this
        server, no longer open) or "unknown" (never issued, or another client's open job)."""
        job = self._jobs.get(job_id)
        if job is not None:
            return "current" if job.client_id == client_id else "unknown"
        if self._completed_job.get(client_id) == job_id:
            return "completed"
        if 1 <= job_id < self._next_job_id:
            return "superseded"
        return "unknown"

    def open_job(self, client_id: str, job_id: int) -> Job | None:
        """Job ``job_id`` if it is ``client_id``'s and still open (a shard serves its slice)."""
        job = self._jobs.get(job_id)
        return job if job is not None and job.client_id == client_id else None

    @property
    def jobs_issued(self) -> int:
        """How many jobs this strategy has issued (job ids are 1 to this number)."""
        return self._next_job_id - 1

    def check_data(self, update: Update) -> None:
        """The refusals that depend on the update's numbers rather than the strategy's state
        (InvalidUpdate), so that each shard of a sharded server can check its own slice before
        the shards vote; a replayed update id is not checked (it will be DUPLICATE)."""
        if self.ledger.lookup(update.client_id, update.update_id) is None:
            self._validate_numbers(update)

    # --------------------------------------------------------------------------- helpers

    def client_delta(
        self, update: Update, job: Job, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The update as client weights minus the job's start weights (into ``out`` if given).

        Without ``out`` a DELTA update returns the staging slot itself: read it before returning.
        """
        if update.kind is UpdateKind.DELTA:
            return update.tensor if out is None else out.copy_(update.tensor)
        return torch.sub(update.tensor, job.weights, out=out)

    def client_weights(
        self, update: Update, job: Job, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The client's final weights (start weights plus delta for a DELTA update)."""
        if update.kind is UpdateKind.WEIGHTS:
            return update.tensor if out is None else out.copy_(update.tensor)
        return torch.add(job.weights, update.tensor, out=out)

    def _new_model_buffer(self) -> torch.Tensor:
        """An uninitialised [D] float32 tensor for the next version: a retired version's memory
        once no lease on it is held (a job, a snapshot, a stream), else a new allocation."""
        return self._versions.take()

    def lease(self, *tensors: torch.Tensor | None) -> Lease:
        """Hold version tensors (the model, a job's, or views of them) against reuse until the
        lease is released: what a reader that outlives the call it got them from must do. Take
        it on the aggregation thread, or while holding another lease on the same tensors."""
        return self._versions.lease(*tensors)

    def _publish(self, model: torch.Tensor) -> int:
        """Make ``model`` (a tensor nobody writes again) the next version; return the version.

        A non-finite ``model`` (or pending float buffers) is refused with NonFiniteResult and
        nothing is published: call it before any other change of state, or check the candidate
        first with :meth:`_require_finite`."""
        if model is not self._model:
            self._check_version(model)
        pending = self.float_buffers.pending
        if pending is not None:
            self._require_finite(pending, "the next version of the float buffers")
        if model is not self._model:
            self._versions.retire(self._model)
        self._model = model
        self.float_buffers.commit()
        self.version += 1
        return self.version

    @contextlib.contextmanager
    def _noise_for_release(self, extra: int = 0) -> Iterator[torch.Tensor | None]:
        """Differential privacy's noise for the version about to be published, made of the
        contributions gathered and ``extra`` more: a [D] draw of N(0, (z C)^2) to add to the
        clipped sum before the strategy scales it (None without DP or noise). A release refused
        inside the block (its model would not be finite) has spent its draw: the next one is
        fresh, since the refusal, which everyone sees, depended on that draw."""
        privacy = self.privacy
        if privacy is None or privacy.noise_multiplier == 0:
            yield None
            return
        yield privacy.noise(extra)

    def _clipped_per_layer(self, update: Update, job: Job) -> Update:
        """Differential privacy's per-layer clipping (``dp_clip_layers``): the update's delta
        with each layout tensor scaled to its own bound (their squares add up to C^2, so the
        whole delta stays within C), as a DELTA update in a scratch buffer. One read and one
        write of D more than whole-model clipping, which folds its factor into the strategy's
        accumulate. Per-layer norms are the whole model's on a sharded server."""
        privacy = self.privacy
        assert privacy is not None and privacy.layer_bounds is not None
        out = privacy.layer_scratch()
        if self._layer_segments is None:  # this strategy's slice of each layout tensor
            bounds = self.layout.offsets.tolist()
            self._layer_segments = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        segments = self._layer_segments
        squares = torch.zeros(len(segments), dtype=torch.float64)
        for i, seg in enumerate(segments):
            part = out[seg]
            if update.kind is UpdateKind.WEIGHTS:
                torch.sub(update.tensor[seg], job.weights[seg], out=part)
            else:
                part.copy_(update.tensor[seg])
            squares[i] = torch.linalg.vector_norm(part, dtype=torch.float64) ** 2
        if update.non_finite:  # NaN/Inf somewhere (on some shard): every layer's factor is 0
            squares.fill_(math.inf)
        if self.reduce is not None:
            squares = self.reduce(squares)
        whole = squares.tolist()
        factors = privacy.layer_factors(whole)
        for seg, f in zip(segments, factors, strict=True):
            if f != 1.0:
                out[seg].mul_(f)
        norm = math.sqrt(sum(f * f * q for f, q in zip(factors, whole, strict=True) if f))
        return dataclasses.replace(
            update, kind=UpdateKind.DELTA, tensor=out, norm=norm, non_finite=False
        )

    def _clip_factor(self, update: Update, job: Job, delta: torch.Tensor | None = None) -> float:
        """Differential privacy's ``min(1, C / |delta|)`` for this update: with the norm the
        decoder computed for a DELTA upload (:attr:`Update.norm`, float64) on one server, else
        the whole model's norm of ``delta`` (the update's delta, when the caller has built it
        already) or of the delta computed here."""
        assert self.privacy is not None
        norm = update.norm if update.kind is UpdateKind.DELTA and self.reduce is None else None
        if norm is None:
            norm = (
                self.whole_norm(delta, update.non_finite)
                if delta is not None
                else self.delta_norm(update, job)
            )
        return self.privacy.clip_factor(norm)

    def _private_delta(self, update: Update, job: Job) -> Update:
        """Differential privacy's form of an accepted update: its delta, as a DELTA update. A
        WEIGHTS update's delta (client weights minus the job's, float32) is computed here,
        once, into a buffer of the strategy's. A delta holding NaN/Inf (sent so, or finite
        weights whose difference overflows float32) counts as clipped to zero, its clip factor
        ``min(1, C / inf)`` being 0: it becomes a zero delta of norm inf (``non_finite``), so
        the version is published as it would be for the zero-out neighbour (that client's
        update all zeros) and the client alone is told (:data:`NON_FINITE_CLIPPED`). Refusing
        it instead would tell everyone, by the version that then does not appear, that its
        values were not finite. The finiteness comes from the delta's float64 norm (the
        decoder's for a DELTA upload, else one pass that clipping then reuses): finite only
        when every value is; on a shard, this slice's (the whole norm is summed again)."""
        if update.kind is UpdateKind.WEIGHTS:
            delta = self._private_scratch()
            torch.sub(update.tensor, job.weights, out=delta)
            update = dataclasses.replace(update, kind=UpdateKind.DELTA, tensor=delta, norm=None)
        norm = update.norm
        if norm is None:
            norm = float(torch.linalg.vector_norm(update.tensor, dtype=torch.float64))
            if self.reduce is None:
                update = dataclasses.replace(update, norm=norm)
        if math.isfinite(norm):
            return update
        zero = self._private_scratch().zero_()
        return dataclasses.replace(update, tensor=zero, norm=math.inf, non_finite=True)

    def _private_scratch(self) -> torch.Tensor:
        """The [D] float32 buffer :meth:`_private_delta` writes a delta into (one per strategy,
        made on first use: only WEIGHTS and NaN/Inf updates under DP need it)."""
        if self._dp_scratch is None:
            self._dp_scratch = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        return self._dp_scratch

    def _stepped_version(
        self, total: Callable[[slice], torch.Tensor], step: float, extra: int = 0
    ) -> torch.Tensor:
        """The checked next version ``x + step * (total + noise)`` of a buffered strategy,
        chunk by chunk: ``total(s)`` is its float64 sum over elements ``s`` (a fresh tensor it
        may change), rounded once to float32; the noise is differential privacy's for a
        release of the gathered contributions and ``extra`` more (none without DP). Nothing
        of the state changes (a refused release's noise draw is spent)."""
        with self._noise_for_release(extra) as noise:
            new = self._new_model_buffer()
            for start in range(0, self.dim, 1 << 18):
                s = slice(start, min(start + (1 << 18), self.dim))
                summed = total(s)
                if noise is not None:
                    summed.add_(noise[s])
                torch.add(self._model[s], summed, alpha=step, out=new[s])
            self._check_version(new)
        return new

    def _released(self) -> None:
        """A version was published: the accountant spends the contributions it held (and
        adaptive clipping moves C)."""
        if self.privacy is not None:
            self.privacy.released()

    def _require_privacy_budget(self) -> None:
        """Refuse (PrivacyBudgetSpent) once the privacy budget stopped the publications."""
        if self.privacy is not None:
            self.privacy.require_open()

    def model_absmax(self) -> float:
        """max |x| over the current version (cached per version), for strategies that bound
        what a step can reach instead of computing it; on a sharded server the sum of the
        shards' maxima (a bound every shard computes alike)."""
        cached = self._absmax
        if cached is not None and cached[0] == self.version:
            return cached[1]
        lo, hi = torch.aminmax(self._model) if self.dim else (torch.zeros(()), torch.zeros(()))
        value = max(-float(lo), float(hi))
        if self.reduce is not None:
            value = float(self.reduce(torch.tensor([value], dtype=torch.float64)))
        self._absmax = (self.version, value)
        return value

    def _checked_absmax(self, t: torch.Tensor, what: str) -> float:
        """max |t| (NonFiniteResult if ``t`` holds NaN/Inf), the way :meth:`model_absmax`
        measures: on a sharded server the sum of the shards' maxima, so every shard decides
        alike."""
        lo, hi = torch.aminmax(t) if t.numel() else (torch.zeros(()), torch.zeros(()))
        value = max(-float(lo), float(hi))  # NaN in, NaN out; Inf in, Inf out
        if self.reduce is not None:
            value = float(self.reduce(torch.tensor([value], dtype=torch.float64)))
        if not math.isfinite(value):
            raise NonFiniteResult(
                f"applying this update would make {what} non-finite (NaN/Inf: a float32 "
                "overflow); it was refused and nothing changed. Send a smaller update."
            )
        return value

    def _require_reach(self, reach: float, what: str) -> None:
        """Refuse (NonFiniteResult) when a bound on the values a step could produce is past
        float32's range (:data:`FLOAT32_SAFE_MAX`)."""
        if not reach < FLOAT32_SAFE_MAX:
            raise NonFiniteResult(
                f"with this update {what} could reach {reach:.3g}, past float32's range; it "
                "was refused and nothing changed. Send a smaller update."
            )

    def _check_version(self, model: torch.Tensor) -> None:
        """Refuse (NonFiniteResult) a candidate next version that is not finite, handing its
        buffer back to the pool."""
        try:
            self._require_finite(model, "the next version of the model")
        except NonFiniteResult:
            self._versions.retire(model)
            raise

    def _require_finite(self, t: torch.Tensor, what: str) -> None:
        """Refuse the update being applied (NonFiniteResult) unless every element of ``t`` is
        finite. On a sharded server the shards agree (one all_reduce), so they refuse together.

        The rule every strategy here follows: before its first change of state, ``_apply``
        checks each value it is about to keep (a new cache row, a running sum, a version) and
        the model it would publish if its aggregation ran now, so an aggregation that a later
        update or timer triggers publishes a value that was checked already."""
        bad = count_non_finite(t)
        if self.reduce is not None:
            bad = int(self.reduce(torch.tensor([float(bad)], dtype=torch.float64)).item())
        if bad:
            raise NonFiniteResult(
                f"applying this update would make {what} non-finite ({bad} NaN/Inf values: a "
                "float32 overflow); it was refused and nothing changed. Send a smaller update."
            )

    def _require_finite_chunks(
        self, compute: Callable[[slice], torch.Tensor], what: str, chunk: int = 1 << 18
    ) -> None:
        """:meth:`_require_finite` of a [D] value given chunk by chunk (``compute(s)`` returns
        the elements ``s`` of the value), so a candidate is checked without a [D] temporary.

        Each chunk's float32 sum stays on the device (one synchronisation in all, not one per
        chunk); a chunk whose sum is not finite is computed again and counted exactly (a sum of
        finite values can overflow)."""
        parts = [slice(start, min(start + chunk, self.dim)) for start in range(0, self.dim, chunk)]
        sums = torch.zeros(len(parts), dtype=torch.float32, device=self.device)
        for i, part in enumerate(parts):
            sums[i] = compute(part).sum()
        suspects = (~torch.isfinite(sums)).nonzero().flatten().tolist()
        bad = sum(count_non_finite(compute(parts[i])) for i in suspects)
        if self.reduce is None:
            if bad:
                raise NonFiniteResult(
                    f"applying this update would make {what} non-finite ({bad} NaN/Inf "
                    "values: a float32 overflow); it was refused and nothing changed. Send a "
                    "smaller update."
                )
            return
        self._require_finite(torch.full((1,), math.nan if bad else 0.0), what)

    def _emit(self, event: str, now: float, **fields: Any) -> None:
        """Hand an event (plain JSON values) to :attr:`event_sink`, if one is set."""
        if self.event_sink is not None:
            record = {"event": event, "strategy": self.name, "version": self.version}
            record.update(time=float(now), **fields)
            self.event_sink(record)

    def _no_job(self, reason: PendingReason) -> None:
        """``job_for``'s None, saying why (:attr:`pending_reason`)."""
        self.pending_reason = reason

    def _require_registered(self, client_id: str) -> None:
        if client_id not in self._clients:
            raise NotRegistered(
                f"client {client_id!r} is not registered with this server; call Register first"
            )

    def _issue_job(self, client_id: str, deadline: float | None, now: float | None = None) -> Job:
        """The client's outstanding job if it starts from the current version and its lease
        has not ended, else a new one issued at ``now`` (default: the latest time seen).
        PrivacyBudgetSpent once the privacy budget stopped the publications: no more work."""
        self._require_privacy_budget()
        now = self._now if now is None else float(now)
        old = self.outstanding_job(client_id)
        if old is not None and old.base_version == self.version and not self._expired(old, now):
            return old  # nothing changes (the log need not record this call)
        self._now = now
        if old is not None:
            self._retire_job(old)  # superseded: the client asked again, so it dropped the job
        job = Job(
            job_id=self._next_job_id,
            client_id=client_id,
            base_version=self.version,
            deadline=deadline,
            recipe=self._recipe,
            tensors=types.MappingProxyType(self._with_buffers(self._job_tensors(client_id))),
            issued_at=now,
        )
        self._next_job_id += 1
        self._jobs[job.job_id] = job
        self._job_of[client_id] = job.job_id
        self._job_leases[job.job_id] = self._versions.lease(*job.tensors.values())
        return job

    def _job_tensors(self, client_id: str) -> dict[str, torch.Tensor]:
        """Named snapshots a new job carries; "weights" is the current model (shared)."""
        return {"weights": self._model}

    def _with_buffers(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Add the global float buffers as "buffers" unless the strategy chose the job's own
        (ORTHOFL hands a client its own statistics back, docs/algorithms/orthofl.md G6)."""
        current = self.float_buffers.current
        if current is not None:
            tensors.setdefault("buffers", current)
        return tensors

    def _retire_job(self, job: Job) -> None:
        """Forget an outstanding job; its start weights go with the last job referring to them."""
        del self._jobs[job.job_id]
        if self._job_of.get(job.client_id) == job.job_id:
            del self._job_of[job.client_id]
        lease = self._job_leases.pop(job.job_id, None)
        if lease is not None:
            lease.release()

    def _expired(self, job: Job, now: float) -> bool:
        """Whether the job's lease has ended by ``now``."""
        lease = self.config.job_lease_seconds
        return lease is not None and now >= job.issued_at + lease

    def _next_expiry(self) -> float | None:
        """When the first open job's lease ends (jobs are kept in issue order)."""
        lease = self.config.job_lease_seconds
        if lease is None or not self._jobs:
            return None
        return min(job.issued_at for job in self._jobs.values()) + lease

    def _expire_jobs(self, now: float) -> None:
        """Retire every job whose lease has ended by ``now`` (and free what only it held)."""
        expired = [j for j in self._jobs.values() if self._expired(j, now)]
        for job in expired:
            self._retire_job(job)
            logger.info(
                "%s: job %d of %s retired: its lease of %g s ended", self.name, job.job_id,
                job.client_id, self.config.job_lease_seconds,
            )  # fmt: skip

    def _require_leased(self, job: Job, now: float) -> None:
        """Refuse an update whose job's lease ended (the timer may not have retired it yet)."""
        if self._expired(job, now):
            raise JobSuperseded(
                f"job {job.job_id} was issued at {job.issued_at:.3f} and its lease "
                f"(job_lease_seconds={self.config.job_lease_seconds:g}) ended before the update "
                "arrived; discard this update and ask for a new job"
            )

    def _reopen_job(self, job: Job) -> None:
        """Undo :meth:`_retire_job` of the client's current job (an update refused while being
        applied). Both dicts are kept in job-id order (ids only grow), as state_dict lists them."""
        self._jobs[job.job_id] = job
        self._job_of[job.client_id] = job.job_id
        self._job_leases[job.job_id] = self._versions.lease(*job.tensors.values())
        self._jobs = dict(sorted(self._jobs.items()))
        self._job_of = dict(sorted(self._job_of.items(), key=lambda item: item[1]))

    def _validate(self, update: Update) -> Job:
        """Checks every strategy makes before touching state; returns the update's job."""
        self._require_registered(update.client_id)
        t = update.tensor
        if t.dim() != 1 or t.numel() != self.dim or t.dtype != torch.float32:
            raise InvalidUpdate(
                f"update tensor must be flat float32 [{self.dim}], got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != self.device:
            raise InvalidUpdate(f"update tensor is on {t.device}, the strategy on {self.device}")
        if not isinstance(update.kind, UpdateKind):
            raise InvalidUpdate(f"update kind must be WEIGHTS or DELTA, got {update.kind!r}")
        if update.num_samples < 0 or not math.isfinite(update.work_done) or update.work_done < 0:
            raise InvalidUpdate(
                f"num_samples ({update.num_samples}) and work_done ({update.work_done}) must be "
                "finite and >= 0"
            )
        bound = self.config.max_num_samples
        if update.num_samples > bound:
            raise TooManySamples(
                f"num_samples {update.num_samples} is above max_num_samples={bound}: the update "
                "would outweigh the others by a count no client's data reaches; send the number "
                "of examples trained on, or raise max_num_samples in the strategy config"
            )
        self._validate_numbers(update)
        job = self._jobs.get(update.job_id)
        if job is None:
            if 1 <= update.job_id < self._next_job_id:
                raise JobSuperseded(
                    f"job {update.job_id} is no longer open (completed, replaced by a newer job "
                    "for this client, or its round closed); discard this update and ask for a "
                    "new job"
                )
            raise InvalidUpdate(f"job {update.job_id} was never issued by this server")
        if job.client_id != update.client_id:
            raise InvalidUpdate(
                f"job {job.job_id} belongs to client {job.client_id!r}, not {update.client_id!r}"
            )
        if update.base_version != job.base_version:
            raise InvalidUpdate(
                f"update says it started from version {update.base_version}, but job "
                f"{job.job_id} started from version {job.base_version}"
            )
        s = self.version - job.base_version
        bound = self.config.max_staleness
        if bound is not None and s > bound:
            raise TooStale(
                f"update from version {job.base_version} is {s} versions behind the current "
                f"version {self.version} (max_staleness={bound}); ask for a new job"
            )
        self._validate_norm(update, job)
        return job

    def _validate_numbers(self, update: Update) -> None:
        """The update's values: finite (NaN/Inf refused, naming where), and its float buffers.
        Under differential privacy a NaN/Inf delta is not refused but clipped to zero
        (:meth:`_private_delta`), so only the float buffers are checked here (DP refuses models
        with float buffers, so there are none)."""
        if self.privacy is not None:
            self._validate_buffers(update.buffers)
            return
        t = update.tensor
        bad = count_non_finite(t)
        if bad:
            index = int((~torch.isfinite(t)).nonzero()[0])
            raise NonFiniteUpdate(
                f"the update holds {float(t[index])} at {self._locate(index)} ({bad} NaN/Inf "
                "values in all): NaN/Inf updates are refused"
            )
        self._validate_buffers(update.buffers)

    def _locate(self, index: int) -> str:
        """Where flat element ``index`` lies, for messages: "element 3 of 'fc.bias'"."""
        offsets = self.layout.offsets.tolist()
        layer = max(0, bisect.bisect_right(offsets, index) - 1)
        if layer < len(self.layout.names):
            return f"element {index - offsets[layer]} of {self.layout.names[layer]!r}"
        return f"element {index}"

    def _validate_norm(self, update: Update, job: Job) -> None:
        """``max_update_norm``: the L2 norm of the client's delta (float64; on a sharded server
        the whole model's, summed over the shards)."""
        bound = self.config.max_update_norm
        if bound is None:
            return
        norm = self.delta_norm(update, job)
        if not norm <= bound:
            raise UpdateNormTooLarge(
                f"the update's delta has L2 norm {norm:.6g}, above max_update_norm={bound:g}; "
                "clip it before sending, or raise max_update_norm in the strategy config"
            )

    def _validate_buffers(self, b: torch.Tensor | None) -> None:
        """The update's float buffers: present exactly when the layout has some, [B] float32
        on the strategy's device, finite, and no negative variance."""
        n = self.float_buffers.numel
        if n == 0:
            if b is not None:
                raise InvalidUpdate("the update carries float buffers but the model has none")
            return
        if b is None:
            raise InvalidUpdate(
                f"the model has {n} float buffer elements (BatchNorm running statistics): the "
                'update must carry the client\'s as "buffers"'
            )
        if b.dim() != 1 or b.numel() != n or b.dtype != torch.float32 or b.device != self.device:
            raise InvalidUpdate(
                f"update buffers must be flat float32 [{n}] on {self.device}, got {b.dtype} "
                f"{tuple(b.shape)} on {b.device}"
            )
        if count_non_finite(b):
            raise NonFiniteUpdate("update buffers contain NaN or Inf")
        if self._variance_index.numel() and bool((b[self._variance_index] < 0).any()):
            raise InvalidUpdate("update buffers hold a negative running_var")

    def _check(self, update: Update, job: Job, staleness: int, now: float) -> None:
        """Strategy-specific refusals; must not change state (default: none)."""
        return None

    @abstractmethod
    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        """Fold an accepted update in (its job is already retired) and return its outcome."""

    # --------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly: a point-in-time copy (tensors cloned)."""
        bases: dict[int, torch.Tensor] = {}
        jobs = []
        for job in self._jobs.values():
            bases.setdefault(job.base_version, job.weights)
            jobs.append(
                {
                    "job_id": job.job_id,
                    "client_id": job.client_id,
                    "base_version": job.base_version,
                    "deadline": job.deadline,
                    "issued_at": job.issued_at,
                    "recipe": job.recipe.to_dict(),
                    "tensors": {k: v for k, v in job.tensors.items() if k != "weights"},
                }
            )
        state = {
            "strategy": self.name,
            "layout_hash": self.layout.hash,
            "config": self.config.to_dict(),
            "version": self.version,
            "model": self._model,
            "bases": bases,
            "clients": dict(self._clients),
            "jobs": jobs,
            "job_of": dict(self._job_of),
            "completed_job": dict(self._completed_job),
            "next_job_id": self._next_job_id,
            "now": self._now,
            "rng": self._rng.get_state(),
            "ledger": self.ledger.state_dict(),
            "float_buffers": self.float_buffers.state_dict(),
            "extra": self._extra_state(),
        }
        if self.update_filters is not None:
            state["update_filter"] = self.update_filters.state_dict()
        if self.privacy is not None:
            state["privacy"] = self.privacy.state()
        return clone_tensors(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` output (same strategy and layout); a state that is
        refused part-way (ValueError) leaves the strategy as it was."""
        before = self.state_dict()
        try:
            self._load_state(state)
        except Exception:
            self._load_state(before)
            raise

    def _load_state(self, state: Mapping[str, Any]) -> None:
        if state["strategy"] != self.name:
            raise ValueError(f"state is for strategy {state['strategy']!r}, not {self.name!r}")
        if state["layout_hash"] != self.layout.hash:
            raise ValueError("state was saved for a different model layout (layout hash differs)")
        if state["config"] != self.config.to_dict():
            logger.warning("%s: resuming with a config that differs from the saved one", self.name)

        # One copy per saved storage, shared by every restore function of this load (the
        # subclasses' and the float buffers' too): what shared memory live shares it again.
        self._copy_saved = SharedCopies(self.device)
        self.version = int(state["version"])
        self._model = self._restore(state["model"])
        self._absmax = None
        self._versions.clear()
        # One tensor per version, shared by every job that started from it (and the model).
        bases = {int(v): self._restore(t) for v, t in state["bases"].items()}
        if self.version in bases:
            bases[self.version] = self._model
        self._clients = {str(c): float(t) for c, t in state["clients"].items()}
        self._jobs = {}
        for j in state["jobs"]:
            tensors = {"weights": bases[int(j["base_version"])]}
            tensors.update({k: self._restore(v) for k, v in j["tensors"].items()})
            recipe = Recipe.from_dict(j["recipe"])
            job = Job(
                job_id=int(j["job_id"]),
                client_id=str(j["client_id"]),
                base_version=int(j["base_version"]),
                deadline=j["deadline"],
                recipe=recipe if recipe != self._recipe else self._recipe,
                tensors=types.MappingProxyType(tensors),
                issued_at=float(j.get("issued_at", 0.0)),  # states saved before leases: 0
            )
            self._jobs[job.job_id] = job
        self._job_of = {str(c): int(j) for c, j in state["job_of"].items()}
        self._completed_job = {str(c): int(j) for c, j in state["completed_job"].items()}
        self._next_job_id = int(state["next_job_id"])
        self._now = float(state.get("now", 0.0))
        self._rng.set_state(state["rng"].clone())
        self.ledger.load_state_dict(state["ledger"])
        self.float_buffers.load_state_dict(state["float_buffers"], self._copy_saved)
        self._load_extra_state(state["extra"])
        if self.update_filters is not None:
            self.update_filters.load_state_dict(state.get("update_filter"))
        if self.privacy is not None:
            saved = state.get("privacy")
            if saved is None:
                raise ValueError(
                    "the saved state has no privacy accountant (it was saved without the dp_ "
                    "keys): resuming it with differential privacy would start epsilon at 0"
                )
            self.privacy.load(saved)
        del self._copy_saved
        # The loaded jobs (a subclass may have given them tensors of its own) hold theirs.
        for lease in self._job_leases.values():
            lease.release()
        self._job_leases = {j: self._versions.lease(*job.tensors.values())
                            for j, job in self._jobs.items()}  # fmt: skip

    def _extra_state(self) -> dict[str, Any]:
        """Subclass state for :meth:`state_dict` (tensors are cloned by the caller)."""
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`_extra_state` returned; copy tensors with :meth:`_restore`."""
        return None

    def _restore(
        self, t: torch.Tensor | None, dtype: torch.dtype = torch.float32, shared: bool = True
    ) -> Any:
        """A saved tensor (None stays None) as a fresh ``dtype`` tensor on the strategy's
        device, during :meth:`load_state_dict`. ``shared``: through the load's
        :class:`SharedCopies`, so that what shared memory live shares it again; otherwise a
        copy of its own."""
        return restore_tensor(t, self.device, dtype, self._copy_saved if shared else None)

    # --------------------------------------------------------------------------- changes

    # Side effects of job_for other than issuing a job (a class default: the count starts at 0).
    _side_effects: int = 0

    def _note_side_effect(self) -> None:
        """Call when a call that may issue no job changed state anyway (opened a round or an
        epoch, dispatched a client): the server then logs it, so that replay repeats it."""
        self._side_effects += 1

    @property
    def change_count(self) -> int:
        """A number that moves exactly when :meth:`job_for` changed the strategy's state: a job
        issued (which also retires the one it supersedes) or a noted side effect. The server
        logs a GetJob only when it moved; a strategy whose job_for changes anything else must
        call :meth:`_note_side_effect` (tests/strategies/test_strategy_durable_state.py checks
        all)."""
        return self._next_job_id + self._side_effects
