"""Differential privacy's accountant: what each client has spent over the versions published
so far, and the (epsilon, delta) it amounts to (docs/privacy.md, "The accountant").

**What is kept.** Per client ``mu^2 = sum over releases of (k s / z)^2``: ``s`` the client's
sensitivity in units of the clipping norm C in that release, ``z`` that release's noise
multiplier, ``k`` the neighbouring relation's factor (1 for ``zero_out``: one client's updates
set to zero; 2 for ``replace_one``: replaced by arbitrary ones, which moves a linear function
of clipped contributions by up to ``2 s C``, by the triangle inequality). Gaussian mechanisms
compose exactly into one Gaussian mechanism with the squared means added: a client's releases
are one ``mu``-GDP mechanism (Dong, Roth & Su 2019, Cor. 3.3). Beside it, the rounds of sync
FedAvg that sampled every client independently with probability ``q`` from a secret source
(``amplified`` rounds, :meth:`PrivacyAccountant.open_round`): every client, sampled or not,
is charged ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` for each, and the contributions to
such a round cost no ``mu^2``. All clients share those rounds, so they are one count per
``(q, z)``.

**From mu^2 to epsilon at delta** (``kind``, the ``dp_accountant`` key):

* ``gdp``: exact. ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`` is the
  privacy profile of a ``mu``-GDP mechanism (Dong, Roth & Su 2019, Cor. 2.13; Balle & Wang
  2018, Thm. 8), solved for eps (log-space, ``scipy.special.log_ndtr``; Brent's method);
  ``eps = 0`` when ``delta(0) <= delta``. About 0.02 ms. It cannot express an amplified round:
  those are charged as the unsampled Gaussian (``mu^2 += 1 / z^2`` per round), which bounds them.
* ``pld``: dp-accounting's privacy loss distribution accountant, pessimistic by its
  discretization: for ``mu^2`` alone one ``GaussianDpEvent(1 / mu)`` at an interval of
  ``eps_gdp / 200`` (at most 0.5 % above the exact value; 1-11 ms); with amplified rounds,
  their ``SelfComposedDpEvent`` plus that Gaussian event at an interval of 1e-3 (tens of ms).
* ``rdp``: dp-accounting's Rényi accountant for the same events (loose by 5-15 % for a
  Gaussian; about 0.3 ms, tens of ms with amplified rounds).

Each conversion is cached per ``(mu^2, amplified rounds)``: the budget check asks one new value
per release at most.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "ACCOUNTANT_KINDS",
    "AMPLIFYING_KINDS",
    "PrivacyAccountant",
    "dp_accounting_module",
    "gaussian_epsilon",
    "gdp_delta",
    "gdp_epsilon",
    "mu_squared_epsilon",
]

_INSTALL = "pip install 'aggsrv[dp]'"

ACCOUNTANT_KINDS = ("gdp", "pld", "rdp")
AMPLIFYING_KINDS = ("pld", "rdp")  # those that can compose Poisson-sampled rounds
NEIGHBOUR_FACTORS = {"zero_out": 1.0, "replace_one": 2.0}
# "pld" for mu^2 alone: the discretization interval as a share of the exact epsilon. The PLD
# accountant's epsilon is at most one interval above the exact one (measured: 0.5 % at most for
# mu in [1e-4, 100]) and costs 1-11 ms a conversion.
PLD_INTERVAL_SHARE = 1.0 / 200.0
PLD_MIN_INTERVAL = 1e-5
# "pld" with amplified rounds: one interval for the sampled rounds' self-composition and the
# Gaussian (within 0.1 % of an interval of 1e-4 for q in [0.01, 1], z in [0.8, 2], up to 2000
# rounds; 30-70 ms against 0.3-0.6 s).
PLD_AMPLIFIED_INTERVAL = 1e-3
_CACHE_SIZE = 4096


class _DropUnconvergedOrders(logging.Filter):
    """dp-accounting's Rényi accountant logs a warning each time a fractional order of a
    Poisson-sampled Gaussian does not converge; it leaves that order out, which is sound (the
    bound is a minimum over the orders). Once per release would fill a server's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("_compute_log_a_frac failed to converge")


_FILTER = _DropUnconvergedOrders()


def dp_accounting_module() -> Any:
    try:
        import dp_accounting
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError(
            f"differential privacy's accountant needs the dp-accounting package ({_INSTALL})"
        ) from exc
    absl = logging.getLogger("absl")
    if _FILTER not in absl.filters:
        absl.addFilter(_FILTER)
    return dp_accounting


def _special() -> Any:
    try:
        from scipy import optimize, special
    except ImportError as exc:  # dp-accounting needs scipy too: the same extra brings it
        raise ImportError(f"differential privacy's accountant needs scipy ({_INSTALL})") from exc
    return optimize, special


def _log_gdp_delta(eps: float, mu: float) -> float:
    """``log delta(eps)`` of a ``mu``-GDP mechanism, stable at large eps: ``log Phi(a) +
    log(1 - e^(eps + log Phi(b) - log Phi(a)))``, ``a = -eps/mu + mu/2``, ``b = a - mu``."""
    _, special = _special()
    a = -eps / mu + mu / 2.0
    log_a = float(special.log_ndtr(a))
    log_b = float(special.log_ndtr(a - mu))
    gap = eps + log_b - log_a  # < 0: e^eps Phi(b) < Phi(a)
    if gap >= 0.0:  # rounding at the far tail: delta is below anything we resolve
        return -math.inf
    return log_a + math.log(-math.expm1(gap))


def gdp_delta(eps: float, mu: float) -> float:
    """The exact delta at ``eps`` of a ``mu``-GDP (Gaussian) mechanism (Dong, Roth & Su 2019,
    Cor. 2.13): ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``."""
    if mu <= 0:
        return 0.0
    if not math.isfinite(mu):
        return 1.0
    return math.exp(_log_gdp_delta(eps, mu))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest eps with ``delta(eps) <= delta`` for a ``mu``-GDP mechanism: 0 when
    ``delta(0) <= delta``, infinite for an infinite ``mu``."""
    if mu <= 0:
        return 0.0
    if not math.isfinite(mu):
        return math.inf
    optimize, special = _special()
    log_target = math.log(delta)
    if _log_gdp_delta(0.0, mu) <= log_target:
        return 0.0
    # delta(eps) <= Phi(-eps/mu + mu/2), which is delta at this eps: a bracket.
    hi = mu * (mu / 2.0 + float(special.ndtri(1.0 - delta))) + 1e-12
    while _log_gdp_delta(hi, mu) > log_target:  # rounding at the bracket's edge
        hi = 2.0 * hi + 1.0
    return float(
        optimize.brentq(
            lambda e: _log_gdp_delta(e, mu) - log_target, 0.0, hi, xtol=1e-13, rtol=1e-14
        )
    )


def _composed_epsilon(
    kind: str, mu_squared: float, rounds: tuple[tuple[float, float, int], ...], delta: float
) -> float:
    """dp-accounting's epsilon ("pld" or "rdp") of the amplified ``rounds`` ((q, z, count)
    each) composed with one Gaussian mechanism of squared mean ``mu_squared``."""
    dpa = dp_accounting_module()
    if kind == "rdp":
        accountant = dpa.rdp.RdpAccountant()
    elif rounds:
        accountant = dpa.pld.PLDAccountant(value_discretization_interval=PLD_AMPLIFIED_INTERVAL)
    else:
        interval = max(gdp_epsilon(math.sqrt(mu_squared), delta) * PLD_INTERVAL_SHARE,
                       PLD_MIN_INTERVAL)  # fmt: skip
        accountant = dpa.pld.PLDAccountant(value_discretization_interval=interval)
    for q, z, count in rounds:
        event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
        accountant.compose(dpa.SelfComposedDpEvent(event, count))
    if mu_squared > 0:
        accountant.compose(dpa.GaussianDpEvent(1.0 / math.sqrt(mu_squared)))
    with np.errstate(over="ignore", divide="ignore"):  # the PLD's overflow: handled below
        eps = float(accountant.get_epsilon(delta))
    if kind == "pld" and not math.isfinite(eps):
        # The PLD's epsilon overflows far out (eps in the hundreds, e.g. mu = 35 at 1e-3):
        # the exact value for a Gaussian alone, else the Renyi bound.
        if not rounds:
            return gdp_epsilon(math.sqrt(mu_squared), delta)
        return _composed_epsilon("rdp", mu_squared, rounds, delta)
    return eps


def mu_squared_epsilon(
    mu_squared: float,
    delta: float,
    kind: str = "gdp",
    rounds: tuple[tuple[float, float, int], ...] = (),
) -> float:
    """Epsilon at ``delta`` of a Gaussian mechanism of squared mean ``mu_squared`` composed
    with ``rounds`` ((q, z, count) each: ``count`` Poisson-sampled Gaussian mechanisms of rate
    q and multiplier z, sensitivity 1), as the accountant ``kind`` converts it. 0 with nothing
    released, infinite without noise."""
    if kind not in ACCOUNTANT_KINDS:
        raise ValueError(f"the accountant must be one of {ACCOUNTANT_KINDS}, got {kind!r}")
    rounds = tuple((q, z, n) for q, z, n in rounds if n > 0 and q > 0)
    if any(z <= 0 for _, z, _ in rounds) or not mu_squared < math.inf:
        return math.inf
    if kind == "gdp":  # a sampled round is bounded by the Gaussian mechanism it samples for
        mu_squared += sum(n / (z * z) for _, z, n in rounds)
        return gdp_epsilon(math.sqrt(mu_squared), delta) if mu_squared > 0 else 0.0
    if mu_squared <= 0 and not rounds:
        return 0.0
    return _composed_epsilon(kind, mu_squared, rounds, delta)


def gaussian_epsilon(
    noise_multiplier: float, squared_sensitivity: float, delta: float, kind: str = "rdp"
) -> float:
    """Epsilon at ``delta`` of Gaussian mechanisms whose squared sensitivities (in units of the
    clipping norm) sum to ``squared_sensitivity``, each with noise ``noise_multiplier`` times the
    clipping norm: 0 with nothing released, infinite without noise. ``kind``: the conversion
    (:func:`mu_squared_epsilon`); Rényi by default, as this function always computed it."""
    if squared_sensitivity <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return mu_squared_epsilon(squared_sensitivity / noise_multiplier**2, delta, kind)


class PrivacyAccountant:
    """Per client, the privacy spent on the versions it contributed to, as ``mu^2 = sum over
    releases of (k s / z)^2`` (the squared mean of the Gaussian mechanism they compose to: ``s``
    its sensitivity in units of C, ``k`` 2 under ``replace_one`` and 1 under ``zero_out``, ``z``
    that release's noise multiplier, so a resumed server may change z); the amplified rounds
    every client was charged (``rounds``: (q, z) -> count); the contributions waiting for the
    next release, and whether that release is an amplified round (``sampled``: its q)."""

    def __init__(
        self, noise_multiplier: float, delta: float, kind: str = "gdp", neighbour: str = "zero_out"
    ) -> None:
        if kind not in ACCOUNTANT_KINDS:
            raise ValueError(f"the accountant must be one of {ACCOUNTANT_KINDS}, got {kind!r}")
        if neighbour not in NEIGHBOUR_FACTORS:
            raise ValueError(
                f"the neighbour relation must be one of {tuple(NEIGHBOUR_FACTORS)}, got "
                f"{neighbour!r}"
            )
        self.kind = kind  # how mu^2 (and the amplified rounds) become epsilon
        self.neighbour = neighbour
        self.factor = NEIGHBOUR_FACTORS[neighbour]  # a release's sensitivity per unit of s
        self.noise_multiplier = noise_multiplier  # z of the next release
        self.delta = delta
        self.spent: dict[str, float] = {}  # client -> mu^2 so far
        self.pending: dict[str, float] = {}  # client -> s in the release being gathered
        self.rounds: dict[tuple[float, float], int] = {}  # (q, z) -> amplified rounds released
        self.sampled: float | None = None  # q when the release being gathered is amplified
        self.releases = 0  # versions published with a contribution in them (or amplified)
        self._worst = 0.0  # max(spent.values())
        self._epsilons: dict[tuple[float, tuple[tuple[float, float, int], ...]], float] = {}

    @property
    def amplifies(self) -> bool:
        """Whether a Poisson-sampled round can be charged as one (:meth:`open_round`): the
        ``pld`` and ``rdp`` accountants compose sampled Gaussian events, for the ``zero_out``
        relation (dp-accounting's sampled Gaussian is the add-or-remove pair, which zero-out
        is: the client's zeroed contribution is in the sum exactly when it is sampled)."""
        return self.kind in AMPLIFYING_KINDS and self.neighbour == "zero_out"

    def open_round(self, q: float) -> None:
        """The release being gathered is a round that included every client independently with
        probability ``q``, drawn from randomness nobody else knows: when it is published every
        client is charged one ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, and the
        contributions to it (at most one, ``s <= 1``, per client) cost no ``mu^2``."""
        if not self.amplifies:
            raise ValueError(
                f"the {self.kind!r} accountant under {self.neighbour!r} claims no amplification "
                "by sampling (it needs dp_accountant 'pld' or 'rdp' and dp_neighbour 'zero_out')"
            )
        if not 0.0 < q <= 1.0:
            raise ValueError(f"a sampling rate must be in (0, 1], got {q}")
        self.sampled = float(q)

    def republished(self, pending: Mapping[str, float], round_key: tuple[float, float] | None):
        """A release already charged (``pending``, and ``round_key`` = (q, z) when it was an
        amplified round) was published a second time with fresh noise (recovery replays what
        was published before a crash): two noised copies of one sum. Its contributions are
        charged once more; an amplified round is charged as one
        ``PoissonSampledDpEvent(q, GaussianDpEvent(z / sqrt(2)))`` instead of ``z``'s (the same
        sample, twice the information), and a contribution above the sampled event's (``s >
        1``) once more whole."""
        if round_key is not None:
            left = self.rounds.get(round_key, 0) - 1
            if left > 0:
                self.rounds[round_key] = left
            else:
                self.rounds.pop(round_key, None)
            twice = (round_key[0], round_key[1] / math.sqrt(2.0))
            self.rounds[twice] = self.rounds.get(twice, 0) + 1
        for c, s in pending.items():
            total = self.spent.get(c, 0.0) + self._charge_in(s, amplified=round_key is not None)
            self.spent[c] = total
            self._worst = max(self._worst, total)

    def round_key(self) -> tuple[float, float] | None:
        """(q, z) of the amplified round being gathered; None when it is not one."""
        return None if self.sampled is None else (self.sampled, self.noise_multiplier)

    def contribute(self, client: str, weight: float) -> None:
        self.pending[client] = self.pending.get(client, 0.0) + weight

    def _charge(self, s: float) -> float:
        """mu^2 of one release of sensitivity ``s`` (infinite without noise). In an amplified
        round, a client's contribution of ``s <= 1`` is the sampled event's: nothing; more
        (not made by sync FedAvg, whose clients report once a round) is charged whole, as if
        unsampled."""
        return self._charge_in(s, amplified=self.sampled is not None)

    def _charge_in(self, s: float, amplified: bool) -> float:
        """:meth:`_charge` for a release that was (or was not) an amplified round."""
        if s == 0 or (amplified and s <= 1.0 + 1e-12):
            return 0.0
        z = self.noise_multiplier
        return (self.factor * s / z) ** 2 if z > 0 else math.inf

    def _rounds(self, extra: bool) -> tuple[tuple[float, float, int], ...]:
        """The amplified rounds as (q, z, count), with the one being gathered if ``extra``."""
        rounds = dict(self.rounds)
        key = self.round_key()
        if extra and key is not None:
            rounds[key] = rounds.get(key, 0) + 1
        return tuple(sorted((q, z, n) for (q, z), n in rounds.items()))

    def worst_after(self, release: Mapping[str, float]) -> float:
        """The largest ``mu^2`` over clients once a release charging each client of
        ``release`` its sensitivity is published (the amplified rounds are
        :meth:`epsilon_of`'s)."""
        worst = self._worst
        for c, s in release.items():
            worst = max(worst, self.spent.get(c, 0.0) + self._charge(s))
        return worst

    def epsilon_of(self, mu_squared: float) -> float:
        """Epsilon at ``delta`` of a client with squared mean ``mu_squared`` once the release
        being gathered is published: with the amplified rounds so far, and that release when
        it is one (without amplified rounds: the Gaussian mechanism's alone)."""
        return self._epsilon(mu_squared, self._rounds(extra=True))

    def _epsilon(self, mu_squared: float, rounds: tuple[tuple[float, float, int], ...]) -> float:
        if not math.isfinite(mu_squared):
            return math.inf
        if rounds and not self.amplifies:
            # Rounds of a run resumed under another accountant or relation: each bounded by
            # the Gaussian mechanism it sampled for, at this relation's sensitivity.
            if any(z <= 0 for _, z, _ in rounds):
                return math.inf
            mu_squared += sum(n * (self.factor / z) ** 2 for _, z, n in rounds)
            rounds = ()
        key = (mu_squared, rounds)
        eps = self._epsilons.get(key)
        if eps is None:
            eps = mu_squared_epsilon(mu_squared, self.delta, self.kind, rounds)
            if len(self._epsilons) > _CACHE_SIZE:  # a cache, not a record
                self._epsilons.clear()
            self._epsilons[key] = eps
        return eps

    def epsilon(self) -> float:
        """The run's epsilon at ``delta`` so far: the worst-off client's."""
        return self._epsilon(self._worst, self._rounds(extra=False))

    def release(self) -> None:
        """A version was published: the pending contributions are spent (and an amplified
        round is charged to every client, even with no contribution in it)."""
        if not self.pending and self.sampled is None:
            return
        for c, s in self.pending.items():
            total = self.spent.get(c, 0.0) + self._charge(s)
            self.spent[c] = total
            self._worst = max(self._worst, total)
        if self.sampled is not None:
            key = (self.sampled, self.noise_multiplier)
            self.rounds[key] = self.rounds.get(key, 0) + 1
            self.sampled = None
        self.pending.clear()
        self.releases += 1

    def state(self) -> dict[str, Any]:
        return {
            "spent": dict(self.spent),
            "pending": dict(self.pending),
            "releases": self.releases,
            "rounds": [[q, z, n] for (q, z), n in sorted(self.rounds.items())],
            "sampled": self.sampled,
        }

    def load(self, state: Mapping[str, Any]) -> None:
        self.spent = {str(c): float(v) for c, v in state["spent"].items()}
        self.pending = {str(c): float(v) for c, v in state["pending"].items()}
        self.releases = int(state["releases"])
        # States saved before amplified rounds existed have none.
        self.rounds = {(float(q), float(z)): int(n) for q, z, n in state.get("rounds", [])}
        sampled = state.get("sampled")
        self.sampled = None if sampled is None else float(sampled)
        self._worst = max(self.spent.values(), default=0.0)
