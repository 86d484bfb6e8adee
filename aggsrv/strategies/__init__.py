"""Aggregation strategies: one module per algorithm behind the protocol of ``base.py``.

``make_strategy(name, layout=..., initial=..., config=..., device=..., max_clients=...)`` builds
one by name; ``STRATEGIES`` maps the implemented names to their classes. Names reserved for
later issues raise NotImplementedError naming the issue that brings them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aggsrv.strategies.base import Strategy
from aggsrv.strategies.ca2fl import CA2FL, CA2FLConfig
from aggsrv.strategies.config import StrategyConfig
from aggsrv.strategies.errors import (
    InvalidUpdate,
    JobSuperseded,
    NonFiniteResult,
    NonFiniteUpdate,
    NotRegistered,
    ShardsDisagree,
    StrategyError,
    TooManyClients,
    TooManySamples,
    TooStale,
    UpdateNormTooLarge,
)
from aggsrv.strategies.fedasync import FedAsync, FedAsyncConfig
from aggsrv.strategies.fedavg import FedAvg, FedAvgConfig
from aggsrv.strategies.fedbuff import FedBuff, FedBuffConfig
from aggsrv.strategies.feddgic import FedDGIC, FedDGICConfig, FedFG, FedFGConfig
from aggsrv.strategies.feden import FedEN, FedENConfig
from aggsrv.strategies.fedhist import TWAFL, FedHist, FedHistConfig, TWAFLConfig
from aggsrv.strategies.fedogd import FedOGD, FedOGDConfig
from aggsrv.strategies.fedprox import FedProx, FedProxConfig
from aggsrv.strategies.job import Job
from aggsrv.strategies.ledger import UpdateLedger
from aggsrv.strategies.mifa import MIFA, MIFAConfig
from aggsrv.strategies.orthofl import OrthoFL, OrthoFLConfig
from aggsrv.values import Outcome, PendingReason, ProjectionMode, Recipe, Status, Update, UpdateKind

__all__ = [
    "CA2FL",
    "RESERVED",
    "STRATEGIES",
    "CA2FLConfig",
    "FedAsync",
    "FedAsyncConfig",
    "FedAvg",
    "FedAvgConfig",
    "FedBuff",
    "FedBuffConfig",
    "FedDGIC",
    "FedDGICConfig",
    "FedEN",
    "FedENConfig",
    "FedFG",
    "FedFGConfig",
    "FedHist",
    "FedHistConfig",
    "FedOGD",
    "FedOGDConfig",
    "FedProx",
    "FedProxConfig",
    "InvalidUpdate",
    "MIFA",
    "MIFAConfig",
    "OrthoFL",
    "OrthoFLConfig",
    "TWAFL",
    "TWAFLConfig",
    "Job",
    "JobSuperseded",
    "NonFiniteResult",
    "NonFiniteUpdate",
    "NotRegistered",
    "Outcome",
    "PendingReason",
    "ProjectionMode",
    "Recipe",
    "ShardsDisagree",
    "Status",
    "Strategy",
    "StrategyConfig",
    "StrategyError",
    "TooManyClients",
    "TooManySamples",
    "TooStale",
    "Update",
    "UpdateKind",
    "UpdateLedger",
    "UpdateNormTooLarge",
    "make_strategy",
    "strategy_class",
    "strategy_settings",
]

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedAsync,
        FedBuff,
        FedProx,
        FedOGD,
        FedEN,
        MIFA,
        OrthoFL,
        CA2FL,
        FedHist,
        TWAFL,
        FedDGIC,
        FedFG,
    )
}

# Names reserved for strategies a later issue brings: name -> "the issue that brings it".
RESERVED: dict[str, str] = {}


def make_strategy(
    name: str, config: StrategyConfig | Mapping[str, Any] | None = None, **kwargs: Any
) -> Strategy:
    """Build the strategy called ``name`` with the Strategy constructor's keyword arguments;
    ``config`` is its settings, or a mapping of its keys read by :func:`strategy_settings`."""
    cls = strategy_class(name)  # a reserved name stays NotImplementedError here
    if not isinstance(config, StrategyConfig):
        config = strategy_settings(name, config)
    return cls(config=config, **kwargs)


def strategy_settings(name: str, keys: Mapping[str, Any] | None = None) -> StrategyConfig:
    """The settings of the strategy called ``name`` from its keys (a [strategy_config] table):
    the one place a name and a table become a typed config, whichever way they came (the
    command line, a TOML file, a sweep, a checkpoint, the Flower adapter). ValueError naming
    what is wrong."""
    try:
        cls = strategy_class(name)
    except NotImplementedError as exc:
        raise ValueError(str(exc)) from None
    try:
        return cls.config_class.from_dict(keys)
    except TypeError as exc:  # e.g. a table where a number belongs
        raise ValueError(f"[strategy_config] for {cls.name}: {exc}") from None


def strategy_class(name: str) -> type[Strategy]:
    """The class of the strategy called ``name`` (case-insensitive), or a clear error.

    ``"package.module:ClassName"`` names a user strategy: a :class:`Strategy` subclass importable
    from the server's (and simulator's) Python path.
    """
    if ":" in name:
        return _user_strategy(name)
    key = name.lower()
    if key in STRATEGIES:
        return STRATEGIES[key]
    if key in RESERVED:
        raise NotImplementedError(
            f"strategy {name!r} is not implemented yet: {key} arrives with {RESERVED[key]}"
        )
    known = ", ".join(sorted(STRATEGIES) + sorted(RESERVED))
    raise ValueError(f"unknown strategy {name!r}; known strategies: {known}")


def _user_strategy(spec: str) -> type[Strategy]:
    from aggsrv.imports import load_object

    obj = load_object(spec, "strategy")
    if not (isinstance(obj, type) and issubclass(obj, Strategy)):
        raise ValueError(f"strategy {spec!r} is not a subclass of aggsrv.strategies.Strategy")
    return obj
