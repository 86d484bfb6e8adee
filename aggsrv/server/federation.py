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
After each call the shards compare what it did (``_agree``): a shard that differs has diverged,
and the federation stops on every shard.

Fail-stop: a strategy refuses a call with a StrategyError and changes nothing. Any other
exception on the aggregation thread (a bug, an allocation that fails) may leave the strategy
half-changed and the call unlogged, so the federation stops taking writes (``fail``), as when the
log cannot be written: nothing more runs on the strategy or is published, and a restart with
--resume rebuilds the state from the log, without the half-made call. The event loop reads
strategy state only through the aggregation thread (``read``) or what a call left behind
(``_Settled``), never beside a call half made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import types
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from aggsrv.layout import ModelLayout
from aggsrv.server import durability as D
from aggsrv.server import shards as S
from aggsrv.server.config import ServerConfig
from aggsrv.server.durability import WalRecord
from aggsrv.server.metrics import ServerMetrics
from aggsrv.server.persistence import RecoveryError, StateStore, restore
from aggsrv.sharding import ShardLayout, ShardMap
from aggsrv.strategies import (
    InvalidUpdate,
    Job,
    Outcome,
    ShardsDisagree,
    Status,
    Strategy,
    StrategyError,
    Update,
    UpdateKind,
    make_strategy,
)
from aggsrv.transport import StagingSlot

log = logging.getLogger(__name__)
T = TypeVar("T")
# The default checkpoint_every_bytes is 4x the model or twice the newest checkpoint, but not
# below this: a small model's checkpoint costs its fixed overheads (fsyncs, a new segment, the
# update-id ledger) whatever its size, and replaying this much log takes well under a second.
MIN_CHECKPOINT_EVERY_BYTES = 16 << 20

# How often a released staging slot asks whether the device copies out of it are done.
SLOT_POLL_SECONDS = 0.001


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


class AggregationFailed(DurabilityError):
    """The federation stopped taking writes for another reason (an unexpected exception on the
    aggregation thread, shards that diverged, a lost shard): refused like a failed log write."""


@dataclass(frozen=True)
class _Settled:
    """What the event loop publishes after a call, read on the aggregation thread when the call
    is done: the loop never reads the strategy while the next call may be half made."""

    version: int
    weights: torch.Tensor
    buffers: torch.Tensor | None
    deadline: float | None

    @classmethod
    def of(cls, strategy: Strategy) -> _Settled:
        return cls(
            strategy.version,
            strategy.global_model(),
            strategy.global_buffers(),
            strategy.next_deadline(),
        )


@dataclass
class _Reply:
    """The answer to the slice a shard of rank >= 1 took for the update it is following."""

    staged: S.StagedSlice
    result: Any = None
    error: BaseException | None = None


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
        self._failure_lock = threading.Lock()
        self._settled: _Settled | None = None  # the strategy after the last call
        self._version = 0  # the latest published version
        self._announced: tuple[str, dict[str, Any]] | None = None  # rank 0: the call being made
        self._reply: _Reply | None = None  # a shard of rank >= 1: the slice being followed
        # Whole models offered to a sharded rank 0 (its staging slots hold its slice only).
        self._whole_slots = asyncio.Semaphore(config.max_concurrent_uploads)
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

    async def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        refusals: tuple[type[Exception], ...] = (),
        after_failure: bool = False,
    ) -> T:
        """Run `fn(*args)` on the aggregation thread, after every call queued before it.

        Fail-stop: `fn` refuses with a StrategyError (which changes nothing) or one of
        ``refusals``. Any other exception may have left the strategy half-changed and the call
        unlogged: the federation stops taking writes (:meth:`fail`), and this call and every
        later one raise AggregationFailed (``after_failure`` runs `fn` anyway: leaving the
        shard group)."""
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            self._executor, self._run_call, fn, args, refusals, after_failure
        )
        if self.failure is None:
            self.publish()
        return result

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)`, a read of strategy state, on the aggregation thread between two
        calls, so it never sees one half made. Runs after a failure too (what it reads may then
        be half-changed: a caller that answers from it checks :attr:`failure`)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _run_call(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        refusals: tuple[type[Exception], ...],
        after_failure: bool,
    ) -> T:
        """(aggregation thread) :meth:`call`'s rule; a sharded rank 0 then compares what the
        call it announced did with the other shards (:meth:`_agree`)."""
        if self.failure is not None and not after_failure:
            raise AggregationFailed(self.failure)
        self._announced = None
        try:
            result = fn(*args)
        except StrategyError:
            self._agree_on_announced(refused=True)
            raise
        except DurabilityError:  # fail() said why
            raise
        except refusals:
            raise
        except ShardsDisagree as exc:
            raise self._stop_on_divergence(exc, self._announced) from exc
        except Exception as exc:
            raise self._stop_on_unexpected(exc, getattr(fn, "__qualname__", repr(fn))) from exc
        self._agree_on_announced(refused=False)
        self._settle()
        return result

    def _stop_on_divergence(
        self, exc: ShardsDisagree, call: tuple[str, dict[str, Any]] | None
    ) -> AggregationFailed:
        """Fail-stop when the strategy found, in the middle of a call, that the shards took
        different branches (every shard sees the same sums, so all stop)."""
        what = S.describe_call(*call) if call is not None else "a call"
        self.fail(f"the shards diverged on {what}: {exc}")
        return AggregationFailed(self.failure)

    def _stop_on_unexpected(self, exc: Exception, where: str) -> AggregationFailed:
        """Fail-stop after an exception a call does not refuse with (aggregation thread)."""
        self.fail(
            f"unexpected {type(exc).__name__} on the aggregation thread in {where}: {exc} (the "
            "strategy may be half-changed; the call was not logged)",
            exc,
        )
        return AggregationFailed(self.failure)

    def _settle(self) -> None:
        """(aggregation thread, after a call) What :meth:`publish` will publish."""
        if self.strategy is not None:
            self._settled = _Settled.of(self.strategy)

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
        # What the last call left (read on the aggregation thread); the strategy itself only
        # when no call ran yet (a resumed or restored server, before it serves).
        state = self._settled or _Settled.of(strategy)
        wal = self._wal()
        if wal is None and not self._unpublished and state.version != self.published_version:
            # Calls made without _log (a shard following rank 0): the version the call left.
            self._captured = state.version
            snap = Snapshot(state.version, state.weights, self.clock(), state.buffers)
            self._unpublished.append((snap, None))
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
        self._arm_timer(state.deadline)

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

    def _arm_timer(self, deadline: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
            self._announced = (kind, meta)

    def _agree_on_announced(self, refused: bool) -> None:
        """Rank 0, after making the call it announced (aggregation thread)."""
        announced, self._announced = self._announced, None
        if announced is not None:
            self._agree(*announced, refused)

    def _agree(self, kind: str, meta: dict[str, Any], refused: bool) -> None:
        """Every shard, after a call rank 0 ordered (aggregation thread): one small all_reduce
        compares what the call did on each shard (refused or not, the version, jobs issued,
        clients). The shards make the same calls on the same state, so a shard that differs
        has diverged; every shard sees the same comparison, so all stop taking writes."""
        shards = self.shards
        if shards is None or kind not in S.COMPARED_KINDS:
            return
        assert self.strategy is not None
        rows = self._collective(shards.compare, S.call_digest(self.strategy, refused))
        if rows is not None:
            self.fail(f"the shards diverged on {S.describe_call(kind, meta)}: {S.divergence(rows)}")
            raise AggregationFailed(self.failure)

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
        """The receiving thread of a shard of rank >= 1: take the calls rank 0 announces, in its
        order, and make each on the aggregation thread (where reads of the strategy queue too),
        until rank 0 announces "stop", a collective fails or the shards diverge."""
        shards = self.shards
        loop = self._loop
        assert shards is not None and loop is not None
        while True:
            try:
                kind, meta = shards.receive()
            except S.ShardLost as exc:
                self.fail(str(exc))
                return
            if kind == "stop":
                log.info("rank 0 stopped the federation")
                if self.on_coordinator_stop is not None:
                    loop.call_soon_threadsafe(self.on_coordinator_stop)
                return
            if kind == "noop":
                continue
            try:
                self._executor.submit(self._follow_step, kind, meta).result()
            except DurabilityError:  # fail() said why
                return
            except RuntimeError:  # the server stopped (its aggregation thread with it)
                return
            loop.call_soon_threadsafe(self._followed)

    def _followed(self) -> None:
        """After a followed call (event loop): publish a new version, wake waiting handlers
        (a slice of a job waits for the job to exist here)."""
        if self.failure is None:
            self.publish()
        self.notify()

    def _follow_step(self, kind: str, meta: dict[str, Any]) -> None:
        """(aggregation thread of a shard of rank >= 1) Make one call rank 0 made, compare what
        it did with the other shards, then answer the slice of an update."""
        self._reply = None
        try:
            refused = self._follow_call(kind, meta)
            self._agree(kind, meta, refused)
        except S.ShardLost as exc:
            self.fail(str(exc))
            self._answer_slice(AggregationFailed(self.failure))
            raise AggregationFailed(self.failure) from exc
        except DurabilityError as exc:  # a lost shard, shards that diverged: fail() said why
            self._answer_slice(exc)
            raise
        except ShardsDisagree as exc:
            error = self._stop_on_divergence(exc, (kind, meta))
            self._answer_slice(error)
            raise error from exc
        except Exception as exc:  # a bug: this shard's state may now differ from rank 0's
            error = self._stop_on_unexpected(exc, f"shard {self.shards.rank} following a {kind}")
            self._answer_slice(error)
            # Rank 0 may be waiting in a collective this shard will never join: leaving the
            # group ends its wait now rather than at shard_timeout_seconds.
            self.shards.close()
            raise error from exc
        self._answer_slice()
        self._settle()

    def _answer_slice(self, error: BaseException | None = None) -> None:
        reply, self._reply = self._reply, None
        if reply is not None:
            reply.staged.resolve(reply.result, error=error or reply.error)

    def _follow_call(self, kind: str, meta: dict[str, Any]) -> bool:
        """Make the call rank 0 announced; whether it was refused here."""
        if kind == "adopt":
            whole = ModelLayout.from_dict(meta["layout"])
            weights = self._collective(self.shards.share_model, None, whole.numel)
            self.install(*self._build(whole, weights, None))
            return False
        assert self.strategy is not None, f"a {kind} call before the model"
        if kind == "update":  # its data is this shard's own slice, and the shards vote
            return self._follow_update(meta, float(meta["now"]))
        try:  # the same records a restarted server replays from its log
            self.replay(WalRecord(kind, meta))
        except StrategyError:
            return True
        return False

    def _follow_update(self, meta: dict[str, Any], now: float) -> bool:
        """Follow an update on this shard's slice; whether it was refused here. The answer to
        the slice waits in :attr:`_reply` until the shards agree on the outcome."""
        shards = self.shards
        strategy = self.strategy
        staged = shards.staged.take((meta["client"], meta["update_id"]), shards.slice_wait)
        verdict, own, update = S.SLICE_MISSING, None, None
        if staged is not None:
            self._reply = _Reply(staged)
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
        votes = self._collective(shards.vote, verdict)
        if max(votes):
            if self._reply is not None:
                self._reply.error = S.refusal(
                    votes, shards.rank, own, meta["update_id"], shards.slice_wait
                )
            return True
        assert self._reply is not None and update is not None
        try:
            outcome = strategy.on_update(update, now)
        except StrategyError as exc:
            self._reply.error = exc
            return True
        s = _staleness(outcome, strategy.version - update.base_version)
        if outcome.original is None:
            self.count_accepted(outcome)
        else:
            self.counters["duplicate"] += 1
        self._reply.result = (s, outcome)
        return False

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

    def fail(self, reason: str, exc: BaseException | None = None) -> None:
        """Stop taking writes for good (an operator restarts with --resume); from any thread.
        The first reason is logged once, at CRITICAL, with ``exc``'s traceback if given."""
        with self._failure_lock:
            first = self.failure is None
            if first:
                self.failure = reason
        if self.shards is not None:
            self.shards.staged.fail_all(AggregationFailed(self.failure))
        self.closing = True
        if not first:
            return
        log.critical("%s; refusing all further calls (restart with --resume)", reason,
                     exc_info=exc)  # fmt: skip
        if self.on_failure is not None:
            self._on_loop(self.on_failure, reason)

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop: now when called there (or without a loop),
        else as soon as the loop gets to it."""
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            fn(*args)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def count_accepted(self, outcome: Outcome) -> None:
        """Count an accepted update (served or replayed from the log)."""
        self.counters["accepted"] += 1
        if outcome.status is Status.APPLIED:
            self.counters["applied"] += 1

    # ------------------------------------------------------------------ replaying the log

    def replay(self, record: WalRecord) -> None:
        """Repeat one logged call with its logged inputs: recovery replays the log with it, and a
        shard of rank >= 1 follows rank 0's calls with it. Called on the aggregation thread,
        before the server serves or in the follower's order, never beside another call."""
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
        elif record.kind == "update":
            tensors = record.tensors
            update = Update(
                client_id=m["client"],
                job_id=int(m["job_id"]),
                base_version=int(m["base_version"]),
                update_id=m["update_id"],
                num_samples=int(m["num_samples"]),
                work_done=float(m["work_done"]),
                kind=UpdateKind[m["kind"]],
                tensor=_on(tensors["update"], strategy.device),
                buffers=_on(tensors["buffers"], strategy.device) if "buffers" in tensors else None,
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

    def recover(self, store: StateStore) -> int:
        """Load the newest checkpoint of ``store`` and replay the log after it; the number of
        records replayed. The next records go to a new segment. Run it on the aggregation thread
        (before the server serves): replay makes the calls the live server made there."""
        number, path, payload = store.load_latest()
        restore(self, payload)
        self.last_checkpoint = (int(payload["state"]["version"]), float(payload["created_at"]))
        strategy = self.strategy
        assert strategy is not None
        sink, strategy.event_sink = strategy.event_sink, None  # its events were written already
        replayed = updates = 0
        t0 = time.perf_counter()
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
        self.publish_recovered()
        store.reopen(number)
        # Counted from the checkpoint, not from this start (the next checkpoint is due as if
        # the server had never stopped).
        self.updates_since_checkpoint = updates
        log.info(
            "resumed from checkpoint %d (%s): version %d after replaying %d logged records in "
            "%.2f s", number, path.name, self.version, replayed, time.perf_counter() - t0,
        )  # fmt: skip
        return replayed

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
            s = _staleness(outcome, s)
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
        self._version = snap.version  # one int: readable from any thread
        while len(self.snapshots) > self.config.retained_versions:
            self.snapshots.popitem(last=False)

    @property
    def version(self) -> int:
        """The newest version readers see (durable, in the durable mode); the strategy may be a
        few calls ahead while their records are being fsynced."""
        return self.published_version if self.strategy is not None else 0

    @property
    def published_version(self) -> int:
        """The latest published version, one GetModel serves now (0 before the model)."""
        return self._version

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

    def cache_bytes_between_calls(self, timeout: float = 10.0) -> int:
        """:meth:`cache_bytes` for a thread that may block (the metrics endpoint's): measured on
        the aggregation thread between two calls; 0 once that thread has stopped."""
        if self.strategy is None:
            return 0
        try:
            return self._executor.submit(self.cache_bytes).result(timeout)
        except RuntimeError:  # the executor shut down: the server is stopping
            return 0

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


def _staleness(outcome: Outcome, at_apply: int) -> int:
    """The staleness to answer: the one the strategy recorded when it accepted the update (for
    a DUPLICATE, the original's), else the version difference at apply time."""
    return outcome.staleness if outcome.staleness is not None else at_apply


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


def rebuild(config: ServerConfig, directory: str | os.PathLike, checkpoint: int) -> Federation:
    """A fresh federation from checkpoint ``checkpoint`` of ``directory`` plus every record
    logged after it, as recovery does it (from the first checkpoint when nothing was pruned:
    an audit of the whole log, and the oracle of the crash tests). Needs no event loop."""
    fed = Federation(config)

    def run() -> None:
        restore(fed, D.load_checkpoint(D.checkpoint_path(directory, checkpoint)))
        for _, record in D.iter_records(directory, checkpoint):
            fed.replay(record)
        fed.publish_recovered()

    try:
        fed.on_aggregation_thread(run)  # as live and as recovery: same kernels, same thread
    finally:
        fed.shutdown_threads()
    return fed


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)
