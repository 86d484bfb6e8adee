"""Publication: a version the strategy made reaches readers (GetModel, GetStatus, jobs) only once
the log record of the call that made it is fsynced, so a version number always names the model
a restarted server has under that number. Versions wait here, captured on the aggregation
thread right after the call that made them, until the federation says their record is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from aggsrv.server.dashboard.events import PublishRate
from aggsrv.server.deadline_timer import DeadlineTimer
from aggsrv.server.metrics import ServerMetrics
from aggsrv.server.update_health import RecentChange
from aggsrv.server.versions import RetainedVersions, Snapshot, release
from aggsrv.strategies import Strategy


@dataclass(frozen=True)
class Settled:
    """What the event loop publishes after a call, read on the aggregation thread when the call
    is done: the loop never reads the strategy while the next call may be half made."""

    version: int
    deadline: float | None
    buffer: tuple[int, int] | None  # (waiting, size) of a buffered strategy

    @classmethod
    def of(cls, strategy: Strategy) -> Settled:
        return cls(strategy.version, strategy.next_deadline(), strategy.buffer_fill())


class Publication:
    """The versions made but not yet published, what the last call left, and the wake-up of
    the handlers waiting for a change."""

    def __init__(
        self,
        versions: RetainedVersions,
        timer: DeadlineTimer,
        metrics: ServerMetrics,
        publish_rate: PublishRate,
        clock: Callable[[], float],
    ) -> None:
        self._versions = versions
        self._timer = timer
        self._direction = RecentChange()
        self._metrics = metrics
        self._publish_rate = publish_rate
        self._clock = clock
        self._strategy: Strategy | None = None
        self._settled: Settled | None = None  # the strategy after the last call
        # Versions made on the aggregation thread, waiting for their log record to be fsynced
        # before readers see them: (snapshot, LSN of the record; None without a log).
        self._unpublished: deque[tuple[Snapshot, int | None]] = deque()
        self._captured = -1  # the last version queued there
        # (version, LSN) of the record of the call being made, once it is logged.
        self._record: tuple[int, int | None] | None = None
        # A buffered strategy's fill and version after the last call, and since when it fills.
        self._buffer_fill, self._buffer_version = 0, -1
        self._buffer_since: float | None = None
        self._changed = asyncio.Event()

    def restart(self, strategy: Strategy, direction: RecentChange) -> None:
        """Publish ``strategy``'s versions from its current one on (a new or restored model,
        or the state recovery reached): nothing made before waits any longer. Each new version
        refreshes ``direction``, the model's recent change."""
        while self._unpublished:
            release(self._unpublished.popleft()[0])
        self._captured = strategy.version
        self._record = None
        self._strategy = strategy
        self._direction = direction

    def record_at(self, lsn: int | None) -> None:
        """(aggregation thread) The call being made is logged at ``lsn`` (None without a log):
        the version it made is published once that is durable."""
        strategy = self._strategy
        if strategy is not None:
            self._record = (strategy.version, lsn)

    def settle(self) -> None:
        """(aggregation thread, after a call) What :meth:`publish` will publish: a new version
        the call made (its tensors as they are now, leased: snapshots are made on this thread
        only), waiting for its record (none for a call that was not logged: a shard following
        rank 0), and the strategy's deadline and buffer after it."""
        strategy = self._strategy
        if strategy is None:
            return
        snap = None
        version = strategy.version
        if version != self._captured:
            record = self._record
            lsn = record[1] if record is not None and record[0] == version else None
            self._captured = version
            snap = self._versions.snapshot_of(strategy)
            self._unpublished.append((snap, lsn))
        settled = Settled.of(strategy)
        self._settled = settled
        now = self._clock()
        if snap is not None:
            self._direction.refresh(snap.weights, now)
        # The time from a buffer's first update to the step that empties it: a step is a new
        # version with the fill gone down (after each call, in order).
        fill = settled.buffer[0] if settled.buffer is not None else 0
        stepped = version != self._buffer_version and fill < self._buffer_fill
        if stepped and self._buffer_since is not None:
            self._metrics.buffer_fill_seconds.observe(now - self._buffer_since)
            self._buffer_since = None
        if fill > 0 and self._buffer_since is None:
            self._buffer_since = now  # the update that went in first (after a step: this one)
        self._buffer_fill, self._buffer_version = fill, version

    def publish(self, durable_lsn: int) -> None:
        """Publish the new versions whose log records are durable (up to ``durable_lsn``), wake
        waiting job streams, re-arm the timer (event loop)."""
        strategy = self._strategy
        if strategy is None:
            return
        # What the last call left (read on the aggregation thread); the strategy itself only
        # when no call ran yet (a resumed or restored server, before it serves).
        state = self._settled or Settled.of(strategy)
        published = False
        while self._unpublished:
            snap, lsn = self._unpublished[0]
            if lsn is not None and lsn > durable_lsn:
                break  # not on disk yet: its ack's make_durable publishes it
            self._unpublished.popleft()
            self._versions.retain(snap)
            self._metrics.versions_published.inc()
            self._publish_rate.published(self._clock())
            published = True
        if published:  # wake the job streams waiting for a change
            self._changed.set()
            self._changed = asyncio.Event()
        self._timer.arm(state.deadline)

    def buffer_now(self) -> tuple[int, int]:
        """(waiting, size) of a buffered strategy after the last call; (0, 0) otherwise."""
        settled = self._settled
        return settled.buffer if settled is not None and settled.buffer is not None else (0, 0)

    def notify(self) -> None:
        """Wake job streams waiting for a state change (a registration, a round opening)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def watch(self) -> asyncio.Event:
        """What :meth:`wait_for_change` waits on: take it *before* looking at the state, so a
        change made between the look and the wait is not slept through."""
        return self._changed

    async def wait_for_change(self, since: asyncio.Event, timeout: float) -> None:
        """Return once the state changed after :meth:`watch` gave ``since`` (at once if it
        already did), or after ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(since.wait(), timeout)
