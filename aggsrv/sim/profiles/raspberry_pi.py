"""ORTHOFL's measured Raspberry-Pi latencies and the pooled statistics its alternatives use."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import optimize, stats

__all__ = ["RASPBERRY_PI_PROFILES", "RPI_POOLED"]

# ORTHOFL's 9 Raspberry-Pi latency profiles (mean, std) in seconds, computed from the authors'
# Async-HFL traces (docs/algorithms/orthofl.md 2.3, "Computed from the trace files").
RASPBERRY_PI_PROFILES: tuple[tuple[float, float], ...] = (
    (96.21, 135.58),
    (904.12, 222.23),
    (360.23, 103.47),
    (276.63, 187.24),
    (150.16, 210.27),
    (161.41, 194.38),
    (177.24, 209.79),
    (106.25, 32.71),
    (385.55, 111.89),
)


def _rpi_pooled(table: Sequence[tuple[float, float]]) -> dict[str, float]:
    """mu_R, sigma_R and the 5th/95th percentiles of the RPi latencies
    (docs/algorithms/orthofl.md App. B.4).

    The raw measurements are not in the repository, so (DECISION) the pool is the equal-weight
    mixture of the profiles, as clients draw them uniformly: mean and std from the table's
    moments, percentiles from the latencies as simulated (N(mean, std), non-positive draws
    replaced by the mean), found by root finding on the mixture's CDF.
    """
    means = np.array([m for m, _ in table])
    stds = np.array([s for _, s in table])
    mean = float(means.mean())
    std = math.sqrt(float((stds**2 + means**2).mean()) - mean * mean)
    below0 = stats.norm.cdf(-means / stds)  # the mass each profile moves to its mean

    def cdf(x: float) -> float:
        body = np.clip(stats.norm.cdf((x - means) / stds) - below0, 0.0, None)
        return float(np.mean(body + np.where(x >= means, below0, 0.0)))

    def quantile(q: float) -> float:
        hi = float(np.max(means + 12 * stds))
        return float(optimize.brentq(lambda x: cdf(x) - q, 0.0, hi, xtol=1e-12, rtol=1e-15))

    return {"mean": mean, "std": std, "p5": quantile(0.05), "p95": quantile(0.95)}


RPI_POOLED: dict[str, float] = _rpi_pooled(RASPBERRY_PI_PROFILES)
