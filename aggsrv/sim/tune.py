"""``aggsrv tune``: try strategy settings on the timing of real clients before changing them in
production.

A recorded trace (``aggsrv serve --trace``) becomes the straggler profile of a sweep
(``trace:file=FILE``): as many simulated clients as the trace holds, a budget of the recorded
span, on the virtual clock. Its arms are the current setting (the baseline: the strategy with the
setting's keys) and one arm per point of the grid (the strategy with the point's keys on top),
each over the seeds. ``aggsrv.sim.tune_report`` then tabulates each setting's final accuracy,
its margin over the current setting, and the replayed runs' versions, arrivals and staleness.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aggsrv.sim.config import SimConfig
from aggsrv.sim.profiles.trace_replay import client_timelines
from aggsrv.sim.sweep import Arm, Sweep, check_sweep
from aggsrv.trace_format import read_trace

CURRENT = "current"


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["buffer_size=5,10,20", "eta=0.5,1"]`` -> ``{"buffer_size": [5, 10, 20], ...}``."""
    from aggsrv.sim.profiles.spec import _value

    grid: dict[str, list[Any]] = {}
    for item in items:
        key, eq, values = item.partition("=")
        key = key.strip().removeprefix("strategy_config.")
        if not eq or not key or not values.strip():
            raise ValueError(f"--grid needs KEY=V1,V2,..., got {item!r}")
        if key in grid:
            raise ValueError(f"--grid {key} given twice")
        grid[key] = [_value(v) for v in values.split(",")]
    if not grid:
        raise ValueError("--grid KEY=V1,V2,... is needed (the settings to try)")
    return grid


def _label(point: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())


def tune_sweep(
    trace: str | Path,
    strategy: str,
    grid: Mapping[str, Sequence[Any]],
    seeds: Sequence[int],
    base: SimConfig | None = None,
    scale: float = 1.0,
    budget: str | None = None,
) -> Sweep:
    """The sweep that replays ``trace`` under the current setting and every grid point."""
    path = Path(trace).resolve()
    recorded = read_trace(path)
    timelines = client_timelines(recorded, gone_after=3.0)
    if not timelines:
        raise ValueError(f"{path} holds no job that a client completed: nothing to replay")
    span = max(u.received for u in recorded.updates) - recorded.start
    setting = (base or SimConfig()).to_dict()
    setting.update(
        strategy=strategy,
        profile=f"trace:file={path},scale={scale}",
        clients=len(timelines),
        budget=budget or f"{max(span * scale, 1e-3):.6g}s",
        transport="inproc",
    )
    base_config = SimConfig.from_mapping(setting)
    keys = list(grid)
    arms = [Arm(label=CURRENT, strategy=strategy, role="baseline")]
    for values in itertools.product(*(grid[k] for k in keys)):
        point = dict(zip(keys, values, strict=True))
        arms.append(Arm(label=_label(point), strategy=strategy, role="method", config=point))
    sweep = Sweep(
        path=path,
        base=base_config,
        seeds=list(seeds),
        axes=[],
        arms=arms,
        description=(
            f"{strategy} on the replayed timing of {len(timelines)} recorded clients "
            f"({path.name}, {span:.1f} s recorded, scale {scale}): each setting's margin over "
            "the current one."
        ),
    )
    check_sweep(sweep)
    return sweep
