"""Sharding (docs/sharding.md), rank 0's side: on a sharded server the log's records are the
replicated log. Rank 0 announces each call to the other shards (``announce``) right before
making it, on its aggregation thread; the other shards (aggsrv.server.shard_follower) make the
same calls with the same inputs on their slices, so every shard takes the same decisions at the
same versions. After each call the shards compare what it did (``agree``): a shard that differs
has diverged, and the federation stops on every shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from aggsrv.server import shards as S
from aggsrv.server.fail_stop import AggregationFailed, DurabilityError, FailStop
from aggsrv.strategies import Strategy, Update

# The calls that take a number in rank 0's order (``seq``): those that change state.
SEQUENCED_KINDS = ("adopt", "register", "job", "update", "timer", "checkpoint")


class Replication:
    """Rank 0's side of a sharded federation: announce each call, vote, compare. Every shard
    compares (:meth:`agree`); without shards each step does nothing."""

    def __init__(
        self,
        strategy: Callable[[], Strategy | None],
        fail_stop: FailStop,
        closing: Callable[[], bool],
        written_lsn: Callable[[], int | None],
        durable_lsn: Callable[[], int],
    ) -> None:
        """``strategy`` and ``closing``: the federation's, as they are now (it adopts a model
        after it is made); ``written_lsn`` and ``durable_lsn``: how far rank 0's log is written
        and fsynced."""
        self.shards: S.ShardGroup | None = None  # set by the server before it serves
        self.sums: Any = None  # the federation's LoggedReducer: a call's sums are its own
        self._strategy = strategy
        self._fail_stop = fail_stop
        self._closing = closing
        self._written_lsn = written_lsn
        self._durable_lsn = durable_lsn
        # Rank 0, on the aggregation thread: the call being made (compared once it is made).
        self.announced: tuple[str, dict[str, Any]] | None = None
        # Rank 0's order: the number of the last sequenced call announced, and how far every
        # sequenced call is durable (logged and fsynced, or changed nothing): a shard of rank >= 1
        # answers a slice and publishes a version only once rank 0's decision is durable.
        self.seq = 0
        self.durable_seq = 0
        self.durable_sent = 0
        self._call_lsn: int | None = None
        self._call_logged = False
        # (LSN that covers the call, seq) of calls made, not yet known durable.
        self._pending: deque[tuple[int | None, int]] = deque()
        self._pending_lock = threading.Lock()

    def announce(self, kind: str, meta: dict[str, Any]) -> None:
        """Rank 0 of a sharded federation: announce the call about to be made. A sequenced call
        gets the next number in ``meta["seq"]`` (its record carries it)."""
        shards = self.shards
        if shards is None:
            return
        if kind in SEQUENCED_KINDS:
            self.seq += 1
            meta["seq"] = self.seq
            self._call_logged = False
            if self.sums is not None:
                self.sums.take()  # sums made between calls are no call's
        self.mark_durable(self._durable_lsn())
        self._fail_stop.collective(shards.announce, kind, meta, self.durable_seq)
        self.durable_sent = max(self.durable_sent, self.durable_seq)
        self.announced = (kind, meta)

    def logged(self, lsn: int | None) -> None:
        """(aggregation thread) The call announced is logged at ``lsn``."""
        self._call_lsn, self._call_logged = lsn, True

    def _close_call(self, announced: tuple[str, dict[str, Any]] | None) -> None:
        if announced is None or "seq" not in announced[1]:
            return
        # A call that was not logged changed nothing: it is durable once what came before is.
        lsn = self._call_lsn if self._call_logged else self._written_lsn()
        with self._pending_lock:
            self._pending.append((lsn, int(announced[1]["seq"])))
        self._call_logged = False

    def mark_durable(self, durable_lsn: int) -> bool:
        """The log is durable up to ``durable_lsn`` (event loop): whether that made calls
        durable that the other shards have not been told of."""
        with self._pending_lock:
            while self._pending and (self._pending[0][0] or 0) <= durable_lsn:
                self.durable_seq = max(self.durable_seq, self._pending.popleft()[1])
        return self.durable_seq > self.durable_sent

    def forget_pending(self) -> None:
        """Recovery: the calls made before it are either in the log or gone."""
        with self._pending_lock:
            self._pending.clear()
        self.announced = None
        self._call_logged = False

    def announce_durable(self) -> None:
        """(aggregation thread) Tell the other shards how far rank 0's decisions are durable,
        unless an announce did already."""
        if self.shards is not None and self.durable_seq > self.durable_sent:
            self.announce("durable", {})

    def take_announced(self) -> tuple[str, dict[str, Any]] | None:
        """(aggregation thread) The call announced, if any, once it failed: the next call
        starts with none."""
        announced, self.announced = self.announced, None
        return announced

    def agree_on_announced(self, refused: bool) -> None:
        """Rank 0, after making the call it announced (aggregation thread)."""
        announced, self.announced = self.announced, None
        self._close_call(announced)
        if announced is not None:
            self.agree(*announced, refused)

    def agree(self, kind: str, meta: dict[str, Any], refused: bool) -> None:
        """Every shard, after a call rank 0 ordered (aggregation thread): one small all_reduce
        compares what the call did on each shard (refused or not, the version, jobs issued,
        clients). The shards make the same calls on the same state, so a shard that differs
        has diverged; every shard sees the same comparison, so all stop taking writes."""
        shards = self.shards
        if shards is None or kind not in S.COMPARED_KINDS:
            return
        strategy = self._strategy()
        assert strategy is not None
        fail_stop = self._fail_stop
        rows = fail_stop.collective(shards.compare, S.call_digest(strategy, refused))
        if rows is not None:
            fail_stop.fail(
                f"the shards diverged on {S.describe_call(kind, meta)}: {S.divergence(rows)}"
            )
            raise AggregationFailed(fail_stop.failure)

    def vote(self, update: Update) -> None:
        """All or none: every shard checks its slice, and one refusal refuses the update
        everywhere (raised as the refusal) before any state changes."""
        shards = self.shards
        if shards is None:
            return
        verdict, own = S.slice_verdict(self._strategy(), update)
        votes = self._fail_stop.collective(shards.vote, verdict)
        if max(votes):
            raise S.refusal(votes, shards.rank, own, update.update_id, shards.slice_wait)

    async def keep_alive(self, call: Callable[..., Awaitable[Any]]) -> None:
        """Rank 0: announce a no-op when idle (through ``call``, the aggregation loop's), so
        the other shards' wait for the next call never times out and a lost shard is noticed
        within a heartbeat."""
        shards = self.shards
        assert shards is not None and shards.is_coordinator
        while not self._closing():
            await asyncio.sleep(shards.heartbeat / 2)
            if self._closing():
                return
            if time.monotonic() - shards.last_announce >= shards.heartbeat:
                with contextlib.suppress(DurabilityError):
                    await call(self.announce, "noop", {})
