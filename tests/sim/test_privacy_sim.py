"""Differential privacy in the simulator: the budget ends a run, epsilon is in every metrics row
and the summary, it matches what the run's own trace says was released (recomputed here with
dp-accounting), a run's noise repeats with its seed, and the grpc transport stops alike."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from aggsrv.sim.config import SimConfig
from aggsrv.sim.runner import run

dpa = pytest.importorskip("dp_accounting", reason="the dp extra (pip install 'aggsrv[dp]')")

KEYS = {"buffer_size": 3, "dp_clip_norm": 1.0, "dp_noise_multiplier": 3.0,
        "dp_target_epsilon": 8.0, "dp_accountant": "rdp"}  # fmt: skip


def _run(tmp_path: Path, name: str, transport: str = "inproc", **extra) -> tuple[dict, list]:
    config = {"strategy": "fedbuff", "dataset": "digits", "clients": 6, "model": "mlp",
              "profile": "tiers", "budget": "40s", "eval_every": "3s", "transport": transport,
              "seed": 2, "strategy_config": KEYS, "out": str(tmp_path / name), **extra}  # fmt: skip
    out = run(SimConfig.from_mapping(config), progress=False).out_dir
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics, out


def _released_epsilon(trace: Path, z: float, delta: float) -> tuple[float, int]:
    """From the trace alone: each update counts toward the first version published at or
    after its answer (APPLIED: its own; BUFFERED at v: v + 1); per client and version the
    contributions add, a client's releases compose, and the worst client's epsilon is the
    run's. Returns (epsilon, releases)."""
    per_version: dict[int, Counter] = defaultdict(Counter)
    published = set()
    for rec in map(json.loads, trace.read_text().splitlines()):
        if rec["ev"] != "update":
            continue
        if rec["out"] == "applied":
            per_version[rec["v"]][rec["c"]] += 1
            published.add(rec["v"])
        elif rec["out"] == "buffered":
            per_version[rec["v"] + 1][rec["c"]] += 1
    events: dict[str, list[float]] = defaultdict(list)
    for v in sorted(published):
        for client, n in per_version[v].items():
            events[client].append(z / n)
    worst = 0.0
    for multipliers in events.values():
        acc = dpa.rdp.RdpAccountant()
        for m in multipliers:
            acc.compose(dpa.GaussianDpEvent(m))
        worst = max(worst, acc.get_epsilon(delta))
    return worst, len(published)


def test_the_budget_ends_an_inproc_run_and_epsilon_matches_its_trace(tmp_path: Path) -> None:
    summary, metrics, out = _run(tmp_path, "a")
    privacy = summary["privacy"]
    assert summary["privacy_spent"] and privacy["budget_spent"]
    assert summary["virtual_time"] < 40.0  # ended by the budget, not the clock
    assert 0 < privacy["epsilon"] <= KEYS["dp_target_epsilon"]
    eps, releases = _released_epsilon(out / "trace.jsonl", 3.0, 1e-5)
    assert privacy["releases"] == releases == summary["versions"]
    assert privacy["epsilon"] == pytest.approx(eps, rel=1e-9)
    curve = [m["epsilon"] for m in metrics]
    assert curve == sorted(curve) and curve[0] == 0.0 and curve[-1] == privacy["epsilon"]
    # The same seed draws the same noise: the same model, so the same accuracy curve.
    again, again_metrics, _ = _run(tmp_path, "b")
    assert [m["test_accuracy"] for m in again_metrics] == [m["test_accuracy"] for m in metrics]


def test_the_budget_ends_a_grpc_run_too(tmp_path: Path) -> None:
    summary, metrics, out = _run(tmp_path, "g", transport="grpc")
    privacy = summary["privacy"]
    assert summary["privacy_spent"] and privacy["budget_spent"]
    assert 0 < privacy["epsilon"] <= KEYS["dp_target_epsilon"]
    eps, releases = _released_epsilon(out / "trace.jsonl", 3.0, 1e-5)
    assert privacy["releases"] == releases
    assert privacy["epsilon"] == pytest.approx(eps, rel=1e-9)
    assert all("epsilon" in m for m in metrics)
