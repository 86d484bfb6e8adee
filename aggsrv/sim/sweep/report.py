"""A sweep's report: ``sweep.md`` (Markdown tables) and one heat map per method and ablation,
``heatmap-<arm>.png``: its margin over the best baseline per cell, in accuracy points.

The first axis runs down the map, the second across; with more axes there is one panel per
combination of the others. A cell shows the mean margin, its standard deviation over the seeds,
the baseline it is measured against and where the arm goes ahead of it for good; cells within
the seeds' noise are hatched and their number is prefixed with "~" (``margins.verdict``), and
"!" marks a cell whose baselines all diverged.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from aggsrv.sim.sweep.definition import Sweep, slug
from aggsrv.sim.sweep.margins import ArmResult, CellSummary, Margin, summarize
from aggsrv.sim.sweep.table import load_results

__all__ = [
    "arm_accuracy_text",
    "format_report",
    "margin_text",
    "plot_heatmaps",
    "report_sweep",
]

_MARK = {"wins": "", "loses": "", "noise": "~", "n<2": "?", "broken": "!"}
_UNIT = {"virtual_time": " s", "version": " v", "rounds": " r"}


def _ahead_text(m: Margin) -> str:
    """Where the arm goes ahead for good, in the budget's unit ("" if it never does)."""
    if m.ahead_from is None:
        return ""
    return f"ahead from {m.ahead_from:.4g}{_UNIT.get(m.curve_x or '', '')}"


def _points(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:+.1f}"


def _partial(summary: CellSummary) -> str:
    """A cell whose baselines have not all run: its best baseline may still change."""
    n = summary.missing_baseline_runs
    return f" (partial: {n} baseline run{'s' * (n != 1)} to come)" if n else ""


def margin_text(m: Margin | None) -> str:
    if m is None:
        return "-"
    sd = "" if math.isnan(m.sd) else f" ± {100 * m.sd:.1f}"
    return f"{_MARK[m.verdict]}{_points(m.mean)}{sd}"


def _accuracy_text(mean: float, sd: float) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.3f}" + ("" if math.isnan(sd) else f" ± {sd:.3f}")


def arm_accuracy_text(r: ArmResult) -> str:
    """An arm's accuracy over the seeds with its flags (D: diverged, S: stalled seeds)."""
    text = _accuracy_text(r.mean, r.sd)
    if r.diverged:
        text += " D" + ",".join(str(x) for x in r.diverged)
    if r.stalled:
        text += " S" + ",".join(str(x) for x in r.stalled)
    if r.errors:
        text += f" ({len(r.errors)} failed)"
    return text


def _mapped(sweep: Sweep) -> list[str]:
    return [a.label for a in sweep.arms if a.role != "baseline"]


def _grid(sweep: Sweep):
    """(row labels, column labels, panels): panels are the label tuples of the further axes."""
    labels = [axis.labels for axis in sweep.axes]
    rows = labels[0] if labels else [""]
    cols = labels[1] if len(labels) > 1 else [""]
    panels = list(itertools.product(*labels[2:]))
    return rows, cols, panels


def _panel_title(names: list[str], panel: tuple[str, ...]) -> str:
    return ", ".join(f"{n} = {v}" for n, v in zip(names[2:], panel, strict=True))


def _lookup(summaries: list[CellSummary]) -> dict[tuple[str, ...], CellSummary]:
    return {s.cell.labels: s for s in summaries}


def _cell_labels(sweep: Sweep, row: str, col: str, panel: tuple[str, ...]) -> tuple[str, ...]:
    return (row, col)[: len(sweep.axes)] + panel


def format_report(sweep: Sweep, summaries: list[CellSummary]) -> str:
    """Markdown: the file's description, one margin grid per mapped arm, then every arm's
    accuracy per cell."""
    rows, cols, panels = _grid(sweep)
    by_cell = _lookup(summaries)
    names = [a.name for a in sweep.axes]
    lines = [sweep.description, ""] if sweep.description else []
    for arm in _mapped(sweep):
        lines.append(f"**{arm}**: margin over the best baseline, accuracy points (mean ± sd)")
        lines.append("")
        for panel in panels:
            if panel:
                lines.append(f"*{_panel_title(names, panel)}*")
                lines.append("")
            head = names[0] if names else ""
            if len(names) > 1:
                head += f" \\ {names[1]}"
            lines.append(f"| {head} | " + " | ".join(cols) + " |")
            lines.append("|---" * (len(cols) + 1) + "|")
            for row in rows:
                cells = []
                for col in cols:
                    s = by_cell.get(_cell_labels(sweep, row, col, panel))
                    m = s.margins.get(arm) if s else None
                    text = margin_text(m)
                    if m is not None and m.verdict == "wins":
                        text = f"**{text}**"
                    if m is None:
                        text = "not run"
                    else:
                        text += f" vs {m.baseline}"
                        text += f", {_ahead_text(m)}" if _ahead_text(m) else ""
                        text += _partial(s)
                    cells.append(text)
                lines.append(f"| {row} | " + " | ".join(cells) + " |")
            lines.append("")
    lines.append(
        "Final accuracy per cell, mean ± sd over the seeds (D: the seeds that diverged, S: "
        "those that stalled):"
    )
    lines.append("")
    arms = [a.label for a in sweep.arms]
    lines.append("| cell | " + " | ".join(arms) + " |")
    lines.append("|---" * (len(arms) + 1) + "|")
    for s in summaries:
        cells = []
        for label in arms:
            text = arm_accuracy_text(s.arms[label])
            if label == s.best_baseline:
                text = f"*{text}*"
            cells.append(text)
        lines.append(f"| {s.cell.key()} | " + " | ".join(cells) + " |")
    runs = sum(len(r.accuracy) + len(r.errors) for s in summaries for r in s.arms.values())
    wall = sum(r.wall_time for s in summaries for r in s.arms.values())
    lines.append("")
    lines.append(
        f"{runs} runs, {wall / 60:.0f} core-minutes (the sum of the runs' wall times). "
        "*Italics*: the cell's best healthy baseline. Margins are paired by seed; **bold**: "
        "every seed agrees and the mean exceeds the sd; ~: within the seeds' noise; "
        "?: fewer than two seeds; !: every baseline of the cell diverged or stalled (no "
        'verdict); "ahead from": '
        "where the arm's mean lead over that baseline turns positive for good."
    )
    return "\n".join(lines) + "\n"


def plot_heatmaps(sweep: Sweep, summaries: list[CellSummary], out: Path) -> list[Path]:
    """One PNG per mapped arm; a shared colour scale across them (accuracy points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows, cols, panels = _grid(sweep)
    by_cell = _lookup(summaries)
    names = [a.name for a in sweep.axes]
    means = [
        100 * m.mean for s in summaries for m in s.margins.values() if not math.isnan(m.mean)
    ]  # fmt: skip
    vmax = max([1.0, *(abs(v) for v in means)])
    paths = []
    for arm in _mapped(sweep):
        fig, axes = plt.subplots(
            1, len(panels), figsize=(1.9 * len(cols) * len(panels) + 1.5, 1.1 * len(rows) + 1.4),
            squeeze=False,
        )  # fmt: skip
        image = None
        for ax, panel in zip(axes[0], panels, strict=True):
            grid = np.full((len(rows), len(cols)), np.nan)
            for i, row in enumerate(rows):
                for j, col in enumerate(cols):
                    s = by_cell.get(_cell_labels(sweep, row, col, panel))
                    m = s.margins.get(arm) if s else None
                    if m is None:
                        ax.text(j, i, "not run", ha="center", va="center", fontsize=7)
                        continue
                    grid[i, j] = 100 * m.mean
                    text = margin_text(m) + f"\nvs {m.baseline}"
                    if _ahead_text(m):
                        text += "\n" + _ahead_text(m)
                    text += _partial(s).replace(" (", "\n(")
                    weight = "bold" if m.verdict in ("wins", "loses") else "normal"
                    ax.text(j, i, text, ha="center", va="center", fontsize=7, weight=weight,
                            bbox={"facecolor": "white", "alpha": 0.6, "linewidth": 0})  # fmt: skip
                    if m.verdict in ("noise", "n<2", "broken"):
                        ax.add_patch(
                            plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//",
                                          edgecolor="0.55", linewidth=0)
                        )  # fmt: skip
            image = ax.imshow(grid, cmap="RdYlGn", vmin=-vmax, vmax=vmax, aspect="auto")
            ax.set_xticks(range(len(cols)), cols, fontsize=8)
            ax.set_yticks(range(len(rows)), rows, fontsize=8)
            if len(names) > 1:
                ax.set_xlabel(names[1])
            if names:
                ax.set_ylabel(names[0])
            if panel:
                ax.set_title(_panel_title(names, panel), fontsize=8)
        fig.suptitle(f"{arm}: margin over the best baseline (accuracy points)", fontsize=9)
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
        path = out / f"heatmap-{slug(arm)}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def report_sweep(sweep: Sweep, out: Path, plot: bool = True) -> tuple[str, list[Path]]:
    """Write OUT/sweep.md and the heat maps from the table as it is now (partial is fine)."""
    out = Path(out).resolve()
    summaries = summarize(sweep, load_results(out), out)
    text = format_report(sweep, summaries)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.md").write_text(text)
    paths = plot_heatmaps(sweep, summaries, out) if plot else []
    return text, paths
