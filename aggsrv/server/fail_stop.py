"""Fail-stop: why a federation stopped taking writes, set once from any thread.

A strategy refuses a call with a StrategyError and changes nothing. Any other exception on the
aggregation thread (a bug, an allocation that fails) may leave the strategy half-changed and the
call unlogged, so the federation stops taking writes, as when the log cannot be written or a
shard is lost: nothing more runs on the strategy or is published, and a restart with --resume
rebuilds the state from the log, without the half-made call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from aggsrv.server import shards as S
from aggsrv.strategies import ShardsDisagree

log = logging.getLogger("aggsrv.server.federation")

T = TypeVar("T")


class DurabilityError(RuntimeError):
    """The write-ahead log could not be written or synced: the server stops taking writes."""


class AggregationFailed(DurabilityError):
    """The federation stopped taking writes for another reason (an unexpected exception on the
    aggregation thread, shards that diverged, a lost shard): refused like a failed log write."""


class FailStop:
    """The federation's one reason to stop (:attr:`failure`), and who hears of it."""

    def __init__(self, on_stop: Callable[[str], None]) -> None:
        """``on_stop(reason)`` runs on every :meth:`fail`, on the failing thread (the federation
        refuses the slices waiting for rank 0 and closes)."""
        self.failure: str | None = None
        # The server's: told once, on the event loop (it stops the server, or a shard's health).
        self.on_failure: Callable[[str], None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop that serves
        # A sharded federation with state directories heals after a lost shard (the server
        # sets this): writes stop until the group is whole again, then go on.
        self.heals = False
        self.lost_shard = False  # the failure is a lost shard (not a bug or a divergence)
        # A shard was lost in the middle of a call here: this shard's state may be half-changed
        # (it recovers from its state directory when the group forms again).
        self.dirty = False
        self._on_stop = on_stop
        self._lock = threading.Lock()

    def fail(self, reason: str, exc: BaseException | None = None, lost_shard: bool = False) -> None:
        """Stop taking writes (an operator restarts with --resume; a sharded federation that
        heals goes on once a lost shard is back: ``lost_shard``); from any thread. The first
        reason is logged once, at CRITICAL, with ``exc``'s traceback if given."""
        heals = lost_shard and self.heals
        if heals:
            reason += (
                "; the federation is not whole: writes are refused until the lost shard rejoins "
                "(restart it with --resume; it rejoins by itself): retry in a few seconds"
            )
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = reason
                self.lost_shard = lost_shard
        assert self.failure is not None
        self._on_stop(self.failure)
        if not first:
            return
        if heals:
            log.critical("%s", reason)
        else:
            log.critical("%s; refusing all further calls (restart with --resume)", reason,
                         exc_info=exc)  # fmt: skip
        if self.on_failure is not None:
            self.on_loop(self.on_failure, reason)

    def stop_on_divergence(
        self, exc: ShardsDisagree, call: tuple[str, dict[str, Any]] | None
    ) -> AggregationFailed:
        """Fail-stop when the strategy found, in the middle of a call, that the shards took
        different branches (every shard sees the same sums, so all stop)."""
        what = S.describe_call(*call) if call is not None else "a call"
        self.fail(f"the shards diverged on {what}: {exc}")
        return AggregationFailed(self.failure)

    def stop_on_unexpected(self, exc: Exception, where: str) -> AggregationFailed:
        """Fail-stop after an exception a call does not refuse with (aggregation thread)."""
        self.fail(
            f"unexpected {type(exc).__name__} on the aggregation thread in {where}: {exc} (the "
            "strategy may be half-changed; the call was not logged)",
            exc,
        )
        return AggregationFailed(self.failure)

    def collective(self, fn: Callable[..., T], *args: Any) -> T:
        """A collective between the shards (aggregation thread). A lost shard stops the
        federation taking writes, like a failed log write: the shards must not diverge."""
        try:
            return fn(*args)
        except S.ShardLost as exc:
            self.fail(str(exc), lost_shard=True)
            raise DurabilityError(self.failure) from exc

    def healed(self) -> None:
        """The group is whole again and every shard reloaded its state: take writes again."""
        with self._lock:
            self.failure = None
            self.lost_shard = False

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop: now when called there (or without a loop),
        else as soon as the loop gets to it."""
        loop = self.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            fn(*args)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)
