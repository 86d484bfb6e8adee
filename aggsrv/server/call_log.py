"""The write-ahead log of a federation's calls. Every call that changes the strategy's state (a
registration, a job, an accepted update, a timer) reads the clock on the aggregation thread and
appends a record of the call and its time here, in the order the calls ran. Replaying those
records against the newest checkpoint repeats the same calls with the same inputs, so a
restarted server reaches the same state bit for bit. Registrations, jobs and updates are
acknowledged only once their record is fsynced (group commit). A GetJob that changed nothing
(the same job again, or none yet) is not logged.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from aggsrv.server.fail_stop import DurabilityError, FailStop
from aggsrv.server.metrics import ServerMetrics


class CallLog:
    """Appends the records of calls (aggregation thread) and waits for them to be durable (event
    loop); without a state directory, or with durability off, there is no log to write."""

    def __init__(self, fail_stop: FailStop, metrics: ServerMetrics) -> None:
        self._fail_stop = fail_stop
        self._metrics = metrics
        self.store: Any = None  # the state directory (aggsrv.server.persistence), once set
        self._sync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="wal-sync")
        # Accepted updates logged since the newest checkpoint (replayed ones included): counted
        # and reset on the aggregation thread, where the log is cut.
        self.updates_since_checkpoint = 0
        # The LSN of the newest record whose call issued a job (any kind of call may), and the
        # number of jobs issued by then: a job handed out again is durable once that LSN is.
        self.issue_lsn: int | None = None
        self._jobs_logged = 0

    @property
    def wal(self) -> Any:
        """The write-ahead log (aggsrv.server.durability); None when calls are not logged."""
        return self.store.wal if self.store is not None else None

    def durable_lsn(self) -> int:
        """The log's records up to this LSN are on disk (all of them without a log)."""
        wal = self.wal
        return wal.durable_lsn if wal is not None else 0

    def written_lsn(self) -> int | None:
        """The LSN of the newest record written (None without a log)."""
        wal = self.wal
        return wal.written_lsn if wal is not None else None

    def count_updates_from(self, updates: int) -> None:
        """(aggregation thread) The log since the newest checkpoint holds ``updates`` updates."""
        self.updates_since_checkpoint = updates

    def restart(self, jobs_issued: int) -> None:
        """The jobs issued so far are on disk already (a checkpoint's, or replayed)."""
        self._jobs_logged, self.issue_lsn = jobs_issued, None

    def append(
        self,
        kind: str,
        meta: dict[str, Any],
        tensors: dict[str, torch.Tensor] | None,
        jobs_issued: int,
    ) -> int | None:
        """Append a record of a state change (aggregation thread); its LSN, None without a log.
        A failed write stops the server: the state in memory is then ahead of the log.
        ``jobs_issued``: the strategy's count after the call."""
        if kind == "update":
            self.updates_since_checkpoint += 1
        wal = self.wal
        lsn = None
        if wal is not None:
            try:
                lsn = wal.append(kind, meta, tensors)
            except Exception as exc:
                fail_stop = self._fail_stop
                fail_stop.fail(f"could not append to the write-ahead log: {exc}")
                raise DurabilityError(fail_stop.failure) from exc
        if jobs_issued != self._jobs_logged:
            self._jobs_logged = jobs_issued
            self.issue_lsn = lsn
        return lsn

    async def make_durable(self, lsn: int | None) -> int:
        """Return once the log is fsynced up to ``lsn`` (shared fsyncs: group commit); the LSN
        the log is durable up to then (:meth:`durable_lsn`)."""
        wal = self.wal
        if wal is None:
            return 0
        if lsn is None or wal.durable_lsn >= lsn:
            return wal.durable_lsn  # nothing to wait for (and no thread hop)
        t0 = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(self._sync_pool, wal.sync, lsn)
        except Exception as exc:
            fail_stop = self._fail_stop
            fail_stop.fail(f"could not fsync the write-ahead log: {exc}")
            raise DurabilityError(fail_stop.failure) from exc
        self._metrics.fsync_seconds.observe(time.perf_counter() - t0)
        return wal.durable_lsn

    def sync_now(self, lsn: int | None = None) -> None:
        """(aggregation thread) Block until the log is durable up to ``lsn`` (all of it when
        None): a shard's slice before it votes, rank 0's log before it orders a checkpoint. A
        failed fsync stops the server, as in :meth:`make_durable`."""
        wal = self.wal
        if wal is None:
            return
        t0 = time.perf_counter()
        try:
            wal.sync(wal.written_lsn if lsn is None else lsn)
        except Exception as exc:
            fail_stop = self._fail_stop
            fail_stop.fail(f"could not fsync the write-ahead log: {exc}")
            raise DurabilityError(fail_stop.failure) from exc
        self._metrics.fsync_seconds.observe(time.perf_counter() - t0)

    def shutdown(self) -> None:
        """Stop the fsync threads."""
        self._sync_pool.shutdown()
