"""Federation state behind the gRPC service: the strategy, the client registry with leases,
staging slots, counters, and the calls the handlers make (register, next job, apply an update),
each logged and replayable (:meth:`Federation.replay`).

The federation is the hub of its parts, each an object of its own module that is handed what it
needs: the aggregation thread (aggsrv.server.aggregation_loop), the stop when a call fails
(aggsrv.server.fail_stop), the log of calls (aggsrv.server.call_log), the versions waiting for
their record (aggsrv.server.publication) and those readers see (aggsrv.server.versions), the
strategy's timer (aggsrv.server.deadline_timer), checkpoints (aggsrv.server.checkpoints), rank 0
of a sharded server (aggsrv.server.replication) and the other shards
(aggsrv.server.shard_follower). The steps of a call are sequenced here, each part handed what
the one before returned: announce it to the shards, make it, log it (the version it made is
captured right after it, at its record's LSN); publish what is durable, wait until its record
is, publish what that made durable, then checkpoint if due.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import types
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from aggsrv.layout import ModelLayout
from aggsrv.server import durability as D
from aggsrv.server import shards as S
from aggsrv.server.aggregation_loop import AggregationLoop
from aggsrv.server.call_log import CallLog
from aggsrv.server.checkpoints import MIN_CHECKPOINT_EVERY_BYTES, Checkpoints
from aggsrv.server.client_activity import ClientActivity
from aggsrv.server.config import ServerConfig
from aggsrv.server.dashboard.events import PublishRate, StrategyEvents
from aggsrv.server.deadline_timer import DeadlineTimer
from aggsrv.server.disclosure import public_refusals
from aggsrv.server.durability import WalRecord
from aggsrv.server.fail_stop import AggregationFailed, DurabilityError, FailStop
from aggsrv.server.metrics import SLOWEST, ClientsNow, ServerMetrics
from aggsrv.server.persistence import RecoveryError, StateStore, restore
from aggsrv.server.publication import Publication
from aggsrv.server.replication import Replication
from aggsrv.server.shard_follower import ShardFollower
from aggsrv.server.trace import TraceWriter
from aggsrv.server.update_health import RecentChange, RobustOutliers, UpdateNorms
from aggsrv.server.upload_log import UploadLog
from aggsrv.server.versions import (
    LeaseHandoff,
    RetainedVersions,
    Snapshot,
    needs_host_copy,
    to_host,
)
from aggsrv.sharding import LoggedReducer, ShardLayout, ShardMap, decode_sums, encode_sums
from aggsrv.strategies import (
    Job,
    Outcome,
    PendingReason,
    Status,
    Strategy,
    Update,
    UpdateKind,
    make_strategy,
)
from aggsrv.strategies.buffers import NO_LEASE, Lease
from aggsrv.strategies.cached_rows import RowCacheInfo
from aggsrv.strategies.privacy import PrivacyBudgetSpent
from aggsrv.strategies.saved_state import load_state
from aggsrv.transport import DeviceCrossing, StagingSlot

log = logging.getLogger(__name__)
# Importable from here as before the split (the service, tests, bench).
__all__ = [
    "MIN_CHECKPOINT_EVERY_BYTES", "AggregationFailed", "ClientRecord", "DurabilityError",
    "EventLog", "Federation", "Snapshot", "needs_host_copy", "payload_sizes", "rebuild",
    "staging_slot", "to_host", "update_meta",
]  # fmt: skip

T = TypeVar("T")

# The logged calls of a sharded rank 0 whose records carry their sums over the shards.
SUMMED_KINDS = ("register", "job", "timer", "update")

# How often a released staging slot asks whether the device copies out of it are done.
SLOT_POLL_SECONDS = 0.001


@dataclass
class ClientRecord:
    """What the server knows of one registered client."""

    client_id: str
    registered_at: float
    lease_expires: float
    labels: dict[str, str] = field(default_factory=dict)


class EventLog:
    """Appends strategy events to a JSON-lines file, one flushed line per event (the file
    outlives a crash; events are diagnostics, not state)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        log.info("event %s at v%s", record.get("event"), record.get("version"))


class Federation:
    """The server's state; all strategy access goes through :meth:`call`."""

    def __init__(
        self,
        config: ServerConfig,
        clock: Callable[[], float] = time.time,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics if metrics is not None else ServerMetrics()
        # Differential privacy (the dp_ keys): what depends on updates' values is shown to
        # admins only (aggsrv.server.disclosure); the Prometheus port serves none of it.
        self.private = bool(getattr(config.strategy_settings, "private", False))
        if self.private:
            self.metrics.withhold_data()
        self.started_at = clock()
        self.device = _resolve_device(config.device)
        self.layout: ModelLayout | None = None
        self.strategy: Strategy | None = None
        self.clients: dict[str, ClientRecord] = {}
        self.counters: Counter[str] = Counter()
        self.rejected_by_code: Counter[str] = Counter()
        self.rejected_by_reason: Counter[tuple[str, str]] = Counter()  # (code, reason)
        self.uploads_in_progress = 0  # uploads occupying a staging slot
        self.updates_waiting = 0  # validated updates handed to the aggregation loop, not yet done
        self.in_flight_updates: set[tuple[str, str]] = set()
        self.trace: TraceWriter | None = None  # --trace: jobs and updates, for replay
        # Differential privacy: the log says once that the budget stopped the publications.
        self._budget_logged = False
        self._budget_lsn: int | None = None
        # Who holds which job since when (metrics). A client waiting for a job is seen once per
        # pending interval: not dropped out for being silent that long.
        self.activity = ClientActivity(
            dropout_floor=max(30.0, 2.0 * config.pending_interval_seconds)
        )
        self.publish_rate = PublishRate()
        self.update_norms = UpdateNorms()  # the norms of recent updates, for outliers
        self.update_cosines = RobustOutliers()  # their cosines to the model's recent change
        self.direction = RecentChange()
        self.strategy_events = StrategyEvents()
        self._slots: asyncio.Queue[StagingSlot] | None = None
        # Each slot's way to a device cache (by the slot's id), made on first use.
        self._crossings: dict[int, DeviceCrossing] = {}
        # Uploads cross to the strategy's device as they arrive when it is not the CPU; True
        # makes them cross on the CPU too (the same path, tested without a GPU).
        self.cross_uploads_on_cpu = False
        self.closing = False
        self.last_eval: tuple[int, dict[str, float]] | None = None
        # Whole models offered to a sharded rank 0 (its staging slots hold its slice only).
        self._whole_slots = asyncio.Semaphore(config.max_concurrent_uploads)

        # The parts, each handed what it needs; the federation's state they follow as it
        # changes (the strategy, the shards, closing) is read when they need it.
        def strategy() -> Strategy | None:
            return self.strategy

        def closing() -> bool:
            return self.closing

        self.fail_stop = FailStop(on_stop=self._stopped)
        self.call_log = CallLog(self.fail_stop, self.metrics)
        self.replication = Replication(
            strategy, self.fail_stop, closing, self.call_log.written_lsn,
            self.call_log.durable_lsn,
        )  # fmt: skip
        self._durable_notice: asyncio.Task | None = None
        # A shard's sums over the shards, kept so that a shard can replay a call alone (rank 0
        # logs them with each call), and its slice of the model once it has one.
        self.sums = (
            LoggedReducer(config.rank, config.shards, keep=config.rank == 0)
            if config.shards > 1 else None
        )  # fmt: skip
        self.replication.sums = self.sums
        self._highest_call = 0  # the highest call number this shard has seen
        self.versions = RetainedVersions(config.retained_versions, clock, strategy)
        self.timer = DeadlineTimer(clock, self._fire_timer, idle=self._runs_no_timers)
        self.publication = Publication(
            self.versions, self.timer, self.metrics, self.publish_rate, clock
        )
        self.aggregation = AggregationLoop(self.fail_stop, self.publication.settle)
        self.checkpoints = Checkpoints(
            config, clock, self.metrics, self.fail_stop, self.call_log, self.call, self, closing
        )
        self.shard_follower = ShardFollower(
            strategy, self.fail_stop, self.aggregation.submit, self.replication,
            self.publication, self.replay, self._adopt_slice, self.count_outcome,
            self._prepare_slice, self.checkpoints.cut_ordered,
        )  # fmt: skip
        if self.sums is not None:
            self.checkpoints.after_cut = self._after_cut

    @property
    def shards(self) -> S.ShardGroup | None:
        """The shards of a sharded federation (aggsrv.server.shards), set by its server before
        it serves; None when not sharded."""
        return self.replication.shards

    @shards.setter
    def shards(self, shards: S.ShardGroup | None) -> None:
        self.replication.shards = shards
        self.shard_follower.shards = shards
        if shards is not None:
            if self.sums is not None:
                self.sums.connect(shards.reducer)
            if isinstance(self.layout, ShardLayout):
                shards.shard_map = self.layout.shard_map
        # Only the shards of a sharded federation agree on each call.
        self.aggregation.replication = self.replication if shards is not None else None
        # Rank 0 decides when every shard checkpoints, and at which call.
        coordinator = shards is None or shards.is_coordinator
        self.checkpoints.decides = coordinator
        self.checkpoints.order_cut = self._order_cut if shards is not None and coordinator else None

    def _after_cut(self, payload: dict[str, Any]) -> None:
        """(aggregation thread, every shard at the same call) Right after a checkpoint's state
        was taken, load it back into the live strategy: what it derives at a load (bounds,
        caches) is then the same live as in a shard restarted from this checkpoint, so the shard
        replays the calls after it with the same sums over the shards as the live ones made.
        Rank 0 logs the sums the load made ("cut" record): a shard restarted alone loads the
        checkpoint with them."""
        strategy = self.strategy
        assert strategy is not None and self.sums is not None
        load_state(strategy, payload["state"])
        if self.config.rank == 0:
            meta = {"seq": payload["shard"]["seq"], "sums": encode_sums(self.sums.take())}
            self.call_log.append("cut", meta, None, strategy.jobs_issued)

    def _order_cut(self, number: int) -> None:
        """(aggregation thread of rank 0) Every shard checkpoints at the call about to be
        announced. Rank 0's log is made durable up to it first: a shard's checkpoint then never
        holds a call rank 0 could lose in a crash."""
        self.call_log.sync_now()
        self.replication.announce("checkpoint", {"number": number})

    @property
    def store(self) -> StateStore | None:
        """The state directory (aggsrv.server.persistence), set by the server when one is
        configured: the log of calls writes to it, and the checkpoints."""
        return self.call_log.store

    @store.setter
    def store(self, store: StateStore | None) -> None:
        self.call_log.store = store
        self.checkpoints.store = store

    @property
    def failure(self) -> str | None:
        """Why the server stopped taking writes (None while it takes them)."""
        return self.fail_stop.failure

    @property
    def version(self) -> int:
        """The newest version readers see (durable, in the durable mode); the strategy may be a
        few calls ahead while their records are being fsynced."""
        return self.versions.published_version if self.strategy is not None else 0

    @property
    def published_version(self) -> int:
        """The latest published version, one GetModel serves now (0 before the model)."""
        return self.versions.published_version

    @property
    def snapshots(self) -> Mapping[int, Snapshot]:
        """The retained versions by number, oldest first (read by many handlers)."""
        return self.versions.snapshots

    async def call(self, fn: Callable[..., T], *args: Any, **rule: Any) -> T:
        """``fn(*args)`` on the aggregation thread (:meth:`AggregationLoop.call`, whose ``rule``
        it follows), then, while the federation takes writes, what is durable is published and
        the timer re-armed (the many callers that change or snapshot the strategy call it)."""
        result = await self.aggregation.call(fn, *args, **rule)
        if self.fail_stop.failure is None:
            self.publication.publish(self.call_log.durable_lsn())
        return result

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`AggregationLoop.read`: a read of strategy state between two calls."""
        return await self.aggregation.read(fn, *args)

    async def checkpoint(self) -> Any:
        """:meth:`Checkpoints.checkpoint`: checkpoint now (an operator, the final one, tests)."""
        return await self.checkpoints.checkpoint()

    async def logged(self, lsn: int | None) -> None:
        """After a call that went through (event loop): while the federation takes writes,
        publish what is durable already and re-arm the timer; once the call's record (``lsn``)
        is durable, publish what that made durable, then checkpoint if the log has grown
        enough."""
        call_log, publication = self.call_log, self.publication
        if self.fail_stop.failure is None:
            publication.publish(call_log.durable_lsn())
        durable = await call_log.make_durable(lsn)
        publication.publish(durable)
        if self.shards is not None and self.replication.mark_durable(durable):
            self._tell_shards_durable()
        self.checkpoints.checkpoint_if_due()

    def _tell_shards_durable(self) -> None:
        """Rank 0: tell the other shards how far its decisions are durable (they answer slices
        and publish versions only that far), unless a notice is on its way already."""
        task = self._durable_notice
        if task is not None and not task.done():
            return

        async def notice() -> None:
            with contextlib.suppress(DurabilityError):
                await self.aggregation.call(self.replication.announce_durable)

        self._durable_notice = asyncio.get_running_loop().create_task(notice())

    def _log(
        self,
        kind: str,
        meta: dict[str, Any],
        jobs_issued: int,
        tensors: dict[str, torch.Tensor] | None = None,
        upload: UploadLog | None = None,
    ) -> int | None:
        """(aggregation thread) Log a call that changed the strategy's state, after which the
        strategy has issued ``jobs_issued`` jobs; its LSN. A version the call made is published
        once the record is durable. ``upload``: where ``tensors`` were logged as they arrived."""
        if self.sums is not None and kind in SUMMED_KINDS:
            # The call's sums over the shards: any shard replays it alone with them.
            sums = self.sums.take()
            if self.call_log.wal is not None:
                meta = {**meta, "sums": encode_sums(sums)}
        if upload is not None and tensors is not None:
            lsn = self.call_log.append_claiming(kind, meta, upload, tensors, jobs_issued)
        else:
            lsn = self.call_log.append(kind, meta, tensors, jobs_issued)
        self.publication.record_at(lsn)
        if self.shards is not None:
            self.replication.logged(lsn)
        return lsn

    def _stopped(self, failure: str) -> None:
        """The federation stopped taking writes (any thread): the slices waiting for rank 0 are
        refused, and nothing new starts."""
        if self.shards is not None:
            self.shards.staged.fail_all(AggregationFailed(failure))
            self.shard_follower.fail_parked(AggregationFailed(failure))
        self.closing = True
        # Waiting job streams look again now (they end), not at their next pending notice.
        self.fail_stop.on_loop(self.publication.notify)

    def _runs_no_timers(self) -> bool:
        return self.closing or self.follower  # rank 0 orders the timers

    async def _fire_timer(self) -> None:
        if self.strategy is None or self.closing:
            return
        strategy = self.strategy

        def run() -> int | None:
            now = self.clock()
            meta = {"now": now}
            self.replication.announce("timer", meta)  # numbers it: the record carries the number
            strategy.on_timer(now)
            return self._log("timer", meta, strategy.jobs_issued)

        try:
            lsn = await self.aggregation.call(run)
            await self.logged(lsn)  # a version the timer made reaches readers once durable
        except DurabilityError:
            return  # the federation stopped taking writes; fail() said why
        self.publication.notify()

    @property
    def follower(self) -> bool:
        """A shard of rank >= 1: rank 0 orders its strategy calls."""
        return self.shards is not None and not self.shards.is_coordinator

    def count_accepted(self, outcome: Outcome) -> None:
        """Count an update taken in (served or replayed from the log): FILTERED is not accepted
        (the strategy's update filters also count it in their state); an accepted one was
        APPLIED (it completed a version) or BUFFERED (it waits for the step that folds it in)."""
        if outcome.status is Status.FILTERED:
            self.counters["filtered"] += 1
            return
        self.counters["accepted"] += 1
        if outcome.status is Status.APPLIED:
            self.counters["applied"] += 1
        elif outcome.status is Status.BUFFERED:
            self.counters["buffered"] += 1

    def count_outcome(self, outcome: Outcome) -> None:
        """Count what an update came to: a duplicate of one acknowledged before, or not."""
        if outcome.original is not None:
            self.counters["duplicate"] += 1
        else:
            self.count_accepted(outcome)

    # ------------------------------------------------------------------ replaying the log

    def replay(self, record: WalRecord) -> None:
        """Repeat one logged call with its logged inputs: recovery replays the log with it, and a
        shard of rank >= 1 follows rank 0's calls with it. Called on the aggregation thread,
        before the server serves or in the follower's order, never beside another call. A
        sharded call's sums over the shards come from its record when it has them (a shard
        replaying alone), else from the group (a shard following rank 0)."""
        sums = record.meta.get("sums")
        if self.sums is not None and sums is not None:
            with self.sums.replaying(decode_sums(sums)):
                self._replay_call(record)
        else:
            self._replay_call(record)

    def _replay_call(self, record: WalRecord) -> None:
        strategy = self.strategy
        assert strategy is not None
        m = record.meta
        if record.kind == "register":
            strategy.on_register(m["client"], m["now"])
            self.record_registration(m["client"], m["labels"], m["now"])
        elif record.kind == "job":
            strategy.job_for(m["client"], m["now"])
        elif record.kind == "timer":
            strategy.on_timer(m["now"])
        elif record.kind == "budget_spent":
            if strategy.privacy is not None:
                strategy.privacy.exhausted = True
            self._budget_logged = True
        elif record.kind == "update":
            tensors = record.tensors
            kind = UpdateKind[m["kind"]]
            if m.get("codes"):
                self._require_codes(record, kind)
            update = Update(
                client_id=m["client"],
                job_id=int(m["job_id"]),
                base_version=int(m["base_version"]),
                update_id=m["update_id"],
                num_samples=int(m["num_samples"]),
                work_done=float(m["work_done"]),
                kind=kind,
                tensor=_on(tensors["update"], strategy.device),
                buffers=_on(tensors["buffers"], strategy.device) if "buffers" in tensors else None,
                norm=m.get("norm"),
                quantized=record.quantized["update"] if m.get("codes") else None,
            )
            outcome = strategy.on_update(update, m["now"])
            logged = Outcome.from_tuple(m["outcome"])
            if outcome != logged:
                raise RecoveryError(
                    f"update {m['update_id']!r} of {m['client']!r} gave {outcome} on replay, "
                    f"{logged} when it was acknowledged"
                )
            self.count_accepted(outcome)
        else:
            raise RecoveryError(f"unknown record kind {record.kind!r}")

    def _require_codes(self, record: WalRecord, kind: UpdateKind) -> None:
        """An update the live server folded from its codes replays only as codes, into a
        strategy that folds them: decoding first rounds differently."""
        m = record.meta
        what = f"update {m['update_id']!r} of {m['client']!r}"
        if "update" not in record.quantized:
            raise RecoveryError(f"{what} was folded from its codes, but its record holds none")
        if not self.folds_quantized(kind):
            raise RecoveryError(
                f"{what} was folded from its INT8/INT4 codes when it was acknowledged; this "
                "server would decode them first (its device or shards differ from the server's "
                "that wrote the log), which rounds differently: resume with the settings the "
                "log was written with"
            )

    def restore_client(self, client_id: str, registered_at: float, labels: dict[str, str]) -> None:
        """A client of a checkpoint back in the registry (its lease counted from registration)."""
        expires = registered_at + self.config.lease_seconds
        self.clients[client_id] = ClientRecord(client_id, registered_at, expires, labels)

    def record_registration(
        self, client_id: str, labels: dict[str, str], now: float
    ) -> ClientRecord:
        """The registry entry of a (re-)registration at ``now`` (also used by replay)."""
        record = self.clients.get(client_id)
        if record is None:
            record = ClientRecord(client_id, now, now + self.config.lease_seconds)
            self.clients[client_id] = record
        record.labels = dict(labels)
        return record

    def recover(self, store: StateStore) -> int:
        """Load the newest checkpoint of ``store`` and replay the log after it; the number of
        records replayed. The next records go to a new segment. Run it on the aggregation thread
        (before the server serves): replay makes the calls the live server made there."""
        number, path, payload = store.load_latest()
        restore(self, payload)
        version, created_at = int(payload["state"]["version"]), float(payload["created_at"])
        strategy = self.strategy
        assert strategy is not None
        # Its events were written already: the replay only refreshes what the page shows.
        sink = strategy.event_sink
        strategy.event_sink = getattr(sink, "quietly", None)
        replayed = updates = 0
        t0 = time.perf_counter()
        privacy = strategy.privacy
        if privacy is not None:  # republished versions carry fresh noise: charged again
            privacy.begin_recovery()
        try:
            for segment, record in store.records(number):
                try:
                    self.replay(record)
                except Exception as exc:
                    raise RecoveryError(
                        f"replaying segment {segment} record {replayed} ({record.kind}) diverged "
                        f"from the log: {exc}"
                    ) from exc
                replayed += 1
                updates += record.kind == "update"
        finally:
            strategy.event_sink = sink
            if privacy is not None:
                privacy.end_recovery()
        self.publish_recovered()
        store.reopen(number)
        # Counted from the checkpoint, not from this start (the next checkpoint is due as if
        # the server had never stopped).
        self.checkpoints.resumed(version, created_at, updates)
        log.info(
            "resumed from checkpoint %d (%s): version %d after replaying %d logged records in "
            "%.2f s", number, path.name, self.version, replayed, time.perf_counter() - t0,
        )  # fmt: skip
        return replayed

    def call_number(self) -> int:
        """A shard's number of the last call it made, in rank 0's order."""
        return self.replication.seq if self.config.rank == 0 else self.shard_follower.applied_seq

    def note_call_number(self, number: int, made: bool = False) -> None:
        """A shard saw call ``number`` (a slice prepared for it), or made it (``made``)."""
        self._highest_call = max(self._highest_call, number)
        if made and self.config.rank == 0:
            self.replication.seq = number
        elif made:
            self.shard_follower.applied_seq = number

    def highest_call_number(self) -> int:
        return max(self._highest_call, self.call_number())

    def resume_numbering(self, top: int) -> None:
        """After recovery: every shard is at rank 0's state, everything in it durable, and the
        next call rank 0 orders is numbered ``top + 1``."""
        self.replication.forget_pending()
        self.replication.seq = self.replication.durable_seq = top
        self.replication.durable_sent = top
        self.shard_follower.applied_seq = self.shard_follower.rank0_durable = top
        self._highest_call = top

    def publish_recovered(self) -> None:
        """After recovery replayed the log (all of it durable): publish the state reached."""
        strategy = self.strategy
        assert strategy is not None
        self.publication.restart(strategy, self.direction)
        self.call_log.restart(strategy.jobs_issued)  # replayed: on disk
        if strategy.version != self.published_version:
            self.versions.retain(self.versions.snapshot_of(strategy))

    async def register(self, client_id: str, labels: dict[str, str]) -> tuple[bool, ClientRecord]:
        """Register (or re-register) a client; (known before, its record)."""
        strategy = self.strategy
        assert strategy is not None

        def run() -> tuple[bool, ClientRecord, int | None]:
            now = self.clock()
            known = client_id in self.clients
            meta = {"client": client_id, "now": now, "labels": labels}
            self.replication.announce("register", meta)
            strategy.on_register(client_id, now)
            jobs_issued = strategy.jobs_issued
            record = self.record_registration(client_id, labels, now)
            lsn = self._log("register", meta, jobs_issued)
            return known, record, lsn

        known, record, lsn = await self.aggregation.call(run)
        await self.logged(lsn)
        return known, record

    async def next_job(self, client_id: str) -> tuple[Job | None, PendingReason, Lease]:
        """Ask the strategy for the client's next job: (the job, UNSPECIFIED, a lease on its
        tensors that the caller releases once it streamed them), or (None, why not yet, an
        empty lease). A job goes out only once its record is durable, so an update for it is
        never refused as unknown after a crash.

        Only a call that changed the strategy's state (a new job, a round opened) is logged: the
        same job again, or none yet, adds nothing to the log, and needs no fsync once the log
        holds the job already."""
        strategy = self.strategy
        assert strategy is not None
        handoff = LeaseHandoff()

        def run() -> tuple[Job | None, PendingReason, int | None, Lease]:
            now = self.clock()
            meta = {"client": client_id, "now": now}
            self.replication.announce("job", meta)
            before = strategy.change_count
            strategy.pending_reason = PendingReason.UNSPECIFIED
            job = strategy.job_for(client_id, now)
            why = PendingReason.UNSPECIFIED if job is not None else strategy.pending_reason
            if strategy.change_count != before:
                lsn = self._log("job", meta, strategy.jobs_issued)
            else:
                # Unchanged: a job handed out again was logged when it was made, perhaps by a
                # call whose fsync is still running (no wait, and no fsync, once that record is
                # durable).
                lsn = self.call_log.issue_lsn if job is not None else None
            # Here, while the job holds its tensors: once this call returns, another may
            # supersede the job before its stream starts.
            lease = handoff.take(strategy, *job.tensors.values()) if job is not None else NO_LEASE
            return job, why, lsn, lease

        try:
            job, why, lsn, lease = await self.aggregation.call(run)
            await self.logged(lsn)
        except BaseException:  # cancelled, or the log failed: no stream will read the job
            handoff.abandon()
            raise
        return job, why, lease

    async def apply_update(
        self, update: Update, wire: dict[str, torch.Tensor], upload: UploadLog | None = None
    ) -> tuple[int, Outcome]:
        """Fold one validated update in; (staleness, outcome), returned once durable.

        ``wire`` holds the decoded CPU tensors ("update" [, "buffers"]) that the log records;
        ``upload``: where they were logged as they arrived (the record then names them)."""
        strategy = self.strategy
        assert strategy is not None

        def run() -> tuple[int, Outcome, int | None, float]:
            now = self.clock()
            s = strategy.version - update.base_version  # V_apply - v_base, at apply time
            t0 = time.perf_counter()
            meta = update_meta(update, now)
            self.replication.announce("update", meta)
            self.replication.vote(update)
            try:
                outcome = strategy.on_update(update, now)
            except PrivacyBudgetSpent:
                self._log_budget_spent(now)
                raise
            took = time.perf_counter() - t0
            jobs_issued = strategy.jobs_issued
            # The staleness the strategy recorded when it accepted the update (a DUPLICATE:
            # the original's), else the version difference at apply time.
            if outcome.staleness is not None:
                s = outcome.staleness
            record = {**meta, "outcome": list(outcome.to_tuple())}
            self.count_outcome(outcome)
            if outcome.original is not None:
                # The original's record may still be on its way to disk: ack after it.
                return s, outcome, self.call_log.written_lsn(), took
            return s, outcome, self._log("update", record, jobs_issued, wire, upload), took

        call = asyncio.ensure_future(self.aggregation.call(run))
        try:
            staleness, outcome, lsn, took = await asyncio.shield(call)
        except asyncio.CancelledError:
            # The caller went away: the update's tensors are views of its staging slot, which
            # is freed after we return, so the aggregation thread must be done with them.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(call)
            raise
        except PrivacyBudgetSpent:
            # The record that says so is durable first (the refused call published nothing).
            self.publication.publish(await self.call_log.make_durable(self._budget_lsn))
            self.checkpoints.checkpoint_if_due()
            raise
        self.metrics.aggregation_seconds.observe(took)
        await self.logged(lsn)
        return staleness, outcome

    def _log_budget_spent(self, now: float) -> None:
        """Differential privacy's budget stopped the publications (aggregation thread): the
        refusal changed no model state, so no update record says it; this record does, once,
        so that recovery does not hand out jobs again (docs/privacy.md)."""
        if self._budget_logged:
            return
        self._budget_logged = True
        strategy = self.strategy
        assert strategy is not None
        meta: dict[str, Any] = {"now": now}
        if self.shards is not None:  # the number of the update it refused
            meta["seq"] = self.replication.seq
        self._budget_lsn = self._log("budget_spent", meta, strategy.jobs_issued)

    # ------------------------------------------------------------------ the model

    def adopt(
        self, layout: ModelLayout, weights: torch.Tensor, buffers: torch.Tensor | None = None
    ) -> None:
        """Create the strategy from the first model (initial weights and float buffers become
        version 0); with a state directory, checkpoint it before anything else happens."""
        # Built before the other shards hear of it: a model this strategy refuses (ValueError)
        # reaches no shard.
        local, strategy = self._build(layout, weights, buffers)
        if self.shards is not None:
            self.replication.announce("adopt", {"layout": layout.to_dict()})
            self.fail_stop.collective(self.shards.share_model, weights, layout.numel)
        self.install(local, strategy)
        if self.store is not None:
            self.checkpoints.begin()
        log.info(
            "model adopted: %d parameters in %d tensors, layout %s, strategy %s",
            layout.numel, len(layout.names), layout.hash[:12], strategy.name,
        )  # fmt: skip

    def _build(
        self, layout: ModelLayout, weights: torch.Tensor, buffers: torch.Tensor | None
    ) -> tuple[ModelLayout | ShardLayout, Strategy]:
        """The layout served and the strategy of a first model; a shard's, on its slice."""
        cfg = self.config
        served, reducer = self.served_layout(layout)
        if isinstance(served, ShardLayout):
            weights = served.local(weights).clone()
            buffers = buffers if served.buffer_numel else None
        strategy = make_strategy(
            cfg.strategy,
            layout=served,
            initial=weights,
            initial_buffers=buffers,
            config=cfg.strategy_settings,
            device=self.device,
            max_clients=cfg.max_clients,
            reducer=reducer,
        )
        return served, strategy

    def served_layout(self, layout: ModelLayout) -> tuple[ModelLayout, Any]:
        """The layout this process serves of the whole model ``layout`` (a shard's slice) and
        the reducer its strategy sums partial results with (None: one server)."""
        cfg = self.config
        if cfg.shards == 1:
            return layout, None
        shard_map = ShardMap.even(layout.numel, cfg.shards)
        if self.shards is not None:
            self.shards.shard_map = shard_map
        return ShardLayout(layout, shard_map, cfg.rank), self.sums

    def shard_state(self) -> dict[str, Any] | None:
        """What a checkpoint of a shard says of it: its rank among how many shards, the slices'
        bounds, and the number of the last call it made in rank 0's order (None: one server)."""
        layout = self.layout
        if not isinstance(layout, ShardLayout):
            return None
        cfg = self.config
        return {
            "rank": cfg.rank, "shards": cfg.shards, "bounds": list(layout.shard_map.bounds),
            "seq": self.call_number(),
        }  # fmt: skip

    def _adopt_slice(self, whole: ModelLayout, weights: torch.Tensor) -> None:
        """A shard of rank >= 1: serve its slice of the whole model rank 0 shared (and, with a
        state directory, checkpoint it, as rank 0 does)."""
        self.install(*self._build(whole, weights, None))
        if self.store is not None:
            self.checkpoints.begin()

    def _prepare_slice(
        self, update: Update, meta: dict[str, Any], upload: UploadLog | None = None
    ) -> None:
        """(aggregation thread of a shard of rank >= 1) Make this shard's slice of the update
        rank 0 ordered durable before the shard votes for it: a "slice" record of the call's
        number (``meta["seq"]``) and the slice (named as its ``upload``'s parts, logged while
        it arrived). Recovery applies it only if rank 0's log has the update (rank 0's record
        is the decision)."""
        strategy = self.strategy
        call_log = self.call_log
        if call_log.wal is None or strategy is None:
            return
        self.note_call_number(int(meta["seq"]))
        record = {"seq": meta["seq"], "client": update.client_id, "update_id": update.update_id}
        tensors = {"update": update.tensor.detach().cpu()}
        jobs = strategy.jobs_issued
        call_log.sync_now(call_log.append_claiming("slice", record, upload, tensors, jobs))

    def install(self, layout: ModelLayout, strategy: Strategy) -> None:
        """Serve ``strategy`` (new, or restored from a checkpoint) over ``layout``."""
        cfg = self.config
        # The page shows the strategy's last events; rank 0 writes the federation's events.
        events_file = EventLog(cfg.events_file) if cfg.events_file and not self.follower else None
        self.strategy_events = StrategyEvents(then=events_file)
        strategy.event_sink = self.strategy_events
        # The strategy last: a shard of rank >= 1 installs from its aggregation thread, and
        # handlers take a set strategy to mean that the rest is ready.
        self.layout = layout
        slots: asyncio.Queue[StagingSlot] = asyncio.Queue()
        for _ in range(cfg.max_concurrent_uploads):
            slots.put_nowait(staging_slot(layout, pin_memory=self.device.type == "cuda"))
        self._slots = slots
        self._crossings = {}
        versions = self.versions
        versions.drop_all()
        direction = RecentChange()  # from this model on
        self.publication.restart(strategy, direction)
        self.call_log.restart(strategy.jobs_issued)  # on disk already
        versions.retain(versions.snapshot_of(strategy))
        self.direction = direction
        self.direction.refresh(strategy.global_model(), self.clock())
        self.checkpoints.serve(layout)
        self.strategy = strategy

    # ------------------------------------------------------------------ clients and slots

    def open_trace(self) -> None:
        """--trace: open the arrival trace (at start, so a path that cannot be written fails
        the start and not a call). Rank 0 of a sharded server records for all."""
        cfg = self.config
        if cfg.trace and not self.follower and self.trace is None:
            self.trace = TraceWriter(
                cfg.trace, strategy=cfg.strategy, version=lambda: self.published_version,
                clock=self.clock, max_bytes=cfg.trace_max_bytes, backups=cfg.trace_backups,
            )  # fmt: skip
            log.info("recording the arrival trace in %s", cfg.trace)

    def touch(self, client_id: str) -> None:
        """Renew a client's lease."""
        rec = self.clients.get(client_id)
        if rec is not None:
            now = self.clock()
            rec.lease_expires = now + self.config.lease_seconds
            self.activity.seen(client_id, now)

    def folds_quantized(self, kind: UpdateKind) -> bool:
        """Whether an update of ``kind`` sent as quantized values reaches the strategy as codes
        it folds in, undecoded: the strategy does so (:meth:`Strategy.folds_quantized_updates`),
        its model is on the CPU, and the server is not sharded (a relayed update is split as
        float32 values). Live and in replay alike, so replay repeats the same arithmetic."""
        strategy = self.strategy
        return (
            strategy is not None
            and self.shards is None
            and strategy.device.type == "cpu"
            and strategy.folds_quantized_updates(kind)
        )

    def update_quantizations(self) -> tuple[str, ...]:
        """The quantized values an update may carry (``update_quantizations``); none under
        differential privacy, whose clipping bounds the norm of what a client sends."""
        return () if self.private else tuple(self.config.update_quantizations)

    def privacy_now(self) -> dict[str, Any] | None:
        """Differential privacy's spending (None without it): any thread."""
        strategy = self.strategy
        privacy = strategy.privacy if strategy is not None else None
        return privacy.snapshot() if privacy is not None else None

    def clients_now(self) -> ClientsNow:
        """The clients' scrape-time metrics (metrics thread: reads copies)."""
        now = self.clock()
        leases = [(r.client_id, r.lease_expires) for r in list(self.clients.values())]
        activity = self.activity
        return ClientsNow(
            activity.states(now, leases), activity.lags(self.version),
            activity.slowest(now, SLOWEST), activity.update_rates(),
            activity.silences(now, (c for c, _ in leases)),
        )  # fmt: skip

    def active_clients(self) -> int:
        now = self.clock()
        # list(): the aggregation thread may add a client meanwhile.
        return sum(1 for r in list(self.clients.values()) if r.lease_expires >= now)

    async def acquire_slot(self) -> StagingSlot:
        """Wait for a free staging slot: the backpressure that bounds concurrent uploads."""
        assert self._slots is not None
        return await self._slots.get()

    def crossing_for(self, slot: StagingSlot) -> DeviceCrossing | None:
        """How an upload into ``slot`` reaches the strategy's device while it arrives (None: the
        strategy reads the slot itself, on the CPU)."""
        strategy = self.strategy
        if strategy is None or (strategy.device.type == "cpu" and not self.cross_uploads_on_cpu):
            return None
        crossing = self._crossings.get(id(slot))  # the slots live as long as this table
        if crossing is None:
            crossing = self._crossings[id(slot)] = DeviceCrossing(slot, strategy.device)
        return crossing

    def release_slot(self, slot: StagingSlot) -> None:
        """Give a slot back once no device copy still reads it: a copy from pinned memory runs
        on after it was queued, and the next upload must not overwrite its bytes. The loop
        polls the copy's event meanwhile (it never blocks on it)."""
        assert self._slots is not None
        if slot.idle():
            self._slots.put_nowait(slot)
        else:
            asyncio.get_running_loop().call_later(SLOT_POLL_SECONDS, self.release_slot, slot)

    @contextlib.asynccontextmanager
    async def whole_model_slot(self) -> AsyncIterator[StagingSlot]:
        """A landing area for a whole model offered to a sharded rank 0 (its staging slots hold
        its slice): at most max_concurrent_uploads at a time, and freed after use (a late offer
        is rare; its memory is not kept)."""
        assert self.layout is not None
        async with self._whole_slots:
            yield staging_slot(self.layout.whole)

    def cache_bytes(self) -> int:
        """Bytes of the tensors the strategy holds (model, caches, job bases, snapshots of
        retained versions), each storage counted once."""
        seen: dict[tuple[str, int], int] = {}

        def visit(obj: Any, depth: int = 0) -> None:
            if depth > 8:  # a job's tensors: strategy, its job book, a job, the tensors
                return
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                seen[(str(obj.device), storage.data_ptr())] = storage.nbytes()
            elif isinstance(obj, dict | Mapping):
                for v in list(obj.values()):
                    visit(v, depth + 1)
            elif isinstance(obj, list | tuple | set):
                for v in list(obj):
                    visit(v, depth + 1)
            elif hasattr(obj, "__dict__") and not isinstance(obj, type | types.ModuleType):
                visit(vars(obj), depth + 1)

        visit(self.strategy)
        for snap in list(self.versions.snapshots.values()):
            visit(snap.weights)
            visit(snap.buffers)
        return sum(seen.values())

    def row_cache(self) -> RowCacheInfo:
        """The strategy's row cache as reported (dtype "" and zeros without one)."""
        info = self.strategy.row_cache() if self.strategy is not None else None
        return info if info is not None else RowCacheInfo("", 0, 0)

    def cache_bytes_between_calls(self, timeout: float = 10.0) -> int:
        """:meth:`cache_bytes` for a thread that may block (the metrics endpoint's): measured on
        the aggregation thread between two calls; 0 once that thread has stopped."""
        if self.strategy is None:
            return 0
        try:
            return self.aggregation.submit(self.cache_bytes).result(timeout)
        except RuntimeError:  # the executor shut down: the server is stopping
            return 0

    def queue_depth(self) -> int:
        """Validated updates waiting for (or being folded in by) the aggregation loop."""
        return self.updates_waiting

    def reject(self, code_name: str, reason: str = "request") -> None:
        self.counters["rejected"] += 1
        self.rejected_by_code[code_name] += 1
        self.rejected_by_reason[(code_name, reason)] += 1

    def refusal_counts(self, full: bool) -> tuple[int, dict[str, int], dict[tuple[str, str], int]]:
        """(refused uploads, by code, by (code, reason)) since this process started; with
        ``full`` False under differential privacy, the refusals for public reasons only
        (aggsrv.server.disclosure). Any thread: reads copies."""
        by_reason = dict(self.rejected_by_reason.copy())
        if self.private and not full:
            return public_refusals(by_reason)
        return int(self.counters["rejected"]), dict(self.rejected_by_code.copy()), by_reason

    async def close(self) -> None:
        self.closing = True
        if self.trace is not None:
            self.trace.close()
        self.timer.cancel()
        await self.checkpoints.settled()

    async def shutdown_executors(self) -> None:
        """Stop the aggregation and log-sync threads (after :meth:`close` and the final
        checkpoint)."""
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown_threads)

    def shutdown_threads(self) -> None:
        """Blocking form of :meth:`shutdown_executors` (a federation that never served)."""
        self.aggregation.shutdown()
        self.call_log.shutdown()
        self.checkpoints.shutdown()


def update_meta(update: Update, now: float) -> dict[str, Any]:
    """An update's call without its tensors or outcome (what rank 0 announces to the shards);
    with the outcome, the log's record of it: everything replay needs but the tensors."""
    return {
        "client": update.client_id,
        "job_id": update.job_id,
        "base_version": update.base_version,
        "update_id": update.update_id,
        "num_samples": update.num_samples,
        "work_done": update.work_done,
        "kind": update.kind.name,
        "now": now,
        "norm": update.norm,  # a replay clips with the norm the live call used
        # Folded from its wire codes (logged as they came): replay folds them again, the same
        # arithmetic whatever the server it runs on would choose.
        **({"codes": True} if update.quantized is not None else {}),
    }


def payload_sizes(layout: ModelLayout, main: str) -> dict[str, int]:
    """Name -> elements of an upload: ``main`` ("update" or "weights", D) and, when the model has
    float buffers, "buffers" (B): every update and initial model must carry the statistics."""
    b = layout.buffer_numel
    return {main: layout.numel, **({"buffers": b} if b else {})}


def staging_slot(layout: ModelLayout, pin_memory: bool = False) -> StagingSlot:
    """A landing area for one upload of this model: [D] plus the [B] float buffers, if any."""
    b = layout.buffer_numel
    return StagingSlot(layout.numel, {"buffers": b} if b else None, pin_memory=pin_memory)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def rebuild(config: ServerConfig, directory: str | os.PathLike, checkpoint: int) -> Federation:
    """A fresh federation from checkpoint ``checkpoint`` of ``directory`` plus every record
    logged after it, as recovery does it (from the first checkpoint when nothing was pruned:
    an audit of the whole log, and the oracle of the crash tests). Needs no event loop."""
    fed = Federation(config)

    def run() -> None:
        restore(fed, D.load_checkpoint(D.checkpoint_path(directory, checkpoint)))
        privacy = fed.strategy.privacy if fed.strategy is not None else None
        if privacy is not None:  # what recovery republishes is charged twice
            privacy.begin_recovery()
        for _, record in D.iter_records(directory, checkpoint):
            fed.replay(record)
        if privacy is not None:
            privacy.end_recovery()
        fed.publish_recovered()

    try:
        # As live and as recovery: same kernels, same thread.
        fed.aggregation.on_aggregation_thread(run)
    finally:
        fed.shutdown_threads()
    return fed


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)
