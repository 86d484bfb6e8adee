"""Per-client job-time factors: Fed-OGD's tiers and a per-client speed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from .checks import choice, non_negative, positive
from .components import ClientFactor, Context
from .distributions import DISTRIBUTIONS, make_distribution
from .streams import STREAM_SPEED, STREAM_TIER, job_rng

TIER_MIXES: dict[str, dict[float, float]] = {
    # docs/algorithms/fedogd.md 2.6 / 3: the paper's three straggler mixes; the
    # authors' code defaults to L2.
    "L1": {1.0: 0.6, 3.0: 0.2, 5.0: 0.2},
    "L2": {1.0: 0.4, 3.0: 0.3, 5.0: 0.3},
    "L3": {1.0: 0.2, 3.0: 0.4, 5.0: 0.4},
}


class Tiers(ClientFactor):
    """Fed-OGD tiers: client c's jobs take tier(c) = P times as long."""

    kind = "tiers"
    keys = ("mix", "assign")

    def __init__(self, ctx: Context, p: Mapping[str, Any]) -> None:
        where = "tiers"
        self.mix_name, self.mix = self._mix(where, p.get("mix", "L2"))
        self.assign = choice(
            where, "assign", p.get("assign", "shuffled"), ("shuffled", "contiguous")
        )
        n = ctx.num_clients
        periods = sorted(self.mix)
        # Exact counts by largest remainder (ties: faster tier first), so fractions are exact
        # wherever fraction * n is an integer.
        raw = [self.mix[q] * n for q in periods]
        counts = [math.floor(x) for x in raw]
        order = sorted(range(len(periods)), key=lambda i: (-(raw[i] - counts[i]), i))
        for i in order[: n - sum(counts)]:
            counts[i] += 1
        self.counts = dict(zip(periods, counts, strict=True))
        slots = np.repeat(np.array(periods), counts)
        if self.assign == "shuffled":
            slots = slots[job_rng(ctx.seed, 0, 0, STREAM_TIER).permutation(n)]
        self.tier_of = [float(x) for x in slots]

    @staticmethod
    def _mix(where: str, mix: Any) -> tuple[str, dict[float, float]]:
        if isinstance(mix, str) and mix in TIER_MIXES:
            return mix, dict(TIER_MIXES[mix])
        if isinstance(mix, str):
            pairs = [item.split(":") for item in mix.split("/")]
            if not all(len(pair) == 2 for pair in pairs):
                raise ValueError(
                    f"{where}: mix must be one of {sorted(TIER_MIXES)}, a mapping "
                    f"{{period: fraction}} or 'P:fraction/P:fraction', got {mix!r}"
                )
            try:
                mix = {float(a): float(b) for a, b in pairs}
            except ValueError:
                raise ValueError(f"{where}: cannot read the mix {mix!r}") from None
        if not isinstance(mix, Mapping) or not mix:
            raise ValueError(
                f"{where}: mix must be L1, L2, L3 or {{period: fraction}}, got {mix!r}"
            )
        out: dict[float, float] = {}
        for period, frac in mix.items():
            try:
                period = float(period)
            except (TypeError, ValueError):
                raise ValueError(f"{where}: tier period {period!r} is not a number") from None
            out[positive(where, "tier period", period)] = non_negative(where, "fraction", frac)
        total = sum(out.values())
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"{where}: tier fractions must sum to 1, got {total}")
        return "custom", out

    def factor(self, client: int) -> float:
        return self.tier_of[client]

    def describe(self) -> dict[str, Any]:
        return {
            "mix": self.mix_name,
            "assign": self.assign,
            "tiers": [
                {"period": q, "fraction": self.mix[q], "clients": self.counts[q]}
                for q in sorted(self.mix)
            ],
        }


class Speed(ClientFactor):
    """A per-client speed factor drawn once per (seed, client)."""

    kind = "speed"
    keys = ("dist", *sorted(set().union(*(d.keys() for d in DISTRIBUTIONS.values()))))
    # Mean-1 log-normal spread by default; FedDGIC's optional per-client factor is U[1, 3].
    overrides: ClassVar[dict[str, dict[str, float]]] = {
        "lognormal": {"mean": 1.0, "sigma": 0.5},
        "uniform": {"low": 1.0, "high": 3.0},
    }

    def __init__(self, ctx: Context, p: Mapping[str, Any]) -> None:
        p = dict(p)
        name = choice("speed", "dist", p.pop("dist", "lognormal"), sorted(DISTRIBUTIONS))
        self.dist = make_distribution("speed", name, p, self.overrides.get(name))
        self.seed = ctx.seed
        self._cache: dict[int, float] = {}

    def factor(self, client: int) -> float:
        value = self._cache.get(client)
        if value is None:
            draw = self.dist.sample(job_rng(self.seed, client, 0, STREAM_SPEED))
            value = self._cache[client] = max(draw, 0.0)
        return value

    def describe(self) -> dict[str, Any]:
        return self.dist.describe()
