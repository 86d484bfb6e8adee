"""Federation state behind the gRPC service: the strategy and the one aggregation thread that
drives it, the client registry with leases, retained model snapshots, staging slots, counters.

Every strategy call runs on a single worker thread (the aggregation loop), one at a time, so a
strategy needs no locks and heavy kernels never block the event loop that serves gRPC.

Durability: every call that changes the strategy's state (a registration, a job, an accepted
update, a timer) runs through one of the methods below, which read the clock on the aggregation
thread and append a record of the call and its time to the write-ahead log there, in the order
the calls ran. Replaying those records against the newest checkpoint repeats the same calls with
the same inputs, so a restarted server reaches the same state bit for bit. Registrations, jobs and
updates are acknowledged only once their record is fsynced (group commit). A GetJob that changed
nothing (the same job again, or none yet) is not logged. A new version reaches readers (GetModel,
GetStatus, jobs) only once the record that made it is fsynced, so a version number always names
the model a restarted server has under that number.

Sharding (docs/sharding.md): on a sharded server the same records are the replicated log. Rank 0
announces each call to the other shards (``_replicate``) right before making it, on its
aggregation thread; the other shards' aggregation thread (``follow``) makes the same calls with
the same inputs on their slices, so every shard takes the same decisions at the same versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import types
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from aggsrv.layout import ModelLayout
from aggsrv.server import shards as S
from aggsrv.server.config import ServerConfig
from aggsrv.server.durability import WalRecord
from aggsrv.server.metrics import ServerMetrics
from aggsrv.server.persistence import replay
from aggsrv.sharding import ShardLayout, ShardMap
from aggsrv.strategies import (
    InvalidUpdate,
    Job,
    Outcome,
    Status,
    Strategy,
    StrategyError,
    Update,
    make_strategy,
)
from aggsrv.transport import StagingSlot

log = logging.getLogger(__name__)
T = TypeVar("T")
# The default checkpoint_every_bytes is 4x the model or twice the newest checkpoint, but not
# below this: a small model's checkpoint costs its fixed overheads (fsyncs, a new segment, the
# update-id ledger) whatever its size, and replaying this much log takes well under a second.
MIN_CHECKPOINT_EVERY_BYTES = 16 << 20


@dataclass
class ClientRecord:
    """What the server knows of one registered client."""

    client_id: str
    registered_at: float
    lease_expires: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """One retained version: immutable [D] weights (and [B] float buffers, None without any)
    that readers can stream without locks."""

    version: int
    weights: torch.Tensor
    created_at: float
    buffers: torch.Tensor | None = None
    # The host copy of a device version, made once off the event loop and shared by every
    # reader (Federation.on_host): {"copy": the future of {"weights": ..., "buffers": ...}}.
    host: dict[str, asyncio.Future] = field(default_factory=dict, compare=False, repr=False)

    def tensors(self, include_buffers: bool) -> dict[str, torch.Tensor]:
        """The named flat tensors GetModel streams."""
        out = {"weights": self.weights}
        if include_buffers and self.buffers is not None:
            out["buffers"] = self.buffers
        return out


def needs_host_copy(t: torch.Tensor) -> bool:
    """Whether streaming ``t`` needs a device-to-host copy first."""
    return t.device.type != "cpu"


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor (blocking: run it off the event loop)."""
    return t.detach().to("cpu")


class EventLog:
    """Appends strategy events to a JSON-lines file, one flushed line per event (the file
    outlives a crash; events are diagnostics, not state)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        log.info("event %s at v%s", record.get("event"), record.get("version"))


class DurabilityError(RuntimeError):
    """The write-ahead log could not be written or synced: the server stops taking writes."""


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
        self.started_at = clock()
        self.device = _resolve_device(config.device)
        self.layout: ModelLayout | None = None
        self.strategy: Strategy | None = None
        self.clients: dict[str, ClientRecord] = {}
        self.snapshots: OrderedDict[int, Snapshot] = OrderedDict()
        self.counters: Counter[str] = Counter()
        self.rejected_by_code: Counter[str] = Counter()
        self.uploads_in_progress = 0  # uploads occupying a staging slot
        self.updates_waiting = 0  # validated updates handed to the aggregation loop, not yet done
        self.in_flight_updates: set[tuple[str, str]] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggregation")
        self._slots: asyncio.Queue[StagingSlot] | None = None
        self._changed = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self.closing = False
        # Set by the server when a state directory is configured (aggsrv.server.persistence).
        self.store: Any = None
        self.failure: str | None = None  # why the server stopped taking writes
        self.on_failure: Callable[[str], None] | None = None
        self._sync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="wal-sync")
        # Accepted updates logged since the newest checkpoint (replayed ones included): counted
        # and reset on the aggregation thread, where the log is cut.
        self.updates_since_checkpoint = 0
        # Versions made on the aggregation thread, waiting for their log record to be fsynced
        # before readers see them: (snapshot, LSN of the record; None without a log).
        self._unpublished: deque[tuple[Snapshot, int | None]] = deque()
        self._captured = -1  # the last version queued there
        # The LSN of the newest record whose call issued a job (any kind of call may), and the
        # number of jobs issued by then: a job handed out again is durable once that LSN is.
        self._issue_lsn: int | None = None
        self._jobs_logged = 0
        self.published_version = 0  # the newest version readers see
        self.last_checkpoint: tuple[int, float] | None = None  # (version, time)
        self.last_eval: tuple[int, dict[str, float]] | None = None
        self._checkpoint_lock = asyncio.Lock()
        self._checkpoint_task: asyncio.Task | None = None
        # Set by the server of a sharded federation (aggsrv.server.shards).
        self.shards: S.ShardGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_coordinator_stop: Callable[[], None] | None = None

    @property
    def follower(self) -> bool:
        """A shard of rank >= 1: rank 0 orders its strategy calls."""
        return self.shards is not None and not self.shards.is_coordinator

    # ------------------------------------------------------------------ the aggregation loop

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the aggregation thread, after every call queued before it."""
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._executor, fn, *args)
        self.publish()
        return result

    def on_aggregation_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the aggregation thread and wait for it, from a thread that is not
        serving (an offline replay: torch's kernels cost the same there as live)."""
        return self._executor.submit(fn, *args).result()

    def publish(self) -> None:
        """Publish the new versions whose log records are durable, wake waiting job streams,
        re-arm timers (event loop)."""
        strategy = self.strategy
        if strategy is None:
            return
        wal = self._wal()
        if wal is None and not self._unpublished and strategy.version != self.published_version:
            # Calls made without _log (a shard following rank 0): the current version as is.
            self._capture(None)
        durable = wal.durable_lsn if wal is not None else 0
        published = False
        while self._unpublished:
            snap, lsn = self._unpublished[0]
            if lsn is not None and lsn > durable:
                break  # not on disk yet: its ack's make_durable publishes it
            self._unpublished.popleft()
            self._retain(snap)
            published = True
        if published:
            self._changed.set()
            self._changed = asyncio.Event()
        self._arm_timer()

    def _capture(self, lsn: int | None) -> None:
        """Queue the strategy's version for publication if it is new (aggregation thread, right
        after the call that made it): its tensors as they are now, published once ``lsn`` is
        durable."""
        strategy = self.strategy
        if strategy is None or strategy.version == self._captured:
            return
        self._captured = strategy.version
        snap = Snapshot(
            strategy.version, strategy.global_model(), self.clock(), strategy.global_buffers()
        )
        self._unpublished.append((snap, lsn))

    def publish_recovered(self) -> None:
        """After recovery replayed the log (all of it durable): publish the state reached."""
        strategy = self.strategy
        assert strategy is not None
        self._unpublished.clear()
        self._captured = strategy.version
        self._jobs_logged, self._issue_lsn = strategy.jobs_issued, None  # replayed: on disk
        if strategy.version != self.published_version:
            self._retain(
                Snapshot(
                    strategy.version, strategy.global_model(), self.clock(),
                    strategy.global_buffers(),
                )
            )  # fmt: skip

    def _wal(self) -> Any:
        return self.store.wal if self.store is not None else None

    def notify(self) -> None:
        """Wake job streams waiting for a state change (a registration, a round opening)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, timeout: float) -> None:
        """Return after the next state change or `timeout` seconds."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.strategy.next_deadline() if self.strategy is not None else None
        if deadline is None or self.closing or self.follower:  # rank 0 orders the timers
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, deadline - self.clock())
        self._timer = loop.call_later(delay, lambda: loop.create_task(self._fire_timer()))

    async def _fire_timer(self) -> None:
        if self.strategy is None or self.closing:
            return
        strategy = self.strategy

        def run() -> int | None:
            now = self.clock()
            self._replicate("timer", {"now": now})
            strategy.on_timer(now)
            return self._log("timer", {"now": now})

        try:
            lsn = await self.call(run)
            await self.logged(lsn)  # a version the timer made reaches readers once durable
        except DurabilityError:
            return  # the federation stopped taking writes; fail() said why
        self.notify()

    # ------------------------------------------------------------------ logged state changes

    def _log(
        self, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None
    ) -> int | None:
        """Append a record of a state change (aggregation thread); its LSN, None without a log.
        A failed write stops the server: the state in memory is then ahead of the log. A version
        the call made is queued for publication once the record is durable."""
        if kind == "update":
            self.updates_since_checkpoint += 1
        wal = self._wal()
        lsn = None
        if wal is not None:
            try:
                lsn = wal.append(kind, meta, tensors)
            except Exception as exc:
                self.fail(f"could not append to the write-ahead log: {exc}")
                raise DurabilityError(self.failure) from exc
        self._capture(lsn)
        strategy = self.strategy
        if strategy is not None and strategy.jobs_issued != self._jobs_logged:
            self._jobs_logged = strategy.jobs_issued
            self._issue_lsn = lsn
        return lsn

    async def make_durable(self, lsn: int | None) -> None:
        """Return once the log is fsynced up to ``lsn`` (shared fsyncs: group commit)."""
        wal = self._wal()
        if lsn is None or wal is None or wal.durable_lsn >= lsn:
            return  # nothing to wait for (and no thread hop)
        t0 = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(self._sync_pool, wal.sync, lsn)
        except Exception as exc:
            self.fail(f"could not fsync the write-ahead log: {exc}")
            raise DurabilityError(self.failure) from exc
        self.metrics.fsync_seconds.observe(time.perf_counter() - t0)

    async def logged(self, lsn: int | None) -> None:
        """After a logged call (event loop): wait until its record is durable, publish what that
        made durable, and checkpoint if the log has grown enough."""
        await self.make_durable(lsn)
        self.publish()
        self.checkpoint_if_due()

    def _collective(self, fn: Callable[..., T], *args: Any) -> T:
        """A collective between the shards (aggregation thread). A lost shard stops the
        federation taking writes, like a failed log write: the shards must not diverge."""
        try:
            return fn(*args)
        except S.ShardLost as exc:
            self.fail(str(exc))
            raise DurabilityError(self.failure) from exc

    def _replicate(self, kind: str, meta: dict[str, Any]) -> None:
        """Rank 0 of a sharded federation: announce the call about to be made."""
        if self.shards is not None:
            self._collective(self.shards.announce, kind, meta)

    def _vote(self, update: Update) -> None:
        """All or none: every shard checks its slice, and one refusal refuses the update
        everywhere (raised as the refusal) before any state changes."""
        shards = self.shards
        if shards is None:
            return
        verdict, own = S.slice_verdict(self.strategy, update)
        votes = self._collective(shards.vote, verdict)
        if max(votes):
            raise S.refusal(votes, shards.rank, own, update.update_id, shards.slice_wait)

    # ------------------------------------------------------------------ shards of rank >= 1

    def follow(self) -> None:
        """The aggregation thread of a shard of rank >= 1: make the calls rank 0 announces, in
        its order, until it announces "stop" or a collective fails."""
        shards = self.shards
        loop = self._loop
        assert shards is not None and loop is not None
        while True:
            kind = "next"
            try:
                kind, meta = shards.receive()
                if kind == "stop":
                    log.info("rank 0 stopped the federation")
                    if self.on_coordinator_stop is not None:
                        loop.call_soon_threadsafe(self.on_coordinator_stop)
                    return
                self._follow_call(kind, meta)
            except S.ShardLost as exc:
                loop.call_soon_threadsafe(self.fail, str(exc))
                return
            except Exception as exc:  # a bug: this shard's state may now differ from rank 0's
                log.exception("shard %d could not follow a %s call", shards.rank, kind)
                loop.call_soon_threadsafe(self.fail, f"could not follow rank 0's calls: {exc}")
                return
            if kind != "noop":
                loop.call_soon_threadsafe(self._followed)

    def _followed(self) -> None:
        """After a followed call (event loop): publish a new version, wake waiting handlers
        (a slice of a job waits for the job to exist here)."""
        self.publish()
        self.notify()

    def _follow_call(self, kind: str, meta: dict[str, Any]) -> None:
        if kind == "noop":
            return
        if kind == "adopt":
            whole = ModelLayout.from_dict(meta["layout"])
            weights = self.shards.share_model(None, whole.numel)
            self.install(*self._build(whole, weights, None))
            return
        assert self.strategy is not None, f"a {kind} call before the model"
        now = float(meta["now"])
        # A call rank 0's strategy refused changed nothing there; it changes nothing here.
        with contextlib.suppress(StrategyError):
            if kind == "update":  # its data is this shard's own slice, and the shards vote
                self._follow_update(meta, now)
            else:  # the same records a restarted server replays from its log
                replay(self, WalRecord(kind, meta))

    def _follow_update(self, meta: dict[str, Any], now: float) -> None:
        shards = self.shards
        strategy = self.strategy
        staged = shards.staged.take((meta["client"], meta["update_id"]), shards.slice_wait)
        verdict, own, update = S.SLICE_MISSING, None, None
        if staged is not None:
            update = staged.update
            mismatch = _header_mismatch(update, meta)
            if mismatch:
                verdict = S.SLICE_INVALID
                own = InvalidUpdate(
                    f"the header of the slice sent to shard {shards.rank} differs from the one "
                    f"sent to rank 0 ({mismatch}); no shard applied the update"
                )
            else:
                verdict, own = S.slice_verdict(strategy, update)
        votes = shards.vote(verdict)
        if max(votes):
            error = S.refusal(votes, shards.rank, own, meta["update_id"], shards.slice_wait)
            if staged is not None:
                staged.resolve(error=error)
            return
        assert staged is not None and update is not None
        s = strategy.version - update.base_version
        try:
            outcome = strategy.on_update(update, now)
        except StrategyError as exc:
            staged.resolve(error=exc)
            return
        if outcome.original is None:
            self.count_accepted(outcome)
        else:
            self.counters["duplicate"] += 1
        staged.resolve((s, outcome))

    async def apply_slice(self, update: Update) -> tuple[int, Outcome]:
        """A shard of rank >= 1: hold this slice until rank 0 orders its update, then answer
        the outcome every shard reached (or the refusal); (staleness, outcome)."""
        shards = self.shards
        assert shards is not None
        loop = asyncio.get_running_loop()
        key = (update.client_id, update.update_id)
        staged = S.StagedSlice(update, loop.create_future(), loop)
        if not shards.staged.put(key, staged):
            raise S.SliceMissing(f"update {update.update_id!r} is being uploaded already")
        try:
            return await asyncio.wait_for(asyncio.shield(staged.done), shards.order_wait)
        except TimeoutError:
            if shards.staged.withdraw(key, staged):
                raise S.SliceMissing(
                    f"rank 0 did not order update {update.update_id!r} within "
                    f"{shards.order_wait:g} s (shard_order_wait_seconds): its slice for rank 0 "
                    "did not arrive or was refused there; send the update again"
                ) from None
            return await staged.done
        except asyncio.CancelledError:
            # The caller went away; the slot under this slice is freed after we return, so the
            # aggregation thread must be done with it first.
            if not shards.staged.withdraw(key, staged):
                with contextlib.suppress(Exception):
                    await asyncio.shield(staged.done)
            raise

    async def keep_alive(self) -> None:
        """Rank 0: announce a no-op when idle, so the other shards' wait for the next call never
        times out and a lost shard is noticed within a heartbeat."""
        shards = self.shards
        assert shards is not None and shards.is_coordinator
        while not self.closing:
            await asyncio.sleep(shards.heartbeat / 2)
            if self.closing:
                return
            if time.monotonic() - shards.last_announce >= shards.heartbeat:
                with contextlib.suppress(DurabilityError):
                    await self.call(self._replicate, "noop", {})

    def fail(self, reason: str) -> None:
        """Stop taking writes for good (an operator restarts with --resume)."""
        if self.shards is not None:
            self.shards.staged.fail_all(DurabilityError(reason))
        if self.failure is None:
            self.failure = reason
            log.critical("%s; refusing all further calls (restart with --resume)", reason)
            if self.on_failure is not None:
                self.on_failure(reason)
        self.closing = True

    def count_accepted(self, outcome: Outcome) -> None:
        """Count an accepted update (served or replayed from the log)."""
        self.counters["accepted"] += 1
        if outcome.status is Status.APPLIED:
            self.counters["applied"] += 1

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

    async def register(self, client_id: str, labels: dict[str, str]) -> tuple[bool, ClientRecord]:
        """Register (or re-register) a client; (known before, its record)."""
        strategy = self.strategy
        assert strategy is not None

        def run() -> tuple[bool, ClientRecord, int | None]:
            now = self.clock()
            known = client_id in self.clients
            meta = {"client": client_id, "now": now, "labels": labels}
            self._replicate("register", meta)
            strategy.on_register(client_id, now)
            record = self.record_registration(client_id, labels, now)
            lsn = self._log("register", meta)
            return known, record, lsn

        known, record, lsn = await self.call(run)
        await self.logged(lsn)
        return known, record

    async def next_job(self, client_id: str) -> Job | None:
        """Ask the strategy for the client's next job (None: not yet). A job goes out only once
        its record is durable, so an update for it is never refused as unknown after a crash.

        Only a call that changed the strategy's state (a new job, a round opened) is logged: the
        same job again, or none yet, adds nothing to the log, and needs no fsync once the log
        holds the job already."""
        strategy = self.strategy
        assert strategy is not None

        def run() -> tuple[Job | None, int | None]:
            now = self.clock()
            meta = {"client": client_id, "now": now}
            self._replicate("job", meta)
            before = strategy.change_count
            job = strategy.job_for(client_id, now)
            if strategy.change_count != before:
                return job, self._log("job", meta)
            # Unchanged: a job handed out again was logged when it was made, perhaps by a call
            # whose fsync is still running (no wait, and no fsync, once that record is durable).
            return job, (self._issue_lsn if job is not None else None)

        job, lsn = await self.call(run)
        await self.logged(lsn)
        return job

    async def apply_update(
        self, update: Update, wire: dict[str, torch.Tensor]
    ) -> tuple[int, Outcome]:
        """Fold one validated update in; (staleness, outcome), returned once durable.

        ``wire`` holds the decoded CPU tensors ("update" [, "buffers"]) that the log records."""
        strategy = self.strategy
        assert strategy is not None

        def run() -> tuple[int, Outcome, int | None, float]:
            now = self.clock()
            s = strategy.version - update.base_version  # V_apply - v_base, at apply time
            t0 = time.perf_counter()
            self._replicate("update", update_meta(update, now))
            self._vote(update)
            outcome = strategy.on_update(update, now)
            took = time.perf_counter() - t0
            if outcome.original is not None:
                self.counters["duplicate"] += 1
                # The original's record may still be on its way to disk: ack after it.
                wal = self._wal()
                return s, outcome, (wal.written_lsn if wal is not None else None), took
            self.count_accepted(outcome)
            lsn = self._log("update", update_record(update, now, outcome), wire)
            return s, outcome, lsn, took

        staleness, outcome, lsn, took = await self.call(run)
        self.metrics.aggregation_seconds.observe(took)
        await self.logged(lsn)
        return staleness, outcome

    # ------------------------------------------------------------------ checkpoints

    async def checkpoint(self) -> Any:
        """Checkpoint now (after the calls queued before); the written CheckpointInfo."""
        store = self.store
        if store is None:
            raise RuntimeError("no state_dir is configured: there is nowhere to checkpoint to")
        if self.strategy is None:
            raise RuntimeError("the server has no model yet")
        async with self._checkpoint_lock:
            t0 = time.perf_counter()
            # The state and the log rotation happen together on the aggregation thread, so
            # the new segment holds exactly the calls after the state.
            try:
                number, payload = await self.call(self._cut)
            except OSError as exc:
                self.fail(f"could not rotate the write-ahead log: {exc}")
                raise DurabilityError(self.failure) from exc
            loop = asyncio.get_running_loop()
            info = await loop.run_in_executor(None, store.write, number, payload)
            self.last_checkpoint = (info.version, self.clock())
            self.metrics.checkpoints.inc()
            self.metrics.checkpoint_seconds.observe(time.perf_counter() - t0)
            return info

    def _cut(self) -> tuple[int, dict[str, Any]]:
        """(Aggregation thread) the state and a fresh log segment; the counts start again."""
        number, payload = self.store.cut(self)
        self.updates_since_checkpoint = 0
        return number, payload

    def checkpoint_if_due(self) -> None:
        """Start a checkpoint when enough updates or log bytes piled up since the last one
        (both counted from the last checkpoint, across restarts)."""
        store = self.store
        if store is None or self.strategy is None:
            return
        every = self.config.checkpoint_every_updates
        limit = self.checkpoint_bytes_limit()
        if (every and self.updates_since_checkpoint >= every) or (
            limit and store.log_bytes() >= limit
        ):
            self.checkpoint_soon()

    def checkpoint_bytes_limit(self) -> int:
        """checkpoint_every_bytes, or by default the larger of 4x the model's bytes and twice
        the newest checkpoint's (a strategy with a [K, D] cache checkpoints K models: writing
        that every few updates would cost more than the log it saves), at least 16 MiB."""
        every = self.config.checkpoint_every_bytes
        if every is not None:
            return every
        whole = self.layout.whole if self.layout is not None else None
        model_bytes = 4 * (whole.numel + whole.buffer_numel) if whole is not None else 0
        newest = self.store.checkpoint_bytes if self.store is not None else 0
        return max(4 * model_bytes, 2 * newest, MIN_CHECKPOINT_EVERY_BYTES)

    def checkpoint_soon(self) -> None:
        """Start a checkpoint in the background unless one is running."""
        if self.store is None or self.strategy is None or self.closing:
            return
        task = self._checkpoint_task
        if task is not None and not task.done():
            return
        self._checkpoint_task = asyncio.get_running_loop().create_task(self._checkpoint_logged())

    async def _checkpoint_logged(self) -> None:
        try:
            await self.checkpoint()
        except Exception:
            log.exception("checkpoint failed")

    # ------------------------------------------------------------------ model and versions

    def adopt(
        self, layout: ModelLayout, weights: torch.Tensor, buffers: torch.Tensor | None = None
    ) -> None:
        """Create the strategy from the first model (initial weights and float buffers become
        version 0); with a state directory, checkpoint it before anything else happens."""
        # Built before the other shards hear of it: a model this strategy refuses (ValueError)
        # reaches no shard.
        local, strategy = self._build(layout, weights, buffers)
        if self.shards is not None:
            self._replicate("adopt", {"layout": layout.to_dict()})
            self._collective(self.shards.share_model, weights, layout.numel)
        self.install(local, strategy)
        if self.store is not None:
            info = self.store.begin(self)
            self.last_checkpoint = (info.version, self.clock())
        log.info(
            "model adopted: %d parameters in %d tensors, layout %s, strategy %s",
            layout.numel, len(layout.names), layout.hash[:12], strategy.name,
        )  # fmt: skip

    def _build(
        self, layout: ModelLayout, weights: torch.Tensor, buffers: torch.Tensor | None
    ) -> tuple[ModelLayout | ShardLayout, Strategy]:
        """The layout served and the strategy of a first model; a shard's, on its slice."""
        cfg = self.config
        reducer = None
        if self.shards is not None:
            shard_map = ShardMap.even(layout.numel, self.shards.world_size)
            self.shards.shard_map = shard_map
            layout = ShardLayout(layout, shard_map, self.shards.rank)
            weights = layout.local(weights).clone()
            buffers = buffers if layout.buffer_numel else None
            reducer = self.shards.reducer
        strategy = make_strategy(
            cfg.strategy,
            layout=layout,
            initial=weights,
            initial_buffers=buffers,
            config=cfg.strategy_config,
            device=self.device,
            max_clients=cfg.max_clients,
            reducer=reducer,
        )
        return layout, strategy

    def install(self, layout: ModelLayout, strategy: Strategy) -> None:
        """Serve ``strategy`` (new, or restored from a checkpoint) over ``layout``."""
        cfg = self.config
        if cfg.events_file and not self.follower:  # rank 0 writes the federation's events
            strategy.event_sink = EventLog(cfg.events_file)
        # The strategy last: a shard of rank >= 1 installs from its aggregation thread, and
        # handlers take a set strategy to mean that the rest is ready.
        self.layout = layout
        slots: asyncio.Queue[StagingSlot] = asyncio.Queue()
        for _ in range(cfg.max_concurrent_uploads):
            slots.put_nowait(staging_slot(layout, pin_memory=self.device.type == "cuda"))
        self._slots = slots
        self.snapshots.clear()
        self._unpublished.clear()
        self._captured = strategy.version
        self._jobs_logged, self._issue_lsn = strategy.jobs_issued, None  # on disk already
        self._retain(
            Snapshot(
                strategy.version, strategy.global_model(), self.clock(), strategy.global_buffers()
            )
        )
        self.strategy = strategy

    def _retain(self, snap: Snapshot) -> None:
        self.snapshots[snap.version] = snap
        while len(self.snapshots) > self.config.retained_versions:
            self.snapshots.popitem(last=False)
        self.published_version = snap.version

    @property
    def version(self) -> int:
        """The newest version readers see (durable, in the durable mode); the strategy may be a
        few calls ahead while their records are being fsynced."""
        return self.published_version if self.strategy is not None else 0

    def latest(self) -> Snapshot:
        return next(reversed(self.snapshots.values()))

    # ------------------------------------------------------------------ host copies

    async def on_host(self, snap: Snapshot, include_buffers: bool) -> dict[str, torch.Tensor]:
        """The tensors GetModel streams, on the host: a device version's host copy is made once,
        off the event loop, and shared by every reader of that version."""
        tensors = snap.tensors(include_buffers)
        if not any(needs_host_copy(t) for t in tensors.values()):
            return tensors
        host = await self._host_copy(snap)
        return {name: host[name] for name in tensors}

    async def job_on_host(self, job: Job) -> dict[str, torch.Tensor]:
        """A job's tensors on the host: the weights (and buffers) of a retained version from its
        shared host copy, any other device tensor (a basis, a client's own model) copied off
        the event loop."""
        tensors = dict(job.tensors)
        if not any(needs_host_copy(t) for t in tensors.values()):
            return tensors
        snap = self.snapshots.get(job.base_version)
        shared = {}
        if snap is not None:
            shared = {id(snap.weights): "weights"}
            if snap.buffers is not None:
                shared[id(snap.buffers)] = "buffers"
        out: dict[str, torch.Tensor] = {}
        rest: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if id(t) in shared:
                assert snap is not None
                out[name] = (await self._host_copy(snap))[shared[id(t)]]
            elif needs_host_copy(t):
                rest[name] = t
            else:
                out[name] = t
        if rest:
            loop = asyncio.get_running_loop()
            out.update(await loop.run_in_executor(None, _all_to_host, rest))
        return {name: out[name] for name in tensors}

    async def _host_copy(self, snap: Snapshot) -> dict[str, torch.Tensor]:
        """{"weights", "buffers"} of ``snap`` on the host, copied once per version (in an
        executor thread: the event loop keeps serving meanwhile)."""
        future = snap.host.get("copy")
        if future is None:
            tensors = {"weights": snap.weights}
            if snap.buffers is not None:
                tensors["buffers"] = snap.buffers
            future = asyncio.get_running_loop().run_in_executor(None, _all_to_host, tensors)
            snap.host["copy"] = future

            def forget_failure(f: asyncio.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    snap.host.pop("copy", None)  # the next reader tries again

            future.add_done_callback(forget_failure)
        # Shielded: a reader that goes away does not cancel the copy the others wait for.
        return await asyncio.shield(future)

    # ------------------------------------------------------------------ clients and slots

    def touch(self, client_id: str) -> None:
        """Renew a client's lease."""
        rec = self.clients.get(client_id)
        if rec is not None:
            rec.lease_expires = self.clock() + self.config.lease_seconds

    def active_clients(self) -> int:
        now = self.clock()
        # list(): the aggregation thread may add a client meanwhile.
        return sum(1 for r in list(self.clients.values()) if r.lease_expires >= now)

    async def acquire_slot(self) -> StagingSlot:
        """Wait for a free staging slot: the backpressure that bounds concurrent uploads."""
        assert self._slots is not None
        return await self._slots.get()

    def release_slot(self, slot: StagingSlot) -> None:
        assert self._slots is not None
        self._slots.put_nowait(slot)

    def cache_bytes(self) -> int:
        """Bytes of the tensors the strategy holds (model, caches, job bases, snapshots of
        retained versions), each storage counted once."""
        seen: dict[tuple[str, int], int] = {}

        def visit(obj: Any, depth: int = 0) -> None:
            if depth > 6:
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
        for snap in list(self.snapshots.values()):
            visit(snap.weights)
            visit(snap.buffers)
        return sum(seen.values())

    def queue_depth(self) -> int:
        """Validated updates waiting for (or being folded in by) the aggregation loop."""
        return self.updates_waiting

    def reject(self, code_name: str) -> None:
        self.counters["rejected"] += 1
        self.rejected_by_code[code_name] += 1

    async def close(self) -> None:
        self.closing = True
        if self._timer is not None:
            self._timer.cancel()
        task = self._checkpoint_task
        if task is not None and not task.done():
            await asyncio.wait([task])

    async def shutdown_executors(self) -> None:
        """Stop the aggregation and log-sync threads (after :meth:`close` and the final
        checkpoint)."""
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown_threads)

    def shutdown_threads(self) -> None:
        """Blocking form of :meth:`shutdown_executors` (a federation that never served)."""
        self._executor.shutdown()
        self._sync_pool.shutdown()


def _all_to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: to_host(t) if needs_host_copy(t) else t for name, t in tensors.items()}


def update_record(update: Update, now: float, outcome: Outcome) -> dict[str, Any]:
    """The log's description of an accepted update: everything replay needs but the tensors."""
    return {**update_meta(update, now), "outcome": list(outcome.to_tuple())}


def update_meta(update: Update, now: float) -> dict[str, Any]:
    """An update's call without its tensors or outcome (what rank 0 announces to the shards)."""
    return {
        "client": update.client_id,
        "job_id": update.job_id,
        "base_version": update.base_version,
        "update_id": update.update_id,
        "num_samples": update.num_samples,
        "work_done": update.work_done,
        "kind": update.kind.name,
        "now": now,
    }


def _header_mismatch(update: Update, meta: dict[str, Any]) -> str:
    """How a shard's copy of an update's header differs from rank 0's ("" when it does not)."""
    ours = {
        "job_id": update.job_id,
        "base_version": update.base_version,
        "num_samples": update.num_samples,
        "work_done": update.work_done,
        "kind": update.kind.name,
    }
    theirs = {k: meta[k] for k in ours}
    return ", ".join(f"{k}: {ours[k]!r} here, {theirs[k]!r} there" for k in ours
                     if ours[k] != theirs[k])  # fmt: skip


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
