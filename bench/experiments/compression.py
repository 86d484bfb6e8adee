"""Accuracy of compressed updates against float32, with and without error feedback
(docs/compression.md), at equal virtual time:

    python bench/experiments/compression.py --seeds 0 1 2 --out runs/compression
    python bench/experiments/compression.py --setting bench/experiments/feddgic_dropouts.toml

Each setting (the default scenario of `aggsrv simulate --transport inproc`, or a config file) runs
for every strategy and every compression below, the same seeds for all; the in-process
simulator's clients compress as the Python client does (aggsrv.client.Compression: each
update's values as the server decodes them, the residual carried to the client's next update).
It prints one markdown table per setting: final test accuracy, mean (min-max) over the seeds,
and the bytes the server received against float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from aggsrv.sim import SimConfig, run
from aggsrv.sim.sweep.definition import arm_settings

STRATEGIES = ["fedavg", "fedbuff", "fedasync", "mifa"]
COMPRESSIONS: dict[str, dict | None] = {
    "float32": None,
    "int8 + EF": {"quantization": "int8"},
    "int8, no EF": {"quantization": "int8", "error_feedback": False},
    "int4 + EF": {"quantization": "int4"},
    "int4, no EF": {"quantization": "int4", "error_feedback": False},
    "top 10 % int8 + EF": {"quantization": "int8", "top_k": 0.1},
}


def one_run(setting: str | None, strategy: str, seed: int, compression: dict | None) -> dict:
    base = SimConfig.load(setting, {"transport": "inproc", "threads": 1})
    config = dataclasses.replace(
        base,
        strategy=strategy,
        # The setting's client recipe, as `aggsrv sweep` and compare.py take it.
        strategy_config=arm_settings(base, strategy, {}),
        seed=seed,
        compression=compression,
    )
    with tempfile.TemporaryDirectory() as out:
        return run(SimConfig.from_mapping(config.to_dict()), progress=False, out_dir=out).summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--setting", action="append", default=None,
        help="a config TOML (repeatable); default: the default scenario",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES)
    args = parser.parse_args()
    for setting in args.setting or [None]:
        name = Path(setting).stem if setting else "default scenario (digits, 8 clients, tiers)"
        rows: dict[tuple[str, str], list[dict]] = {}
        t0 = time.time()
        for strategy in args.strategies:
            for label, compression in COMPRESSIONS.items():
                for seed in args.seeds:
                    s = one_run(setting, strategy, seed, compression)
                    rows.setdefault((strategy, label), []).append(s)
                    print(f"  {name}: {strategy} {label} seed {seed}: "
                          f"{s['final_accuracy']:.4f}", flush=True)  # fmt: skip
        print(f"\n### {name} (seeds {', '.join(map(str, args.seeds))}; {time.time() - t0:.0f} s)\n")
        print("| strategy | " + " | ".join(COMPRESSIONS) + " |")
        print("|---" * (len(COMPRESSIONS) + 1) + "|")
        for strategy in args.strategies:
            base = rows[(strategy, "float32")]
            base_bytes = statistics.mean(s["bytes_received"] / s["updates_applied"] for s in base)
            cells = []
            for label in COMPRESSIONS:
                acc = [s["final_accuracy"] for s in rows[(strategy, label)]]
                per = statistics.mean(
                    s["bytes_received"] / s["updates_applied"] for s in rows[(strategy, label)]
                )
                cells.append(f"{statistics.mean(acc):.3f} ({min(acc):.3f}-{max(acc):.3f}), "
                             f"{per / base_bytes:.3f}x")  # fmt: skip
            print(f"| {strategy} | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main()
