"""What a sweep's table says per cell: each arm's accuracy over the seeds, the best healthy
baseline, and each method's (or ablation's) margin over it with a verdict.

The margin is paired by seed: for seed s, the arm's final accuracy minus the best baseline's on
the same seed (the same data split, stragglers and initial model). Its verdict:

* ``wins`` / ``loses``: every seed's margin has the same sign and the mean margin is larger
  than the margins' standard deviation over the seeds;
* ``noise``: the seeds disagree on the sign, or the mean is within one standard deviation;
* ``n<2``: fewer than two seeds in common, no verdict.

The best baseline of a cell is the baseline arm with the highest mean final accuracy among
those that diverged on no seed (``table.health``); a method never "wins" against a broken
baseline. If every baseline diverged in a cell, the best of them is used and the cell says so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aggsrv.sim.sweep.definition import Cell, Sweep

__all__ = ["ArmResult", "CellSummary", "Margin", "summarize", "verdict"]


@dataclass
class ArmResult:
    """One arm in one cell: the final accuracy per seed and which seeds diverged."""

    arm: str
    role: str
    accuracy: dict[int, float] = field(default_factory=dict)
    diverged: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    wall_time: float = 0.0

    @property
    def mean(self) -> float:
        return statistics.fmean(self.accuracy.values()) if self.accuracy else math.nan

    @property
    def sd(self) -> float:
        return statistics.stdev(self.accuracy.values()) if len(self.accuracy) > 1 else math.nan


@dataclass
class Margin:
    arm: str
    baseline: str
    per_seed: dict[int, float]
    verdict: str

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_seed.values()) if self.per_seed else math.nan

    @property
    def sd(self) -> float:
        return statistics.stdev(self.per_seed.values()) if len(self.per_seed) > 1 else math.nan


@dataclass
class CellSummary:
    cell: Cell
    arms: dict[str, ArmResult]
    best_baseline: str | None
    baselines_broken: bool  # every baseline diverged on some seed
    margins: dict[str, Margin]


def verdict(margins: Iterable[float]) -> str:
    values = list(margins)
    if len(values) < 2:
        return "n<2"
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    same_sign = all(v > 0 for v in values) or all(v < 0 for v in values)
    if same_sign and abs(mean) > sd:
        return "wins" if mean > 0 else "loses"
    return "noise"


def _latest(sweep: Sweep, records: list[dict[str, Any]], out) -> dict[tuple, dict[str, Any]]:
    """The newest line per (cell, arm, seed) whose digest matches the sweep as it is now."""
    wanted = {}
    for cell in sweep.cells():
        for arm in sweep.arms:
            for seed in sweep.seeds:
                spec = sweep.run_spec(cell, arm, seed, out)
                wanted[(cell.key(), arm.label, seed)] = spec.digest()
    latest = {}
    for r in records:
        key = (" / ".join(r["cell"].get(a.name, "?") for a in sweep.axes), r["arm"], r["seed"])
        if wanted.get(key) == r["digest"]:
            latest[key] = r
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
                r = latest.get((cell.key(), arm.label, seed))
                if r is None:
                    continue
                result.wall_time += r["wall_time"] or 0.0
                if r["error"] is not None or r["final_accuracy"] is None:
                    result.errors[seed] = r["error"] or "no accuracy"
                    continue
                result.accuracy[seed] = float(r["final_accuracy"])
                if r["diverged"]:
                    result.diverged.append(seed)
            arms[arm.label] = result
        baselines = [a for a in arms.values() if a.role == "baseline" and a.accuracy]
        healthy = [a for a in baselines if not a.diverged]
        pool = healthy or baselines
        best = max(pool, key=lambda a: a.mean) if pool else None
        margins = {}
        if best is not None:
            for a in arms.values():
                if a.role == "baseline" or not a.accuracy:
                    continue
                common = sorted(set(a.accuracy) & set(best.accuracy))
                per_seed = {s: a.accuracy[s] - best.accuracy[s] for s in common}
                margins[a.arm] = Margin(a.arm, best.arm, per_seed, verdict(per_seed.values()))
        summaries.append(
            CellSummary(cell, arms, best.arm if best else None, bool(baselines) and not healthy,
                        margins)
        )  # fmt: skip
    return summaries
