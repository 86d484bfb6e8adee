"""Sweeps: one experiment setting run over a grid of its axes (heterogeneity, stragglers,
scale), every method against its baselines in every cell over several seeds, reported as one
heat map per method of its margin over the best baseline (`aggsrv sweep`, docs/sweeps.md).

``definition`` reads a sweep file and expands the grid; ``table`` is the results file that
makes a sweep resumable; ``runner`` runs what the table lacks; ``margins`` turns the table into
per-cell margins and verdicts; ``report`` writes the Markdown and the heat maps.
"""

from aggsrv.sim.sweep.definition import (
    Arm,
    Axis,
    Cell,
    RunSpec,
    Sweep,
    check_sweep,
    load_sweep,
)
from aggsrv.sim.sweep.margins import summarize
from aggsrv.sim.sweep.report import report_sweep
from aggsrv.sim.sweep.runner import pending, plan, run_sweep
from aggsrv.sim.sweep.table import load_results

__all__ = [
    "Arm",
    "Axis",
    "Cell",
    "RunSpec",
    "Sweep",
    "check_sweep",
    "load_results",
    "load_sweep",
    "pending",
    "plan",
    "report_sweep",
    "run_sweep",
    "summarize",
]
