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
:meth:`UploadLog.settle`, and only once the call that used the upload is over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from aggsrv.server.durability import PART_KIND

# A part record's bytes besides its data, at most (header, meta JSON, alignment).
PART_OVERHEAD = 128


@dataclass
class Part:
    """One part of an upload: its record's meta, its tensors ("data", a view of the staging
    slot, or "wire", a section's bytes as they came) and the write that appends it, whose
    result is (the log written to, the record's LSN)."""

    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    write: Future[tuple[Any, int | None]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class UploadLog:
    """The parts of one upload (event loop: :meth:`progress`, :meth:`finish`, :meth:`settle`;
    the aggregation thread: :meth:`placed`, via the call log)."""

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
        self.parts: list[Part] = []
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

    def finish(
        self,
        views: dict[str, torch.Tensor],
        sections: dict[str, tuple[memoryview, dict[str, Any]]] | None = None,
    ) -> None:
        """(event loop) The upload arrived whole and checked as ``views``: log what is left.
        ``sections``: the tensors that came as a section of their own format (quantized or
        sparse), their wire bytes and how to decode them: logged as they came, which is
        smaller than their float32 values."""
        sections = sections or {}
        for name, view in views.items():
            self._sizes[name] = view.numel()
            logged = self._logged.get(name, 0)
            if name in sections and len(sections[name][0]) and not logged:
                raw, section = sections[name]
                meta = {"key": self.key, "tensor": name, "start": 0, "section": section}
                self._submit(meta, {"wire": torch.frombuffer(raw, dtype=torch.uint8)})
            elif view.numel() > logged:
                self._write(name, view, logged, view.numel())
            self._logged[name] = view.numel()
        self.finished = True

    def _write(self, name: str, view: torch.Tensor, start: int, end: int) -> None:
        meta = {"key": self.key, "tensor": name, "start": start}
        self._submit(meta, {"data": view[start:end]})

    def _submit(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        write = self._pool.submit(self._append, PART_KIND, meta, tensors)
        self.parts.append(Part(meta, tensors, write))

    def placed(self) -> list[tuple[Any, int | None]]:
        """(aggregation thread) Wait until every part is written: where each one went, (the
        log, its LSN), or (None, None) for one not written (dropped by :meth:`settle`, or the
        log was closed under it). Raises what a write raised."""
        out: list[tuple[Any, int | None]] = []
        for part in self.parts:
            try:
                out.append(part.write.result())
            except concurrent.futures.CancelledError:
                out.append((None, None))
        return out

    def claim(self) -> dict[str, Any]:
        """The meta by which a record claims these parts as its tensors."""
        return {"parts": self.key, "part_tensors": [[n, s] for n, s in self._sizes.items()]}

    async def settle(self) -> None:
        """(event loop, the upload is done with) Drop the writes not begun and wait out those
        still reading the slot, which is then free to reuse; their errors were the
        federation's to handle. After a record claimed the parts there is nothing left."""
        running = [part.write for part in self.parts if not part.write.cancel()]
        if not running:
            return
        done = asyncio.gather(*map(asyncio.wrap_future, running), return_exceptions=True)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # Cancelled again: the slot must still not be reused under a writer.
            concurrent.futures.wait(running)

    def unclaimed_bytes(self) -> int:
        """(after :meth:`settle`) The log bytes of the parts written that no record named."""
        if self.claimed:
            return 0
        return sum(
            part.nbytes + PART_OVERHEAD
            for part in self.parts
            if not part.write.cancelled() and part.write.exception() is None
        )
