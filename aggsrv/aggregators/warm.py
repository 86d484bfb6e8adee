"""Compiling an aggregator's kernels before the first aggregation needs them.

The CPU kernels are numba functions compiled on their first call in a process (about 8 s for
the order statistics with no on-disk cache, over 1 s to load them from it on 2 loaded cores),
and the Triton ones on theirs. Paid inside the first aggregation, that stalls the aggregation
thread while clients wait for acknowledgements; a server restarted after a crash would pay it
again on the first aggregation after each restart. :func:`warm_up` runs the rule, and the
coordinate-wise median it falls back to, once on a few small rows at start-up instead.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from aggsrv import kernels
from aggsrv.aggregators.combine import combine
from aggsrv.aggregators.spec import Aggregator

__all__ = ["warm_up"]

logger = logging.getLogger(__name__)

# What this process has compiled already: (rule, clipped, device, dtype).
_warm: set[tuple[str, bool, str, torch.dtype]] = set()
_lock = threading.Lock()
# Columns of the warm-up rows: wider than one vector so the compiled loops run their bodies.
_COLUMNS = 67


def warm_up(
    spec: Aggregator, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> float:
    """Run ``spec`` (and the median fallback) once on small rows of ``dtype`` on ``device``, if
    this process has not yet; the seconds it took (0.0 when nothing was left to compile)."""
    device = torch.device(device)
    key = (spec.rule, spec.norm_bound is not None, str(device), dtype)
    with _lock:
        if key in _warm or spec.is_mean:
            return 0.0
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(0)
        rows = max(spec.min_rows(), 5)
        X = torch.randn(rows, _COLUMNS, generator=gen).to(device=device, dtype=dtype)
        center = torch.zeros(_COLUMNS, dtype=dtype, device=device)
        combine(spec, X, torch.ones(rows, dtype=torch.float64), center=center)
        kernels.coordinate_median(X)
        _warm.add(key)
        seconds = time.perf_counter() - t0
    logger.info("aggregator %r: kernels ready on %s in %.2f s", str(spec), device, seconds)
    return seconds
