"""Differential privacy's accountant: what each client has spent over the versions published
so far, and the (epsilon, delta) it amounts to (docs/privacy.md, "The accountant")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["PrivacyAccountant", "dp_accounting_module", "gaussian_epsilon"]

_INSTALL = "pip install 'aggsrv[dp]'"


def dp_accounting_module() -> Any:
    try:
        import dp_accounting
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError(
            f"differential privacy's accountant needs the dp-accounting package ({_INSTALL})"
        ) from exc
    return dp_accounting


def gaussian_epsilon(noise_multiplier: float, squared_sensitivity: float, delta: float) -> float:
    """Epsilon at ``delta`` of Gaussian mechanisms whose squared sensitivities (in units of the
    clipping norm) sum to ``squared_sensitivity``, each with noise ``noise_multiplier`` times the
    clipping norm: 0 with nothing released, infinite without noise."""
    if squared_sensitivity <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    dpa = dp_accounting_module()
    accountant = dpa.rdp.RdpAccountant()
    accountant.compose(dpa.GaussianDpEvent(noise_multiplier / math.sqrt(squared_sensitivity)))
    return float(accountant.get_epsilon(delta))


class PrivacyAccountant:
    """Per client, the privacy spent on the versions it contributed to, as ``mu^2 = sum over
    releases of (s / z)^2`` (the squared mean of the Gaussian mechanism they compose to: ``s``
    its sensitivity in units of C, ``z`` that release's noise multiplier, so a resumed server
    may change z); the contributions waiting for the next release."""

    def __init__(
        self, noise_multiplier: float, delta: float, kind: str = "gdp", neighbour: str = "zero_out"
    ) -> None:
        self.kind = kind  # how mu^2 becomes epsilon (TODO: gdp, pld; rdp today)
        self.neighbour = neighbour  # TODO: replace_one doubles every sensitivity
        self.noise_multiplier = noise_multiplier  # z of the next release
        self.delta = delta
        self.spent: dict[str, float] = {}  # client -> mu^2 so far
        self.pending: dict[str, float] = {}  # client -> s in the release being gathered
        self.releases = 0  # versions published with a contribution in them
        self._worst = 0.0  # max(spent.values())
        self._epsilons: dict[float, float] = {}

    def contribute(self, client: str, weight: float) -> None:
        self.pending[client] = self.pending.get(client, 0.0) + weight

    def _charge(self, s: float) -> float:
        """mu^2 of one release of sensitivity ``s`` (infinite without noise)."""
        if s == 0:
            return 0.0
        z = self.noise_multiplier
        return (s / z) ** 2 if z > 0 else math.inf

    def worst_after(self, release: Mapping[str, float]) -> float:
        """The largest ``mu^2`` over clients once a release charging each client of
        ``release`` its sensitivity is published."""
        worst = self._worst
        for c, s in release.items():
            worst = max(worst, self.spent.get(c, 0.0) + self._charge(s))
        return worst

    def epsilon_of(self, mu_squared: float) -> float:
        """Epsilon at ``delta`` of a Gaussian mechanism with squared mean ``mu_squared``."""
        if not math.isfinite(mu_squared):
            return math.inf
        eps = self._epsilons.get(mu_squared)
        if eps is None:
            eps = gaussian_epsilon(1.0, mu_squared, self.delta)
            if len(self._epsilons) > 4096:  # a cache, not a record
                self._epsilons.clear()
            self._epsilons[mu_squared] = eps
        return eps

    def epsilon(self) -> float:
        """The run's epsilon at ``delta`` so far: the worst-off client's."""
        return self.epsilon_of(self._worst)

    def release(self) -> None:
        """A version was published: the pending contributions are spent."""
        if not self.pending:
            return
        for c, s in self.pending.items():
            total = self.spent.get(c, 0.0) + self._charge(s)
            self.spent[c] = total
            self._worst = max(self._worst, total)
        self.pending.clear()
        self.releases += 1

    def state(self) -> dict[str, Any]:
        return {"spent": dict(self.spent), "pending": dict(self.pending),
                "releases": self.releases}  # fmt: skip

    def load(self, state: Mapping[str, Any]) -> None:
        self.spent = {str(c): float(v) for c, v in state["spent"].items()}
        self.pending = {str(c): float(v) for c, v in state["pending"].items()}
        self.releases = int(state["releases"])
        self._worst = max(self.spent.values(), default=0.0)
