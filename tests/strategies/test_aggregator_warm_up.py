"""A strategy with a robust aggregator compiles the rule's kernels when it is built, not in its
first aggregation (aggsrv/aggregators/warm.py): in a fresh interpreter, after the strategy is
made, a real aggregation over odd-sized rows compiles nothing more (no numba dispatcher of the
CPU kernels gains a signature), and the result is the rule's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Builds FedBuff with the rule, counts every CPU kernel's compiled signatures, runs one buffer
# of updates through the strategy, and reports the counts before and after plus the model.
PROBE = r"""
import json, sys, numpy as np, torch
import numba
from aggsrv.kernels import cpu, _cpu_distance, _cpu_order, _cpu_median_window
from aggsrv.layout import ModelLayout
from aggsrv.strategies import make_strategy
from aggsrv.values import Update, UpdateKind

def compiled():
    out = {}
    for mod in (cpu, _cpu_distance, _cpu_order, _cpu_median_window):
        for name, obj in vars(mod).items():
            if isinstance(obj, numba.core.dispatcher.Dispatcher):
                out[f"{mod.__name__}.{name}"] = len(obj.signatures)
    return out

rule, buffer = sys.argv[1], int(sys.argv[2])
layout = ModelLayout.from_named_shapes([("w", (37, 29)), ("b", (37,))])  # D = 1110
gen = torch.Generator().manual_seed(int(sys.argv[3]))
initial = torch.randn(layout.numel, generator=gen)
s = make_strategy("fedbuff", layout=layout, initial=initial.clone(),
                  config={"buffer_size": buffer, "aggregator": rule, "server_lr": 1.0})
before = compiled()
rows = torch.randn(buffer, layout.numel, generator=gen)
for i in range(buffer):
    s.on_register(f"c{i}", 0.0)
for i in range(buffer):
    job = s.job_for(f"c{i}", 0.0)
    kind = UpdateKind.WEIGHTS if i % 2 else UpdateKind.DELTA
    tensor = job.weights + rows[i] if kind is UpdateKind.WEIGHTS else rows[i].clone()
    s.on_update(Update(f"c{i}", job.job_id, job.base_version, f"u{i}", 10, job.recipe.work_target,
                       kind, tensor), 0.0)
after = compiled()
print(json.dumps({"before": before, "after": after, "version": s.version,
                  "step": (s.global_model() - initial).tolist(), "rows": rows.tolist()}))
"""


@pytest.mark.parametrize(
    "rule, buffer",
    [("median", 6), ("trimmed_mean:trim=0.2", 7), ("bulyan:f=1", 9), ("geometric_median", 5)],
)
def test_the_first_aggregation_compiles_nothing_the_warm_up_did_not(rule: str, buffer: int) -> None:
    import numpy as np

    seed = np.random.SeedSequence().entropy % (1 << 31)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, rule, str(buffer), str(seed)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["version"] == 1, (rule, seed)
    before, after = got["before"], got["after"]
    assert any(before.values()), f"{rule}: the strategy compiled no kernel when it was built"
    grown = {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0)}
    assert not grown, f"{rule} (seed {seed}): the first aggregation compiled {grown}"
    # The step is the rule's aggregate of the buffer's deltas (server_lr 1, FedBuff's 1/M
    # weights are equal, so every rule sees plain rows).
    X = np.asarray(got["rows"], dtype=np.float64)
    step = np.asarray(got["step"])
    if rule == "median":
        np.testing.assert_allclose(step, np.median(X, 0), rtol=1e-5, atol=1e-5)
    elif rule.startswith("trimmed_mean"):
        import scipy.stats

        np.testing.assert_allclose(step, scipy.stats.trim_mean(X, 0.2, axis=0), atol=1e-5)


def test_warm_up_runs_once_per_rule_and_device_and_never_for_the_mean() -> None:
    from aggsrv.aggregators import Aggregator, warm_up

    assert warm_up(Aggregator.parse("mean"), "cpu") == 0.0
    spec = Aggregator.parse("trimmed_mean:trim=0.25")
    warm_up(spec, "cpu")
    assert warm_up(spec, "cpu") == 0.0
    assert warm_up(Aggregator.parse("trimmed_mean:trim=0.4"), "cpu") == 0.0  # same kernels
