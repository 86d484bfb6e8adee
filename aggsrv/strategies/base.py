"""The Strategy protocol of docs/design.md "Strategies", and the order in which a strategy's
components handle a call (the value types live in aggsrv.values, the rest beside this module).

A strategy owns its state (device tensors, jobs it handed out, an RNG, the update ledger) and is
driven from one aggregation loop only, so it takes no locks. It reads time only from the ``now``
argument (seconds on the server's or the simulator's clock) and never imports gRPC.

Conventions every strategy here follows (the server is written against them):

* **Versions and jobs** as docs/design.md "Strategies" says: a published version's tensor
  (:meth:`Strategy.global_model`) is never written again, though the next version may share it
  when nothing changed; :meth:`Strategy.job_for` hands a reconnecting client its job again, and
  an update for a superseded job is refused with :class:`JobSuperseded`.
* **Leases.** A retired version's buffer is reused (:mod:`aggsrv.strategies.buffers`) once no
  lease on it is held: whatever reads a version tensor after the call that handed it out returns
  (a job, a stream, a host copy, a retained snapshot) holds :meth:`Strategy.lease` on it.
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

import contextlib
import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar, get_args, get_origin

import torch

from aggsrv.layout import ModelLayout
from aggsrv.sharding import LocalReducer, Reducer
from aggsrv.strategies import finite_results
from aggsrv.strategies.buffers import Lease, VersionBuffers
from aggsrv.strategies.cached_rows import RowCacheInfo
from aggsrv.strategies.config import StrategyConfig
from aggsrv.strategies.dp_clipping import NON_FINITE_CLIPPED
from aggsrv.strategies.errors import (
    NonFiniteResult,
    NotRegistered,
    StrategyError,
    TooManyClients,
)
from aggsrv.strategies.float_buffers import FloatBuffers
from aggsrv.strategies.job import Job, JobBook
from aggsrv.strategies.ledger import UpdateLedger
from aggsrv.strategies.norms import delta_norm, whole_norm
from aggsrv.strategies.privacy import privacy_for
from aggsrv.strategies.robust import RobustCombiner
from aggsrv.strategies.saved_state import load_state, save_state
from aggsrv.strategies.state_copy import restore_tensor
from aggsrv.strategies.update_filters import Screening, UpdateFilters
from aggsrv.strategies.validation import UpdateChecks, agree_on_branch
from aggsrv.values import Outcome, PendingReason, Recipe, Status, Update, UpdateKind

__all__ = ["Strategy"]

logger = logging.getLogger(__name__)

Config = TypeVar("Config", bound=StrategyConfig)


class Strategy(ABC, Generic[Config]):
    """Base class of every aggregation strategy: the protocol and the order of its steps, whose
    work its components do: ``jobs`` (JobBook), ``checks`` (UpdateChecks), ``privacy``
    (GaussianPrivacy, None without DP), ``update_filters``, ``float_buffers``, ``ledger``;
    :mod:`aggsrv.strategies.saved_state` saves and loads them.

    A subclass names its config class and itself in its class line, ``class
    FedBuff(Strategy[FedBuffConfig], name="fedbuff")``, and implements :meth:`_apply` (fold one
    accepted update in); it may override :meth:`job_for`, :meth:`_check` (extra refusals, no state
    change), :meth:`on_register`, :meth:`next_deadline`, :meth:`on_timer` and the
    ``_extra_state``/``_load_extra_state`` pair.
    """

    name: ClassVar[str] = "base"
    config_class: ClassVar[type[StrategyConfig]] = StrategyConfig
    # How clients' float buffers (BatchNorm statistics) fold into the global ones: see
    # aggsrv/strategies/float_buffers.py. "mean" strategies call self.float_buffers.add().
    buffer_rule: ClassVar[str] = "mean"
    config: Config

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        """``name`` from the class keyword, ``config_class`` from a ``Strategy[Config]`` base
        (the bound of a type variable, for a strategy generic over its config)."""
        super().__init_subclass__(**kwargs)
        cls.name = name or cls.name
        for base in cls.__dict__.get("__orig_bases__", ()):
            origin = get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Strategy):
                (config,) = get_args(base)
                cls.config_class = config.__bound__ if isinstance(config, TypeVar) else config

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
        self.config = self.config_class.typed(config, self.name)
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
        # (version, max |x|): the version number, not the tensor, so no old version is kept.
        self._absmax: tuple[int, float] | None = None
        self.ledger = UpdateLedger()
        self._clients: dict[str, float] = {}  # client id -> registration time, in join order
        self.jobs = JobBook(self._versions, self.config.job_lease_seconds, self.name)
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
        self.privacy = privacy_for(self.config, layout, self.device, self.reducer.rank, self.reduce)
        self.checks = UpdateChecks(
            layout, self.dim, self.device, self.config, layout.buffer_numel,
            private=self.privacy is not None,
        )  # fmt: skip
        # The config's robust aggregator (None for the mean and for configs without the key).
        aggregator = getattr(self.config, "aggregator", "mean")
        self._robust = RobustCombiner.for_config(aggregator, self.name, self.device)

    # --------------------------------------------------------------------------- public API

    def delta_norm(self, update: Update, job: Job) -> float:
        """The L2 norm (float64) of the update's delta (on a shard the whole model's)."""
        return delta_norm(update, job, self.reduce)

    def whole_norm(self, t: torch.Tensor, non_finite: bool = False) -> float:
        """The L2 norm (float64) of the whole-model vector whose slice ``t`` is."""
        return whole_norm(t, self.reduce, non_finite)

    @property
    def dim(self) -> int:
        """D, the length of the flat model."""
        return self._model.numel()

    @property
    def clients(self) -> tuple[str, ...]:
        """Registered client ids in the order they joined."""
        return tuple(self._clients)

    def row_cache(self) -> RowCacheInfo | None:
        """How the per-client row cache is stored, for strategies that keep one (None for the
        others). Reads no tensor: safe from the metrics and status threads."""
        return None

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

    def folds_quantized_updates(self, kind: UpdateKind) -> bool:
        """Whether an update of ``kind`` whose values come as codes (``Update.quantized``) is
        folded in from the codes, in the pass that adds it (default: no; it is decoded into its
        tensor first). The answer may depend on the configuration, never on the state: the
        server asks before the upload arrives, and replay asks again."""
        return False

    def on_update(self, update: Update, now: float) -> Outcome:
        """Fold one validated update in, or refuse it without changing any state.

        A replayed update id returns DUPLICATE with the original outcome and changes nothing.
        """
        if update.quantized is not None and not self.folds_quantized_updates(update.kind):
            update = update.materialized()
        prior = self.ledger.lookup(update.client_id, update.update_id)
        try:
            if prior is None:
                self._require_privacy_budget()
                job = self._validate(update)
                self.jobs.require_leased(job, now)
                s = self.version - job.base_version
                self._check(update, job, s, now)
        except StrategyError:
            agree_on_branch(self.reducer, self.reduce, prior is not None, refused=True)
            raise
        agree_on_branch(self.reducer, self.reduce, prior is not None, refused=False)
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
            update = self.privacy.private_update(update, job)
            zeroed = update.non_finite
        # The job's start weights are read while the next version is written: held until then
        # (retiring the job gives up its own lease).
        with self._versions.lease(*job.tensors.values()):
            self.jobs.retire(job)
            try:
                outcome = self._apply(update, job, s, now)
            except StrategyError:
                # _apply refuses only before its first change of state (see _require_finite),
                # so reopening the job restores the state exactly.
                self.jobs.reopen(job)
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
        self.jobs.complete(job)
        return outcome

    def _filter_out(
        self, update: Update, job: Job, staleness: int, now: float, screening: Screening
    ) -> Outcome:
        """An update the filters refused: its job is consumed (the client asks for a new one)
        and the answer, FILTERED(current version, reason), is remembered like an accepted
        update's; the model and the strategy's own state stay as they were."""
        assert self.update_filters is not None and screening.refusal is not None
        reason, detail = screening.refusal
        self.jobs.retire(job)
        self.update_filters.count_refusal(screening)
        outcome = Outcome(
            Status.FILTERED, self.version, staleness=staleness, reason=reason, detail=detail
        )
        self._now = float(now)
        self.ledger.record(update.client_id, update.update_id, outcome)
        self.jobs.complete(job)
        logger.info(
            "%s: update %s of %s filtered (%s): %s", self.name, update.update_id,
            update.client_id, reason.name, detail,
        )  # fmt: skip
        return outcome

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
        expiry = self.jobs.next_expiry()
        if own is None or expiry is None:
            return own if expiry is None else expiry
        return min(own, expiry)

    def on_timer(self, now: float) -> None:
        """Retire the jobs whose lease ended by ``now``, then handle the strategy's own
        deadlines (:meth:`_on_timer`)."""
        self._now = float(now)
        self.jobs.expire(now)
        self._on_timer(now)

    def _next_deadline(self) -> float | None:
        """When the strategy's own timer is due (rounds, epochs; default: never)."""
        return None

    def _on_timer(self, now: float) -> None:
        """The strategy's own deadlines that passed by ``now`` (default: nothing)."""

    def staleness(self, job: Job) -> int:
        """``s = version - job.base_version`` if the job's update arrived now."""
        return self.version - job.base_version

    def outstanding_job(self, client_id: str) -> Job | None:
        """The client's outstanding job, if any."""
        return self.jobs.outstanding(client_id)

    def job_state(self, client_id: str, job_id: int) -> str:
        """What became of ``job_id`` for ``client_id`` (:meth:`JobBook.job_state`)."""
        return self.jobs.job_state(client_id, job_id)

    def open_job(self, client_id: str, job_id: int) -> Job | None:
        """Job ``job_id`` if it is ``client_id``'s and still open (a shard serves its slice)."""
        return self.jobs.open_job(client_id, job_id)

    @property
    def jobs_issued(self) -> int:
        """How many jobs this strategy has issued (job ids are 1 to this number)."""
        return self.jobs.issued

    def check_data(self, update: Update) -> None:
        """The refusals that depend on the update's numbers rather than the strategy's state
        (InvalidUpdate), so that each shard of a sharded server can check its own slice before
        the shards vote; a replayed update id is not checked (it will be DUPLICATE)."""
        if self.ledger.lookup(update.client_id, update.update_id) is None:
            self.checks.numbers(update)

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

    def _running_sum(self, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed [D] sum of contributions (empty with a robust rule, which keeps rows)."""
        return torch.zeros(self.dim if self._robust is None else 0, dtype=dtype, device=self.device)

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
        self._require_finite_buffers(
            self.float_buffers.pending, "the next version of the float buffers"
        )
        if model is not self._model:
            self._versions.retire(self._model)
        self._model = model
        self.float_buffers.commit()
        self.version += 1
        return self.version

    @contextlib.contextmanager
    def _noise_for_release(self, extra: int = 0) -> Iterator[torch.Tensor | None]:
        """DP's noise for the version about to be published, of the contributions gathered and
        ``extra`` more (:meth:`GaussianPrivacy.release_noise`; None without DP or noise)."""
        yield None if self.privacy is None else self.privacy.release_noise(extra)

    def _stepped_version(
        self,
        total: Callable[[slice], torch.Tensor],
        step: float,
        extra: int = 0,
        chunk: int = 1 << 18,
    ) -> torch.Tensor:
        """The checked next version ``x + step * (total + noise)`` of a buffered strategy,
        chunk by chunk: ``total(s)`` is its float64 sum over elements ``s`` (a fresh tensor it
        may change), rounded once to float32; the noise is differential privacy's for a
        release of the gathered contributions and ``extra`` more (none without DP). Nothing
        of the state changes (a refused release's noise draw is spent)."""
        with self._noise_for_release(extra) as noise:
            new = self._new_model_buffer()
            for start in range(0, self.dim, chunk):
                s = slice(start, min(start + chunk, self.dim))
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
        """max |x| over the current version (:func:`.finite_results.absmax`, cached per version),
        for strategies that bound what a step can reach instead of computing it."""
        if self._absmax is None or self._absmax[0] != self.version:
            self._absmax = (self.version, finite_results.absmax(self._model, self.reduce))
        return self._absmax[1]

    def _checked_absmax(self, t: torch.Tensor, what: str) -> float:
        """max |t| as :meth:`model_absmax` measures it (NonFiniteResult if NaN/Inf)."""
        return finite_results.checked_absmax(t, what, self.reduce)

    def _check_version(self, model: torch.Tensor) -> None:
        """Refuse (NonFiniteResult) a candidate next version that is not finite, handing its
        buffer back to the pool."""
        try:
            self._require_finite(model, "the next version of the model")
        except NonFiniteResult:
            self._versions.retire(model)
            raise

    def _require_finite(self, t: torch.Tensor, what: str) -> None:
        """Refuse (NonFiniteResult) unless ``t`` is finite (:mod:`.finite_results`'s rule)."""
        finite_results.require_finite(t, what, self.reduce)

    def _require_finite_buffers(self, t: torch.Tensor | None, what: str) -> None:
        """:meth:`_require_finite` of float buffers (None: none to check). Sharded, they live on
        rank 0 only, but the check's reduce is a collective: every shard joins it whenever the
        model has float buffers, with no bad values where it holds none."""
        if t is None and (self.reduce is None or not self.layout.whole.buffer_numel):
            return
        self._require_finite(t if t is not None else torch.empty(0), what)

    def _require_finite_chunks(
        self, compute: Callable[[slice], torch.Tensor], what: str, chunk: int = 1 << 18
    ) -> None:
        """:meth:`_require_finite` of a [D] value that ``compute(s)`` gives chunk by chunk."""
        finite_results.require_finite_chunks(
            compute, what, self.dim, self.device, self.reduce, chunk
        )

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
        old = self.jobs.outstanding(client_id)
        if old is not None and old.base_version == self.version and not self.jobs.expired(old, now):
            return old  # nothing changes (the log need not record this call)
        self._now = now
        if old is not None:
            self.jobs.retire(old)  # superseded: the client asked again, so it dropped the job
        tensors = self._with_buffers(self._job_tensors(client_id))
        return self.jobs.issue(client_id, self.version, deadline, self._recipe, tensors, now)

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

    def _validate(self, update: Update) -> Job:
        """Checks every strategy makes before touching state; returns the update's job."""
        self._require_registered(update.client_id)
        self.checks.form(update)
        self.checks.numbers(update)
        job = self.jobs.for_update(update)
        self.checks.staleness(job, self.version)
        if self.config.max_update_norm is not None:
            self.checks.norm(self.delta_norm(update, job))
        return job

    def _check(self, update: Update, job: Job, staleness: int, now: float) -> None:
        """Strategy-specific refusals; must not change state (default: none)."""

    @abstractmethod
    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        """Fold an accepted update in (its job is already retired) and return its outcome."""

    # --------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly: a point-in-time copy (tensors cloned)."""
        return save_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` output (same strategy and layout); a state that is
        refused part-way (ValueError) leaves the strategy as it was."""
        before = self.state_dict()
        try:
            load_state(self, state)
        except Exception:
            load_state(self, before)
            raise

    def _extra_state(self) -> dict[str, Any]:
        """Subclass state for :meth:`state_dict` (tensors are cloned by the caller)."""
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`_extra_state` returned; copy tensors with :meth:`_restore`."""

    def _restore(
        self, t: torch.Tensor | None, dtype: torch.dtype = torch.float32, shared: bool = True
    ) -> Any:
        """A saved tensor (None stays None) as a fresh ``dtype`` tensor on the strategy's
        device, during :meth:`load_state_dict`; ``shared``: one copy per saved storage (what
        shared memory live shares it again), else a copy of its own."""
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
        return self.jobs.next_id + self._side_effects
