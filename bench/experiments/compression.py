"""Accuracy of compressed updates against float32, with and without error feedback
(docs/compression.md), at equal virtual time:

    python bench/experiments/compression.py --seeds 0 1 2 --out runs/compression
    python bench/experiments/compression.py --setting bench/experiments/feddgic_dropouts.toml
    python bench/experiments/compression.py --cache --seeds 0 1 2

Each setting (the default scenario of `aggsrv simulate --transport inproc`, or a config file) runs
for every strategy and every compression below, the same seeds for all; the in-process
simulator's clients compress as the Python client does (aggsrv.client.Compression: each
update's values as the server decodes them, the residual carried to the client's next update).
It prints one markdown table per setting: final test accuracy, mean (min-max) over the seeds,
and the bytes the server received against float32.

``--cache`` compares instead the server's row cache (``cache_dtype``) of the strategies that keep
one (float32 updates), and prints the bytes a cached row takes against float32.
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


CACHE_STRATEGIES = ["mifa", "fedogd", "ca2fl", "feddgic"]
CACHE_DTYPES = ["float32", "bfloat16", "int8"]


def one_run(
    setting: str | None,
    strategy: str,
    seed: int,
    compression: dict | None,
    cache_dtype: str | None = None,
) -> dict:
    base = SimConfig.load(setting, {"transport": "inproc", "threads": 1})
    # The setting's client recipe, as `aggsrv sweep` and compare.py take it.
    settings = arm_settings(base, strategy, {})
    if cache_dtype is not None:
        settings["cache_dtype"] = cache_dtype
    config = dataclasses.replace(
        base,
        strategy=strategy,
        strategy_config=settings,
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
    parser.add_argument("--strategies", nargs="+", default=None)
    parser.add_argument("--cache", action="store_true", help="compare the row cache's dtypes")
    args = parser.parse_args()
    if args.cache:
        for setting in args.setting or [None]:
            cache_table(setting, args.seeds, args.strategies or CACHE_STRATEGIES)
        return
    args.strategies = args.strategies or STRATEGIES
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


def cache_table(setting: str | None, seeds: list[int], strategies: list[str]) -> None:
    """One markdown table: final accuracy per strategy and cache dtype, and a row's bytes."""
    name = Path(setting).stem if setting else "default scenario (digits, 8 clients, tiers)"
    t0 = time.time()
    acc: dict[tuple[str, str], list[float]] = {}
    for strategy in strategies:
        for dtype in CACHE_DTYPES:
            for seed in seeds:
                s = one_run(setting, strategy, seed, None, dtype)
                acc.setdefault((strategy, dtype), []).append(s["final_accuracy"])
                print(f"  {name}: {strategy} cache {dtype} seed {seed}: "
                      f"{s['final_accuracy']:.4f}", flush=True)  # fmt: skip
    print(f"\n### {name}: cache_dtype (seeds {', '.join(map(str, seeds))}; "
          f"{time.time() - t0:.0f} s)\n")  # fmt: skip
    print("| strategy | " + " | ".join(CACHE_DTYPES) + " |")
    print("|---" * (len(CACHE_DTYPES) + 1) + "|")
    for strategy in strategies:
        cells = []
        for dtype in CACHE_DTYPES:
            a = acc[(strategy, dtype)]
            cells.append(f"{statistics.mean(a):.3f} ({min(a):.3f}-{max(a):.3f})")
        print(f"| {strategy} | " + " | ".join(cells) + " |")
    print()


if __name__ == "__main__":
    main()
