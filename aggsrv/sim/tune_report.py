"""The table ``aggsrv tune`` prints: per setting, what the model gained and what the timing did.

A production change is judged on both. A bigger buffer may win accuracy and publish a third of
the versions; a staleness rule may win by folding in fewer updates. So beside each setting's
final accuracy and its margin over the current setting (paired by seed, as in a sweep), the
table gives the replayed runs' own timing, read from their traces:

* ``versions``: global versions published, mean over the seeds;
* ``arrivals/s``: uploads answered per (virtual) second, and ``folded in``: the share of them that
  counted toward the model (applied or buffered, not refused, filtered or duplicate);
* ``staleness``: mean, 90th percentile and maximum of the folded-in updates' staleness, over all
  the seeds' updates.

The first row is the recorded trace itself, so the replay's fidelity is visible: the current
setting's timing should look like the recording when the recording ran the same strategy.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aggsrv.sim.sweep.definition import Sweep
from aggsrv.sim.sweep.margins import summarize
from aggsrv.sim.sweep.report import arm_accuracy_text, margin_text
from aggsrv.sim.sweep.table import load_results, run_dir_of
from aggsrv.trace_format import Trace, read_trace

__all__ = ["Timing", "format_tune_table", "timing_of", "tune_report"]

TABLE_NAME = "tune.md"


@dataclass
class Timing:
    """What the clients' arrivals did in one or more runs (pooled)."""

    seconds: list[float] = field(default_factory=list)  # each run's span
    answered: list[int] = field(default_factory=list)  # each run's answered uploads
    folded: list[int] = field(default_factory=list)  # each run's folded-in uploads
    versions: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # every folded-in update's, pooled

    def add(self, trace: Trace, seconds: float, versions: int) -> None:
        self.seconds.append(seconds)
        self.answered.append(len(trace.updates))
        self.folded.append(sum(u.folded_in for u in trace.updates))
        self.versions.append(versions)
        self.staleness.extend(
            u.staleness for u in trace.updates if u.folded_in and u.staleness is not None
        )

    @property
    def arrivals_per_second(self) -> float:
        rates = [n / s for n, s in zip(self.answered, self.seconds, strict=True) if s > 0]
        return statistics.fmean(rates) if rates else math.nan

    @property
    def folded_share(self) -> float:
        total = sum(self.answered)
        return sum(self.folded) / total if total else math.nan

    def cells(self) -> list[str]:
        if not self.seconds:
            return ["-"] * 5
        s = np.asarray(self.staleness, dtype=np.float64)
        stale = (
            [f"{s.mean():.2f}", f"{np.percentile(s, 90):.0f}", f"{s.max():.0f}"]
            if s.size
            else ["-", "-", "-"]
        )
        return [
            f"{statistics.fmean(self.versions):.1f}",
            f"{self.arrivals_per_second:.3g}",
            "-" if math.isnan(self.folded_share) else f"{100 * self.folded_share:.0f} %",
            *stale,
        ]


def timing_of(trace: Trace, seconds: float | None = None, versions: int | None = None) -> Timing:
    """One trace's timing. Without ``seconds``/``versions`` (a recorded trace) they are read
    from the trace: its span, and the last applied version minus the first job's base."""
    timing = Timing()
    if seconds is None:
        ends = [u.received for u in trace.updates]
        seconds = (max(ends) - trace.start) if ends else 0.0
    if versions is None:
        bases = [j.base for j in trace.jobs] + [u.base for u in trace.updates if u.base is not None]
        last = [u.version for u in trace.updates]
        versions = max(last) - min(bases) if last and bases else 0
    timing.add(trace, seconds, versions)
    return timing


def _run_timings(sweep: Sweep, out: Path) -> dict[str, Timing]:
    """Each arm's timing, pooled over the seeds whose line matches the sweep as it is now."""
    (cell,) = sweep.cells()
    wanted = {
        sweep.run_spec(cell, arm, seed, out).digest(): arm.label
        for arm in sweep.arms
        for seed in sweep.seeds
    }
    timings = {arm.label: Timing() for arm in sweep.arms}
    for record in load_results(out):
        label = wanted.pop(record["digest"], None)
        if label is None or record["error"] is not None:
            continue
        trace_path = run_dir_of(record, out) / "trace.jsonl"
        if not trace_path.is_file():
            continue
        timings[label].add(
            read_trace(trace_path), float(record["virtual_time"] or 0.0), record["versions"] or 0
        )
    return timings


def format_tune_table(
    sweep: Sweep, out: Path, recorded: Trace, recorded_strategy: str, baseline: str
) -> str:
    """Markdown: one row for the recording, then one per setting (the current one first)."""
    out = Path(out).resolve()
    (summary,) = summarize(sweep, load_results(out), out)
    timings = _run_timings(sweep, out)
    head = [
        "setting", "final accuracy", f"vs {baseline} (points)", "versions", "arrivals/s",
        "folded in", "mean staleness", "p90 staleness", "max staleness",
    ]  # fmt: skip
    recorded_row = [f"recorded ({recorded_strategy})", "-", "-", *timing_of(recorded).cells()]
    lines = [
        sweep.description,
        "",
        "| " + " | ".join(head) + " |",
        "|---" * len(head) + "|",
        "| " + " | ".join(recorded_row) + " |",
    ]
    for arm in sweep.arms:
        accuracy = arm_accuracy_text(summary.arms[arm.label])
        m = summary.margins.get(arm.label)
        margin = "baseline" if arm.label == baseline else margin_text(m)
        if m is not None and m.verdict == "wins":
            margin = f"**{margin}**"
        cells = [arm.label, accuracy, margin, *timings[arm.label].cells()]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Accuracy: mean ± sd over the seeds {', '.join(map(str, sweep.seeds))} (D: seeds that "
        "diverged, S: that stalled). Margins are paired by seed; **bold**: every seed agrees "
        "and the mean exceeds the sd; ~: within the seeds' noise; ?: fewer than two seeds. "
        "Versions: published, mean over the seeds. Arrivals/s: uploads answered per second; "
        "folded in: the share applied or buffered. Staleness: over every seed's folded-in "
        "updates. The recorded row is the trace itself.",
    ]
    return "\n".join(lines) + "\n"


def tune_report(sweep: Sweep, out: Path, trace: str | Path, baseline: str) -> str:
    """Write OUT/tune.md from the table as it is now (a partial table is fine) and return it."""
    recorded = read_trace(trace)
    strategies = sorted(set(recorded.strategies)) or ["?"]
    text = format_tune_table(sweep, out, recorded, "/".join(strategies), baseline)
    (Path(out) / TABLE_NAME).write_text(text)
    return text
