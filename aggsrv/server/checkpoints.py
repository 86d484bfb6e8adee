"""Checkpoints of a federation: when one is due, and taking it (the state directory is
aggsrv.server.persistence's: it stores and loads; this module decides when).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aggsrv.layout import ModelLayout
from aggsrv.server.call_log import CallLog
from aggsrv.server.config import ServerConfig
from aggsrv.server.fail_stop import DurabilityError, FailStop
from aggsrv.server.metrics import ServerMetrics

log = logging.getLogger("aggsrv.server.federation")


# The default checkpoint_every_bytes is 4x the model or twice the newest checkpoint, but not
# below this: a small model's checkpoint costs its fixed overheads (fsyncs, a new segment, the
# update-id ledger) whatever its size, and replaying this much log takes well under a second.
MIN_CHECKPOINT_EVERY_BYTES = 16 << 20


class Checkpoints:
    """Checkpoints to the federation's state directory (its StateStore)."""

    def __init__(
        self,
        config: ServerConfig,
        clock: Callable[[], float],
        metrics: ServerMetrics,
        fail_stop: FailStop,
        call_log: CallLog,
        call: Callable[..., Awaitable[Any]],
        state: Any,
        closing: Callable[[], bool],
    ) -> None:
        """``call``: runs a call on the aggregation thread, where the state is cut; ``state``:
        what a checkpoint holds (the federation, as aggsrv.server.persistence reads it);
        ``closing``: the federation's, as it is now."""
        self._config = config
        self._clock = clock
        self._metrics = metrics
        self._fail_stop = fail_stop
        self._call_log = call_log
        self._call = call
        self._state = state
        self._closing = closing
        # 4 bytes a value of the whole model served, None before it has one (:meth:`serve`).
        self._model_bytes: int | None = None
        self.store: Any = None  # the state directory (aggsrv.server.persistence), once set
        self.last_checkpoint: tuple[int, float] | None = None  # (version, time)
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        # Rank 0 of a sharded federation: orders every shard's cut at the call about to be cut
        # (called with the checkpoint's number, on the aggregation thread, before the cut).
        self.order_cut: Callable[[int], None] | None = None
        # A sharded federation's, on the aggregation thread right after each cut (the payload
        # taken): every shard's strategy then is what a restart from that checkpoint loads.
        self.after_cut: Callable[[dict[str, Any]], None] | None = None
        # Whether this process decides when to checkpoint (not a shard of rank >= 1).
        self.decides = True
        # A shard of rank >= 1 writes the checkpoints rank 0 orders here, one at a time.
        self._writer: ThreadPoolExecutor | None = None

    def serve(self, layout: ModelLayout) -> None:
        """The federation serves a model laid out as ``layout`` (a shard's: its slice of it)."""
        whole = layout.whole
        self._model_bytes = 4 * (whole.numel + whole.buffer_numel)

    def begin(self) -> None:
        """The first checkpoint of a fresh federation (its model just adopted), then the log."""
        info, payload = self.store.begin(self._state)
        self.last_checkpoint = (info.version, self._clock())
        if self.after_cut is not None:
            self.after_cut(payload)

    def resumed(self, version: int, created_at: float, updates: int) -> None:
        """Recovery loaded the checkpoint of ``version`` written at ``created_at`` and replayed
        ``updates`` updates after it: the next checkpoint is due as if the server had never
        stopped."""
        self.last_checkpoint = (version, created_at)
        self._call_log.count_updates_from(updates)

    async def checkpoint(self) -> Any:
        """Checkpoint now (after the calls queued before); the written CheckpointInfo."""
        store = self.store
        if store is None:
            raise RuntimeError("no state_dir is configured: there is nowhere to checkpoint to")
        if self._model_bytes is None:
            raise RuntimeError("the server has no model yet")
        async with self._lock:
            t0 = time.perf_counter()
            # The state and the log rotation happen together on the aggregation thread, so
            # the new segment holds exactly the calls after the state.
            try:
                number, payload = await self._call(self._cut)
            except OSError as exc:
                fail_stop = self._fail_stop
                fail_stop.fail(f"could not rotate the write-ahead log: {exc}")
                raise DurabilityError(fail_stop.failure) from exc
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, self._write, number, payload, t0)

    def _write(self, number: int, payload: dict[str, Any], t0: float) -> Any:
        """(a thread of its own) Write a cut's checkpoint, and count it from ``t0``."""
        info = self.store.write(number, payload)
        self.last_checkpoint = (info.version, self._clock())
        self._metrics.checkpoints.inc()
        self._metrics.checkpoint_seconds.observe(time.perf_counter() - t0)
        return info

    def _cut(self) -> tuple[int, dict[str, Any]]:
        """(Aggregation thread) the state and a fresh log segment; the counts start again."""
        number = self.store.segment + 1
        if self.order_cut is not None:
            self.order_cut(number)
        number, payload = self.store.cut(self._state, number)
        if self.after_cut is not None:
            self.after_cut(payload)
        self._call_log.count_updates_from(0)
        return number, payload

    def cut_ordered(self, meta: dict[str, Any]) -> None:
        """(aggregation thread of a shard of rank >= 1) Cut this shard's state at the call rank 0
        ordered the checkpoint at, and write it in the background."""
        store = self.store
        if store is None:
            return
        number, payload = store.cut(self._state, int(meta["number"]))
        if self.after_cut is not None:
            self.after_cut(payload)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")

        def write(t0: float) -> None:
            try:
                self._write(number, payload, t0)
            except Exception:
                log.exception("checkpoint %d failed (the log still holds its calls)", number)

        self._writer.submit(write, time.perf_counter())

    def shutdown(self) -> None:
        """Wait for a checkpoint being written in the background (a shard of rank >= 1)."""
        if self._writer is not None:
            self._writer.shutdown()

    def checkpoint_if_due(self) -> None:
        """Start a checkpoint when enough updates or log bytes piled up since the last one
        (both counted from the last checkpoint, across restarts)."""
        store = self.store
        if store is None or self._model_bytes is None or not self.decides:
            return
        every = self._config.checkpoint_every_updates
        limit = self.checkpoint_bytes_limit()
        if (every and self._call_log.updates_since_checkpoint >= every) or (
            limit and store.log_bytes() >= limit
        ):
            self.checkpoint_soon()

    def checkpoint_bytes_limit(self) -> int:
        """checkpoint_every_bytes, or by default the larger of 4x the model's bytes and twice
        the newest checkpoint's (a strategy with a [K, D] cache checkpoints K models: writing
        that every few updates would cost more than the log it saves), at least 16 MiB."""
        every = self._config.checkpoint_every_bytes
        if every is not None:
            return every
        return self._default_bytes_limit()

    def _default_bytes_limit(self) -> int:
        model_bytes = self._model_bytes or 0
        newest = self.store.checkpoint_bytes if self.store is not None else 0
        return max(4 * model_bytes, 2 * newest, MIN_CHECKPOINT_EVERY_BYTES)

    def unclaimed_bytes_limit(self) -> int:
        """How many bytes of uploads logged ahead and never applied a log segment may hold
        before uploads are no longer logged ahead (aggsrv.server.call_log): the size at which
        a checkpoint is due, the default one when checkpoints are not cut by size."""
        return self.checkpoint_bytes_limit() or self._default_bytes_limit()

    def checkpoint_soon(self) -> None:
        """Start a checkpoint in the background unless one is running."""
        if self.store is None or self._model_bytes is None or self._closing():
            return
        task = self._task
        if task is not None and not task.done():
            return
        self._task = asyncio.get_running_loop().create_task(self._checkpoint_logged())

    async def _checkpoint_logged(self) -> None:
        try:
            await self.checkpoint()
        except Exception:
            log.exception("checkpoint failed")

    async def settled(self) -> None:
        """Return once the checkpoint running in the background, if any, is done."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait([task])
