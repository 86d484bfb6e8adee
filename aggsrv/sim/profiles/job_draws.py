"""Per-job draws: a delay from one of the distributions, or ORTHOFL's Raspberry-Pi latencies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .checks import choice, non_negative, positive
from .components import Context, JobDraw
from .distributions import make_distribution
from .raspberry_pi import RASPBERRY_PI_PROFILES
from .streams import STREAM_DELAY, STREAM_RPI_ASSIGN, STREAM_RPI_JOB, job_rng


class Delay(JobDraw):
    """A per-job draw from one of the distributions, a factor or added seconds."""

    kind = "delay"
    once = False

    def __init__(self, ctx: Context, p: Mapping[str, Any], dist: str) -> None:
        p = dict(p)
        where = f"delay ({dist})"
        self.mode = choice(where, "mode", p.pop("mode", "mul"), ("mul", "add"))
        self.dist = make_distribution(where, dist, p)
        self.seed = ctx.seed
        self.stream = STREAM_DELAY + ctx.index

    def draw(self, client: int, round_: int) -> float:
        return max(self.dist.sample(job_rng(self.seed, client, round_, self.stream)), 0.0)

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, **self.dist.describe()}


class RaspberryPiDraw(JobDraw):
    """ORTHOFL's RPi latencies: a profile per client, N(mean, std) per job."""

    kind = "raspberry_pi"
    keys = ("assign", "nonpositive", "mode", "profiles")

    def __init__(self, ctx: Context, p: Mapping[str, Any]) -> None:
        where = "raspberry_pi"
        self.table = self._table(where, p.get("profiles", RASPBERRY_PI_PROFILES))
        self.assign = choice(where, "assign", p.get("assign", "random"), ("random", "round_robin"))
        self.nonpositive = choice(
            where, "nonpositive", p.get("nonpositive", "mean"), ("mean", "resample")
        )
        self.mode = choice(where, "mode", p.get("mode", "mul"), ("mul", "add"))
        n, k = ctx.num_clients, len(self.table)
        if self.assign == "random":
            # The authors' get_delay: np.random.choice(9, M), without replacement when M < 9.
            rng = job_rng(ctx.seed, 0, 0, STREAM_RPI_ASSIGN)
            self.profile_of = [int(i) for i in rng.choice(k, n, replace=n >= k)]
        else:
            self.profile_of = [c % k for c in range(n)]
        self.seed = ctx.seed

    @staticmethod
    def _table(where: str, table: Any) -> tuple[tuple[float, float], ...]:
        if isinstance(table, str) or not isinstance(table, Sequence) or not table:
            raise ValueError(f"{where}: profiles must be a list of [mean, std] pairs")
        rows = []
        for row in table:
            if isinstance(row, str) or not isinstance(row, Sequence) or len(row) != 2:
                raise ValueError(f"{where}: each profile must be [mean, std], got {row!r}")
            rows.append((positive(where, "mean", row[0]), non_negative(where, "std", row[1])))
        return tuple(rows)

    def draw(self, client: int, round_: int) -> float:
        mean, std = self.table[self.profile_of[client]]
        rng = job_rng(self.seed, client, round_, STREAM_RPI_JOB)
        x = float(rng.normal(mean, std))
        if self.nonpositive == "resample":
            # A truncated normal by rejection; 1000 tries cover any table with mean > 0.
            for _ in range(1000):
                if x > 0:
                    break
                x = float(rng.normal(mean, std))
        return x if x > 0 else mean  # the authors' rule: non-positive latencies become the mean

    def describe(self) -> dict[str, Any]:
        counts = np.bincount(self.profile_of, minlength=len(self.table))
        return {
            "assign": self.assign,
            "nonpositive": self.nonpositive,
            "mode": self.mode,
            "profiles": [
                {"mean": m, "std": s, "clients": int(c)}
                for (m, s), c in zip(self.table, counts, strict=True)
            ],
        }
