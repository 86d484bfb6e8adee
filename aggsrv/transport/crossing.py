"""An upload's way from its host staging slot to the device, overlapped with the wire.

Without it a server with a CUDA cache waits for the trailer, then copies the whole update to the
device: the upload's time is the wire's plus the copy's. `DeviceCrossing` queues a copy of each
stretch of ``step_bytes`` that has landed in the (pinned) slot as the chunks arrive, on a copy
stream of its own, so that when the trailer comes only the last stretch is left to cross. The
copies are stream-ordered: `finish` makes the device's current stream wait for the copy stream's
last event (no host synchronisation), and the slot stays fenced until that event has passed, so
the next upload does not overwrite bytes a copy still reads.

Each upload crosses into tensors allocated for it (the strategy may keep what it is given),
allocated on the copy stream when its first stretch crosses: a block torch's caching allocator
hands out there is free on the copy stream (one freed on the strategy's stream while its kernels
still read it is not handed out here), and the tensors handed out are recorded on the current
stream, so that once the strategy drops them their memory is reused only after its kernels ran.

The current stream the copies are made to wait on is the event loop thread's; the aggregation
thread reads the tensors on its own current stream. Neither thread sets a stream, so both are
the device's default stream: a strategy that runs its kernels on another stream must first make
that stream wait for the default one.

On the CPU the same object copies synchronously into separate host tensors: the server does not
use it there (the staging slot is already where the strategy reads), but its bookkeeping is
tested the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .decoder import StagingSlot

__all__ = ["DeviceCrossing"]

STEP_BYTES = 4 << 20  # a copy per 4 MiB landed: each launch costs microseconds, each MiB ~20 us


class DeviceCrossing:
    """Copies ``slot``'s landed bytes to ``device`` while the rest of the upload arrives.

    Per upload: :meth:`begin`, :meth:`progress` after each chunk with the decoder's
    ``decoded()``, then :meth:`finish` with the decoder's finished views (or :meth:`abandon`
    when the upload is refused)."""

    def __init__(
        self, slot: StagingSlot, device: torch.device | str, step_bytes: int | None = None
    ) -> None:
        self.slot = slot
        self.device = torch.device(device)
        step_bytes = STEP_BYTES if step_bytes is None else step_bytes
        if step_bytes <= 0:
            raise ValueError(f"step_bytes must be > 0, got {step_bytes}")
        self.step_elements = max(1, step_bytes // 4)
        self._bases: dict[str, torch.Tensor] = {"flat": slot.flat, **slot.extras}
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
        self._dst: dict[str, torch.Tensor] = {}
        self._crossed: dict[str, int] = {}  # elements of each tensor queued so far, by name
        self._copies = 0
        self._open = False

    @property
    def copies(self) -> int:
        """Copies queued so far (every upload since this crossing was made)."""
        return self._copies

    def begin(self) -> None:
        """A new upload (its device tensors are allocated when its first stretch crosses:
        a stalled upload holds no device memory)."""
        self._dst = {}
        self._crossed = {}
        self._open = True

    def _target(self, name: str) -> torch.Tensor:
        """The device tensor of the slot buffer ``name`` for this upload, allocated on first
        use (torch.OutOfMemoryError when the device has no room)."""
        dst = self._dst.get(name)
        if dst is None:
            base = self._bases[name]
            if self._stream is None:
                dst = torch.empty(base.numel(), dtype=base.dtype, device=self.device)
            else:
                with torch.cuda.stream(self._stream):
                    dst = torch.empty(base.numel(), dtype=base.dtype, device=self.device)
            self._dst[name] = dst
        return dst

    def progress(self, decoded: Iterable[tuple[str, torch.Tensor, int]]) -> None:
        """Queue the copy of every tensor's landed elements past what crossed, once at least
        ``step_bytes`` of it waits (``decoded``: the decoder's (name, view, elements final))."""
        self._require_open()
        step = self.step_elements
        for name, view, landed in decoded:
            done = self._crossed.get(name, 0)
            if landed - done >= step:
                self._copy(name, view, done, landed)

    def finish(
        self, views: dict[str, torch.Tensor], decoded: Iterable[tuple[str, torch.Tensor, int]]
    ) -> dict[str, torch.Tensor]:
        """Queue what is left of each tensor (all of a section decoded at the end), make the
        device's current stream wait for the copies, fence the slot; the device tensors of
        ``views`` by name."""
        self._require_open()
        for name, view, _ in decoded:
            done = self._crossed.get(name, 0)
            if done < view.numel():
                self._copy(name, view, done, view.numel())
        out = {name: self._counterpart(view) for name, view in views.items()}
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            for t in self._dst.values():
                t.record_stream(current)  # the strategy's kernels read them there
        self._settle()
        return out

    def abandon(self) -> None:
        """The upload was refused: nothing crossed is used; the slot is fenced until the copies
        already queued are done."""
        if self._open:
            self._settle()

    def _settle(self) -> None:
        self._open = False
        self._dst = {}
        if self._stream is None:
            return
        event = torch.cuda.Event()
        event.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        self.slot.fence_with(event)

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError("DeviceCrossing: call begin() before an upload's chunks")

    def _counterpart(self, view: torch.Tensor) -> torch.Tensor:
        """The device tensor ``view`` of the slot crosses into."""
        for name, base in self._bases.items():
            if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                continue
            offset = view.storage_offset() - base.storage_offset()
            if offset >= 0 and offset + view.numel() <= base.numel():
                return self._target(name)[offset : offset + view.numel()]
        raise ValueError("DeviceCrossing: a view that is not in the slot's buffers")

    def _copy(self, name: str, view: torch.Tensor, start: int, end: int) -> None:
        dst = self._counterpart(view)[start:end]
        src = view[start:end]
        if self._stream is None:
            dst.copy_(src)
        else:
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
        self._crossed[name] = end
        self._copies += 1
