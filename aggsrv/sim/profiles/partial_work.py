"""FedEN's stragglers: in some jobs a client does only part of the local work."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from .checks import choice, fraction_count, int_at_least, number
from .components import Component, Context
from .streams import (
    STREAM_PARTIAL_PERSISTENT,
    STREAM_PARTIAL_PICK,
    STREAM_PARTIAL_WORK,
    job_rng,
)


class PartialWork(Component):
    """FedEN's stragglers: some jobs do only part of the local work."""

    kind = "partial_work"
    keys = ("fraction", "selection", "units")

    def __init__(self, ctx: Context, p: Mapping[str, Any]) -> None:
        where = "partial_work"
        self.fraction = number(where, "fraction", p.get("fraction", 0.1))
        self.selection = choice(
            where, "selection", p.get("selection", "exact"), ("exact", "bernoulli", "persistent")
        )
        self.units = int_at_least(where, "units", p.get("units", 10), 2)
        self.n, self.seed = ctx.num_clients, ctx.seed
        self.k = fraction_count(where, self.fraction, self.n)
        rng = job_rng(ctx.seed, 0, 0, STREAM_PARTIAL_PERSISTENT)
        self.persistent = frozenset(int(c) for c in rng.choice(self.n, self.k, replace=False))
        self._pick = lru_cache(maxsize=256)(self._pick_round)

    def _pick_round(self, round_: int) -> frozenset[int]:
        # FedEN's protocol (docs/algorithms/feden.md 1.8): exactly round(s * K) stragglers per
        # round, drawn by an RNG seeded by the round, so every method sees the same ones.
        rng = job_rng(self.seed, 0, round_, STREAM_PARTIAL_PICK)
        return frozenset(int(c) for c in rng.choice(self.n, self.k, replace=False))

    def straggles(self, client: int, round_: int) -> bool:
        if self.selection == "exact":
            return client in self._pick(round_)
        if self.selection == "persistent":
            return client in self.persistent
        rng = job_rng(self.seed, client, round_, STREAM_PARTIAL_PICK)
        return bool(rng.random() < self.fraction)

    def work_fraction(self, client: int, round_: int) -> float:
        if not self.straggles(client, round_):
            return 1.0
        # E_i ~ UniformInt{1, ..., E-1}: FedProx's randint(1, E), upper bound exclusive.
        done = int(job_rng(self.seed, client, round_, STREAM_PARTIAL_WORK).integers(1, self.units))
        return done / self.units

    def describe(self) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "selection": self.selection,
            "units": self.units,
            "stragglers_per_round": self.k if self.selection != "bernoulli" else None,
        }
