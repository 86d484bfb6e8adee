"""The delay distributions, as ``scipy.stats`` distributions, from the keys a spec gives them.

Each class reads its keys (a ``mean`` or the distribution's own parameters, see the package
docstring), maps them to the scipy distribution's parameterisation, and draws from it with the
generator of the draw (``rvs(random_state=rng)``), so every draw stays seeded by
(seed, client, round, stream). Mean and std are scipy's (``inf`` where they do not exist). A
zero spread (``uniform`` with ``low == high``, ``lognormal`` with ``std`` or ``sigma`` 0) is a
point mass, which scipy does not take as a continuous distribution.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from scipy import stats

from .checks import non_negative, number, positive

__all__ = ["DISTRIBUTIONS", "Distribution", "make_distribution"]


class Distribution:
    """A delay distribution: a frozen ``scipy.stats`` distribution, or a point mass."""

    name: ClassVar[str]
    # Keys that set the same thing (mean or rate, ...): a default is dropped when the user
    # gives another key of its group.
    groups: ClassVar[tuple[frozenset[str], ...]]
    defaults: ClassVar[dict[str, float]]

    frozen: Any  # scipy.stats' frozen distribution; None for a point mass at ``point``
    point: float = math.nan

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset().union(*cls.groups)

    @property
    def mean(self) -> float:
        return self.point if self.frozen is None else float(self.frozen.mean())

    @property
    def std(self) -> float:
        return 0.0 if self.frozen is None else float(self.frozen.std())

    def sample(self, rng: np.random.Generator) -> float:
        return self.point if self.frozen is None else float(self.frozen.rvs(random_state=rng))

    def params(self) -> dict[str, float]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"dist": self.name, **self.params(), "mean": self.mean, "std": self.std}


class Exponential(Distribution):
    """Exponential with ``mean`` (or ``rate``): memoryless job times; ``expon(scale=mean)``."""

    name = "exponential"
    groups = (frozenset({"mean", "rate"}),)
    defaults = {"mean": 1.0}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        if "rate" in p:
            self.scale = 1.0 / positive(where, "rate", p["rate"])
        else:
            self.scale = positive(where, "mean", p["mean"])
        self.frozen = stats.expon(scale=self.scale)

    def params(self) -> dict[str, float]:
        return {"rate": 1.0 / self.scale}


class LogNormal(Distribution):
    """Log-normal from its ``mean``/``std`` or its log-space ``mu``/``sigma``;
    ``lognorm(s=sigma, scale=exp(mu))``."""

    name = "lognormal"
    groups = (frozenset({"mean", "mu"}), frozenset({"std", "sigma"}))
    defaults = {"mean": 1.0, "std": 1.0}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        if "std" in p:
            if "mu" in p:
                raise ValueError(f"{where}: give std with mean, or sigma with mu, not std with mu")
            mean = positive(where, "mean", p["mean"])
            std = non_negative(where, "std", p["std"])
            # ORTHOFL App. B.4: the log-space parameters that reproduce mean and std.
            self.sigma = math.sqrt(math.log(std**2 / mean**2 + 1.0))
            self.mu = math.log(mean) - self.sigma**2 / 2
        else:
            self.sigma = non_negative(where, "sigma", p["sigma"])
            if "mu" in p:
                self.mu = number(where, "mu", p["mu"])
            else:
                self.mu = math.log(positive(where, "mean", p["mean"])) - self.sigma**2 / 2
        if self.sigma > 5:
            raise ValueError(f"{where}: sigma = {self.sigma:.3g} > 5 overflows job times")
        if self.sigma == 0:
            self.frozen, self.point = None, math.exp(self.mu)
        else:
            self.frozen = stats.lognorm(s=self.sigma, scale=math.exp(self.mu))

    def params(self) -> dict[str, float]:
        return {"mu": self.mu, "sigma": self.sigma}


class HalfNormal(Distribution):
    """|N(0, scale)| + loc: loc 0 and scale from the mean, or a shift matching ``std``;
    ``halfnorm(loc, scale)``."""

    name = "halfnormal"
    groups = (frozenset({"mean", "scale"}), frozenset({"std"}))
    defaults = {"mean": 1.0}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        # The half-normal's mean is loc + scale * sqrt(2/pi), its std scale * sqrt(1 - 2/pi).
        root = math.sqrt(2 / math.pi)
        if "std" in p:
            if "scale" in p:
                raise ValueError(f"{where}: give std with mean, not with scale")
            # docs/algorithms/orthofl.md G11's alternative: match mean and std
            # with a shifted half-normal.
            self.scale = positive(where, "std", p["std"]) / math.sqrt(1 - 2 / math.pi)
            self.loc = positive(where, "mean", p["mean"]) - self.scale * root
        elif "scale" in p:
            self.scale, self.loc = positive(where, "scale", p["scale"]), 0.0
        else:
            # docs/algorithms/orthofl.md G11's default: loc 0, scale from
            # the mean; the mode is at 0.
            self.scale, self.loc = positive(where, "mean", p["mean"]) / root, 0.0
        self.frozen = stats.halfnorm(loc=self.loc, scale=self.scale)

    def params(self) -> dict[str, float]:
        # With a negative loc, draws below 0 are clipped, so the true mean is a bit higher.
        return {"loc": self.loc, "scale": self.scale}


class Uniform(Distribution):
    """Uniform on [``low``, ``high``]; ``uniform(loc=low, scale=high - low)``."""

    name = "uniform"
    groups = (frozenset({"low"}), frozenset({"high"}))
    defaults = {"low": 0.5, "high": 1.5}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        self.low = non_negative(where, "low", p["low"])
        self.high = number(where, "high", p["high"])
        if self.high < self.low:
            raise ValueError(f"{where}: needs low <= high, got low={self.low}, high={self.high}")
        if self.high == self.low:
            self.frozen, self.point = None, self.low
        else:
            self.frozen = stats.uniform(loc=self.low, scale=self.high - self.low)

    def params(self) -> dict[str, float]:
        return {"low": self.low, "high": self.high}


class Pareto(Distribution):
    """Pareto I with ``shape`` and minimum ``scale`` (or the ``mean`` it implies);
    ``pareto(b=shape, scale=scale)``."""

    name = "pareto"
    groups = (frozenset({"shape"}), frozenset({"mean", "scale"}))
    defaults = {"shape": 3.0, "mean": 1.0}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        a = self.shape = positive(where, "shape", p["shape"])
        if "scale" in p:
            self.scale = positive(where, "scale", p["scale"])
        else:
            if a <= 1:
                raise ValueError(f"{where}: shape {a} <= 1 has no mean; give scale instead")
            # The mean of Pareto I is scale * a / (a - 1).
            self.scale = positive(where, "mean", p["mean"]) * (a - 1) / a
        self.frozen = stats.pareto(b=a, scale=self.scale)

    def params(self) -> dict[str, float]:
        return {"shape": self.shape, "scale": self.scale}


DISTRIBUTIONS: dict[str, type[Distribution]] = {
    d.name: d for d in (Exponential, LogNormal, HalfNormal, Uniform, Pareto)
}


def _merge(dist: type[Distribution], defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict:
    """``given`` over ``defaults``, dropping a default whose group the user already set."""
    merged = {}
    for key, value in defaults.items():
        group = next((g for g in dist.groups if key in g), frozenset({key}))
        if not group & given.keys():
            merged[key] = value
    merged.update(given)
    return merged


def make_distribution(
    where: str, name: str, given: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
) -> Distribution:
    """The distribution ``name`` from the keys ``given``, over ``overrides`` (a component's
    own defaults), over the distribution's defaults."""
    dist = DISTRIBUTIONS[name]
    unknown = sorted(set(given) - dist.keys())
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {unknown} for {name}; known: {sorted(dist.keys())}"
        )
    params = _merge(dist, _merge(dist, dist.defaults, overrides or {}), given)
    return dist(where, params)
