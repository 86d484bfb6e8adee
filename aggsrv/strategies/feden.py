"""FedEN (Sultana et al., "Elastic Optimization for Stragglers in Edge FL"): FedAvg's server that
includes partial work, with the elastic-net client recipe (docs/algorithms/feden.md).

Clients minimise ``F_k(w) + lam * ((1 - alpha)/2 * |w - a|^2 + alpha * |w - a|_1)``
(``Recipe.elastic_lambda``/``elastic_alpha``) with plain SGD; stragglers send what they did and
the server averages every update it receives (Eq. 5), partial or not. The choices the paper
leaves open are config switches (docs/algorithms/feden.md section 5):

* ``centre`` (G1): ``"zero"`` (default, Eq. 9 literally) or ``"global"`` (the job's start
  weights, the FedProx-like variant: with ``alpha = 0`` it is FedProx with ``mu = lam``);
* ``solver`` (G2): ``"subgradient"`` (default, SGD on loss + penalty, sign(0) = 0) or ``"prox"``
  (soft-thresholding after each step, exact zeros in ``w - a``);
* ``weighting`` (G5): ``"uniform"`` (default, ``1/|S|`` of Eq. 5; an update with no samples
  counts 0) or ``"samples"`` (``n_i / sum n``, Eq. 3, FedAvg's weighting);
* ``lam = 1e-3``, ``alpha = 0.5`` (G6: the paper reports none; the spec's starting point);
* Table 2: ``learning_rate = 0.01``, ``batch_size = 10``, 10 local epochs (``local_epochs`` and
  ``local_steps`` unset; either one overrides),
  ``participation = 0.1`` (G3: C = 0.1, not the printed 0.01), ``partial_work = "include"``.

The recipe carries the centre and solver as ``Recipe.extra["elastic_centre"]`` (0 zero,
1 global) and ``["elastic_solver"]`` (0 subgradient, 1 prox); on the wire they are
``ElasticNet.anchor``/``solver`` (aggsrv.protocol), and aggsrv.client.train reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from aggsrv.strategies.fedavg import FedAvg, FedAvgConfig
from aggsrv.values import Recipe, Update

__all__ = ["CENTRES", "SOLVERS", "FedEN", "FedENConfig"]

# Recipe.extra keys and values (the same strings as aggsrv.client.train's ELASTIC_* constants;
# the client package is not imported here, docs/design.md's arrows run the other way).
ELASTIC_CENTRE = "elastic_centre"
ELASTIC_SOLVER = "elastic_solver"
ELASTIC_EXCLUDE_BIASES = "elastic_exclude_biases"
CENTRES = ("zero", "global")  # index = the extra's value
SOLVERS = ("subgradient", "prox")
WEIGHTINGS = ("uniform", "samples")
DEFAULT_EPOCHS = 10.0  # Table 2's E, used when neither local_epochs nor local_steps is set


@dataclass
class FedENConfig(FedAvgConfig):
    """FedAvg's settings plus the elastic net (see the module docstring for each key).

    ``preset = "paper"``: the paper's Table 2 values (the defaults spelled out, with E = 10).
    """

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "paper": {
            "lam": 1e-3, "alpha": 0.5, "learning_rate": 0.01, "batch_size": 10,
            "local_epochs": 10.0, "partial_work": "include",
        },
    }  # fmt: skip

    HELP: ClassVar[Mapping[str, str]] = {
        "local_epochs": "local epochs per job; unset = local_steps, or 10 epochs (Table 2)",
        "lam": "elastic-net strength (>= 0)",
        "alpha": "elastic-net mix in [0, 1]: 0 all L2, 1 all L1",
        "centre": "what the penalty pulls towards: zero or global (the job's start weights)",
        "solver": "client solver: subgradient (SGD on loss + penalty) or prox",
        "weighting": "mean over updates: uniform or samples (FedAvg's weighting)",
        "exclude_biases": "leave biases and normalisation parameters unpenalised",
    }

    lam: float = 1e-3
    alpha: float = 0.5
    centre: str = "zero"
    solver: str = "subgradient"
    weighting: str = "uniform"
    # G14: leave biases and normalisation parameters unpenalised (default: every parameter).
    exclude_biases: bool = False
    partial_work: str = "include"
    participation: float | int = 0.1
    learning_rate: float = 0.01  # Table 2 (FedAvg's default is 0.05)
    batch_size: int = 10

    def __post_init__(self) -> None:
        """Check ranges and choices with messages that name the key."""
        super().__post_init__()
        if self.private:  # FedAvg's keys, but FedEN weighs its updates by p_i
            from aggsrv.strategies.privacy import refuse_privacy_keys

            refuse_privacy_keys("feden", ["dp_clip_norm"])
        if not 0.0 <= self.lam < float("inf"):
            raise ValueError(
                f"lam (the elastic-net strength) must be finite and >= 0, got {self.lam}"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha (the L1/L2 mix) must be in [0, 1], got {self.alpha}")
        for key, choices in (
            ("centre", CENTRES),
            ("solver", SOLVERS),
            ("weighting", WEIGHTINGS),
        ):
            if getattr(self, key) not in choices:
                raise ValueError(f"{key} must be one of {choices}, got {getattr(self, key)!r}")

    def recipe(self, **overrides: Any) -> Recipe:
        """The shared recipe, with Table 2's 10 local epochs when neither work key is set."""
        recipe = super().recipe(**overrides)
        if self.local_epochs is None and self.local_steps is None:
            recipe = dataclasses.replace(recipe, local_epochs=DEFAULT_EPOCHS)
        return recipe

    def elastic_recipe(self) -> Recipe:
        """The client recipe with the elastic-net terms."""
        extra = {
            ELASTIC_CENTRE: float(CENTRES.index(self.centre)),
            ELASTIC_SOLVER: float(SOLVERS.index(self.solver)),
        }
        if self.exclude_biases:
            extra[ELASTIC_EXCLUDE_BIASES] = 1.0
        return self.recipe(
            elastic_lambda=float(self.lam), elastic_alpha=float(self.alpha), extra=extra
        )


class FedEN(FedAvg[FedENConfig], name="feden"):
    """FedAvg that includes partial work, averages uniformly and sends the elastic-net recipe."""

    def make_recipe(self) -> Recipe:
        """FedAvg's recipe plus lam, alpha, the centre and the solver (the elastic-net terms)."""
        return self.config.elastic_recipe()

    def _weight_of(self, update: Update) -> float:
        """p_i: 1 (uniform; 0 without samples) or n_i (``weighting = "samples"``)."""
        if self.config.weighting == "samples":
            return float(update.num_samples)
        return 1.0 if update.num_samples > 0 else 0.0
