"""Simulation configuration: one dataclass with working defaults, loaded from TOML and overridden
from the command line. Unknown keys are an error, so a typo never silently runs the default."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from aggsrv.config_check import Count
from aggsrv.config_file import TomlConfig

if TYPE_CHECKING:
    from aggsrv.strategies import StrategyConfig

__all__ = ["Budget", "SimConfig", "parse_budget"]

TRANSPORTS = ("inproc", "grpc")
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([svr])\s*$")
_UNITS = {"s": "seconds", "v": "versions", "r": "rounds"}


@dataclass(frozen=True)
class Budget:
    """How long a run lasts: virtual seconds, server versions, or rounds.

    A round is one server version for the round-based strategies (``fedavg``/``fedprox`` in
    ``sync`` mode) and, for the asynchronous ones, as many accepted updates as there are
    clients (the client work of one synchronous round), so budgets in rounds compare strategies
    at equal client work.
    """

    amount: float
    unit: str  # seconds | versions | rounds

    def __str__(self) -> str:
        n = int(self.amount) if self.amount == int(self.amount) else self.amount
        return f"{n}{self.unit[0]}"


def parse_budget(text: str | int | float) -> Budget:
    """``"600s"``, ``"500v"`` or ``"50r"`` (a bare number means virtual seconds)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        text = f"{text}s"
    m = _BUDGET.match(str(text))
    if not m:
        raise ValueError(
            f"budget must be a number followed by s (virtual seconds), v (versions) or r "
            f"(rounds), e.g. 600s, 500v, 50r; got {text!r}"
        )
    amount = float(m.group(1))
    if amount <= 0:
        raise ValueError(f"budget must be > 0, got {text!r}")
    unit = _UNITS[m.group(2)]
    if unit != "seconds" and amount != int(amount):
        raise ValueError(f"a budget in {unit} must be a whole number, got {text!r}")
    return Budget(amount, unit)


@dataclass
class SimConfig(TomlConfig):
    """Everything `aggsrv simulate` needs; every key may appear in the TOML file.

    What each key does is in :attr:`HELP` (printed by --print-config, shown by the options'
    --help, listed in docs/config.md).
    """

    KIND = "simulate"  # in error messages (not a field: no annotation)

    HELP: ClassVar[Mapping[str, str]] = {
        "strategy": "the aggregation strategy: a name (fedasync, fedavg, fedbuff, ...; "
        "docs/config.md lists them) or package.module:Class",
        "strategy_config": "the strategy's own keys, the client recipe included; unless given, "
        "min_available = clients (where it has one)",
        "dataset": "digits, fashion_mnist, mnist_subset, or module:callable returning a Dataset",
        "data_dir": "folder of the data set's files (fashion_mnist, user loaders); unset = the "
        "loader's default (the Debian package's)",
        "partition": "how the data is split between the clients: NAME or NAME:key=value,... (e.g. "
        "iid, dirichlet_per_client:alpha=0.5)",
        "clients": "simulated clients",
        "model": "the network: a name from aggsrv.sim.models.MODELS (e.g. mlp, lenet5) or "
        "module:callable",
        "model_config": "keyword arguments of the model's builder",
        "profile": 'straggler and dropout profile: a preset ("tiers"), "name:key=value,..." or a '
        "table",
        "base_time": "virtual seconds of one full job on a tier-1 client",
        "budget": "how long the run lasts: virtual seconds, versions or rounds, e.g. 600s, 500v, "
        "50r",
        "eval_every": "evaluate the global model every this much (e.g. 5s, 10v, 1r); auto = 40 "
        "times per budget",
        "transport": "grpc (a real server process and clients) or inproc (one process on a "
        "virtual clock)",
        "time_scale": "grpc only: wall seconds per virtual second",
        "seed": "seed of the run: data split, initial model, profile, attackers (and dp_seed "
        "under DP)",
        "out": "the run's folder; unset = runs/STRATEGY-DATASET-TRANSPORT-sSEED",
        "scenario": "the scenario's name in aggsrv report; unset = PROFILE/PARTITION[/ATTACK]",
        "label": "the run's name in aggsrv report's tables and plots; unset = the strategy",
        "eval_batch_size": "batch size of the evaluation on the test set",
        "threads": "torch threads for training and evaluation; 0 = torch's default",
        "attack": "Byzantine clients, NAME:fraction=0.2,KEY=VALUE,... (docs/attacks.md); unset = "
        "every client honest",
        "compression": "compressed client updates with error feedback (quantization, top_k, ...: "
        "docs/compression.md); unset = float32",
    }

    strategy: str = "fedasync"
    # The run's defaults are added by _run_defaults, not here: the table stays as written.
    strategy_config: dict[str, Any] = field(default_factory=dict)
    dataset: str = "digits"
    data_dir: str | None = None
    partition: str = "iid"
    clients: Count = 8
    model: str = "mlp"
    model_config: dict[str, Any] = field(default_factory=dict)
    profile: str | dict[str, Any] = "tiers"
    base_time: float = 1.0
    budget: str = "60s"
    eval_every: str = "auto"
    transport: str = "grpc"
    time_scale: float = 0.25
    seed: int = 0
    out: str | None = None
    scenario: str | None = None
    label: str | None = None
    eval_batch_size: Count = 2048
    threads: int = 0
    attack: str | None = None
    compression: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not self.base_time > 0 or not self.time_scale > 0:
            raise ValueError("base_time and time_scale must be > 0")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        self.budget_spec()
        self.attack_spec()
        self.compression_spec()
        if self.eval_every != "auto":
            parse_budget(self.eval_every)
        from aggsrv.strategies import strategy_settings

        # The settings the run uses, read once: the table as written (checked with its own
        # keys' messages) with the run's defaults on top. ``strategy_config`` stays the table
        # as written (config.toml, sweep digests), so a changed table takes
        # dataclasses.replace, which reads it again.
        given = strategy_settings(self.strategy, self.strategy_config)
        self.strategy_settings = dataclasses.replace(given, **self._run_defaults(given))

    def _run_defaults(self, settings: StrategyConfig) -> dict[str, Any]:
        """The strategy keys the run sets where the table does not: a round-based strategy
        waits for all the simulated clients before its first round (``min_available =
        clients``), else the first round would hold only the first client to register. Under
        differential privacy ``dp_seed`` defaults to the run's seed."""
        given = self.strategy_config
        keys: dict[str, Any] = {}
        if hasattr(settings, "min_available") and "min_available" not in given:
            keys["min_available"] = self.clients
        # An experiment's noise repeats with its seed (a server draws it from the OS).
        if given.get("dp_clip_norm") is not None and given.get("dp_seed") is None:
            keys["dp_seed"] = self.seed
        seeded = keys.get("dp_seed", given.get("dp_seed")) is not None
        if seeded and "dp_insecure_seed" not in given:  # its noise may be recomputed
            keys["dp_insecure_seed"] = True
        return keys

    def effective_strategy_config(self) -> dict[str, Any]:
        """The strategy's table as the run uses it (the table given to a server process)."""
        return {**self.strategy_config, **self._run_defaults(self.strategy_settings)}

    def compression_spec(self):
        """The clients' ``compression`` (aggsrv.client.Compression), or None."""
        if self.compression is None:
            return None
        from aggsrv.client.compression import Compression

        table = dict(self.compression)
        if "state_path" in table:
            raise ValueError("compression.state_path is a client's; a simulation keeps none")
        try:
            return Compression(**table)
        except TypeError as exc:
            raise ValueError(f"compression: {exc}") from None

    def attack_spec(self):
        """The parsed ``attack`` (an AttackSpec, checked against ``clients``), or None."""
        if self.attack is None:
            return None
        from aggsrv.sim.attacks import parse_attack

        spec = parse_attack(self.attack)
        spec.check(self.clients)
        return spec

    def budget_spec(self) -> Budget:
        return parse_budget(self.budget)

    def eval_spec(self) -> Budget:
        """The evaluation interval, in the budget's unit when "auto" (40 points per run)."""
        if self.eval_every != "auto":
            return parse_budget(self.eval_every)
        b = self.budget_spec()
        if b.unit == "seconds":
            return Budget(b.amount / 40, "seconds")
        return Budget(max(1, int(b.amount) // 40), b.unit)

    def scenario_label(self) -> str:
        if self.scenario:
            return self.scenario
        profile = self.profile if isinstance(self.profile, str) else self.profile.get("name", "?")
        attack = self.attack_spec()
        return f"{profile}/{self.partition}" + (f"/{attack.label()}" if attack else "")

    def out_dir(self) -> Path:
        if self.out:
            return Path(self.out)
        return Path("runs") / f"{self.strategy}-{self.dataset}-{self.transport}-s{self.seed}"
