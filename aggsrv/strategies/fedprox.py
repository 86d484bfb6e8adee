"""FedProx (Li et al. 2020): FedAvg's server with the proximal client recipe.

Clients minimise ``F_k(w) + mu/2 * |w - w_t|^2`` (``Recipe.proximal_mu``), which keeps partial
work useful, so FedProx includes partial work by default (FedAvg drops it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from aggsrv.strategies.fedavg import FedAvg, FedAvgConfig
from aggsrv.values import Recipe

__all__ = ["FedProx", "FedProxConfig"]


@dataclass
class FedProxConfig(FedAvgConfig):
    """FedAvg's settings plus the proximal coefficient ``mu``."""

    HELP: ClassVar[Mapping[str, str]] = {"mu": "proximal coefficient of the client objective"}

    mu: float = 0.01
    partial_work: str = "include"

    def __post_init__(self) -> None:
        """Check ranges."""
        super().__post_init__()
        if self.mu < 0:
            raise ValueError(f"mu must be >= 0, got {self.mu}")


class FedProx(FedAvg[FedProxConfig], name="fedprox"):
    """FedAvg whose jobs carry the proximal term ``mu``."""

    def make_recipe(self) -> Recipe:
        """FedAvg's recipe with ``proximal_mu = mu``."""
        return self.config.recipe(proximal_mu=self.config.mu)
