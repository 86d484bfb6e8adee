"""Accuracy against epsilon for the strategies that serve differential privacy: the table and
plot of docs/privacy.md's experiment.

    python bench/experiments/dp_table.py bench/experiments/dp_fmnist.toml \\
        --seeds 0 1 2 --jobs 2 --out runs/dp

Per method (sync FedAvg, FedBuff, FedAsync: METHODS below, each with the setting's recipe and
clipping norm) and seed:

1. **The clipping-only run** (epsilon = infinity): ``dp_noise_multiplier = 0``. Its trace says
   which client contributed to which published version. The simulator's timing does not depend
   on the model, so every noised run of the same method and seed has the same arrivals.
2. **Calibration.** From that trace, each client's ``S`` (the sum over versions of its
   contributions' count, squared; docs/privacy.md, "The accountant's assumption") and the
   largest, ``S_max``. For each target epsilon, the noise multiplier ``z`` whose Gaussian
   mechanism ``z / sqrt(S_max)`` has exactly that epsilon at ``delta`` (bisection on
   dp-accounting's RDP accountant). The worst-off client then reaches the target at the end of
   the run.
3. **The noised runs,** with that ``z`` and ``dp_target_epsilon`` a hair above the target (a
   guard: a run whose arrivals drifted stops instead of overspending).

Runs go to OUT/<method>-eps<epsilon>-s<seed>; one whose summary.json exists is not run again.
At the end: OUT/table.txt (Markdown: final accuracy, mean ± sd over the seeds; the epsilon
reached; the calibrated z), OUT/results.json and OUT/accuracy_vs_epsilon.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from aggsrv.sim import SimConfig, run
from aggsrv.strategies.dp_accounting import gaussian_epsilon

# Method label -> (strategy, its own keys on top of the setting's). Sync FedAvg samples every
# client in every round and waits for the slowest (a timeout longer than the run). FedBuff's
# server learning rate is the best of 1, 3 and 10 without noise (seed 0: 0.52, 0.62, 0.52).
METHODS = {
    "fedavg": ("fedavg", {"mode": "sync", "participation": 1.0, "round_timeout": 1e6}),
    "fedbuff": ("fedbuff", {"buffer_size": 10, "server_lr": 3.0}),
    "fedasync": ("fedasync", {"alpha": 0.6}),
}
EPSILONS = [1.0, 4.0, 8.0]
DELTA = 1e-5
KEYS = {
    "fedavg": {"mode", "participation", "round_timeout", "min_clients", "min_available"},
    "fedbuff": {"buffer_size", "staleness_weighting", "server_lr"},
    "fedasync": {"alpha", "staleness", "a"},
}


def settings(base: SimConfig, method: str, seed: int, z: float, eps: float | None, out: Path):
    strategy, own = METHODS[method]
    keys = {k: v for k, v in base.strategy_config.items()
            if not any(k in KEYS[m] for m in KEYS if m != strategy)}  # fmt: skip
    keys.update(own, dp_noise_multiplier=z, dp_delta=DELTA)
    if eps is not None:
        keys["dp_target_epsilon"] = eps * (1 + 1e-6)
    data = base.to_dict()
    data.update(strategy=strategy, seed=seed, strategy_config=keys, out=str(out), label=method)
    return SimConfig.from_mapping(data)


def worst_squared_sensitivity(trace: Path) -> float:
    """S_max from a run's trace: each update counts toward the first version published at or
    after its answer (APPLIED: its own; BUFFERED at v: the next one published)."""
    per_version: dict[int, Counter] = defaultdict(Counter)
    published: list[int] = []
    pending: list[tuple[str, int]] = []
    for rec in map(json.loads, trace.read_text().splitlines()):
        if rec["ev"] != "update" or rec["out"] not in ("applied", "buffered"):
            continue
        pending.append((rec["c"], rec["v"]))
        if rec["out"] == "applied":
            published.append(rec["v"])
            for client, _ in pending:
                per_version[rec["v"]][client] += 1
            pending = []
    squared: Counter = Counter()
    for v in published:
        for client, n in per_version[v].items():
            squared[client] += n * n
    return max(squared.values(), default=0.0)


def calibrate(eps: float, squared: float, delta: float = DELTA) -> float:
    """The noise multiplier z with epsilon(z / sqrt(squared)) = eps (bisection)."""
    lo, hi = 1e-3, 1e4
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if gaussian_epsilon(mid, squared, delta) > eps:
            lo = mid
        else:
            hi = mid
    return hi


def _run(config: SimConfig) -> dict:
    summary_path = Path(config.out) / "summary.json"
    if not summary_path.is_file():
        run(config, progress=False)
    return json.loads(summary_path.read_text())


def run_all(base: SimConfig, seeds: list[int], jobs: int, out: Path) -> list[dict]:
    rows = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        pilots = {
            pool.submit(_run, settings(base, m, s, 0.0, None, out / f"{m}-epsinf-s{s}")): (m, s)
            for m in METHODS for s in seeds
        }  # fmt: skip
        noised = {}
        for done in as_completed(pilots):
            method, seed = pilots[done]
            summary = done.result()
            squared = worst_squared_sensitivity(out / f"{method}-epsinf-s{seed}" / "trace.jsonl")
            rows.append({"method": method, "seed": seed, "epsilon_target": math.inf, "z": 0.0,
                         "squared_max": squared, **_fields(summary)})  # fmt: skip
            print(f"{method} s{seed} clipping only: {summary['final_accuracy']:.4f} "
                  f"(S_max {squared:g})", flush=True)  # fmt: skip
            for eps in EPSILONS:
                z = calibrate(eps, squared)
                path = out / f"{method}-eps{eps:g}-s{seed}"
                job = pool.submit(_run, settings(base, method, seed, z, eps, path))
                noised[job] = (method, seed, eps, z, squared)
        for done in as_completed(noised):
            method, seed, eps, z, squared = noised[done]
            summary = done.result()
            rows.append({"method": method, "seed": seed, "epsilon_target": eps, "z": z,
                         "squared_max": squared, **_fields(summary)})  # fmt: skip
            print(f"{method} s{seed} eps {eps:g} (z {z:.3g}): {summary['final_accuracy']:.4f}, "
                  f"epsilon {summary['privacy']['epsilon']:.4g}", flush=True)  # fmt: skip
    return rows


def _fields(summary: dict) -> dict:
    privacy = summary["privacy"] or {}
    return {
        "final_accuracy": summary["final_accuracy"],
        "epsilon": privacy.get("epsilon"),
        "releases": privacy.get("releases"),
        "versions": summary["versions"],
        "stopped_by_budget": summary["privacy_spent"],
        "virtual_time": summary["virtual_time"],
    }


def _mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def table(rows: list[dict]) -> str:
    columns = [*EPSILONS, math.inf]
    head = "| method | " + " | ".join(f"ε = {e:g}".replace("inf", "∞") for e in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    for method in METHODS:
        cells = []
        for eps in columns:
            mine = [r for r in rows if r["method"] == method and r["epsilon_target"] == eps]
            if not mine:
                cells.append("-")
                continue
            acc = _mean_sd([r["final_accuracy"] for r in mine])
            if eps == math.inf:
                cells.append(f"{acc} (clipping only)")
            else:
                z = statistics.fmean(r["z"] for r in mine)
                reached = max(r["epsilon"] for r in mine)
                cells.append(f"{acc} (z {z:.2g}, ε reached ≤ {reached:.3g})")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| method | releases (versions) | S_max (worst client's sum of squared "
                 "contributions per version) |")  # fmt: skip
    lines.append("|---|---|---|")
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method and r["epsilon_target"] == math.inf]
        if mine:
            rel = statistics.fmean(r["versions"] for r in mine)
            sq = statistics.fmean(r["squared_max"] for r in mine)
            lines.append(f"| {method} | {rel:.0f} | {sq:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [*EPSILONS, 16.0]  # infinity drawn at 16, labelled
    for method in METHODS:
        means, sds = [], []
        for eps in [*EPSILONS, math.inf]:
            acc = [r["final_accuracy"] for r in rows
                   if r["method"] == method and r["epsilon_target"] == eps]  # fmt: skip
            means.append(statistics.fmean(acc) if acc else math.nan)
            sds.append(statistics.stdev(acc) if len(acc) > 1 else 0.0)
        ax.errorbar(xs, means, yerr=sds, marker="o", capsize=3, label=method)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{e:g}" for e in EPSILONS] + ["∞"])
    ax.set_xlabel(f"ε (δ = {DELTA:g}), worst-off client")
    ax.set_ylabel("final test accuracy")
    ax.set_title("Fashion-MNIST, 100 clients, tiered stragglers, 120 virtual s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = SimConfig.load(args.config, {"threads": 1})
    rows = run_all(base, args.seeds, args.jobs, out)
    # JSON has no infinity: the clipping-only runs' target and epsilon are null.
    plain = [{k: None if isinstance(v, float) and math.isinf(v) else v for k, v in r.items()}
             for r in rows]  # fmt: skip
    (out / "results.json").write_text(json.dumps(plain, indent=1))
    text = table(rows)
    (out / "table.txt").write_text(text)
    plot(rows, out / "accuracy_vs_epsilon.png")
    print(text + f"\nplot: {out / 'accuracy_vs_epsilon.png'}")


if __name__ == "__main__":
    main()
