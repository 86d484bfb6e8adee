"""Checkpoints of a federation and its recovery from the newest one (the state directory is
aggsrv.server.persistence's: it stores and loads; this module decides when, and replays).

A mixin of :class:`~aggsrv.server.federation.Federation`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aggsrv.server.aggregation_loop import DurabilityError
from aggsrv.server.persistence import RecoveryError, StateStore, restore

log = logging.getLogger("aggsrv.server.federation")


# The default checkpoint_every_bytes is 4x the model or twice the newest checkpoint, but not
# below this: a small model's checkpoint costs its fixed overheads (fsyncs, a new segment, the
# update-id ledger) whatever its size, and replaying this much log takes well under a second.
MIN_CHECKPOINT_EVERY_BYTES = 16 << 20


class Checkpoints:
    """Recovery from and checkpoints to the federation's state directory (its StateStore)."""

    def recover(self, store: StateStore) -> int:
        """Load the newest checkpoint of ``store`` and replay the log after it; the number of
        records replayed. The next records go to a new segment. Run it on the aggregation thread
        (before the server serves): replay makes the calls the live server made there."""
        number, path, payload = store.load_latest()
        restore(self, payload)
        self.last_checkpoint = (int(payload["state"]["version"]), float(payload["created_at"]))
        strategy = self.strategy
        assert strategy is not None
        # Its events were written already: the replay only refreshes what the page shows.
        sink = strategy.event_sink
        strategy.event_sink = getattr(sink, "quietly", None)
        replayed = updates = 0
        t0 = time.perf_counter()
        privacy = strategy.privacy
        if privacy is not None:  # republished versions carry fresh noise: charged again
            privacy.begin_recovery()
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
            if privacy is not None:
                privacy.end_recovery()
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
