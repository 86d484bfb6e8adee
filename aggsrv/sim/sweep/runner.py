"""Run a sweep: every (cell, arm, seed) not already in the results table, ``jobs`` at a time,
each finished run appended to the table at once (so a sweep killed at any point resumes).

Two phases: the methods and baselines of every cell first; then each ablation in the cells
where its method wins clearly (``margins.verdict``), or everywhere with ``where = "all"``, so the
map says which part of a method earns its margin without paying for ablations where there is
no margin to explain.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from aggsrv.sim.sweep.definition import RunSpec, Sweep
from aggsrv.sim.sweep.margins import summarize
from aggsrv.sim.sweep.table import append_result, load_results, result_record

__all__ = ["pending", "plan", "run_sweep"]


def plan(sweep: Sweep, out: Path, phase: str) -> list[RunSpec]:
    """Every run of a phase ("main": methods and baselines; "ablations"), in grid order."""
    cells = sweep.cells()
    if phase == "main":
        arms = [a for a in sweep.arms if a.role != "ablation"]
        return [sweep.run_spec(c, a, s, out) for c in cells for a in arms for s in sweep.seeds]
    summaries = summarize(sweep, load_results(out), out)
    specs = []
    for summary in summaries:
        for arm in sweep.arms:
            if arm.role != "ablation":
                continue
            margin = summary.margins.get(arm.of)
            if arm.where == "all" or (margin is not None and margin.verdict == "wins"):
                specs += [sweep.run_spec(summary.cell, arm, s, out) for s in sweep.seeds]
    return specs


def pending(specs: list[RunSpec], out: Path) -> list[RunSpec]:
    """The runs the table does not hold yet with the same digest (or that failed)."""

    def key(cell: dict[str, str], arm: str, seed: int, digest: str) -> tuple:
        return (tuple(sorted(cell.items())), arm, seed, digest)

    done = {
        key(r["cell"], r["arm"], r["seed"], r["digest"])
        for r in load_results(out)
        if r["error"] is None
    }
    return [s for s in specs if key(s.cell.as_dict(), s.arm.label, s.seed, s.digest()) not in done]


def _execute(config: dict[str, Any]) -> tuple[dict[str, Any] | None, list[dict], str | None]:
    """Run one simulation: (summary, metrics rows, error). Whatever goes wrong, reading the
    run's output included, becomes the run's error; the sweep goes on."""
    from aggsrv.sim import SimConfig, run

    out = Path(config["out"])
    try:
        # A run not in the table has no result worth keeping: start its directory afresh (a
        # killed or edited run would otherwise append to its old events.jsonl).
        if out.exists():
            shutil.rmtree(out)
        run(SimConfig.from_mapping(config), progress=False)
        summary = json.loads((out / "summary.json").read_text())
        rows = (out / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in rows if line]
    except Exception as exc:  # noqa: BLE001 - a failed run is recorded, the sweep goes on
        return None, [], traceback.format_exception_only(type(exc), exc)[-1].strip()
    return summary, metrics, None


def _worker(config: dict[str, Any]):
    """What the pool runs: ``_execute`` looked up when called, so tests can replace it."""
    return _execute(config)


def _worker_init() -> None:
    """A worker dies with the sweep: Ctrl-C reaches the parent only (it stops the workers),
    and on Linux a worker is killed when its parent dies, so a killed sweep leaves no
    simulation running into a directory the resumed sweep will use."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() == 1:  # the parent died before the line above took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1
WORKER_DIED = "the worker process died (killed, or out of memory) during this run or beside it"


def _describe(spec: RunSpec, record: dict[str, Any]) -> str:
    if record["error"]:
        return f"{spec.cell.key()} | {spec.arm.label} s{spec.seed}: FAILED {record['error']}"
    flag = " DIVERGED" if record["diverged"] else ""
    flag += " STALLED" if record["stalled"] else ""
    return (
        f"{spec.cell.key()} | {spec.arm.label} s{spec.seed}: final "
        f"{record['final_accuracy']:.3f}{flag} ({record['wall_time']:.0f} s)"
    )


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the workers now (not after their runs)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.kill()


def _in_pool(specs: list[RunSpec], jobs: int, finish: Callable) -> None:
    """Run ``specs`` on ``jobs`` workers, submitting only as many as run at once (so stopping
    loses at most ``jobs`` runs). A worker that dies (SIGKILL, the OOM killer) breaks the pool:
    the runs it had in flight are recorded as failed and a new pool takes the rest."""
    queue = list(reversed(specs))
    while queue:
        pool = ProcessPoolExecutor(max_workers=jobs, initializer=_worker_init)
        try:
            running: dict[Future, RunSpec] = {}
            broken = False
            while (queue or running) and not broken:
                while queue and len(running) < jobs and not broken:
                    try:
                        running[pool.submit(_worker, queue[-1].config)] = queue[-1]
                        queue.pop()
                    except BrokenProcessPool:  # broke since the last wait: not this run
                        broken = True
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    spec = running.pop(future)
                    try:
                        outcome = future.result()
                    except BrokenProcessPool:
                        broken = True
                        outcome = (None, [], WORKER_DIED)
                    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
                        outcome = (None, [], f"{type(exc).__name__}: {exc}")
                    finish(spec, outcome)
            if broken:
                for spec in running.values():
                    finish(spec, (None, [], WORKER_DIED))
        except BaseException:
            _stop(pool)
            raise
        pool.shutdown(wait=True)


def _run_phase(
    specs: list[RunSpec], out: Path, jobs: int, log: Callable[[str], None], progress: bool | None
) -> int:
    from tqdm import tqdm

    if not specs:
        return 0
    enabled = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=len(specs), unit="run", disable=not enabled, file=sys.stderr)
    failed = done = 0

    def finish(spec: RunSpec, outcome) -> None:
        nonlocal failed, done
        summary, metrics, error = outcome
        record = result_record(spec, summary, metrics, error, out)
        append_result(out, record)
        failed += error is not None
        done += 1
        bar.update(1)
        log(f"[{done}/{len(specs)}] {_describe(spec, record)}")

    try:
        if jobs <= 1:
            for spec in specs:
                finish(spec, _execute(spec.config))
        else:
            _in_pool(specs, jobs, finish)
    finally:
        bar.close()
    return failed


def run_sweep(
    sweep: Sweep,
    out: Path,
    jobs: int = 1,
    log: Callable[[str], None] = print,
    progress: bool | None = None,
    phases: tuple[str, ...] = ("main", "ablations"),
) -> int:
    """Run what the table lacks; returns the number of runs that failed (recorded as such)."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for phase in phases:
        specs = plan(sweep, out, phase)
        todo = pending(specs, out)
        log(f"{phase}: {len(specs)} runs, {len(specs) - len(todo)} already in the table")
        t0 = time.perf_counter()
        failed += _run_phase(todo, out, jobs, log, progress)
        if todo:
            log(f"{phase}: {len(todo)} runs in {time.perf_counter() - t0:.0f} s")
    return failed
