"""Straggler and dropout profiles: what each client's jobs cost on the simulator's virtual clock.

For job ``r`` of client ``c`` (``r`` counts that client's jobs: 0, 1, 2, ...) a ``Profile``
answers ``plan(c, r)``: the job's duration in virtual seconds and the fraction of the local work
the client does; ``online(c, t, updates_sent)`` says whether the client is present at virtual
time ``t``, and ``next_change`` when that may flip, so the simulator can schedule a wake-up.

Durations combine the components of the profile in a fixed way::

    duration = base_time * tier(c) * speed(c) * prod(mul draws of job (c, r)) + sum(add draws)

floored at ``1e-9 * base_time`` so a job never takes zero time. ``mul`` draws are dimensionless
factors (the default: a delay "distribution with mean 1" leaves the mean job time unchanged);
``add`` draws are virtual seconds added on top (e.g. communication).

Reproducibility: every draw comes from ``np.random.default_rng([seed, client, round, STREAM])``
with one STREAM constant per kind of draw (client-level draws use round 0, round-level draws
client 0). The key always has four words because numpy's SeedSequence ignores trailing zero
words (``[1, 2, 3]`` and ``[1, 2, 3, 0]`` give the same stream), so keys of different lengths
could collide. Hence every strategy in a comparison sees exactly the same stragglers, whatever
order the simulator asks in.

Specs (``make_profile``): a preset name (``"tiers"``), ``"name:key=value,key=value"``, several
of those joined by ``+`` (``"tiers:mix=L1+dropout:count=5"``), a mapping ``{"name": preset,
key: value, ...}``, a mapping of presets to their keys (``{"tiers": {"mix": "L1"}, "dropout":
{"count": 5}}``), or both at once; ``base_time`` may appear as a key anywhere. In strings,
``lo..hi`` is a range and a custom tier mix is ``mix=1:0.5/3:0.5``.

Presets (``PROFILES``) and what they model:

* ``none``: every job takes ``base_time``.
* ``tiers`` (Fed-OGD, docs/algorithms/fedogd.md 2.6 and 3): a tier-P client's job takes P x base.
  ``mix`` is ``L1`` {1: 60%, 3: 20%, 5: 20%}, ``L2`` {40/30/30%, the authors' default} or ``L3``
  {20/40/40%} or a custom {P: fraction}; exact counts (largest remainder), assigned by a
  permutation seeded by ``seed`` (``assign=shuffled``) or by contiguous client index, fastest
  first, as the authors' code does (``assign=contiguous``).
* ``speed``: a per-client factor, seeded by (seed, client): log-normal with mean 1 and
  sigma 0.5 by default, or e.g. ``dist=uniform`` (1 to 3: FedDGIC's optional speed spread,
  docs/algorithms/feddgic.md 2.2).
* ``exponential`` (mean 1; FedHist's i.i.d. exponential job times, docs/algorithms/fedhist.md 1.5),
  ``lognormal`` (mean 1, std 1: the coefficient of variation of ORTHOFL's pooled RPi latencies),
  ``halfnormal`` (mean 1, loc 0: docs/algorithms/orthofl.md G11), ``uniform`` (0.5 to 1.5),
  ``pareto`` (shape 3, mean 1); generic ``delay:dist=...``. Keys: the distribution's parameters
  (below) and ``mode`` = ``mul`` (default) or ``add``.
* ``raspberry_pi`` (ORTHOFL, docs/algorithms/orthofl.md 2.3): each client gets one of the 9 measured
  RPi profiles (mean, std in seconds) at random; each job takes N(mean, std) x base_time seconds,
  non-positive draws replaced by the mean as in the authors' code (docs/algorithms/orthofl.md G12).
* ``rpi_lognormal``, ``rpi_halfnormal``, ``rpi_uniform`` (ORTHOFL App. B.4, Fig. 6): the three
  alternative distributions parameterised by the pooled RPi statistics, in seconds.
* ``dropout`` (FedDGIC, docs/algorithms/feddgic.md 2.2 and 5 #29): ``fraction`` 0.25 of the clients
  (5 of 20) leave after a number of their own updates drawn from 4..20 (after the n_cal = 3 grouping
  rounds, within the first 20% of 100 epochs), permanently unless ``return_after`` is set.
* ``partial_work`` (FedEN, docs/algorithms/feden.md 1.8 and 2): a ``fraction`` 0.1 of the clients
  are stragglers in each round and do E_i ~ UniformInt{1..E-1} of E = ``units`` = 10 epochs; they
  still take the full job time (they are not late, they stop early).

Distribution parameters (all draws are clipped at 0): ``exponential``: ``mean`` | ``rate``;
``lognormal``: ``mean`` | ``mu`` and ``std`` | ``sigma`` (mean and std map to the log-space
parameters as in docs/algorithms/orthofl.md App. B.4); ``halfnormal``: ``mean`` | ``scale``,
optional ``std`` (moment matching with a shift, docs/algorithms/orthofl.md G11's alternative);
``uniform``: ``low``, ``high``; ``pareto``: ``shape`` and ``mean`` | ``scale`` (the minimum).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "PROFILES",
    "RASPBERRY_PI_PROFILES",
    "RPI_POOLED",
    "JobPlan",
    "Preset",
    "Profile",
    "make_profile",
]

# One stream per kind of draw; never 0 (see the module docstring).
STREAM_TIER = 1
STREAM_SPEED = 2
STREAM_RPI_ASSIGN = 3
STREAM_RPI_JOB = 4
STREAM_DROP_CHOICE = 5
STREAM_DROP_LEAVE = 6
STREAM_DROP_RETURN = 7
STREAM_PARTIAL_PICK = 8
STREAM_PARTIAL_PERSISTENT = 9
STREAM_PARTIAL_WORK = 10
STREAM_DELAY = 100  # + the delay's position among the profile's delays: each has its own stream

_FLOOR = 1e-9  # the shortest job, in units of base_time: durations stay > 0


def _rng(seed: int, client: int, round_: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, client, round_, stream])


@dataclass(frozen=True)
class JobPlan:
    """What one job costs: its duration and how much of the local work the client does."""

    duration: float  # virtual seconds from receiving the job to the update arriving
    work_fraction: float = 1.0  # 1.0: full local work; < 1: a straggler sending partial work

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration) and self.duration > 0):
            raise ValueError(f"a job's duration must be finite and > 0, got {self.duration}")
        if not 0 < self.work_fraction <= 1:
            raise ValueError(f"work_fraction must be in (0, 1], got {self.work_fraction}")


# ---------------------------------------------------------------------------- checks


def _number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be finite, got {value!r}")
    return float(value)


def _positive(where: str, key: str, value: Any) -> float:
    v = _number(where, key, value)
    if v <= 0:
        raise ValueError(f"{where}: {key} must be > 0, got {value!r}")
    return v


def _non_negative(where: str, key: str, value: Any) -> float:
    v = _number(where, key, value)
    if v < 0:
        raise ValueError(f"{where}: {key} must be >= 0, got {value!r}")
    return v


def _int(where: str, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key} must be an int >= {minimum}, got {value!r}")
    return value


def _choice(where: str, key: str, value: Any, options: Sequence[str]) -> str:
    if value not in options:
        raise ValueError(f"{where}: {key} must be one of {list(options)}, got {value!r}")
    return value


def _range(where: str, key: str, value: Any, *, integer: bool) -> tuple[float, float]:
    """A number or a ``[lo, hi]`` pair (drawn uniformly per client) as ``(lo, hi)``."""

    def check(v: Any) -> float:
        return float(_int(where, key, v, 0)) if integer else _non_negative(where, key, v)

    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != 2:
            raise ValueError(f"{where}: {key} must be a number or [lo, hi], got {value!r}")
        lo, hi = check(value[0]), check(value[1])
        if lo > hi:
            raise ValueError(f"{where}: {key} range must have lo <= hi, got {value!r}")
        return lo, hi
    v = check(value)
    return v, v


def _fraction_count(where: str, fraction: float, n: int) -> int:
    """round(fraction * n), halves up, so 0.25 of 20 is 5 and 0.5 of 1 is 1."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"{where}: fraction must be in [0, 1], got {fraction!r}")
    return min(n, math.floor(fraction * n + 0.5))


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars, tuples and infinities made JSON-friendly."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ---------------------------------------------------------------------------- distributions


class _Dist:
    """A non-negative distribution with analytic moments (for ``describe`` and the tests)."""

    name: ClassVar[str]
    # Keys that set the same thing (mean or rate, ...): a default is dropped when the user
    # gives another key of its group.
    groups: ClassVar[tuple[frozenset[str], ...]]
    defaults: ClassVar[dict[str, float]]

    mean: float
    std: float  # inf where it does not exist

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset().union(*cls.groups)

    def sample(self, rng: np.random.Generator) -> float:
        raise NotImplementedError

    def params(self) -> dict[str, float]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"dist": self.name, **self.params(), "mean": self.mean, "std": self.std}


class _Exponential(_Dist):
    """Exponential with ``mean`` (or ``rate``): memoryless job times."""

    name = "exponential"
    groups = (frozenset({"mean", "rate"}),)
    defaults = {"mean": 1.0}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        if "rate" in p:
            self.mean = 1.0 / _positive(where, "rate", p["rate"])
        else:
            self.mean = _positive(where, "mean", p["mean"])
        self.std = self.mean

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.exponential(self.mean))

    def params(self) -> dict[str, float]:
        return {"rate": 1.0 / self.mean}


class _LogNormal(_Dist):
    """Log-normal from its ``mean``/``std`` or its log-space ``mu``/``sigma``."""

    name = "lognormal"
    groups = (frozenset({"mean", "mu"}), frozenset({"std", "sigma"}))
    defaults = {"mean": 1.0, "std": 1.0}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        if "std" in p:
            if "mu" in p:
                raise ValueError(f"{where}: give std with mean, or sigma with mu, not std with mu")
            mean = _positive(where, "mean", p["mean"])
            std = _non_negative(where, "std", p["std"])
            # ORTHOFL App. B.4: the log-space parameters that reproduce mean and std.
            self.sigma = math.sqrt(math.log(std**2 / mean**2 + 1.0))
            self.mu = math.log(mean) - self.sigma**2 / 2
        else:
            self.sigma = _non_negative(where, "sigma", p["sigma"])
            if "mu" in p:
                self.mu = _number(where, "mu", p["mu"])
            else:
                self.mu = math.log(_positive(where, "mean", p["mean"])) - self.sigma**2 / 2
        if self.sigma > 5:
            raise ValueError(f"{where}: sigma = {self.sigma:.3g} > 5 overflows job times")
        self.mean = math.exp(self.mu + self.sigma**2 / 2)
        self.std = self.mean * math.sqrt(math.expm1(self.sigma**2))

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.lognormal(self.mu, self.sigma))

    def params(self) -> dict[str, float]:
        return {"mu": self.mu, "sigma": self.sigma}


class _HalfNormal(_Dist):
    """|N(0, scale)| + loc: loc 0 and scale from the mean, or a shift matching ``std``."""

    name = "halfnormal"
    groups = (frozenset({"mean", "scale"}), frozenset({"std"}))
    defaults = {"mean": 1.0}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        root = math.sqrt(2 / math.pi)
        if "std" in p:
            if "scale" in p:
                raise ValueError(f"{where}: give std with mean, not with scale")
            # docs/algorithms/orthofl.md G11's alternative: match mean and std
            # with a shifted half-normal.
            self.scale = _positive(where, "std", p["std"]) / math.sqrt(1 - 2 / math.pi)
            self.loc = _positive(where, "mean", p["mean"]) - self.scale * root
        elif "scale" in p:
            self.scale, self.loc = _positive(where, "scale", p["scale"]), 0.0
        else:
            # docs/algorithms/orthofl.md G11's default: loc 0, scale from
            # the mean; the mode is at 0.
            self.scale, self.loc = _positive(where, "mean", p["mean"]) / root, 0.0
        self.mean = self.loc + self.scale * root
        self.std = self.scale * math.sqrt(1 - 2 / math.pi)

    def sample(self, rng: np.random.Generator) -> float:
        return self.loc + abs(float(rng.normal(0.0, self.scale)))

    def params(self) -> dict[str, float]:
        # With a negative loc, draws below 0 are clipped, so the true mean is a bit higher.
        return {"loc": self.loc, "scale": self.scale}


class _Uniform(_Dist):
    """Uniform on [``low``, ``high``]."""

    name = "uniform"
    groups = (frozenset({"low"}), frozenset({"high"}))
    defaults = {"low": 0.5, "high": 1.5}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        self.low = _non_negative(where, "low", p["low"])
        self.high = _number(where, "high", p["high"])
        if self.high < self.low:
            raise ValueError(f"{where}: needs low <= high, got low={self.low}, high={self.high}")
        self.mean = (self.low + self.high) / 2
        self.std = (self.high - self.low) / math.sqrt(12)

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.low, self.high))

    def params(self) -> dict[str, float]:
        return {"low": self.low, "high": self.high}


class _Pareto(_Dist):
    """Pareto I with ``shape`` and minimum ``scale`` (or the ``mean`` it implies)."""

    name = "pareto"
    groups = (frozenset({"shape"}), frozenset({"mean", "scale"}))
    defaults = {"shape": 3.0, "mean": 1.0}

    def __init__(self, where: str, p: Mapping[str, Any]) -> None:
        a = self.shape = _positive(where, "shape", p["shape"])
        if "scale" in p:
            self.scale = _positive(where, "scale", p["scale"])
        else:
            if a <= 1:
                raise ValueError(f"{where}: shape {a} <= 1 has no mean; give scale instead")
            self.scale = _positive(where, "mean", p["mean"]) * (a - 1) / a
        self.mean = self.scale * a / (a - 1) if a > 1 else math.inf
        self.std = self.scale / (a - 1) * math.sqrt(a / (a - 2)) if a > 2 else math.inf

    def sample(self, rng: np.random.Generator) -> float:
        # numpy's pareto is Lomax (Pareto II, minimum 0); + 1 gives Pareto I with minimum 1.
        return self.scale * (1.0 + float(rng.pareto(self.shape)))

    def params(self) -> dict[str, float]:
        return {"shape": self.shape, "scale": self.scale}


_DISTS: dict[str, type[_Dist]] = {
    d.name: d for d in (_Exponential, _LogNormal, _HalfNormal, _Uniform, _Pareto)
}


def _merge(dist: type[_Dist], defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict:
    """``given`` over ``defaults``, dropping a default whose group the user already set."""
    merged = {}
    for key, value in defaults.items():
        group = next((g for g in dist.groups if key in g), frozenset({key}))
        if not group & given.keys():
            merged[key] = value
    merged.update(given)
    return merged


def _make_dist(where: str, name: str, given: Mapping[str, Any], overrides=None) -> _Dist:
    dist = _DISTS[name]
    unknown = sorted(set(given) - dist.keys())
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {unknown} for {name}; known: {sorted(dist.keys())}"
        )
    params = _merge(dist, _merge(dist, dist.defaults, overrides or {}), given)
    return dist(where, params)


# ---------------------------------------------------------------------------- RPi data

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


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _rpi_pooled(table: Sequence[tuple[float, float]]) -> dict[str, float]:
    """mu_R, sigma_R and the 5th/95th percentiles of the RPi latencies
    (docs/algorithms/orthofl.md App. B.4).

    The raw measurements are not in the repository, so (DECISION) the pool is the equal-weight
    mixture of the profiles, as clients draw them uniformly: mean and std from the table's
    moments, percentiles from the latencies as simulated (N(mean, std), non-positive draws
    replaced by the mean), found by bisection on the mixture's CDF.
    """
    k = len(table)
    mean = sum(m for m, _ in table) / k
    std = math.sqrt(sum(s * s + m * m for m, s in table) / k - mean * mean)

    def cdf(x: float) -> float:
        total = 0.0
        for m, s in table:
            below0 = _phi(-m / s)
            total += max(_phi((x - m) / s) - below0, 0.0) + (below0 if x >= m else 0.0)
        return total / k

    def quantile(q: float) -> float:
        lo, hi = 0.0, max(m + 12 * s for m, s in table)
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
        return hi

    return {"mean": mean, "std": std, "p5": quantile(0.05), "p95": quantile(0.95)}


RPI_POOLED: dict[str, float] = _rpi_pooled(RASPBERRY_PI_PROFILES)


# ---------------------------------------------------------------------------- components


@dataclass
class _Ctx:
    """What every component needs to know about the run."""

    num_clients: int
    seed: int
    index: int  # position among the profile's components of the same kind


class _Component:
    """One ingredient of a profile, built from its checked keys."""

    kind: ClassVar[str]
    keys: ClassVar[tuple[str, ...]] = ()
    once: ClassVar[bool] = True  # at most one per profile

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


class _ClientFactor(_Component):
    """A per-client multiplier of the job time."""

    def factor(self, client: int) -> float:
        raise NotImplementedError


class _JobDraw(_Component):
    """A per-job draw: a factor (``mul``) or added virtual seconds (``add``)."""

    mode: str

    def draw(self, client: int, round_: int) -> float:
        raise NotImplementedError


_TIER_MIXES: dict[str, dict[float, float]] = {
    # docs/algorithms/fedogd.md 2.6 / 3: the paper's three straggler mixes; the
    # authors' code defaults to L2.
    "L1": {1.0: 0.6, 3.0: 0.2, 5.0: 0.2},
    "L2": {1.0: 0.4, 3.0: 0.3, 5.0: 0.3},
    "L3": {1.0: 0.2, 3.0: 0.4, 5.0: 0.4},
}


class _Tiers(_ClientFactor):
    """Fed-OGD tiers: client c's jobs take tier(c) = P times as long."""

    kind = "tiers"
    keys = ("mix", "assign")

    def __init__(self, ctx: _Ctx, p: Mapping[str, Any]) -> None:
        where = "tiers"
        self.mix_name, self.mix = self._mix(where, p.get("mix", "L2"))
        self.assign = _choice(
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
            slots = slots[_rng(ctx.seed, 0, 0, STREAM_TIER).permutation(n)]
        self.tier_of = [float(x) for x in slots]

    @staticmethod
    def _mix(where: str, mix: Any) -> tuple[str, dict[float, float]]:
        if isinstance(mix, str) and mix in _TIER_MIXES:
            return mix, dict(_TIER_MIXES[mix])
        if isinstance(mix, str):
            pairs = [item.split(":") for item in mix.split("/")]
            if not all(len(pair) == 2 for pair in pairs):
                raise ValueError(
                    f"{where}: mix must be one of {sorted(_TIER_MIXES)}, a mapping "
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
            out[_positive(where, "tier period", period)] = _non_negative(where, "fraction", frac)
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


class _Speed(_ClientFactor):
    """A per-client speed factor drawn once per (seed, client)."""

    kind = "speed"
    keys = ("dist", *sorted(set().union(*(d.keys() for d in _DISTS.values()))))
    # Mean-1 log-normal spread by default; FedDGIC's optional per-client factor is U[1, 3].
    overrides: ClassVar[dict[str, dict[str, float]]] = {
        "lognormal": {"mean": 1.0, "sigma": 0.5},
        "uniform": {"low": 1.0, "high": 3.0},
    }

    def __init__(self, ctx: _Ctx, p: Mapping[str, Any]) -> None:
        p = dict(p)
        name = _choice("speed", "dist", p.pop("dist", "lognormal"), sorted(_DISTS))
        self.dist = _make_dist("speed", name, p, self.overrides.get(name))
        self.seed = ctx.seed
        self._cache: dict[int, float] = {}

    def factor(self, client: int) -> float:
        value = self._cache.get(client)
        if value is None:
            draw = self.dist.sample(_rng(self.seed, client, 0, STREAM_SPEED))
            value = self._cache[client] = max(draw, 0.0)
        return value

    def describe(self) -> dict[str, Any]:
        return self.dist.describe()


class _Delay(_JobDraw):
    """A per-job draw from one of the distributions, a factor or added seconds."""

    kind = "delay"
    once = False

    def __init__(self, ctx: _Ctx, p: Mapping[str, Any], dist: str) -> None:
        p = dict(p)
        where = f"delay ({dist})"
        self.mode = _choice(where, "mode", p.pop("mode", "mul"), ("mul", "add"))
        self.dist = _make_dist(where, dist, p)
        self.seed = ctx.seed
        self.stream = STREAM_DELAY + ctx.index

    def draw(self, client: int, round_: int) -> float:
        return max(self.dist.sample(_rng(self.seed, client, round_, self.stream)), 0.0)

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, **self.dist.describe()}


class _RaspberryPi(_JobDraw):
    """ORTHOFL's RPi latencies: a profile per client, N(mean, std) per job."""

    kind = "raspberry_pi"
    keys = ("assign", "nonpositive", "mode", "profiles")

    def __init__(self, ctx: _Ctx, p: Mapping[str, Any]) -> None:
        where = "raspberry_pi"
        self.table = self._table(where, p.get("profiles", RASPBERRY_PI_PROFILES))
        self.assign = _choice(where, "assign", p.get("assign", "random"), ("random", "round_robin"))
        self.nonpositive = _choice(
            where, "nonpositive", p.get("nonpositive", "mean"), ("mean", "resample")
        )
        self.mode = _choice(where, "mode", p.get("mode", "mul"), ("mul", "add"))
        n, k = ctx.num_clients, len(self.table)
        if self.assign == "random":
            # The authors' get_delay: np.random.choice(9, M), without replacement when M < 9.
            rng = _rng(ctx.seed, 0, 0, STREAM_RPI_ASSIGN)
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
            rows.append((_positive(where, "mean", row[0]), _non_negative(where, "std", row[1])))
        return tuple(rows)

    def draw(self, client: int, round_: int) -> float:
        mean, std = self.table[self.profile_of[client]]
        rng = _rng(self.seed, client, round_, STREAM_RPI_JOB)
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


class _Dropout(_Component):
    """Clients that leave at a virtual time or after N updates, and may come back."""

    kind = "dropout"
    keys = ("count", "fraction", "clients", "at_time", "after_updates", "return_after")

    def __init__(self, ctx: _Ctx, p: Mapping[str, Any]) -> None:
        where = "dropout"
        n = ctx.num_clients
        chosen = [k for k in ("count", "fraction", "clients") if k in p]
        if len(chosen) > 1:
            raise ValueError(f"{where}: give one of count, fraction, clients, not {chosen}")
        if "clients" in p:
            clients = p["clients"]
            if isinstance(clients, str) or not isinstance(clients, Sequence):
                raise ValueError(f"{where}: clients must be a list of client indices")
            ids = sorted({_int(where, "client", c, 0) for c in clients})
            if ids and ids[-1] >= n:
                raise ValueError(f"{where}: client {ids[-1]} out of range for {n} clients")
        else:
            if "count" in p:
                k = _int(where, "count", p["count"], 0)
                if k > n:
                    raise ValueError(f"{where}: count {k} exceeds the {n} clients")
            else:
                k = _fraction_count(where, _number(where, "fraction", p.get("fraction", 0.25)), n)
            rng = _rng(ctx.seed, 0, 0, STREAM_DROP_CHOICE)
            ids = sorted(int(c) for c in rng.choice(n, k, replace=False))
        if "at_time" in p and "after_updates" in p:
            raise ValueError(f"{where}: give at_time or after_updates, not both")
        self.by_time = "at_time" in p
        spec = p["at_time"] if self.by_time else p.get("after_updates", [4, 20])
        key = "at_time" if self.by_time else "after_updates"
        leave = _range(where, key, spec, integer=not self.by_time)
        if not self.by_time and leave[0] < 1:
            raise ValueError(f"{where}: after_updates must be >= 1, got {spec!r}")
        ret = p.get("return_after")
        ret_range = None if ret is None else _range(where, "return_after", ret, integer=False)
        shown = list(leave) if self.by_time else [int(v) for v in leave]
        self.spec = {key: shown, "return_after": None if ret_range is None else list(ret_range)}
        # Per client: when it leaves (virtual time, or its number of updates) and for how long.
        self.leave: dict[int, float] = {}
        self.away_for: dict[int, float | None] = {}
        for c in ids:
            lo, hi = leave
            rng = _rng(ctx.seed, c, 0, STREAM_DROP_LEAVE)
            if self.by_time:
                self.leave[c] = lo if lo == hi else float(rng.uniform(lo, hi))
            else:
                self.leave[c] = float(rng.integers(int(lo), int(hi) + 1))
            if ret_range is None:
                self.away_for[c] = None
            else:
                rlo, rhi = ret_range
                rng = _rng(ctx.seed, c, 0, STREAM_DROP_RETURN)
                self.away_for[c] = rlo if rlo == rhi else float(rng.uniform(rlo, rhi))
        # after_updates with a return: the virtual time each client was first seen gone.
        self._left_at: dict[int, float] = {}

    def _window(
        self, client: int, t: float, sent: int, last_update_at: float | None
    ) -> tuple[float, float] | None:
        """The client's absence ``[start, end)`` (end may be inf), or None if it is not known
        to be away at (t, sent): it never leaves, has not left yet, or came back."""
        if client not in self.leave:
            return None
        away = self.away_for[client]
        if self.by_time:
            start = self.leave[client]
            return (start, math.inf if away is None else start + away)
        n = int(self.leave[client])
        if sent < n:
            return None
        if away is None:
            return (-math.inf, math.inf)
        if sent > n:
            return None  # it came back and sent more
        if last_update_at is None:
            # The simulator asks when the N-th update arrives: remember the earliest such time.
            last_update_at = min(self._left_at.get(client, t), t)
            self._left_at[client] = last_update_at
        return (last_update_at, last_update_at + away)

    def online(self, client: int, t: float, sent: int, last_update_at: float | None) -> bool:
        window = self._window(client, t, sent, last_update_at)
        return window is None or not window[0] <= t < window[1]

    def next_change(
        self, client: int, t: float, sent: int, last_update_at: float | None
    ) -> float | None:
        window = self._window(client, t, sent, last_update_at)
        if window is None:
            return None  # never leaves, or only its next update can make it leave
        start, end = window
        if t < start:
            return start
        return end if t < end and math.isfinite(end) else None

    def describe(self) -> dict[str, Any]:
        return {
            **self.spec,
            "clients": [
                {
                    "client": c,
                    "at_time" if self.by_time else "after_updates": (
                        self.leave[c] if self.by_time else int(self.leave[c])
                    ),
                    "return_after": self.away_for[c],
                }
                for c in sorted(self.leave)
            ],
        }


class _PartialWork(_Component):
    """FedEN's stragglers: some jobs do only part of the local work."""

    kind = "partial_work"
    keys = ("fraction", "selection", "units")

    def __init__(self, ctx: _Ctx, p: Mapping[str, Any]) -> None:
        where = "partial_work"
        self.fraction = _number(where, "fraction", p.get("fraction", 0.1))
        self.selection = _choice(
            where, "selection", p.get("selection", "exact"), ("exact", "bernoulli", "persistent")
        )
        self.units = _int(where, "units", p.get("units", 10), 2)
        self.n, self.seed = ctx.num_clients, ctx.seed
        self.k = _fraction_count(where, self.fraction, self.n)
        rng = _rng(ctx.seed, 0, 0, STREAM_PARTIAL_PERSISTENT)
        self.persistent = frozenset(int(c) for c in rng.choice(self.n, self.k, replace=False))
        self._pick = lru_cache(maxsize=256)(self._pick_round)

    def _pick_round(self, round_: int) -> frozenset[int]:
        # FedEN's protocol (docs/algorithms/feden.md 1.8): exactly round(s * K) stragglers per
        # round, drawn by an RNG seeded by the round, so every method sees the same ones.
        rng = _rng(self.seed, 0, round_, STREAM_PARTIAL_PICK)
        return frozenset(int(c) for c in rng.choice(self.n, self.k, replace=False))

    def straggles(self, client: int, round_: int) -> bool:
        if self.selection == "exact":
            return client in self._pick(round_)
        if self.selection == "persistent":
            return client in self.persistent
        return bool(_rng(self.seed, client, round_, STREAM_PARTIAL_PICK).random() < self.fraction)

    def work_fraction(self, client: int, round_: int) -> float:
        if not self.straggles(client, round_):
            return 1.0
        # E_i ~ UniformInt{1, ..., E-1}: FedProx's randint(1, E), upper bound exclusive.
        done = int(_rng(self.seed, client, round_, STREAM_PARTIAL_WORK).integers(1, self.units))
        return done / self.units

    def describe(self) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "selection": self.selection,
            "units": self.units,
            "stragglers_per_round": self.k if self.selection != "bernoulli" else None,
        }


# ---------------------------------------------------------------------------- presets


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
            names = [self.dist] if self.dist else sorted(_DISTS)
            keys = {"mode"}.union(*(_DISTS[d].keys() for d in names))
            return tuple(sorted(keys | ({"dist"} if self.dist is None else set())))
        return _KINDS[self.kind].keys


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
}

_KINDS: dict[str, type[_Component]] = {
    c.kind: c for c in (_Tiers, _Speed, _Delay, _RaspberryPi, _Dropout, _PartialWork)
}


# ---------------------------------------------------------------------------- parsing

_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _value(text: str) -> Any:
    """A ``key=value`` value from a string spec: bool, None, int, float, ``lo..hi`` or str."""
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if low in ("inf", "+inf", "-inf", "nan"):
        return float(low)  # read as numbers so the range check names the problem
    if ".." in text:
        lo, _, hi = text.partition("..")
        if _NUMBER.match(lo.strip()) and _NUMBER.match(hi.strip()):
            return [_value(lo), _value(hi)]
    if _NUMBER.match(text):
        return int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)
    return text


def _parse_string(spec: str) -> list[tuple[str, dict[str, Any]]]:
    parts = []
    # "+" joins presets; "1e+3" is a number, so only a "+" followed by a name splits.
    for chunk in re.split(r"\+(?=\s*[A-Za-z_])", spec):
        name, _, rest = chunk.partition(":")
        params: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, val = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"profile {spec!r}: expected key=value, got {item!r}")
            if key.strip() in params:
                raise ValueError(f"profile {spec!r}: {key.strip()!r} given twice")
            params[key.strip()] = _value(val)
        parts.append((name.strip(), params))
    return parts


def _parse_mapping(spec: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    rest = dict(spec)
    name = rest.pop("name", None)
    parts = []
    for key in list(rest):
        value = rest[key]
        if key in PROFILES and (isinstance(value, Mapping) or value is None or value is True):
            del rest[key]
            parts.append((key, dict(value) if isinstance(value, Mapping) else {}))
        elif key in PROFILES and value is False:
            del rest[key]  # {"dropout": false} switches a component off
    if name is not None:
        if not isinstance(name, str):
            raise ValueError(f"profile name must be a string, got {name!r}")
        parts.insert(0, (name, rest))
    elif set(rest) - {"base_time"}:
        raise ValueError(
            f"profile mapping has unknown keys {sorted(set(rest) - {'base_time'})}: use "
            "{'name': preset, key: value, ...} or {preset: {key: value}, ...}; presets: "
            f"{', '.join(PROFILES)}"
        )
    elif "base_time" in rest:
        parts.append(("none", {"base_time": rest["base_time"]}))
    return parts or [("none", {})]


def _parse(spec: Any) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(spec, str):
        if not spec.strip():
            raise ValueError(f"empty profile spec; presets: {', '.join(PROFILES)}")
        return _parse_string(spec)
    if isinstance(spec, Mapping):
        return _parse_mapping(spec)
    if isinstance(spec, Sequence):
        return [part for item in spec for part in _parse(item)]
    raise ValueError(f"a profile spec is a string, a mapping or a list of them, got {spec!r}")


# ---------------------------------------------------------------------------- the profile


class Profile:
    """One run's stragglers and dropouts; build it with ``make_profile``.

    ``plan`` is a pure function of (seed, client, round). ``online``/``next_change`` are pure
    too, except for dropouts that leave after N updates and come back: the profile remembers
    the virtual time it first sees a client's N-th update (the simulator asks when it arrives)
    unless ``last_update_at`` gives it. So use one Profile per run.
    """

    def __init__(
        self,
        *,
        num_clients: int,
        seed: int,
        base_time: float,
        parts: Sequence[tuple[str, Mapping[str, Any]]],
    ) -> None:
        self.num_clients, self.seed, self.base_time = num_clients, seed, base_time
        self._factors: list[_ClientFactor] = []
        self._draws: list[_JobDraw] = []
        self._dropout: _Dropout | None = None
        self._partial: _PartialWork | None = None
        self._described: list[dict[str, Any]] = []
        seen: dict[str, int] = {}
        for name, params in parts:
            preset = PROFILES[name]
            if preset.kind is None:
                continue
            cls = _KINDS[preset.kind]
            if cls.once and preset.kind in seen:
                raise ValueError(f"profile: {preset.kind!r} appears twice; give it once")
            ctx = _Ctx(num_clients, seed, seen.get(preset.kind, 0))
            seen[preset.kind] = seen.get(preset.kind, 0) + 1
            merged = {**preset.defaults, **params}
            if preset.kind == "delay":
                dist = preset.dist or merged.pop("dist")
                _choice(name, "dist", dist, sorted(_DISTS))
                comp: _Component = _Delay(ctx, merged, dist)
            else:
                comp = cls(ctx, merged)
            self._described.append({"name": name, "kind": comp.kind, **comp.describe()})
            if isinstance(comp, _ClientFactor):
                self._factors.append(comp)
            elif isinstance(comp, _JobDraw):
                self._draws.append(comp)
            elif isinstance(comp, _Dropout):
                self._dropout = comp
            elif isinstance(comp, _PartialWork):
                self._partial = comp
        self._tiers = next((f for f in self._factors if isinstance(f, _Tiers)), None)
        self._client_factor = [math.nan] * num_clients

    # -------------------------------------------------------------- checks

    def _client(self, client: int) -> int:
        if isinstance(client, bool) or not isinstance(client, int | np.integer):
            raise ValueError(f"client must be an int, got {client!r}")
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} out of range for {self.num_clients} clients")
        return int(client)

    @staticmethod
    def _count(what: str, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"{what} must be an int >= 0, got {value!r}")
        return int(value)

    @staticmethod
    def _time(t: float) -> float:
        if isinstance(t, bool) or not isinstance(t, int | float | np.floating | np.integer):
            raise ValueError(f"virtual time must be a number, got {t!r}")
        if not math.isfinite(t):
            raise ValueError(f"virtual time must be finite, got {t!r}")
        return float(t)

    # -------------------------------------------------------------- queries

    def tier(self, client: int) -> float:
        """Client ``client``'s tier P (its job-time multiplier); 1.0 without tiers."""
        c = self._client(client)
        return 1.0 if self._tiers is None else self._tiers.factor(c)

    def plan(self, client: int, round: int) -> JobPlan:
        """Duration and work fraction of job ``round`` (0, 1, 2, ...) of ``client``."""
        c, r = self._client(client), self._count("round", round)
        factor = self._client_factor[c]
        if math.isnan(factor):
            factor = math.prod(f.factor(c) for f in self._factors)
            self._client_factor[c] = factor
        added = 0.0
        for d in self._draws:
            x = d.draw(c, r)
            if d.mode == "mul":
                factor *= x
            else:
                added += x
        duration = max(self.base_time * factor + added, _FLOOR * self.base_time)
        if not math.isfinite(duration):
            raise ValueError(
                f"job {r} of client {c} drew an infinite duration; the profile's "
                f"distributions are too heavy-tailed: {self._described}"
            )
        work = 1.0 if self._partial is None else self._partial.work_fraction(c, r)
        return JobPlan(duration, work)

    def online(
        self,
        client: int,
        t: float,
        updates_sent: int,
        *,
        last_update_at: float | None = None,
    ) -> bool:
        """Whether ``client`` is present at virtual time ``t`` after ``updates_sent`` updates.

        ``last_update_at``: when its latest update arrived; only dropouts that leave after N
        updates and return use it, and it defaults to the first time the profile is asked.
        """
        c, t = self._client(client), self._time(t)
        sent = self._count("updates_sent", updates_sent)
        if self._dropout is None:
            return True
        return self._dropout.online(c, t, sent, last_update_at)

    def next_change(
        self,
        client: int,
        t: float,
        updates_sent: int,
        *,
        last_update_at: float | None = None,
    ) -> float | None:
        """The next virtual time > ``t`` at which ``online`` may flip without the client sending
        another update; None if it never will (it stays, stays away, or only its next update
        can make it leave)."""
        c, t = self._client(client), self._time(t)
        sent = self._count("updates_sent", updates_sent)
        if self._dropout is None:
            return None
        return self._dropout.next_change(c, t, sent, last_update_at)

    @property
    def dropout_clients(self) -> tuple[int, ...]:
        """The clients that leave at some point (sorted)."""
        return () if self._dropout is None else tuple(sorted(self._dropout.leave))

    def describe(self) -> dict[str, Any]:
        """The resolved parameters, JSON-ready (for the run's config and summary)."""
        return _plain(
            {
                "num_clients": self.num_clients,
                "seed": self.seed,
                "base_time": self.base_time,
                "components": self._described,
            }
        )


def make_profile(
    spec: str | Mapping[str, Any] | Sequence[Any],
    num_clients: int,
    seed: int,
    base_time: float = 1.0,
) -> Profile:
    """Build the profile ``spec`` (see the module docstring) for ``num_clients`` clients.

    ``base_time`` is the virtual seconds of one full job of a tier-1 client; a ``base_time``
    key in ``spec`` overrides it. Raises ValueError naming the known presets or keys when the
    spec has an unknown one, and for any out-of-range value.
    """
    n = Profile._count("num_clients", num_clients)
    if n < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients!r}")
    s = Profile._count("seed", seed)
    parts = []
    times: list[float] = []
    for name, params in _parse(spec):
        if name not in PROFILES:
            raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
        params = dict(params)
        if "base_time" in params:
            times.append(_positive("profile", "base_time", params.pop("base_time")))
        preset = PROFILES[name]
        allowed = preset.keys()
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            known = ", ".join(allowed) if allowed else "none"
            raise ValueError(f"profile {name!r}: unknown keys {unknown}; known: {known}, base_time")
        parts.append((name, params))
    if len(set(times)) > 1:
        raise ValueError(f"profile: conflicting base_time values {times}")
    base = times[0] if times else _positive("profile", "base_time", base_time)
    return Profile(num_clients=n, seed=s, base_time=base, parts=parts)
