"""The profile of one run (``Profile``) and the spec front door (``make_profile``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .checks import choice, count_matrix, plain, positive
from .client_factors import Tiers
from .components import ClientFactor, Component, Context, JobDraw
from .distributions import DISTRIBUTIONS
from .dropout import Dropout
from .job_draws import Delay
from .partial_work import PartialWork
from .presets import KINDS, PROFILES
from .spec import parse_spec
from .trace_replay import TraceReplay

_FLOOR = 1e-9  # the shortest job, in units of base_time: durations stay > 0


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
        label_counts: np.ndarray | None = None,
    ) -> None:
        self.num_clients, self.seed, self.base_time = num_clients, seed, base_time
        self._factors: list[ClientFactor] = []
        self._draws: list[JobDraw] = []
        self._dropout: Dropout | None = None
        self._partial: PartialWork | None = None
        self._trace: TraceReplay | None = None
        self._described: list[dict[str, Any]] = []
        seen: dict[str, int] = {}
        for name, params in parts:
            preset = PROFILES[name]
            if preset.kind is None:
                continue
            cls = KINDS[preset.kind]
            if cls.once and preset.kind in seen:
                raise ValueError(f"profile: {preset.kind!r} appears twice; give it once")
            ctx = Context(num_clients, seed, seen.get(preset.kind, 0), label_counts)
            seen[preset.kind] = seen.get(preset.kind, 0) + 1
            merged = {**preset.defaults, **params}
            if preset.kind == "delay":
                dist = preset.dist or merged.pop("dist")
                choice(name, "dist", dist, sorted(DISTRIBUTIONS))
                comp: Component = Delay(ctx, merged, dist)
            else:
                comp = cls(ctx, merged)
            self._described.append({"name": name, "kind": comp.kind, **comp.describe()})
            if isinstance(comp, ClientFactor):
                self._factors.append(comp)
            elif isinstance(comp, JobDraw):
                self._draws.append(comp)
            elif isinstance(comp, Dropout):
                self._dropout = comp
            elif isinstance(comp, PartialWork):
                self._partial = comp
            elif isinstance(comp, TraceReplay):
                self._trace = comp
        others = [d["name"] for d in self._described if d["kind"] != "trace"]
        if self._trace is not None and others:
            raise ValueError(
                f"profile: trace replays recorded durations and absences; it cannot be combined "
                f"with {others}"
            )
        self._tiers = next((f for f in self._factors if isinstance(f, Tiers)), None)
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
        if self._trace is not None:
            return JobPlan(max(self._trace.duration(c, r), _FLOOR))
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
        if self._trace is not None:
            return self._trace.online(c, t, sent)
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
        if self._trace is not None:
            return self._trace.next_change(c, t, sent)
        if self._dropout is None:
            return None
        return self._dropout.next_change(c, t, sent, last_update_at)

    @property
    def dropout_clients(self) -> tuple[int, ...]:
        """The clients that leave at some point (sorted)."""
        if self._trace is not None:
            return self._trace.gone_clients(self.num_clients)
        return () if self._dropout is None else tuple(sorted(self._dropout.leave))

    def describe(self) -> dict[str, Any]:
        """The resolved parameters, JSON-ready (for the run's config and summary)."""
        return plain(
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
    label_counts: Any = None,
) -> Profile:
    """Build the profile ``spec`` (see the module docstring) for ``num_clients`` clients.

    ``base_time`` is the virtual seconds of one full job of a tier-1 client; a ``base_time``
    key in ``spec`` overrides it. ``label_counts``: the data split as a ``[num_clients,
    num_classes]`` array of non-negative integers (training examples per client and label),
    needed only by ``dropout:choose=label``. Raises ValueError naming the known presets or keys
    when the spec has an unknown one, and for any out-of-range value.
    """
    n = Profile._count("num_clients", num_clients)
    if n < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients!r}")
    s = Profile._count("seed", seed)
    counts = None if label_counts is None else count_matrix("label_counts", label_counts, n)
    parts = []
    times: list[float] = []
    for name, params in parse_spec(spec):
        if name not in PROFILES:
            raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
        params = dict(params)
        if "base_time" in params:
            times.append(positive("profile", "base_time", params.pop("base_time")))
        preset = PROFILES[name]
        allowed = preset.keys()
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            known = ", ".join(allowed) if allowed else "none"
            raise ValueError(f"profile {name!r}: unknown keys {unknown}; known: {known}, base_time")
        parts.append((name, params))
    if len(set(times)) > 1:
        raise ValueError(f"profile: conflicting base_time values {times}")
    base = times[0] if times else positive("profile", "base_time", base_time)
    return Profile(num_clients=n, seed=s, base_time=base, parts=parts, label_counts=counts)
