"""What a sweep's table says per cell: each arm's accuracy over the seeds, the best healthy
baseline, and each method's (or ablation's) margin over it with a verdict.

The margin is paired by seed: for seed s, the arm's final accuracy minus the best baseline's on
the same seed (the same data split, stragglers and initial model). Its verdict:

* ``wins`` / ``loses``: every seed's margin has the same sign and the mean margin is larger
  than the margins' standard deviation over the seeds;
* ``noise``: the seeds disagree on the sign, or the mean is within one standard deviation;
* ``n<2``: fewer than two seeds in common, no verdict.

``ahead_from``: where on the run's axis (virtual seconds, versions or rounds: the budget's
unit) the arm goes ahead of that baseline for good. At each evaluation point of the arm's curve
the baseline's accuracy is interpolated, the paired difference averaged over the seeds, and
``ahead_from`` is the first point after which that mean difference stays above zero to the end
(None: the arm ends behind or level). It answers "how long must a run be for the method to pay
off", the question a single final accuracy hides.

The best baseline of a cell is the baseline arm with results on the most seeds and, among
those, the highest mean final accuracy, chosen among the healthy ones: those that diverged
(``table.health``) or stalled on no seed. A method never "wins" against a broken baseline: if
every baseline of a cell is unhealthy, the margins against the best of them are shown with the
verdict ``broken``, and no ablation runs there.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aggsrv.sim.config import parse_budget
from aggsrv.sim.sweep.definition import Cell, RunSpec, Sweep
from aggsrv.sim.sweep.table import curve, run_dir_of

__all__ = ["ArmResult", "CellSummary", "Margin", "ahead_from", "summarize", "verdict"]


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.fmean(values) if values else math.nan


def _sd(values: Iterable[float]) -> float:
    """The sample standard deviation over the seeds (NaN for fewer than two)."""
    values = list(values)
    return statistics.stdev(values) if len(values) > 1 else math.nan


@dataclass
class ArmResult:
    """One arm in one cell: the final accuracy per seed and which seeds diverged."""

    arm: str
    role: str
    accuracy: dict[int, float] = field(default_factory=dict)
    diverged: list[int] = field(default_factory=list)
    stalled: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    wall_time: float = 0.0
    curves: dict[int, np.ndarray] = field(default_factory=dict)  # seed -> [[x, accuracy], ...]
    curve_x: str | None = None  # the metrics column of x (virtual_time, version or rounds)

    @property
    def mean(self) -> float:
        return _mean(self.accuracy.values())

    @property
    def sd(self) -> float:
        return _sd(self.accuracy.values())

    @property
    def healthy(self) -> bool:
        """No seed diverged or stalled (a stalled run stopped before the budget: its final
        accuracy is not one at equal virtual time)."""
        return not self.diverged and not self.stalled


@dataclass
class Margin:
    arm: str
    baseline: str
    per_seed: dict[int, float]
    verdict: str
    ahead_from: float | None = None
    curve_x: str | None = None

    @property
    def mean(self) -> float:
        return _mean(self.per_seed.values())

    @property
    def sd(self) -> float:
        return _sd(self.per_seed.values())


@dataclass
class CellSummary:
    cell: Cell
    arms: dict[str, ArmResult]
    best_baseline: str | None
    baselines_broken: bool  # every baseline diverged or stalled on some seed
    margins: dict[str, Margin]
    # Baseline runs of the grid not in the table yet: the best baseline may still change.
    missing_baseline_runs: int = 0


def verdict(margins: Iterable[float]) -> str:
    values = list(margins)
    if len(values) < 2:
        return "n<2"
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    same_sign = all(v > 0 for v in values) or all(v < 0 for v in values)
    if same_sign and abs(mean) > sd:
        return "wins" if mean > 0 else "loses"
    return "noise"


def ahead_from(arm: dict[int, np.ndarray], base: dict[int, np.ndarray]) -> float | None:
    """The first x of the arm's curve after which its mean paired lead stays above zero."""
    seeds = sorted(set(arm) & set(base))
    if not seeds:
        return None
    end = min(min(arm[s][-1, 0], base[s][-1, 0]) for s in seeds)
    xs = arm[seeds[0]][:, 0]
    xs = xs[(xs > 0) & (xs <= end)]
    if xs.size == 0:
        return None
    lead = np.mean(
        [np.interp(xs, arm[s][:, 0], arm[s][:, 1]) - np.interp(xs, base[s][:, 0], base[s][:, 1])
         for s in seeds],
        axis=0,
    )  # fmt: skip
    if lead[-1] <= 0:
        return None
    behind = np.nonzero(lead <= 0)[0]
    return float(xs[0] if behind.size == 0 else xs[behind[-1] + 1])


def _curve_of(record: dict[str, Any], spec: RunSpec, out) -> dict[str, Any] | None:
    """The record's curve, or for a line written before curves were recorded, the run's."""
    if record.get("curve"):
        return record["curve"]
    metrics = run_dir_of(record, Path(out)) / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return curve(rows, parse_budget(spec.config["budget"]).unit) if rows else None


def _latest(sweep: Sweep, records: list[dict[str, Any]], out) -> dict[tuple, tuple]:
    """The newest line per (cell, arm, seed) whose digest matches the sweep as it is now, with
    its RunSpec."""
    wanted = {}
    for cell in sweep.cells():
        for arm in sweep.arms:
            for seed in sweep.seeds:
                spec = sweep.run_spec(cell, arm, seed, out)
                wanted[(cell.labels, arm.label, seed)] = spec
    latest = {}
    for r in records:
        labels = tuple(r["cell"].get(a.name) for a in sweep.axes)
        key = (labels, r["arm"], r["seed"])
        spec = wanted.get(key)
        if spec is not None and spec.digest() == r["digest"]:
            latest[key] = (r, spec)
    return latest


def summarize(sweep: Sweep, records: list[dict[str, Any]], out) -> list[CellSummary]:
    """Per cell of the grid (in order): the arms' results, the best baseline and the margins."""
    latest = _latest(sweep, records, out)
    summaries = []
    for cell in sweep.cells():
        arms: dict[str, ArmResult] = {}
        for arm in sweep.arms:
            result = ArmResult(arm.label, arm.role)
            for seed in sweep.seeds:
                found = latest.get((cell.labels, arm.label, seed))
                if found is None:
                    continue
                r, spec = found
                result.wall_time += r["wall_time"] or 0.0
                accuracy = r["final_accuracy"]
                if r["error"] is not None or accuracy is None or not math.isfinite(accuracy):
                    result.errors[seed] = r["error"] or f"final accuracy {accuracy}"
                    continue
                result.accuracy[seed] = float(r["final_accuracy"])
                points = _curve_of(r, spec, out)
                if points and points["points"]:
                    result.curves[seed] = np.asarray(points["points"], dtype=np.float64)
                    result.curve_x = points["x"]
                if r["diverged"]:
                    result.diverged.append(seed)
                if r["stalled"]:
                    result.stalled.append(seed)
            arms[arm.label] = result
        baselines = [a for a in arms.values() if a.role == "baseline" and a.accuracy]
        healthy = [a for a in baselines if a.healthy]
        pool = healthy or baselines
        # Most seeds first: a baseline with one surviving seed is not "the best" by luck.
        best = max(pool, key=lambda a: (len(a.accuracy), a.mean)) if pool else None
        broken = bool(baselines) and not healthy
        margins = {}
        if best is not None:
            for a in arms.values():
                if a.role == "baseline" or not a.accuracy:
                    continue
                common = sorted(set(a.accuracy) & set(best.accuracy))
                per_seed = {s: a.accuracy[s] - best.accuracy[s] for s in common}
                margins[a.arm] = Margin(
                    a.arm, best.arm, per_seed,
                    "broken" if broken else verdict(per_seed.values()),
                    ahead_from(a.curves, best.curves), a.curve_x,
                )  # fmt: skip
        summaries.append(
            CellSummary(
                cell, arms, best.arm if best else None, broken, margins,
                sum(len(sweep.seeds) - len(a.accuracy) - len(a.errors)
                    for a in arms.values() if a.role == "baseline"),
            )
        )  # fmt: skip
    return summaries
