"""The named profiles (``PROFILES``): the component each adds and its default keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .client_factors import Speed, Tiers
from .components import Component
from .distributions import DISTRIBUTIONS
from .dropout import Dropout
from .job_draws import Delay, RaspberryPiDraw
from .partial_work import PartialWork
from .raspberry_pi import RPI_POOLED
from .trace_replay import TraceReplay


@dataclass(frozen=True)
class Preset:
    """A named profile: the component it adds and that component's default keys."""

    kind: str | None  # None: adds nothing ("none")
    doc: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    dist: str | None = None  # delay presets: the distribution, fixed by the name

    def keys(self) -> tuple[str, ...]:
        if self.kind is None:
            return ()
        if self.kind == "delay":
            names = [self.dist] if self.dist else sorted(DISTRIBUTIONS)
            keys = {"mode"}.union(*(DISTRIBUTIONS[d].keys() for d in names))
            return tuple(sorted(keys | ({"dist"} if self.dist is None else set())))
        return KINDS[self.kind].keys


def _delay_preset(dist: str, doc: str, **defaults: Any) -> Preset:
    return Preset("delay", doc, defaults, dist)


_RPI = RPI_POOLED
PROFILES: dict[str, Preset] = {
    "none": Preset(None, "all clients equal: every job takes base_time"),
    "tiers": Preset("tiers", "Fed-OGD tiers: a tier-P client's job takes P x base_time"),
    "speed": Preset("speed", "a per-client speed factor (log-normal, mean 1, sigma 0.5)"),
    "delay": Preset("delay", "a per-job delay with dist=...", {"dist": "exponential"}),
    "exponential": _delay_preset("exponential", "per-job factor ~ Exp(mean 1) (FedHist)"),
    "lognormal": _delay_preset("lognormal", "per-job factor ~ log-normal(mean 1, std 1)"),
    "halfnormal": _delay_preset("halfnormal", "per-job factor ~ half-normal(mean 1)"),
    "uniform": _delay_preset("uniform", "per-job factor ~ U[0.5, 1.5]"),
    "pareto": _delay_preset("pareto", "per-job factor ~ Pareto(shape 3, mean 1)"),
    "rpi_lognormal": _delay_preset(
        "lognormal",
        "ORTHOFL App. B.4 log-normal (pooled RPi mean/std, s)",
        mean=_RPI["mean"],
        std=_RPI["std"],
    ),  # fmt: skip
    "rpi_halfnormal": _delay_preset(
        "halfnormal", "ORTHOFL App. B.4 half-normal (pooled RPi mean, s)", mean=_RPI["mean"]
    ),
    "rpi_uniform": _delay_preset(
        "uniform",
        "ORTHOFL App. B.4 uniform (RPi 5th-95th percentiles, s)",
        low=_RPI["p5"],
        high=_RPI["p95"],
    ),  # fmt: skip
    "raspberry_pi": Preset("raspberry_pi", "ORTHOFL's 9 measured RPi profiles, N(mean, std) s"),
    "dropout": Preset("dropout", "FedDGIC dropouts: 25% of clients leave after 4..20 updates"),
    "partial_work": Preset("partial_work", "FedEN stragglers: 10% per round do 1..E-1 of E"),
    "trace": Preset("trace", "replay real clients' timing: trace:file=FILE (aggsrv serve --trace)"),
}

KINDS: dict[str, type[Component]] = {
    c.kind: c for c in (Tiers, Speed, Delay, RaspberryPiDraw, Dropout, PartialWork, TraceReplay)
}
