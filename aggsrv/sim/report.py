"""`aggsrv report RUN_DIR...`: compare runs. A table per (data set, scenario, strategy) with the
mean and spread over seeds, the virtual time to a target accuracy, and one plot with a line per
strategy (mean accuracy against virtual time, a band of +/- one standard deviation).

Runs with FedDGIC grouping events (``events.jsonl``) also get a table line each (the last
grouping's version, k and group sizes) and a dendrogram PNG per grouping next to the plot:
``<plot stem>-dendrogram-<label>-s<seed>.png`` for the last grouping, and ``...-1.png``,
``...-2.png``, ... for the earlier ones in the order they happened (-1 is the first)."""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aggsrv.sim.dendrogram import load_groupings, plot_dendrogram
from aggsrv.sim.output import plot_accuracy

__all__ = [
    "Run",
    "dendrogram_paths",
    "find_runs",
    "format_groupings",
    "format_table",
    "group_runs",
    "load_run",
    "time_to_target",
    "write_dendrograms",
]


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]

    @property
    def key(self) -> tuple[str, str, str]:
        s = self.summary
        return (s["dataset"], s["scenario"], s.get("label") or s["strategy"])


def load_run(path: Path) -> Run:
    path = Path(path)
    summary_file, metrics_file = path / "summary.json", path / "metrics.jsonl"
    if not summary_file.is_file() or not metrics_file.is_file():
        raise FileNotFoundError(f"{path} is not a finished run (no summary.json/metrics.jsonl)")
    summary = json.loads(summary_file.read_text())
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    return Run(path, summary, metrics)


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Each path is a run directory or a folder holding run directories (searched recursively)."""
    runs = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
        if (p / "summary.json").is_file():
            runs.append(load_run(p))
            continue
        found = sorted(q.parent for q in p.rglob("summary.json"))
        if not found:
            raise FileNotFoundError(f"no runs (summary.json) under {p}")
        runs.extend(load_run(q) for q in found)
    return runs


def time_to_target(metrics: list[dict[str, Any]], target: float) -> float | None:
    """The first evaluated virtual time with accuracy >= target (None if never reached)."""
    for row in metrics:
        if row["test_accuracy"] >= target:
            return row["virtual_time"]
    return None


def group_runs(runs: list[Run]) -> dict[tuple[str, str, str], list[Run]]:
    groups: dict[tuple[str, str, str], list[Run]] = defaultdict(list)
    for r in runs:
        groups[r.key].append(r)
    return dict(sorted(groups.items()))


def _mean_sd(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    m = statistics.fmean(values)
    if len(values) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table_rows(runs: list[Run], target: float) -> list[dict[str, Any]]:
    rows = []
    for (dataset, scenario, strategy), group in group_runs(runs).items():
        reached = [t for t in (time_to_target(r.metrics, target) for r in group) if t is not None]
        rows.append(
            {
                "dataset": dataset,
                "scenario": scenario,
                "strategy": strategy,
                "runs": len(group),
                "seeds": sorted({r.summary["seed"] for r in group}),
                "final_accuracy": [r.summary["final_accuracy"] for r in group],
                "best_accuracy": [r.summary["best_accuracy"] for r in group],
                "time_to_target": reached,
                "reached_target": len(reached),
                "updates_applied": [r.summary["updates_applied"] for r in group],
                "virtual_time": [r.summary["virtual_time"] for r in group],
                # Differential privacy's epsilon at the end (None: the run had no DP).
                "epsilon": [(r.summary.get("privacy") or {}).get("epsilon") for r in group],
            }
        )
    return rows


def format_table(runs: list[Run], target: float) -> str:
    """A fixed-width table: one line per (data set, scenario, strategy)."""
    header = (
        "dataset",
        "scenario",
        "strategy",
        "runs",
        "final acc",
        "best acc",
        f"time to {target:g} (vs)",
        "updates",
    )
    rows = table_rows(runs, target)
    private = any(e is not None for row in rows for e in row["epsilon"])
    if private:
        header = (*header, "epsilon")
    lines = []
    for row in rows:
        ttt = _mean_sd(row["time_to_target"], digits=1)
        if row["reached_target"] < row["runs"]:
            ttt = f"{ttt} ({row['reached_target']}/{row['runs']} reached)"
        lines.append(
            (
                row["dataset"],
                row["scenario"],
                row["strategy"],
                str(row["runs"]),
                _mean_sd(row["final_accuracy"]),
                _mean_sd(row["best_accuracy"]),
                ttt,
                f"{statistics.fmean(row['updates_applied']):.0f}",
            )
        )
        if private:
            eps = [e for e in row["epsilon"] if e is not None]
            lines[-1] = (*lines[-1], _mean_sd(eps, digits=2) if eps else "no DP")
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def plot_runs(runs: list[Run], path: Path, target: float | None = None) -> None:
    """One line per (scenario, strategy): mean accuracy over seeds on a common time grid."""
    groups = group_runs(runs)
    scenarios = {k[:2] for k in groups}
    lines: dict[str, list[dict[str, Any]]] = {}
    bands: dict[str, tuple[list[float], list[float], list[float]]] = {}
    for (dataset, scenario, strategy), group in groups.items():
        label = strategy if len(scenarios) == 1 else f"{strategy} [{dataset}, {scenario}]"
        end = min(max(r.metrics[-1]["virtual_time"], 1e-9) for r in group)
        grid = np.linspace(0.0, end, 200)
        curves = []
        for r in group:
            xs = np.array([m["virtual_time"] for m in r.metrics])
            ys = np.array([m["test_accuracy"] for m in r.metrics])
            # Accuracy is a step function of time: the last evaluation before each grid point.
            idx = np.clip(np.searchsorted(xs, grid, side="right") - 1, 0, len(xs) - 1)
            curves.append(ys[idx])
        arr = np.stack(curves)
        mean = arr.mean(axis=0)
        lines[label] = [
            {"virtual_time": float(t), "test_accuracy": float(a)}
            for t, a in zip(grid, mean, strict=True)
        ]
        if len(group) > 1:
            sd = arr.std(axis=0, ddof=1)
            bands[label] = (grid.tolist(), (mean - sd).tolist(), (mean + sd).tolist())
    title = "mean over seeds"
    if len(scenarios) == 1:
        title += ": " + ", ".join(next(iter(scenarios)))
    plot_accuracy(lines, path, title=title, target=target, bands=bands)


def _file_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "run"


def dendrogram_paths(runs: list[Run], plot: str | Path) -> dict[Path, Path]:
    """Each run's dendrogram file (its last grouping), keyed by run directory:
    ``<plot stem>-dendrogram-<label>-s<seed>.png`` beside ``plot``. Runs that would share a name
    add their data set and scenario, then their directory name, then their place in ``runs``."""
    plot = Path(plot)
    namings = (
        lambda i, r: f"{r.key[2]}-s{r.summary.get('seed', 0)}",
        lambda i, r: f"{r.key[2]}-{r.key[0]}-{r.key[1]}-s{r.summary.get('seed', 0)}",
        lambda i, r: f"{r.key[2]}-{r.path.name}",
        lambda i, r: f"{r.key[2]}-{r.path.name}-{i + 1}",
    )
    names = [_file_part(namings[0](i, r)) for i, r in enumerate(runs)]
    for naming in namings[1:]:
        clash = {v for v in names if names.count(v) > 1}
        names = [
            _file_part(naming(i, r)) if name in clash else name
            for i, (r, name) in enumerate(zip(runs, names, strict=True))
        ]
    return {
        r.path: plot.with_name(f"{plot.stem}-dendrogram-{name}.png")
        for r, name in zip(runs, names, strict=True)
    }


def write_dendrograms(
    runs: list[Run], plot: str | Path, groupings: dict[Path, list[dict[str, Any]]]
) -> dict[Path, list[Path]]:
    """One PNG per grouping event of each run (see the module docstring for the names);
    returns the files written per run directory, the last grouping's first."""
    paths = dendrogram_paths([r for r in runs if groupings.get(r.path)], plot)
    written: dict[Path, list[Path]] = {}
    for r in runs:
        events = groupings.get(r.path)
        if not events:
            continue
        dataset, scenario, label = r.key
        main = paths[r.path]
        files = []
        for i, event in enumerate(events, 1):
            last = i == len(events)
            out = main if last else main.with_name(f"{main.stem}-{i}{main.suffix}")
            title = (
                f"{label} on {dataset}, {scenario}, seed {r.summary.get('seed', '?')}: grouping "
                f"{i}/{len(events)}, version {event.get('version', '?')}"
            )
            if event.get("reason"):
                title += f" ({event['reason']})"
            plot_dendrogram(event, out, title=title)
            files.append(out)
        written[r.path] = [files[-1], *files[:-1]]
    return written


def _group_sizes(event: dict[str, Any]) -> str:
    labels = [int(g) for g in event.get("labels") or []]
    k = int(event.get("k", len(set(labels))))
    return ", ".join(str(labels.count(g)) for g in range(k)) or "-"


def format_groupings(
    runs: list[Run],
    groupings: dict[Path, list[dict[str, Any]]],
    files: dict[Path, list[Path]] | None = None,
) -> str:
    """A line per run with grouping events: its last grouping's version, k and group sizes."""
    header = ["run", "groupings", "version", "k", "group sizes"]
    if files:
        header.append("dendrogram")
    lines = []
    for r in runs:
        events = groupings.get(r.path)
        if not events:
            continue
        last = events[-1]
        line = [
            str(r.path),
            str(len(events)),
            str(last.get("version", "-")),
            str(last.get("k", "-")),
            _group_sizes(last),
        ]
        if files:
            line.append(str(files[r.path][0]) if files.get(r.path) else "-")
        lines.append(line)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["grouping (the last per run):"]
    out.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip() for x in lines]
    return "\n".join(out)


def report(
    paths: list[str | Path],
    target: float = 0.8,
    plot: str | Path | None = "report.png",
    dendrogram: bool = True,
):
    """Load runs, return the table text; write the plot if ``plot`` is a path, and with
    ``dendrogram`` a dendrogram per grouping event beside it. Runs with grouping events add a
    grouping table to the text."""
    runs = find_runs(paths)
    text = format_table(runs, target)
    if plot:
        plot_runs(runs, Path(plot), target)
    groupings = {r.path: load_groupings(r.path) for r in runs}
    if any(groupings.values()):
        files = write_dendrograms(runs, plot, groupings) if plot and dendrogram else None
        text += "\n\n" + format_groupings(runs, groupings, files)
    return text, runs
