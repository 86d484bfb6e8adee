"""The strategy's next deadline (a round's end, a lease's expiry) as a timer on the event loop:
re-armed after every call, since any call may move it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class DeadlineTimer:
    """One pending timer at a time; ``fire`` runs as a task when it is due."""

    def __init__(
        self,
        clock: Callable[[], float],
        fire: Callable[[], Coroutine[Any, Any, None]],
        idle: Callable[[], bool],
    ) -> None:
        """``idle``: whether this federation runs no timers now (closing, or a shard of rank
        >= 1: rank 0 orders the timers)."""
        self._clock = clock
        self._fire = fire
        self._idle = idle
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, deadline: float | None) -> None:
        """Fire at ``deadline`` (clock time) instead of any earlier arming; None: not at all."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline is None or self._idle():
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, deadline - self._clock())
        self._timer = loop.call_later(delay, lambda: loop.create_task(self._fire()))

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
