"""Every robust aggregator against every attack, over several seeds: the literature's table.

    python bench/experiments/robust_table.py bench/experiments/robust_fmnist.toml \\
        --seeds 0 1 2 --jobs 2 --out runs/robust

Each run is the setting (data, split, model, clients, budget, recipe) with one aggregator (the
strategy's ``aggregator`` key, docs/robust.md) and one attack (the simulator's ``attack`` key,
or none). Runs go to OUT/<aggregator>__<attack>-s<seed> (a run whose summary.json exists is
not run again, so an interrupted table resumes); at the end the script writes OUT/table.txt
(Markdown: final accuracy, mean ± sd over the seeds, and the virtual time to ``--target``) and
OUT/table.png (a heat map of the final accuracy: aggregators down, attacks across), and prints
the table.

The grids are below: the aggregators for the strategies that combine rows, the update filters
for those that apply one update at a time (FedAsync, ORTHOFL, FedDGIC, Fed-OGD); f, the
Byzantine rows a rule assumes, is 20 % of the clients, or of the buffer rounded up for a
buffered strategy. ``--aggregators`` / ``--attacks`` pick a subset by label; ``--attacks`` also
takes the stronger ALIE variants of EXTRA_ATTACKS, which the default grid leaves out.
``--jobs N`` runs N simulations at once, each on one thread (``threads = 1``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from aggsrv.sim import SimConfig, run
from aggsrv.strategies import strategy_class

# (label, aggregator spec): f is the setting's Byzantine count (20 % of 25 clients = 5); the
# rules that need it get it, the others do not assume it.
AGGREGATORS = [
    ("mean", "mean"),
    ("median", "median"),
    ("trimmed_mean", "trimmed_mean:trim=0.2"),
    ("krum", "krum:f={f}"),
    ("multi_krum", "multi_krum:f={f}"),
    ("bulyan", "bulyan:f={f}"),
    ("geometric_median", "geometric_median"),
    ("centered_clipping", "centered_clipping"),
]
# Strategies that apply one update at a time take per-update filters instead (docs/robust.md,
# "Asynchronous strategies"): (label, update_filter spec or None).
FILTERS = [
    ("none", None),
    ("norm", "norm:factor=3"),
    ("centered_clip", "centered_clip"),
    ("norm>centered_clip", "norm:factor=3 > centered_clip"),
]
# (label, attack spec or None). The fraction comes from the setting.
ATTACKS = [
    ("none", None),
    # Scale 10: five clients at -10x their honest delta outweigh twenty honest ones in a mean.
    ("sign_flip", "sign_flip:scale=10"),
    ("gaussian", "gaussian"),
    ("scale", "scale:factor=10"),
    ("alie", "alie"),
    ("ipm", "ipm:eps=0.1"),
    ("label_flip", "label_flip"),
]
# Stronger forms of ALIE, run only when named in --attacks: the attackers see every client's
# honest delta (view=all, the paper's threat model), with the paper's z_max or a larger z.
EXTRA_ATTACKS = [
    ("alie_all", "alie:view=all"),
    ("alie_all_z1", "alie:view=all,z=1.0"),
    ("alie_all_z2", "alie:view=all,z=2.0"),
]


def _one(config: dict) -> tuple[str, float, float]:
    cfg = SimConfig.from_mapping(config)
    t0 = time.perf_counter()
    result = run(cfg, progress=False)
    return str(cfg.out), float(result.final_accuracy), time.perf_counter() - t0


def byzantine_rows(base: SimConfig, fraction: float) -> int:
    """The f the rules assume: the Byzantine clients among all (one row each per round), or,
    for a buffer of M arrivals, the expected count in a buffer rounded up."""
    buffer = base.strategy_config.get("buffer_size")
    if buffer is not None:
        return math.ceil(fraction * buffer)
    return round(fraction * base.clients)


def defence_key(base: SimConfig) -> str:
    """The strategy's key for the defence: `update_filter` for the one-at-a-time strategies."""
    known = {f.name for f in dataclasses.fields(strategy_class(base.strategy).config_class)}
    return "update_filter" if "update_filter" in known else "aggregator"


def plan(base: SimConfig, seeds: list[int], defences, attacks, fraction: float, out: Path):
    """The run configs of the grid (as mappings), skipping runs already finished."""
    f = byzantine_rows(base, fraction)
    key = defence_key(base)
    configs = []
    for a_label, a_spec in defences:
        for k_label, k_spec in attacks:
            for seed in seeds:
                run_dir = out / f"{a_label}__{k_label}-s{seed}"
                if (run_dir / "summary.json").exists():
                    continue
                cfg = base.to_dict()
                own = {} if a_spec is None else {key: a_spec.format(f=f)}
                cfg["strategy_config"] = {**base.strategy_config, **own}
                sep = "," if k_spec and ":" in k_spec else ":"
                cfg["attack"] = None if k_spec is None else f"{k_spec}{sep}fraction={fraction}"
                cfg.update(seed=seed, out=str(run_dir), label=a_label, scenario=k_label,
                           threads=1)  # fmt: skip
                configs.append(cfg)
    return configs


def collect(out: Path, target: float) -> dict[tuple[str, str], list[dict]]:
    """(aggregator, attack) -> the finished runs' summaries with their time to target."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for summary in sorted(out.glob("*__*-s*/summary.json")):
        name = summary.parent.name
        a_label, _, rest = name.partition("__")
        k_label = rest.rpartition("-s")[0]
        data = json.loads(summary.read_text())
        reached = None
        metrics = summary.parent / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                row = json.loads(line)
                if row["test_accuracy"] >= target:
                    reached = row["virtual_time"]
                    break
        data["time_to_target"] = reached
        cells.setdefault((a_label, k_label), []).append(data)
    return cells


def _cell(runs: list[dict]) -> str:
    accs = [float(r["final_accuracy"]) for r in runs]
    sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
    # A run whose every late update was refused (a diverged model) ended before its budget.
    stalled = sum(bool(r.get("stalled")) for r in runs)
    note = f" ({stalled} stalled)" if stalled else ""
    return f"{statistics.mean(accs):.3f} ± {sd:.3f}{note}"


def table(cells, aggregators, attacks, target: float) -> str:
    """Markdown: final accuracy (mean ± sd), then the time to target (mean over the seeds that
    reached it, and how many did)."""
    a_labels = [a for a, _ in aggregators if any((a, k) in cells for k, _ in attacks)]
    k_labels = [k for k, _ in attacks if any((a, k) in cells for a, _ in aggregators)]
    lines = ["| aggregator | " + " | ".join(k_labels) + " |"]
    lines.append("|---" * (len(k_labels) + 1) + "|")
    for a in a_labels:
        row = [_cell(cells[(a, k)]) if (a, k) in cells else "-" for k in k_labels]
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    lines += ["", f"Virtual time to accuracy {target} (seeds that reached it):", ""]
    lines.append("| aggregator | " + " | ".join(k_labels) + " |")
    lines.append("|---" * (len(k_labels) + 1) + "|")
    for a in a_labels:
        row = []
        for k in k_labels:
            runs = cells.get((a, k), [])
            hit = [r["time_to_target"] for r in runs if r["time_to_target"] is not None]
            row.append(f"{statistics.mean(hit):.0f} ({len(hit)}/{len(runs)})" if hit else "-")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def heat_map(cells, aggregators, attacks, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    a_labels = [a for a, _ in aggregators if any((a, k) in cells for k, _ in attacks)]
    k_labels = [k for k, _ in attacks if any((a, k) in cells for a, _ in aggregators)]
    grid = np.full((len(a_labels), len(k_labels)), math.nan)
    for i, a in enumerate(a_labels):
        for j, k in enumerate(k_labels):
            if (a, k) in cells:
                grid[i, j] = statistics.mean(float(r["final_accuracy"]) for r in cells[(a, k)])
    fig, ax = plt.subplots(figsize=(1.3 * len(k_labels) + 2.5, 0.5 * len(a_labels) + 1.5))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(k_labels)), k_labels, rotation=30, ha="right")
    ax.set_yticks(range(len(a_labels)), a_labels)
    for i in range(len(a_labels)):
        for j in range(len(k_labels)):
            if not math.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center",
                        color="white" if grid[i, j] < 0.6 else "black", fontsize=8)  # fmt: skip
    fig.colorbar(im, ax=ax, label="final test accuracy")
    ax.set_title("final accuracy: aggregator x attack (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pick(grid, labels):
    if not labels:
        return grid
    known = {label for label, _ in grid}
    unknown = [label for label in labels if label not in known]
    if unknown:
        raise SystemExit(f"unknown labels {unknown}; known: {sorted(known)}")
    return [item for item in grid if item[0] in labels]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the setting: bench/experiments/robust_*.toml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--aggregators", nargs="*", help="defence labels (default: all)")
    parser.add_argument("--attacks", nargs="*", help="labels (default: all)")
    parser.add_argument("--fraction", type=float, default=0.2, help="Byzantine clients")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    base = SimConfig.load(Path(args.config))
    grid = FILTERS if defence_key(base) == "update_filter" else AGGREGATORS
    aggregators = _pick(grid, args.aggregators)
    attacks = (
        _pick(ATTACKS, args.attacks)
        if not args.attacks
        else _pick(ATTACKS + EXTRA_ATTACKS, args.attacks)
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = plan(base, args.seeds, aggregators, attacks, args.fraction, out)
    print(f"{len(configs)} runs to do in {out}", flush=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(_one, cfg) for cfg in configs]
        for i, fut in enumerate(as_completed(futures), 1):
            path, acc, wall = fut.result()
            print(f"[{i}/{len(configs)}] {Path(path).name}: final {acc:.3f} ({wall:.0f} s; "
                  f"{time.perf_counter() - t0:.0f} s in all)", flush=True)  # fmt: skip
    cells = collect(out, args.target)
    text = table(cells, aggregators, attacks, args.target)
    (out / "table.txt").write_text(text + "\n")
    heat_map(cells, aggregators, attacks, out / "table.png")
    print(text)
    print(f"\nwritten: {out / 'table.txt'}, {out / 'table.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
