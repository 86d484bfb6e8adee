"""An upload written to the write-ahead log while it arrives.

A durable server logs every update it applies; written after the update arrived, an update of
4D bytes waits for 4D bytes of writes and an fsync of them before it is acknowledged, and on a
sharded server that happens twice in series (a shard's slice before its vote, rank 0's record
after it). Instead, the decoded bytes of an upload are appended as "part" records while the
rest of it is still on the wire, and the kernel is asked to start writing each part to disk at
once (docs/sharding.md, "The commit"). The record of the call that uses the upload (rank 0's or
one server's "update", a shard's "slice") is then small: it names the parts, and the fsync that
makes it durable has little left to write. Readers make the record whole from its parts
(aggsrv.server.durability).

The parts are views of the staging slot the upload lands in: the slot is reused only after
:meth:`UploadLog.settle`.
"""

from __future__ import annotations

import concurrent.futures
import secrets
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from aggsrv.server.durability import PART_KIND


class UploadLog:
    """The parts of one upload (event loop: :meth:`progress`, :meth:`finish`, :meth:`settle`;
    the aggregation thread: :meth:`written`, via the call log)."""

    def __init__(self, append: Any, pool: ThreadPoolExecutor, part_bytes: int):
        """``append``: the call log's append of one part record, (the log, its LSN) (it stops
        the federation when the log cannot be written); ``pool``: the threads that write the
        parts; ``part_bytes``: the decoded bytes of one part (``wal_part_bytes``)."""
        self._append = append
        self._pool = pool
        self._part_elements = max(1, part_bytes // 4)
        # Unique within the log: a retried upload of the same update leaves other parts.
        self.key = secrets.token_hex(8)
        self._logged: dict[str, int] = {}  # elements of each tensor handed to a writer
        self._sizes: dict[str, int] = {}
        self._writes: list[Future[tuple[Any, int | None]]] = []
        self._write_bytes: list[int] = []
        self.finished = False
        self.claimed = False  # a record named the parts

    def progress(self, decoded: Iterable[tuple[str, torch.Tensor, int]]) -> None:
        """(event loop) The upload so far: (name, the tensor's view in the slot, elements of it
        final); every full part not yet logged goes to a writer."""
        for name, view, done in decoded:
            self._sizes[name] = view.numel()
            logged = self._logged.setdefault(name, 0)
            while done - logged >= self._part_elements:
                self._write(name, view, logged, logged + self._part_elements)
                logged += self._part_elements
            self._logged[name] = logged

    def finish(self, views: dict[str, torch.Tensor]) -> None:
        """(event loop) The upload arrived whole and checked as ``views``: log what is left."""
        for name, view in views.items():
            self._sizes[name] = view.numel()
            logged = self._logged.get(name, 0)
            if view.numel() > logged:
                self._write(name, view, logged, view.numel())
            self._logged[name] = view.numel()
        self.finished = True

    def _write(self, name: str, view: torch.Tensor, start: int, end: int) -> None:
        meta = {"key": self.key, "tensor": name, "start": start}
        part = view[start:end]
        self._writes.append(self._pool.submit(self._append, PART_KIND, meta, {"data": part}))
        self._write_bytes.append(4 * (end - start))

    def written(self) -> tuple[Any, int] | None:
        """(aggregation thread) Wait until every part is written: (the log they are in, the LSN
        of the first one), or None (the upload did not finish, or it has no parts, or its parts
        went to more than one log). Raises what a write raised."""
        if not self.finished:
            return None
        try:
            placed = [w.result() for w in self._writes]
        except concurrent.futures.CancelledError:  # settled under the call: its caller left
            return None
        logs = {id(wal) for wal, _ in placed}
        if len(logs) != 1 or any(lsn is None for _, lsn in placed):
            return None
        return placed[0][0], min(lsn for _, lsn in placed)

    def claim(self) -> dict[str, Any]:
        """The meta by which a record claims these parts as its tensors."""
        return {"parts": self.key, "part_tensors": [[n, s] for n, s in self._sizes.items()]}

    def settle(self) -> None:
        """(event loop, the upload is done with) Drop the writes not begun and wait out those
        still reading the slot, which is then free to reuse; their errors were the
        federation's to handle. After a record claimed the parts there is nothing left."""
        for write in self._writes:
            write.cancel()
        concurrent.futures.wait(self._writes)

    def unclaimed_bytes(self) -> int:
        """(after :meth:`settle`) The bytes of the parts written that no record named."""
        if self.claimed:
            return 0
        written = zip(self._writes, self._write_bytes, strict=True)
        return sum(n for w, n in written if not w.cancelled() and w.exception() is None)
