"""`aggsrv.sim.run(config) -> Result`: one simulation, either transport, with its output files."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aggsrv.sim.config import SimConfig
from aggsrv.sim.output import RunOutput, provenance
from aggsrv.sim.progress import Progress
from aggsrv.sim.setup import prepare

__all__ = ["Result", "run"]

log = logging.getLogger(__name__)


@dataclass
class Result:
    """What a run produced: its metric rows, its summary and where its files are."""

    config: SimConfig
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    out_dir: Path

    @property
    def final_accuracy(self) -> float:
        return self.summary["final_accuracy"]


def run(
    config: SimConfig | dict[str, Any],
    *,
    progress: bool | None = None,
    out_dir: str | Path | None = None,
) -> Result:
    """Run one simulation and write its directory (config.toml, metrics.jsonl, summary.json,
    accuracy.png). ``progress``: draw the bar (default: when stderr is a terminal)."""
    if not isinstance(config, SimConfig):
        config = SimConfig.from_mapping(dict(config))
    wall0 = time.perf_counter()
    setup = prepare(config)
    log.info(
        "%s on %s: %d clients, partition %s\n%s",
        config.strategy, config.dataset, config.clients, config.partition, setup.partition_table,
    )  # fmt: skip
    output = RunOutput(config, Path(out_dir) if out_dir else None)
    for old in output.dir.glob("trace.jsonl*"):  # a run written again records afresh
        old.unlink()
    bar = Progress(config.budget_spec(), f"{config.strategy}/{config.transport}", progress)
    try:
        if config.transport == "inproc":
            from aggsrv.sim.inproc import InprocRun

            engine = InprocRun(
                setup, output.metric, bar, on_event=output.event,
                trace=output.dir / "trace.jsonl",
            )  # fmt: skip
        else:
            from aggsrv.sim.grpc_transport import GrpcRun

            engine = GrpcRun(setup, output.metric, bar, output.dir)
        metrics = engine.run()
    finally:
        bar.close()
        output.close()
    wall = time.perf_counter() - wall0
    summary = _summary(config, setup, engine, metrics, wall)
    output.finish(summary, metrics)
    return Result(config, metrics, summary, output.dir)


def _summary(config: SimConfig, setup, engine, metrics, wall: float) -> dict[str, Any]:
    c = engine.counters
    accs = [m["test_accuracy"] for m in metrics]
    run_wall = metrics[-1]["wall_time"] if metrics else 0.0
    busy = c.train_seconds + c.eval_seconds
    return {
        "strategy": config.strategy,
        "dataset": config.dataset,
        "model": config.model,
        "partition": config.partition,
        "scenario": config.scenario_label(),
        "label": config.label or config.strategy,
        "transport": config.transport,
        "clients": config.clients,
        "seed": config.seed,
        "budget": config.budget,
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "final_loss": metrics[-1]["test_loss"] if metrics else None,
        "versions": metrics[-1]["version"] if metrics else 0,
        "updates_applied": c.applied,
        "updates_rejected": c.rejected,
        "updates_filtered": c.filtered,
        "rejected_by": dict(c.rejected_by),
        "updates_lost_to_dropouts": c.lost,
        "bytes_received": c.bytes_received,
        "virtual_time": metrics[-1]["virtual_time"] if metrics else 0.0,
        "wall_time": wall,
        "run_wall_time": run_wall,
        "train_seconds": c.train_seconds,
        "eval_seconds": c.eval_seconds,
        # Share of the run's wall time spent outside local training and evaluation (inproc:
        # the simulator's own overhead; grpc: transport and waiting included).
        "overhead_share": max(0.0, 1.0 - busy / run_wall) if run_wall > 0 else None,
        "updates_per_second": c.applied / run_wall if run_wall > 0 else None,
        "stalled": getattr(engine, "stalled", False),
        # Differential privacy's spending (None without it); privacy_spent: the budget
        # (dp_target_epsilon) ended the run before its own budget.
        "privacy": engine.privacy_now(),
        "privacy_spent": getattr(engine, "privacy_spent", False),
        "num_parameters": setup.layout.numel,
        "profile": setup.profile.describe(),
        "client_sizes": [s["size"] for s in setup.partition_summary],
        # The attack, its attackers and their crafted updates (None: every client honest).
        "attack": (
            setup.attack.summary(c.crafted_sent, c.crafted_accepted) if setup.attack else None
        ),
        "provenance": provenance(),
    }
