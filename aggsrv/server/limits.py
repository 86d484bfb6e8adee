"""Per-client rate limiting: a token bucket per client id over the calls that cost the server
most (PushUpdate, Register), so one client cannot starve the others or fill the log."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RateLimiter:
    """``rate`` calls per second with bursts of ``burst`` per key; rate 0 allows everything.

    At most ``max_keys`` buckets are kept (least recently used dropped first), so made-up
    client ids cannot grow memory without bound; a dropped bucket starts full again."""

    def __init__(
        self,
        rate: float,
        burst: int,
        max_keys: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, time

    def allow(self, key: str) -> float:
        """Take one token for ``key``: 0.0 if allowed, else the seconds until one is free."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait

    def __len__(self) -> int:
        return len(self._buckets)
