"""Does some client's update look wrong? Each DELTA upload's norm, and its cosine to the model's
recent change, against the recent updates'.

Both come from the pass that checks the upload for NaN/Inf (``aggsrv.fused_dots``: one read of
the update; with no recent change yet, ``aggsrv.finite.squared_norm_if_finite`` gives the norm
alone), so watching them costs no second pass over D. A WEIGHTS upload's norm is the model's,
not a step's: not observed. A sharded server's followers see their slice's values: read rank
0's.

A value is an outlier when it lies more than ``threshold`` robust standard deviations (1.4826 x
the median absolute deviation, floored at ``SPREAD_FLOOR``) from the median of the last
``window`` values; the median and the deviation are refreshed every ``refresh`` values, and
nothing is called an outlier before ``min_seen``. Norms are compared on the log scale, because
they spread by orders of magnitude between clients (data sizes, learning rates) and a scaled
update is a multiple; cosines as they are.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

from aggsrv.fused_dots import squares

TINY = 1e-30  # a zero update's norm, on the log scale: far below any real one
# Norms all equal (clients clipping to one bound) give no spread: a 5 % floor keeps an update
# 1000x larger an outlier.
SPREAD_FLOOR = 0.05


class RobustOutliers:
    """Values far from the recent ones: beyond ``threshold`` robust standard deviations
    (1.4826 x the median absolute deviation, floored at ``floor``) of the last ``window``."""

    def __init__(
        self,
        window: int = 512,
        threshold: float = 3.5,
        refresh: int = 32,
        min_seen: int = 32,
        floor: float = SPREAD_FLOOR,
    ) -> None:
        self.threshold = threshold
        self.refresh = refresh
        self.min_seen = min_seen
        self.floor = floor
        self._values: deque[float] = deque(maxlen=window)
        self._since = 0
        self._center: float | None = None
        self._spread = 0.0

    def observe(self, x: float) -> bool:
        """Record a value; True when it is an outlier against the ones before it."""
        outlier = self._center is not None and abs(x - self._center) > self.threshold * max(
            self._spread, self.floor
        )
        self._values.append(x)
        self._since += 1
        if len(self._values) >= self.min_seen and (
            self._center is None or self._since >= self.refresh
        ):
            values = np.fromiter(self._values, dtype=np.float64, count=len(self._values))
            self._center = float(np.median(values))
            self._spread = 1.4826 * float(np.median(np.abs(values - self._center)))
            self._since = 0
        return outlier


class UpdateNorms(RobustOutliers):
    """Outliers of the log-norm (a scaled update is a multiple: far on the log scale)."""

    def observe(self, norm: float) -> bool:  # type: ignore[override]
        return super().observe(math.log(max(norm, TINY)))


class RecentChange:
    """The model's recent change, the direction each update's cosine is taken to: the global
    weights now minus those of the last refresh, refreshed on the aggregation thread after a new
    version, at most every ``interval`` seconds: one pass over D per interval whatever the
    version rate, into one of two buffers kept for good (a fresh 67 MB tensor a second cost
    page faults worth 8 % of a large upload's time on the development machine).

    Readers (the event loop's upload check, which releases the GIL while it reads) take
    ``current`` and ``generation`` before, and compare ``generation`` after: it is odd while a
    buffer is written and moves on with every refresh, so a cosine computed across a refresh is
    dropped, never wrong. The norm and the NaN/Inf proof do not read the direction at all."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.current: tuple[torch.Tensor, float] | None = None  # (direction, its norm)
        self.generation = 0
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._base: torch.Tensor | None = None
        self._base_at = -math.inf

    def refresh(self, weights: torch.Tensor, now: float) -> None:
        """``weights``: the new version's (an immutable snapshot: kept, not copied, on a CPU)."""
        if now - self._base_at < self.interval:
            return
        host = weights.detach().reshape(-1).to("cpu", torch.float32)
        base = self._base
        self._base, self._base_at = host, now
        if base is None or base.numel() != host.numel():
            return
        if not self._buffers or self._buffers[0].numel() != host.numel():
            self._buffers = [torch.empty_like(host), torch.empty_like(host)]
        target = self._buffers[self._next]  # not the one readers may hold
        self.generation += 1  # odd: writing
        torch.sub(host, base, out=target)
        # The numba float64 sum of squares: torch's float64 norm would first make a float64
        # copy (134 MB for 2^24 values: page faults on every refresh).
        norm = math.sqrt(squares(target.numpy()))
        self.current = (target, norm)
        self.generation += 1
        self._next ^= 1
