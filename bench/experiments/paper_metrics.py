"""FedDGIC's relative metrics (docs/algorithms/feddgic.md 2.4) from finished runs, so our figures
can be set beside the paper's Tables II-V, which report only ratios against each baseline:

* Improvement Ratio on Accuracy ``IR_acc = mean_e (A_m(e) - A_b(e)) / A_b(e)``,
* Reduction Ratio on Loss ``RR_loss = mean_e (L_b(e) - L_m(e)) / L_b(e)``, over every
  evaluation e the runs share (same virtual times), averaged over the seeds both ran;
* Speed-up ``S = (E_b - E_m) / E_b`` with E the first evaluation time reaching the target
  (the spec's decision: 0.95 x the weakest method's final accuracy), mean over seeds.

    python bench/experiments/paper_metrics.py RUNS_DIR --method feddgic

RUNS_DIR holds the run directories of one setting (compare.py's --out); labels are the runs'
``label`` (compare.py sets it).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from aggsrv.sim.report import Run, find_runs, time_to_target


def _by_label(runs: list[Run]) -> dict[str, dict[int, Run]]:
    out: dict[str, dict[int, Run]] = defaultdict(dict)
    for r in runs:
        out[r.summary.get("label") or r.summary["strategy"]][int(r.summary["seed"])] = r
    return dict(out)


def _ratios(method: Run, base: Run) -> tuple[float, float]:
    """(IR_acc, RR_loss) over the evaluations at the virtual times both runs have."""
    mine = {round(m["virtual_time"], 6): m for m in method.metrics}
    ir, rr = [], []
    for b in base.metrics:
        m = mine.get(round(b["virtual_time"], 6))
        if m is None or b["test_accuracy"] <= 0 or b["test_loss"] <= 0:
            continue
        ir.append((m["test_accuracy"] - b["test_accuracy"]) / b["test_accuracy"])
        rr.append((b["test_loss"] - m["test_loss"]) / b["test_loss"])
    if not ir:
        raise ValueError(f"{method.path} and {base.path} share no evaluation time")
    return statistics.fmean(ir), statistics.fmean(rr)


def paper_table(runs: list[Run], method: str) -> str:
    """One line per baseline: IR_acc, RR_loss and speed-up of ``method`` against it."""
    labels = _by_label(runs)
    if method not in labels:
        raise ValueError(f"no runs labelled {method!r}; labels: {sorted(labels)}")
    finals = {
        lab: statistics.fmean(r.summary["final_accuracy"] for r in seeds.values())
        for lab, seeds in labels.items()
    }
    target = 0.95 * min(finals.values())
    lines = [
        f"target accuracy for the speed-up: {target:.4f} (0.95 x the weakest final, "
        f"{min(finals, key=finals.__getitem__)})",
        f"{'baseline':<16} {'seeds':>5} {'IR_acc':>8} {'RR_loss':>8} {'speed-up':>9}",
    ]
    mine = labels[method]
    for lab, seeds in sorted(labels.items()):
        if lab == method:
            continue
        common = sorted(set(seeds) & set(mine))
        ir, rr, sp = [], [], []
        for s in common:
            a, b = _ratios(mine[s], seeds[s])
            ir.append(a)
            rr.append(b)
            e_m = time_to_target(mine[s].metrics, target)
            e_b = time_to_target(seeds[s].metrics, target)
            if e_m is not None and e_b:
                sp.append((e_b - e_m) / e_b)
        speed = f"{100 * statistics.fmean(sp):8.2f}%" if sp else f"{'-':>9}"
        lines.append(
            f"{lab:<16} {len(common):>5} {100 * statistics.fmean(ir):7.2f}% "
            f"{100 * statistics.fmean(rr):7.2f}% {speed}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories or folders of them")
    parser.add_argument("--method", default="feddgic", help="the label measured (default feddgic)")
    args = parser.parse_args(argv)
    print(paper_table(find_runs([Path(p) for p in args.runs]), args.method))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
