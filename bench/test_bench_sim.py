"""Simulator benchmarks: its own overhead, and grpc against inproc accuracy.

Run: `pytest bench/test_bench_sim.py --benchmark-only -s` (about 2.5 minutes; needs the sim
extra and the Debian package dataset-fashion-mnist).

- `test_bench_sim_overhead`: `inproc`, 50 clients of an MLP on Fashion-MNIST (IID, tiered
  stragglers, fedasync) for 30 virtual seconds: the share of the run's wall time spent outside
  local training and evaluation (target under 10%), and updates per second.
- `test_bench_grpc_vs_inproc`: the README's default run (digits, 8 clients, tiers, fedasync,
  60 virtual seconds) over `grpc` and `inproc` for seeds 0, 1, 2: mean final test accuracy of
  each (target: within 3 points).
"""

from __future__ import annotations

import statistics
import tempfile

from conftest import emit

from aggsrv.sim import run


def test_bench_sim_overhead(benchmark) -> None:
    config = {
        "transport": "inproc",
        "dataset": "fashion_mnist",
        "clients": 50,
        "model": "mlp",
        "partition": "iid",
        "profile": "tiers",
        "budget": "30s",
        "strategy_config": {"learning_rate": 0.05},
    }
    with tempfile.TemporaryDirectory() as tmp:
        result = benchmark.pedantic(
            lambda: run({**config, "out": tmp}, progress=False), rounds=1, iterations=1
        )
    s = result.summary
    share = s["overhead_share"]
    ok = share < 0.10
    line = (
        f"sim overhead inproc fashion_mnist mlp 50 clients 30 virtual s: "
        f"{s['updates_applied']} updates in {s['run_wall_time']:.2f} s "
        f"({s['updates_per_second']:.0f} updates/s); training {s['train_seconds']:.2f} s, "
        f"evaluation {s['eval_seconds']:.2f} s, outside both {share:.1%} "
        f"[<10% {'ok' if ok else 'MISSED'}]; final accuracy {s['final_accuracy']:.3f}; "
        f"setup (data, split, model) {s['wall_time'] - s['run_wall_time']:.2f} s"
    )
    emit(benchmark, line, {**{k: s[k] for k in (
        "updates_applied", "run_wall_time", "train_seconds", "eval_seconds", "overhead_share",
        "updates_per_second", "final_accuracy", "wall_time")}, "targets_met": ok})  # fmt: skip


def test_bench_grpc_vs_inproc(benchmark) -> None:
    seeds = (0, 1, 2)
    finals: dict[str, list[float]] = {"inproc": [], "grpc": []}
    walls: dict[str, list[float]] = {"inproc": [], "grpc": []}

    def runs() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            for transport in ("inproc", "grpc"):
                for seed in seeds:
                    r = run(
                        {"transport": transport, "seed": seed, "out": f"{tmp}/{transport}{seed}"},
                        progress=False,
                    )
                    finals[transport].append(r.final_accuracy)
                    walls[transport].append(r.summary["wall_time"])

    benchmark.pedantic(runs, rounds=1, iterations=1)
    mean = {t: statistics.fmean(v) for t, v in finals.items()}
    gap = abs(mean["grpc"] - mean["inproc"])
    ok = gap <= 0.03
    line = (
        "grpc vs inproc, default run (digits, 8 clients, tiers, fedasync, 60 vs), seeds 0-2: "
        f"final accuracy inproc {mean['inproc']:.3f} {[round(a, 3) for a in finals['inproc']]} "
        f"grpc {mean['grpc']:.3f} {[round(a, 3) for a in finals['grpc']]} -> gap "
        f"{gap * 100:.1f} points [<=3 {'ok' if ok else 'MISSED'}]; wall per run inproc "
        f"{statistics.fmean(walls['inproc']):.1f} s, grpc {statistics.fmean(walls['grpc']):.1f} s"
    )
    emit(benchmark, line, {"finals": finals, "walls": walls, "gap": gap, "targets_met": ok})
