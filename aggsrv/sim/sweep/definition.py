"""A sweep file: one experiment setting, the axes to vary it along, and the strategies (arms)
to run in every cell of the grid.

```toml
setting = "../orthofl_rpi_dirichlet.toml"   # a `aggsrv simulate` config, relative to this file
seeds = [0, 1]

[[axis]]                      # values for one key, with short labels for the tables
name = "alpha"
key = "partition"
values = ["dirichlet_per_client:alpha=0.1", "dirichlet_per_client:alpha=1.0"]
labels = ["0.1", "1.0"]

[[axis]]                      # or named points, each any set of overrides
name = "latency"
points = { rpi = { profile = "raspberry_pi" }, lognormal = { profile = "rpi_lognormal" } }

[[arm]]
label = "orthofl"
strategy = "orthofl"
role = "method"               # method: mapped against the best baseline in every cell
[[arm]]
label = "orthofl no calibration"
strategy = "orthofl"
role = "ablation"             # ablation: run where its method wins clearly (or where = "all")
of = "orthofl"
config = { calibrate = false }
[[arm]]
label = "ca2fl"
strategy = "ca2fl"            # role defaults to baseline
```

An override key is a `SimConfig` key (``partition``, ``profile``, ``clients``, ``budget``...)
or ``strategy_config.KEY``, which reaches every arm whose strategy has that key (the arm's own
``config`` does not override an axis). Every arm gets the setting's client recipe (learning
rate, batch size, local work, momentum) for the keys its strategy knows, then its ``config``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aggsrv.sim.config import SimConfig
from aggsrv.strategies import strategy_class

__all__ = [
    "RECIPE_KEYS",
    "ROLES",
    "Arm",
    "Axis",
    "Cell",
    "RunSpec",
    "Sweep",
    "arm_settings",
    "check_sweep",
    "load_sweep",
    "slug",
]

RECIPE_KEYS = ("learning_rate", "batch_size", "local_epochs", "local_steps", "momentum")
ROLES = ("method", "baseline", "ablation")
_TOP_KEYS = {"setting", "seeds", "axis", "arm", "description"}
_ARM_KEYS = {"label", "strategy", "role", "of", "config", "where"}
_AXIS_KEYS = {"name", "key", "values", "labels", "points"}
_STRATEGY_PREFIX = "strategy_config."


def arm_settings(base: SimConfig, strategy: str, own: Mapping[str, Any]) -> dict[str, Any]:
    """The setting's client recipe (the keys ``strategy`` knows) with the arm's keys on top."""
    known = _strategy_keys(strategy)
    settings = {k: v for k, v in base.strategy_config.items() if k in RECIPE_KEYS and k in known}
    settings.update(own)
    return settings


@dataclass(frozen=True)
class Axis:
    name: str
    # (label, overrides) per point, in the file's order.
    points: tuple[tuple[str, dict[str, Any]], ...]

    @property
    def labels(self) -> list[str]:
        return [label for label, _ in self.points]


@dataclass(frozen=True)
class Arm:
    label: str
    strategy: str
    role: str = "baseline"
    of: str | None = None  # the method an ablation belongs to
    config: dict[str, Any] = field(default_factory=dict)
    where: str = "wins"  # ablations: "wins" (cells where `of` wins clearly) or "all"


@dataclass(frozen=True)
class Cell:
    """One point of the grid: a label per axis and the overrides they add up to."""

    axes: tuple[str, ...]
    labels: tuple[str, ...]
    overrides: dict[str, Any]

    def key(self) -> str:
        return " / ".join(self.labels)

    def as_dict(self) -> dict[str, str]:
        return dict(zip(self.axes, self.labels, strict=True))

    def slug(self) -> str:
        return "__".join(slug(label) for label in self.labels) or "cell"


@dataclass(frozen=True)
class RunSpec:
    """One simulation of the sweep: (cell, arm, seed) and its full `SimConfig` mapping."""

    cell: Cell
    arm: Arm
    seed: int
    config: dict[str, Any]

    def digest(self) -> str:
        """A hash of everything that decides the run's result (not where it is written), so a
        changed sweep file re-runs exactly the runs it changed."""
        decisive = {k: v for k, v in self.config.items() if k not in ("out", "label", "scenario")}
        text = json.dumps(decisive, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Sweep:
    path: Path
    base: SimConfig
    seeds: list[int]
    axes: list[Axis]
    arms: list[Arm]
    description: str = ""

    def cells(self) -> list[Cell]:
        """The grid: every combination of the axes' points, first axis slowest."""
        cells = []
        for combo in itertools.product(*(axis.points for axis in self.axes)):
            overrides: dict[str, Any] = {}
            for _, point in combo:
                overrides.update(point)
            labels = tuple(label for label, _ in combo)
            cells.append(Cell(tuple(a.name for a in self.axes), labels, overrides))
        return cells

    def arm(self, label: str) -> Arm:
        for arm in self.arms:
            if arm.label == label:
                return arm
        raise KeyError(label)

    def run_spec(self, cell: Cell, arm: Arm, seed: int, out: Path) -> RunSpec:
        """The run's config: the setting, the cell's overrides, the arm's strategy and keys."""
        config = self.base.to_dict()
        axis_strategy = {}
        for key, value in cell.overrides.items():
            if key.startswith(_STRATEGY_PREFIX):
                axis_strategy[key[len(_STRATEGY_PREFIX) :]] = value
            else:
                config[key] = value
        base = SimConfig.from_mapping({**config, "strategy_config": self.base.strategy_config})
        known = _strategy_keys(arm.strategy)
        settings = arm_settings(base, arm.strategy, arm.config)
        settings.update({k: v for k, v in axis_strategy.items() if k in known})
        config.update(
            strategy=arm.strategy,
            strategy_config=settings,
            seed=seed,
            label=arm.label,
            scenario=cell.key(),
            out=str(out / "runs" / cell.slug() / f"{slug(arm.label)}-s{seed}"),
            threads=1,
        )
        return RunSpec(cell, arm, seed, config)


def slug(text: str) -> str:
    """A label as a file name: letters, digits, '.', '_' and '-' kept, the rest '_'."""
    keep = [c if c.isalnum() or c in "._-" else "_" for c in text]
    return "".join(keep).strip("_") or "x"


def _fail(path: Path, message: str) -> None:
    raise ValueError(f"sweep {path}: {message}")


def _check_table(path: Path, where: str, raw: Any, known: set[str]) -> None:
    """``raw`` is a TOML table with only ``known`` keys (``where``: "[[axis]] 2")."""
    if not isinstance(raw, Mapping):
        _fail(path, f"{where} must be a table")
    unknown = sorted(set(raw) - known)
    if unknown:
        _fail(path, f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")


def _axis(path: Path, i: int, raw: Any) -> Axis:
    _check_table(path, f"[[axis]] {i + 1}", raw, _AXIS_KEYS)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        _fail(path, f"[[axis]] {i + 1} needs a name")
    if "points" in raw:
        if any(k in raw for k in ("key", "values", "labels")):
            _fail(path, f"axis {name!r}: give points, or key with values, not both")
        if not isinstance(raw["points"], Mapping) or not raw["points"]:
            _fail(path, f"axis {name!r}: points must be a non-empty table of tables")
        points = []
        for label, overrides in raw["points"].items():
            if not isinstance(overrides, Mapping):
                _fail(path, f"axis {name!r}, point {label!r}: must be a table of overrides")
            points.append((str(label), dict(overrides)))
    else:
        key, values = raw.get("key"), raw.get("values")
        if not isinstance(key, str) or not isinstance(values, list) or not values:
            _fail(path, f"axis {name!r} needs points, or key and a non-empty list of values")
        labels = raw.get("labels", [str(v) for v in values])
        if not isinstance(labels, list) or len(labels) != len(values):
            _fail(path, f"axis {name!r}: {len(values)} values but labels {labels!r}")
        points = [(str(label), {key: value}) for label, value in zip(labels, values, strict=True)]
    labels = [label for label, _ in points]
    sim_keys = set(SimConfig.keys())
    if len(set(labels)) != len(labels):
        _fail(path, f"axis {name!r}: point labels repeat: {labels}")
    for label, overrides in points:
        for key in overrides:
            if not key.startswith(_STRATEGY_PREFIX) and key not in sim_keys:
                _fail(
                    path,
                    f"axis {name!r}, point {label!r}: {key!r} is neither a simulate key nor "
                    f"strategy_config.KEY; simulate keys: {', '.join(SimConfig.keys())}",
                )
            if key in ("strategy", "strategy_config", "seed", "out", "label", "scenario"):
                _fail(path, f"axis {name!r}: {key!r} is set by the sweep, not by an axis")
    return Axis(name, tuple(points))


def _arm(path: Path, i: int, raw: Any) -> Arm:
    _check_table(path, f"[[arm]] {i + 1}", raw, _ARM_KEYS)
    label, strategy = raw.get("label"), raw.get("strategy")
    if not isinstance(label, str) or not label or not isinstance(strategy, str):
        _fail(path, f"[[arm]] {i + 1} needs a label and a strategy")
    try:
        strategy_class(strategy)
    except (ValueError, NotImplementedError) as exc:
        _fail(path, f"arm {label!r}: {exc}")
    role = raw.get("role", "baseline")
    if role not in ROLES:
        _fail(path, f"arm {label!r}: role must be one of {ROLES}, got {role!r}")
    where = raw.get("where", "wins")
    if where not in ("wins", "all"):
        _fail(path, f"arm {label!r}: where must be 'wins' or 'all', got {where!r}")
    of = raw.get("of")
    if (role == "ablation") != (of is not None):
        _fail(path, f"arm {label!r}: an ablation names its method with of = ..., others do not")
    config = raw.get("config", {})
    if not isinstance(config, Mapping):
        _fail(path, f"arm {label!r}: config must be a table")
    return Arm(label, strategy, role, of, dict(config), where)


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file: every cell and arm must make a valid simulate config."""
    path = Path(path)
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        _fail(path, f"unknown key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    if not isinstance(raw.get("setting"), str):
        _fail(path, "setting = 'PATH.toml' (a simulate config, relative to the sweep) is missing")
    base = SimConfig.load(path.parent / raw["setting"])
    seeds = raw.get("seeds", [0, 1, 2])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        _fail(path, f"seeds must be a non-empty list of integers, got {seeds!r}")
    axes = [_axis(path, i, a) for i, a in enumerate(raw.get("axis", []))]
    if len({a.name for a in axes}) != len(axes):
        _fail(path, "axis names repeat")
    arms = [_arm(path, i, a) for i, a in enumerate(raw.get("arm", []))]
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        _fail(path, f"arm labels repeat: {labels}")
    methods = {a.label for a in arms if a.role == "method"}
    if not methods or not any(a.role == "baseline" for a in arms):
        _fail(path, "a sweep needs at least one arm with role 'method' and one 'baseline'")
    for arm in arms:
        if arm.of is not None and arm.of not in methods:
            _fail(path, f"arm {arm.label!r}: of = {arm.of!r} is not a method arm")
    description = raw.get("description", "")
    if not isinstance(description, str):
        _fail(path, f"description must be text (it opens sweep.md), not {description!r}")
    sweep = Sweep(path, base, list(seeds), axes, arms, description.strip())
    check_sweep(sweep)
    return sweep


def check_sweep(sweep: Sweep) -> None:
    """Every run must make a valid config, with a split and a straggler profile that resolve,
    and a run directory of its own: fail now, not an hour into the sweep."""
    from aggsrv.data.partitions import check_partition_spec
    from aggsrv.sim.profiles import make_profile

    path = sweep.path
    if len(set(sweep.seeds)) != len(sweep.seeds):
        _fail(path, f"seeds repeat: {sweep.seeds}")
    for what, labels in [("arm", [a.label for a in sweep.arms])] + [
        (f"axis {a.name!r}", a.labels) for a in sweep.axes
    ]:
        slugs = [slug(label) for label in labels]
        if len(set(slugs)) != len(slugs):
            _fail(path, f"{what}: labels {labels} name the same directories {slugs}")
    for axis in sweep.axes:
        for label, overrides in axis.points:
            for key in overrides:
                name = key[len(_STRATEGY_PREFIX) :]
                if key.startswith(_STRATEGY_PREFIX) and not any(
                    name in _strategy_keys(arm.strategy) for arm in sweep.arms
                ):
                    _fail(path, f"axis {axis.name!r}, point {label!r}: no arm's strategy has "
                                f"the key {name!r}")  # fmt: skip
    for cell in sweep.cells():
        for arm in sweep.arms:
            spec = sweep.run_spec(cell, arm, sweep.seeds[0], Path("."))
            try:
                cfg = SimConfig.from_mapping(spec.config)
                check_partition_spec(cfg.partition)
                # The split's label counts are not known yet: any counts check a label choice.
                counts = np.ones((cfg.clients, 2), dtype=np.int64)
                make_profile(cfg.profile, cfg.clients, 0, cfg.base_time, label_counts=counts)
            except (ValueError, TypeError) as exc:
                _fail(path, f"cell {cell.key()!r}, arm {arm.label!r}: {exc}")


def _strategy_keys(strategy: str) -> set[str]:
    return {f.name for f in dataclasses.fields(strategy_class(strategy).config_class)}
