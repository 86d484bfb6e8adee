"""The aggregation loop of a federation: every strategy call runs on a single worker thread, one
at a time, so a strategy needs no locks and heavy kernels never block the event loop that serves
gRPC.

Durability: every call that changes the strategy's state (a registration, a job, an accepted
update, a timer) reads the clock on the aggregation thread and appends a record of the call and
its time to the write-ahead log there (``_log``), in the order the calls ran. Replaying those
records against the newest checkpoint repeats the same calls with the same inputs, so a
restarted server reaches the same state bit for bit. Registrations, jobs and updates are
acknowledged only once their record is fsynced (group commit). A GetJob that changed nothing
(the same job again, or none yet) is not logged. A new version reaches readers (GetModel,
GetStatus, jobs) only once the record that made it is fsynced, so a version number always names
the model a restarted server has under that number.

Fail-stop: a strategy refuses a call with a StrategyError and changes nothing. Any other
exception on the aggregation thread (a bug, an allocation that fails) may leave the strategy
half-changed and the call unlogged, so the federation stops taking writes (``fail``), as when the
log cannot be written: nothing more runs on the strategy or is published, and a restart with
--resume rebuilds the state from the log, without the half-made call. The event loop reads
strategy state only through the aggregation thread (``read``) or what a call left behind
(``_Settled``), never beside a call half made.

A mixin of :class:`~aggsrv.server.federation.Federation`, whose ``__init__`` sets the state it
uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from aggsrv.server import shards as S
from aggsrv.strategies import ShardsDisagree, Strategy, StrategyError

log = logging.getLogger("aggsrv.server.federation")


T = TypeVar("T")


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
    deadline: float | None
    buffer: tuple[int, int] | None  # (waiting, size) of a buffered strategy

    @classmethod
    def of(cls, strategy: Strategy) -> _Settled:
        return cls(strategy.version, strategy.next_deadline(), strategy.buffer_fill())


class AggregationLoop:
    """The one aggregation thread of a :class:`~aggsrv.server.federation.Federation`: its calls,
    their log records, what they publish, and the stop when one fails."""

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
        """(aggregation thread, after a call) What :meth:`publish` will publish. Without a log
        (a shard following rank 0, a server without durability), a version a call made without
        ``_log`` is captured here: snapshots are made, and leased, on this thread only."""
        if self.strategy is not None:
            if self._wal() is None:
                self._capture(None)
            self._settled = _Settled.of(self.strategy)
            self._watch_buffer(self._settled)

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
        durable = wal.durable_lsn if wal is not None else 0
        published = False
        while self._unpublished:
            snap, lsn = self._unpublished[0]
            if lsn is not None and lsn > durable:
                break  # not on disk yet: its ack's make_durable publishes it
            self._unpublished.popleft()
            self._retain(snap)
            self.metrics.versions_published.inc()
            self.publish_rate.published(self.clock())
            published = True
        if published:
            self._changed.set()
            self._changed = asyncio.Event()
        self._arm_timer(state.deadline)

    def _watch_buffer(self, settled: _Settled) -> None:
        """(aggregation thread, after each call, in order) The time from a buffer's first
        update to the step that empties it: a step is a new version with the fill gone down."""
        fill = settled.buffer[0] if settled.buffer is not None else 0
        stepped = settled.version != self._buffer_version and fill < self._buffer_fill
        now = self.clock()
        if stepped and self._buffer_since is not None:
            self.metrics.buffer_fill_seconds.observe(now - self._buffer_since)
            self._buffer_since = None
        if fill > 0 and self._buffer_since is None:
            self._buffer_since = now  # the update that went in first (after a step: this one)
        self._buffer_fill, self._buffer_version = fill, settled.version

    def _capture(self, lsn: int | None) -> None:
        """Queue the strategy's version for publication if it is new (aggregation thread, right
        after the call that made it): its tensors as they are now, published once ``lsn`` is
        durable."""
        strategy = self.strategy
        if strategy is None or strategy.version == self._captured:
            return
        self._captured = strategy.version
        self._unpublished.append((self._snapshot_of(strategy), lsn))
        self.direction.refresh(strategy.global_model(), self.clock())

    def publish_recovered(self) -> None:
        """After recovery replayed the log (all of it durable): publish the state reached."""
        strategy = self.strategy
        assert strategy is not None
        self._drop_unpublished()
        self._captured = strategy.version
        self._jobs_logged, self._issue_lsn = strategy.jobs_issued, None  # replayed: on disk
        if strategy.version != self.published_version:
            self._retain(self._snapshot_of(strategy))

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
