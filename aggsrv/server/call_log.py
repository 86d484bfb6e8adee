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

from aggsrv.server.durability import PART_KIND
from aggsrv.server.fail_stop import DurabilityError, FailStop
from aggsrv.server.metrics import ServerMetrics
from aggsrv.server.upload_log import UploadLog


class CallLog:
    """Appends the records of calls (aggregation thread) and waits for them to be durable (event
    loop); without a state directory, or with durability off, there is no log to write."""

    def __init__(self, fail_stop: FailStop, metrics: ServerMetrics) -> None:
        self._fail_stop = fail_stop
        self._metrics = metrics
        self.store: Any = None  # the state directory (aggsrv.server.persistence), once set
        self._sync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="wal-sync")
        self._part_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="wal-parts")
        # Accepted updates logged since the newest checkpoint (replayed ones included): counted
        # and reset on the aggregation thread, where the log is cut.
        self.updates_since_checkpoint = 0
        # The LSN of the newest record whose call issued a job (any kind of call may), and the
        # number of jobs issued by then: a job handed out again is durable once that LSN is.
        self.issue_lsn: int | None = None
        self._jobs_logged = 0
        # Bytes of upload parts that no record named, in the segment (log, start) named here.
        self._unclaimed = 0
        self._unclaimed_where: tuple[Any, int] = (None, 0)

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
        same_segment_as: int | None = None,
    ) -> int | None:
        """Append a record of a state change (aggregation thread); its LSN, None without a log.
        A failed write stops the server: the state in memory is then ahead of the log.
        ``jobs_issued``: the strategy's count after the call. ``same_segment_as``: see
        :meth:`WriteAheadLog.append` (None: not written, the segment changed)."""
        wal = self.wal
        lsn = None
        if wal is not None:
            try:
                lsn = wal.append(kind, meta, tensors, same_segment_as=same_segment_as)
            except Exception as exc:
                raise self._stop("could not append to the write-ahead log", exc) from exc
            if lsn is None:
                return None
        if kind == "update":
            self.updates_since_checkpoint += 1
        if jobs_issued != self._jobs_logged:
            self._jobs_logged = jobs_issued
            self.issue_lsn = lsn
        return lsn

    def upload_log(self, part_bytes: int, unclaimed_limit: int) -> UploadLog | None:
        """(event loop) Where an upload's bytes are logged while it arrives, in parts of
        ``part_bytes`` (0: not logged ahead); None without a log, or while the current segment
        holds ``unclaimed_limit`` bytes of parts no record named: a client whose uploads are
        never applied (refused, or slices sent to a shard of rank >= 1 only, which cannot
        checkpoint on its own) cannot grow the log without bound. The next segment (a
        checkpoint) logs uploads ahead again; until then they are logged whole when applied."""
        wal = self.wal
        if wal is None or not part_bytes:
            return None
        if self._unclaimed_in(wal) >= unclaimed_limit:
            return None
        return UploadLog(self._append_part, self._part_pool, part_bytes)

    def settled(self, upload: UploadLog) -> None:
        """(event loop) ``upload`` is done with: count what it logged that nothing claimed."""
        wal = self.wal
        if wal is not None:
            self._unclaimed = self._unclaimed_in(wal) + upload.unclaimed_bytes()

    def _unclaimed_in(self, wal: Any) -> int:
        """Bytes of unclaimed parts in ``wal``'s current segment (as far as counted)."""
        log, start = self._unclaimed_where
        if log is not wal or start != wal.segment_start:
            self._unclaimed_where, self._unclaimed = (wal, wal.segment_start), 0
        return self._unclaimed

    def _append_part(
        self, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
    ) -> tuple[Any, int | None]:
        """(a part writer; the aggregation thread for a part written again) Append a part of an
        upload and start writing it to disk; (the log it went to, its LSN), (None, None) when
        the log was closed under it (recovery, shutdown: the part is written again, or not
        needed)."""
        wal = self.wal
        if wal is None:
            return None, None
        try:
            return wal, wal.append(kind, meta, tensors, writeback=True)
        except Exception as exc:
            if wal.closed:
                return None, None
            raise self._stop("could not append to the write-ahead log", exc) from exc

    def append_claiming(
        self,
        kind: str,
        meta: dict[str, Any],
        upload: UploadLog | None,
        tensors: dict[str, torch.Tensor],
        jobs_issued: int,
    ) -> int | None:
        """(aggregation thread) :meth:`append` a record whose ``tensors`` are ``upload``'s, as
        one that names the upload's parts. A record and its parts are in one segment: a part
        that is not in the current one (a checkpoint began a segment since, or the log was
        reopened, or the part was not written) is written again first. Without an upload log
        (or parts) the record holds the tensors."""
        wal = self.wal
        if wal is None:
            return self.append(kind, meta, tensors, jobs_issued)
        if upload is None or not upload.finished or not upload.parts:
            return self._append_whole(kind, meta, tensors, jobs_issued)
        placed = upload.placed()
        # Rotations happen on this thread (checkpoint cuts, recovery), so none comes between
        # the parts written here and the record.
        start = wal.segment_start
        for i, (log, lsn) in enumerate(placed):
            if log is not wal or lsn is None or lsn <= start:
                part = upload.parts[i]
                placed[i] = self._append_part(PART_KIND, part.meta, part.tensors)
        if all(log is wal and lsn is not None for log, lsn in placed):
            first = min(lsn for _, lsn in placed)
            claim = {**meta, **upload.claim()}
            lsn = self.append(kind, claim, None, jobs_issued, same_segment_as=first)
            if lsn is not None:
                upload.claimed = True
                return lsn
        return self._append_whole(kind, meta, tensors, jobs_issued)

    def _append_whole(
        self, kind: str, meta: dict[str, Any], tensors: Any, jobs_issued: int
    ) -> int | None:
        """:meth:`append` with the tensors themselves, when the upload's parts cannot be named;
        an update kept as codes has no values to write (the log fails)."""
        if meta.get("codes"):
            raise self._stop(
                "could not log an update kept as codes", RuntimeError("its parts are not logged")
            )
        return self.append(kind, meta, tensors, jobs_issued)

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
            raise self._stop("could not fsync the write-ahead log", exc) from exc
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
            raise self._stop("could not fsync the write-ahead log", exc) from exc
        self._metrics.fsync_seconds.observe(time.perf_counter() - t0)

    def _stop(self, what: str, exc: BaseException) -> DurabilityError:
        """The log failed: the federation stops taking writes; the error to raise."""
        fail_stop = self._fail_stop
        fail_stop.fail(f"{what}: {exc}")
        return DurabilityError(fail_stop.failure)

    def shutdown(self) -> None:
        """Stop the fsync and part-writing threads."""
        self._sync_pool.shutdown()
        self._part_pool.shutdown()
