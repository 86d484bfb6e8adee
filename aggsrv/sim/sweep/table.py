"""The sweep's results table: ``results.jsonl``, one line per finished run, appended as runs end,
so an interrupted sweep resumes where it stopped and a partial table can be reported.

A line is a JSON object with the fields of ``FIELDS`` and, from runs recorded since it was added,
``curve``: the test accuracy over the run, ``{"x": "virtual_time" | "version" | "rounds",
"points": [[x, accuracy], ...]}`` with x in the budget's unit.

A run is done when the table holds a line with its (cell, arm, seed) and the same config
``digest``: edit a cell's overrides or an arm's keys and exactly those runs run again; the newest
line for a run wins when reporting. A torn last line (the process killed mid-write) is ignored
and its run runs again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "CURVE_X",
    "FIELDS",
    "TABLE_NAME",
    "append_result",
    "curve",
    "health",
    "load_results",
    "run_dir_of",
    "result_record",
]

TABLE_NAME = "results.jsonl"
FIELDS = (
    "cell",  # {axis name: point label}
    "arm",
    "role",
    "strategy",
    "seed",
    "digest",
    "final_accuracy",
    "best_accuracy",
    "final_loss",
    "min_loss",
    "diverged",
    "virtual_time",
    "versions",
    "updates_applied",
    "stalled",
    "wall_time",
    "run_dir",
    "error",  # None, or why the run failed (a failed run is run again on resume)
)
# The metrics.jsonl column a curve's x comes from, per budget unit.
CURVE_X = {"seconds": "virtual_time", "versions": "version", "rounds": "rounds"}


def health(losses: Iterable[float]) -> tuple[float, float, bool]:
    """(final loss, lowest loss, diverged) from a run's test losses in order.

    Diverged: the last loss is not finite, or it is above both twice the run's lowest loss and
    the first (the untrained model's): the run ended worse than where it started and far from
    its best. Overfitting by a few tenths does not count."""
    values = [float(v) for v in losses]
    if not values:
        return math.nan, math.nan, False
    finite = [v for v in values if math.isfinite(v)]
    final = values[-1]
    lowest = min(finite) if finite else math.nan
    if not math.isfinite(final):
        return final, lowest, True
    return final, lowest, final > 2 * lowest and final > values[0]


def curve(metrics: list[dict[str, Any]], unit: str) -> dict[str, Any]:
    """The run's accuracy against the budget's unit, from its metrics.jsonl rows."""
    x = CURVE_X[unit]
    return {"x": x, "points": [[float(m[x]), float(m["test_accuracy"])] for m in metrics]}


def result_record(
    spec,
    summary: dict[str, Any] | None,
    metrics: list[dict[str, Any]],
    error: str | None,
    table_dir: Path,
) -> dict:
    """The table line of one run (``spec`` is a RunSpec; ``summary`` its summary.json,
    ``metrics`` its metrics.jsonl rows). ``run_dir`` is written relative to ``table_dir`` when
    the run is inside it, so the table and its runs can move (or the table be committed)."""
    from aggsrv.sim.config import parse_budget

    final_loss, min_loss, diverged = health([m["test_loss"] for m in metrics])
    s = summary or {}
    return {
        "cell": spec.cell.as_dict(),
        "arm": spec.arm.label,
        "role": spec.arm.role,
        "strategy": spec.arm.strategy,
        "seed": spec.seed,
        "digest": spec.digest(),
        "final_accuracy": s.get("final_accuracy"),
        "best_accuracy": s.get("best_accuracy"),
        "final_loss": None if math.isnan(final_loss) else final_loss,
        "min_loss": None if math.isnan(min_loss) else min_loss,
        "diverged": diverged,
        "virtual_time": s.get("virtual_time"),
        "versions": s.get("versions"),
        "updates_applied": s.get("updates_applied"),
        "stalled": s.get("stalled"),
        "wall_time": s.get("wall_time"),
        "run_dir": _relative(spec.config["out"], table_dir),
        "error": error,
        "curve": curve(metrics, parse_budget(spec.config["budget"]).unit) if metrics else None,
    }


def _relative(run_dir: str, table_dir: Path) -> str:
    try:
        return Path(run_dir).resolve().relative_to(Path(table_dir).resolve()).as_posix()
    except ValueError:  # a run outside the table's folder keeps its path
        return run_dir


def run_dir_of(record: dict[str, Any], table_dir: Path) -> Path:
    """Where a line's run is: a relative ``run_dir`` is inside the table's folder."""
    path = Path(record["run_dir"])
    return path if path.is_absolute() else Path(table_dir) / path


def append_result(out: Path, record: dict[str, Any]) -> None:
    """Append one line and make it durable before the next run starts."""
    missing = [f for f in FIELDS if f not in record]
    if missing:
        raise ValueError(f"a results line needs {missing}")
    out.mkdir(parents=True, exist_ok=True)
    keep = (*FIELDS, "curve")
    line = json.dumps({f: record[f] for f in keep if f in record}, allow_nan=True) + "\n"
    path = out / TABLE_NAME
    with open(path, "ab") as fh:
        # A line torn by a kill has no newline; start on a fresh line so it stays one bad line.
        if fh.tell() > 0:
            with open(path, "rb") as rd:
                rd.seek(-1, os.SEEK_END)
                if rd.read(1) != b"\n":
                    fh.write(b"\n")
        fh.write(line.encode())
        fh.flush()
        os.fsync(fh.fileno())


def load_results(out: Path) -> list[dict[str, Any]]:
    """Every complete line of the table (torn or foreign lines are skipped), oldest first."""
    path = Path(out) / TABLE_NAME
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and all(f in record for f in FIELDS):
            records.append(record)
    return records
