"""Order statistics per coordinate (CPU backend) against torch and numpy on the same rows.

`coordinate_median` and `trimmed_mean(trim=0.1)` on [K, D] float32, K in {16, 64}, D = 4M (2^22,
times AGGSRV_BENCH_SCALE), timed interleaved (bench/conftest.py) with:

- **torch.median**: `torch.median(X, dim=0)`, the naive route (target: ours >= 3x faster);
- **torch.quantile**: `torch.quantile(X, 0.5, dim=0)`; torch refuses inputs above 2^24
  elements, which the line then says instead of a time;
- **np.median**: `np.median(X.numpy(), axis=0)`;
- **floor**: `torch.sum(X, dim=0)`, one read of X and one [D] write: what the bandwidth allows.

Effective GB/s = (K D + D) * 4 bytes (one read of X, one [D] write) / median time. Ratios are
medians of per-round ratios: ours / floor and torch.median / ours.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fmt_size, interleaved, random_tensor, report, scaled

from aggsrv import kernels as K_

F32 = 4
D_FULL = 4 * 2**20
TRIM = 0.1


def _quantile_or_none(X: torch.Tensor):
    """torch.quantile's median, or None when torch refuses the input's size."""
    try:
        torch.quantile(X[:, :8], 0.5, dim=0)  # cheap probe of the API itself
        return lambda: torch.quantile(X, 0.5, dim=0)
    except RuntimeError:  # pragma: no cover - the probe is small
        return None


@pytest.fixture(scope="module", params=[16, 64], ids=["K16", "K64"])
def rows(request: pytest.FixtureRequest) -> torch.Tensor:
    K = request.param
    return random_tensor(K, scaled(D_FULL), seed=K)


@pytest.mark.parametrize("kind", ["median", "trimmed"])
def test_order_statistics(benchmark, rows: torch.Tensor, kind: str) -> None:
    X = rows
    K, D = X.shape
    out = torch.empty(D)
    if kind == "median":
        ours = lambda: K_.coordinate_median(X, out=out, backend="cpu")  # noqa: E731
        name = "coordinate_median"
    else:
        ours = lambda: K_.trimmed_mean(X, TRIM, out=out, backend="cpu")  # noqa: E731
        name = f"trimmed_mean(trim={TRIM})"
    fns = {
        "ours": ours,
        "torch.median": lambda: torch.median(X, dim=0),
        "np.median": lambda: np.median(X.numpy(), axis=0),
        "floor": lambda: torch.sum(X, dim=0),
    }
    note = ""
    quantile = _quantile_or_none(X)
    if quantile is not None:
        try:
            quantile()
            fns["torch.quantile"] = quantile
        except RuntimeError as e:  # torch: "quantile() input tensor is too large"
            note = f"; torch.quantile refused [{K}, {fmt_size(D)}]: {str(e).splitlines()[0]}"
    times = interleaved(fns)
    benchmark.pedantic(ours, rounds=1, iterations=1)
    title = f"{name} K={K} D={fmt_size(D)} float32{note}"
    report(
        benchmark,
        title,
        times,
        nbytes=(K * D + D) * F32,
        floor_max=None,
        naive="torch.median",
        naive_min=3.0,
    )
