"""Does some client's update look wrong? The norms of DELTA uploads against the recent ones
(a WEIGHTS upload's norm is the model's, not a step's: not observed; a sharded server's
followers see their slice's norm, so read rank 0's).

The norm comes free with the upload's NaN/Inf check (one pass over the values gives both:
``aggsrv.finite.squared_norm_if_finite``), so watching it costs no second pass over D. An
update is an outlier when its log-norm lies more than ``threshold`` robust standard deviations
(1.4826 x the median absolute deviation) from the median log-norm of the last ``window``
updates (the deviation floored at ``SPREAD_FLOOR``); the median and the deviation are refreshed
every ``refresh`` updates, and nothing is called an outlier before ``min_seen`` updates. Log
scale, because norms spread by orders of magnitude between clients (data sizes, learning rates)
and a scaled update is a multiple.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

TINY = 1e-30  # a zero update's norm, on the log scale: far below any real one
# Norms all equal (clients clipping to one bound) give no spread: a 5 % floor keeps an update
# 1000x larger an outlier.
SPREAD_FLOOR = 0.05


class UpdateNorms:
    def __init__(
        self, window: int = 512, threshold: float = 3.5, refresh: int = 32, min_seen: int = 32
    ) -> None:
        self.threshold = threshold
        self.refresh = refresh
        self.min_seen = min_seen
        self._logs: deque[float] = deque(maxlen=window)
        self._since = 0
        self._center: float | None = None
        self._spread = 0.0

    def observe(self, norm: float) -> bool:
        """Record an accepted update's norm; True when it is an outlier."""
        x = math.log(max(norm, TINY))
        outlier = False
        if self._center is not None and self._spread > 0:
            outlier = abs(x - self._center) > self.threshold * self._spread
        self._logs.append(x)
        self._since += 1
        if len(self._logs) >= self.min_seen and (
            self._center is None or self._since >= self.refresh
        ):
            logs = np.fromiter(self._logs, dtype=np.float64, count=len(self._logs))
            self._center = float(np.median(logs))
            mad = 1.4826 * float(np.median(np.abs(logs - self._center)))
            self._spread = max(mad, SPREAD_FLOOR)
            self._since = 0
        return outlier
