"""Byzantine attackers for the simulator: some clients send crafted updates.

``attack = "NAME:fraction=0.2,seed=S,KEY=VALUE,..."`` in the simulate config picks
``f = round(fraction * clients)`` attackers (Python's ``round``: nearest, ties to even), drawn
without replacement from a stream of their own seeded by ``seed`` (default: the run's seed), so
the same config picks the same attackers on both transports. An attacker is an ordinary client
(same profile, same data); it trains its job honestly (on flipped labels for ``label_flip``),
and what it sends is crafted from that job (all arithmetic in float64, sent as float32):

- ``sign_flip:scale=1``   ``-scale * delta``
- ``gaussian:std=1``      ``N(0, std^2)`` i.i.d. per coordinate, seeded by (seed, client, round)
- ``scale:factor=10``     ``factor * delta`` (model-replacement style boosting)
- ``alie:z=z_max``        ``mu - z * sigma`` (A Little Is Enough, Baruch et al. 2019), with
                          ``s = floor(n / 2 + 1) - f``, ``z_max = Phi^-1((n - s) / n)``
- ``ipm:eps=0.1``         ``-eps * mu`` (inner-product manipulation, Xie et al. 2019)
- ``label_flip``          the honest delta of training with every label ``y`` as ``C - 1 - y``

``mu`` and ``sigma`` (ALIE, IPM) are the coordinate-wise mean and sample standard deviation
(ddof 1) of the honest deltas the attackers can see: a pool keyed by client holding each
depositor's latest honest delta. ``view = "attackers"`` (default): the attackers deposit their
own honest deltas (they collude, but see no one else's); ``view = "all"``: every client
deposits (a non-finite delta is not kept). An attacker deposits before it crafts, so the pool
holds at least its own delta (unless that one is non-finite and the pool is empty: the attacker
then sends its honest delta); with one entry ``sigma`` is 0. Float buffers (BatchNorm statistics)
are always sent honestly.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import torch

from aggsrv.client.train import TrainResult
from aggsrv.sim.ids import client_id
from aggsrv.sim.local import LocalTrainer, draw_seed

__all__ = [
    "ATTACKS",
    "Attack",
    "AttackSpec",
    "AttackedTrainer",
    "HonestPool",
    "alie_z_max",
    "choose_attackers",
    "make_attack",
    "parse_attack",
]

# Random streams of draw_seed(seed, ..., stream): distinct from the batches' and the profile's.
ATTACK_STREAM = 211  # which clients attack
NOISE_STREAM = 212  # the Gaussian attack's noise, per (client, round)

VIEWS = ("attackers", "all")
COMMON = {"fraction": 0.2, "seed": None}  # every attack's parameters, with their defaults
# Each attack's own parameters with their defaults (z None: the paper's z_max).
ATTACKS: dict[str, dict[str, Any]] = {
    "sign_flip": {"scale": 1.0},
    "gaussian": {"std": 1.0},
    "scale": {"factor": 10.0},
    "alie": {"z": None, "view": "attackers"},
    "ipm": {"eps": 0.1, "view": "attackers"},
    "label_flip": {},
}
POOLED = ("alie", "ipm")  # the attacks that read the pool of honest deltas
_INT = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class AttackSpec:
    """A parsed ``attack`` key: the attack's name, the common parameters and its own ones
    (every one present, defaults filled in)."""

    name: str
    fraction: float
    seed: int | None
    params: Mapping[str, Any]

    def count(self, clients: int) -> int:
        """How many of ``clients`` attack: ``round(fraction * clients)``."""
        return round(self.fraction * clients)

    def check(self, clients: int) -> None:
        """What depends on the number of clients: an honest client left; ALIE's z_max finite."""
        f = self.count(clients)
        if f >= clients:
            raise ValueError(
                f"attack {self.label()!r}: round({self.fraction:g} * {clients} clients) = {f} "
                "attackers leaves no honest client; use a smaller fraction"
            )
        if self.name == "alie" and self.params["z"] is None and f:
            alie_z_max(clients, f)

    def label(self) -> str:
        """``name:fraction=F`` and the parameters given other than their defaults."""
        extra = {k: v for k, v in self.params.items() if v != ATTACKS[self.name][k]}
        if self.seed is not None:
            extra["seed"] = self.seed
        items = [f"fraction={self.fraction:g}"] + [
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
        ]
        return f"{self.name}:{','.join(items)}"


def _number(attack: str, key: str, text: str, *, integer: bool = False) -> float | int:
    try:
        if _INT.fullmatch(text):
            value: float | int = int(text)
        elif integer:
            raise ValueError
        else:
            value = float(text)
    except ValueError:
        what = "an integer" if integer else "a number"
        raise ValueError(f"attack {attack!r}: {key} must be {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"attack {attack!r}: {key} must be finite, got {text!r}")
    return value if integer else float(value)


def parse_attack(text: str) -> AttackSpec:
    """``"NAME:key=value,..."`` -> :class:`AttackSpec`; ValueError naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"attack: empty spec {text!r}; attacks: {', '.join(ATTACKS)}")
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r} in {text!r}; attacks: {', '.join(ATTACKS)}")
    own = ATTACKS[name]
    values: dict[str, Any] = {**COMMON, **own}
    given: set[str] = set()
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not key or not raw:
            raise ValueError(f"attack {text!r}: expected key=value, got {item!r}")
        if key not in values:
            takes = ", ".join([*COMMON, *own])
            raise ValueError(f"attack {name!r}: unknown parameter {key!r}; {name} takes {takes}")
        if key in given:
            raise ValueError(f"attack {text!r}: {key!r} given twice")
        given.add(key)
        if key == "view":
            if raw not in VIEWS:
                raise ValueError(f"attack {name!r}: view must be one of {VIEWS}, got {raw!r}")
            values[key] = raw
        elif key == "seed":
            values[key] = _number(name, key, raw, integer=True)
            if values[key] < 0:
                raise ValueError(f"attack {name!r}: seed must be >= 0, got {raw}")
        else:
            values[key] = _number(name, key, raw)
    fraction = values.pop("fraction")
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"attack {name!r}: fraction must be in [0, 1), got {fraction:g}")
    for key in ("std", "eps"):
        if key in values and not values[key] > 0:
            raise ValueError(f"attack {name!r}: {key} must be > 0, got {values[key]:g}")
    seed = values.pop("seed")
    return AttackSpec(name, fraction, seed, values)


def alie_z_max(n: int, f: int) -> float:
    """ALIE's z for ``f`` attackers among ``n`` clients: ``s = floor(n / 2 + 1) - f`` honest
    clients must be outvoted, ``z_max = Phi^-1((n - s) / n)``."""
    s = n // 2 + 1 - f
    if s <= 0:
        raise ValueError(
            f"attack 'alie': with {f} attackers of {n} clients s = floor(n/2 + 1) - f = {s} "
            "<= 0 and z_max is infinite (the attackers are a majority); give z=... explicitly"
        )
    return NormalDist().inv_cdf((n - s) / n)


def choose_attackers(clients: int, count: int, seed: int) -> list[int]:
    """``count`` distinct client indices, sorted, drawn by ``seed``'s attacker stream."""
    rng = np.random.default_rng(draw_seed(seed, ATTACK_STREAM))
    return sorted(int(c) for c in rng.choice(clients, size=count, replace=False))


class HonestPool:
    """The latest honest delta of each depositing client, shared by every trainer of a run
    (the grpc transport's client threads included), so reads and writes hold a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[int, torch.Tensor] = {}

    def deposit(self, client: int, delta: torch.Tensor) -> bool:
        """Keep ``delta`` as ``client``'s latest; a non-finite one (diverged training, which the
        server refuses anyway) is not kept, so it cannot turn every later mu into NaN."""
        if not bool(torch.isfinite(delta).all()):
            return False
        copy = delta.detach().to(torch.float64, copy=True)
        with self._lock:
            self._latest[client] = copy
        return True

    def clients(self) -> list[int]:
        with self._lock:
            return sorted(self._latest)

    def moments(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(mu, sigma, entries): coordinate-wise mean and sample standard deviation (ddof 1;
        0 with one entry) of the latest deltas, in float64, summed in client order."""
        with self._lock:
            rows = [self._latest[c] for c in sorted(self._latest)]
        if not rows:
            raise RuntimeError("the honest pool is empty: an attacker deposits before crafting")
        stacked = torch.stack(rows)
        mu = stacked.mean(0)
        sigma = stacked.std(0, correction=1) if len(rows) > 1 else torch.zeros_like(mu)
        return mu, sigma, len(rows)


class Attack:
    """One run's attackers: who they are, the pool they read, and what they send."""

    def __init__(self, spec: AttackSpec, clients: int, run_seed: int, num_classes: int) -> None:
        spec.check(clients)
        self.spec = spec
        self.name = spec.name
        self.clients = clients
        self.seed = run_seed if spec.seed is None else spec.seed
        self.num_classes = num_classes
        self.attackers = choose_attackers(clients, spec.count(clients), self.seed)
        self._attacking = frozenset(self.attackers)
        p = spec.params
        self.z: float | None = None  # ALIE's z: given, or the paper's z_max
        if self.name == "alie" and self.attackers:
            self.z = p["z"] if p["z"] is not None else alie_z_max(clients, len(self.attackers))
        self.pool = HonestPool() if self.name in POOLED else None
        self._view_all = p.get("view") == "all"

    def is_attacker(self, client: int) -> bool:
        return client in self._attacking

    def wrap(self, trainer: LocalTrainer) -> AttackedTrainer:
        """``trainer`` with this attack applied to its results (and, for ``label_flip``, the
        attackers' labels flipped in it)."""
        if self.name == "label_flip":
            for c in self.attackers:
                trainer.set_labels(c, self.num_classes - 1 - trainer.labels(c))
        return AttackedTrainer(trainer, self)

    def craft(
        self, client: int, round_: int, start: torch.Tensor, result: TrainResult
    ) -> TrainResult:
        """What ``client`` sends for the job it trained from ``start`` with honest ``result``:
        an honest client's result unchanged (deposited in the pool under ``view = "all"``),
        an attacker's with the delta crafted and the weights ``start + delta``."""
        if self.pool is not None and (self._view_all or self.is_attacker(client)):
            self.pool.deposit(client, result.delta)
        if not self.is_attacker(client) or self.name == "label_flip":
            return result
        honest = result.delta.to(torch.float64)
        p = self.spec.params
        if self.name == "sign_flip":
            crafted = -p["scale"] * honest
        elif self.name == "scale":
            crafted = p["factor"] * honest
        elif self.name == "gaussian":
            gen = torch.Generator().manual_seed(draw_seed(self.seed, client, round_, NOISE_STREAM))
            crafted = p["std"] * torch.randn(honest.shape, generator=gen, dtype=torch.float64)
        elif not self.pool.clients():
            return result  # nothing finite to craft from (its own training diverged)
        else:
            mu, sigma, _ = self.pool.moments()
            crafted = mu - self.z * sigma if self.name == "alie" else -p["eps"] * mu
        delta = crafted.to(result.delta.dtype)
        weights = (start.to(delta.device, torch.float64) + crafted).to(result.weights.dtype)
        return dataclasses.replace(result, delta=delta, weights=weights)

    def summary(self, sent: Mapping[str, int], accepted: Mapping[str, int]) -> dict[str, Any]:
        """The run summary's ``attack`` entry; ``sent``/``accepted``: crafted updates per
        attacker id (the transports count them)."""

        ids = [client_id(c) for c in self.attackers]
        return {
            "spec": self.spec.label(),
            "name": self.name,
            "fraction": self.spec.fraction,
            "seed": self.seed,
            "params": dict(self.spec.params),
            "z": self.z,
            "attackers": ids,
            "crafted_sent": {cid: int(sent.get(cid, 0)) for cid in ids},
            "crafted_accepted": {cid: int(accepted.get(cid, 0)) for cid in ids},
        }


class AttackedTrainer:
    """A :class:`LocalTrainer` whose results pass through :meth:`Attack.craft`: the one place
    both transports apply an attack."""

    def __init__(self, trainer: LocalTrainer, attack: Attack) -> None:
        self.inner = trainer
        self.attack = attack

    def num_samples(self, client: int) -> int:
        return self.inner.num_samples(client)

    def run(self, client: int, round_: int, weights: torch.Tensor, *args, **kwargs) -> TrainResult:
        result = self.inner.run(client, round_, weights, *args, **kwargs)
        return self.attack.craft(client, round_, weights, result)


def make_attack(spec: str | None, clients: int, run_seed: int, num_classes: int) -> Attack | None:
    """The run's :class:`Attack` from the config's ``attack`` key (None: no attack)."""
    if spec is None:
        return None
    return Attack(parse_attack(spec), clients, run_seed, num_classes)
