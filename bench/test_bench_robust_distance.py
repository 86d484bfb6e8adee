"""The distance-based robust aggregators on the CPU: Krum's scores against one Gram GEMM, and
geometric median, norm clipping and centered clipping against this machine's memory floor.

Shapes: K in {16, 64} rows of D = 4M (2**22, times AGGSRV_BENCH_SCALE) float32, the rows scaled
by 0.5 .. 1.5 so that a bound at the median norm clips about half of them. Every benchmark times
its candidates interleaved in one run (bench/conftest.py) and reports medians and per-round
median ratios:

- `krum`: `krum_scores(pairwise_sq_distances(X), f)` (f = K/4 - 1) against one
  `torch.mm(X, X.T)` on the same X (target <= 1.2x, GFLOP/s = 2 K^2 D / time); `cdist` is what
  a torch user writes, `torch.cdist(X, X).square_()` and the same selection.
- `geometric_median_iteration`: one smoothed Weiszfeld step as `geometric_median` runs it, a
  `sq_distances_to` pass and a `weighted_sum`, against the floor of two reads of X (target
  <= 1.25x); `geometric_median(iters=1)` (the starting distance pass, one step, its distance
  pass: three reads) is shown beside it.
- `clip_rows` (half the rows above the bound, into a reused `out`): pass 1 reads X, pass 2 reads
  X and writes every row: floor `X.sum()` + `out.copy_(X)` (target <= 1.25x).
- `centered_clip(iters=1)`: one distance pass and one weighted sum: two reads of X.

The [D] operands (point, centre, median) are not counted in the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import fmt_size, random_tensor, run_case, scaled

from aggsrv import kernels as K_

F32 = 4  # bytes per float32 value


@dataclass
class Rows:
    K: int
    D: int
    X: torch.Tensor  # [K, D] float32, shared read-only by the shape's tests
    bound: float  # the median row norm

    def title(self, name: str) -> str:
        return f"{name} K={self.K} D={fmt_size(self.D)}"


@pytest.fixture(scope="module", params=[16, 64], ids=lambda k: f"K{k}-D4M")
def rows(request: pytest.FixtureRequest) -> Rows:
    K = request.param
    D = scaled(4 * 2**20)
    X = random_tensor(K, D, seed=K)
    order = torch.randperm(K, generator=torch.Generator().manual_seed(K))
    X.mul_(torch.linspace(0.5, 1.5, K)[order][:, None])
    norms = K_.layer_dots(X, X, backend="cpu").double().sqrt()
    return Rows(K, D, X, float(norms.median()))


def test_krum(benchmark, rows: Rows) -> None:
    """Krum's scores from one Gram pass: target <= 1.2x one torch.mm(X, X.T)."""
    X, f = rows.X, rows.K // 4 - 1

    def cdist_route():
        return K_.krum_scores(torch.cdist(X, X).square_(), f)

    fns = {
        "ours": lambda: K_.krum_scores(K_.pairwise_sq_distances(X, backend="cpu"), f),
        "cdist": cdist_route,
        "mm": lambda: torch.mm(X, X.T),
    }
    run_case(
        benchmark, rows.title(f"krum_scores(pairwise_sq_distances) f={f}"), fns,
        flops=2.0 * rows.K * rows.K * rows.D, floor="mm", floor_max=1.2, naive=None,
    )  # fmt: skip


def test_geometric_median_iteration(benchmark, rows: Rows) -> None:
    """One Weiszfeld step: sq_distances_to + weighted_sum = two reads of X."""
    X = rows.X
    z = X.mean(0)
    z_next = torch.empty_like(z)
    out = torch.empty_like(z)
    eps = 1e-8

    def step():
        dist = K_.sq_distances_to(X, z, backend="cpu").sqrt()
        b = 1.0 / dist.clamp_min(eps)
        K_.weighted_sum(X, b / b.sum(), out=z_next, backend="cpu")
        return z_next

    def naive():  # the torch code: norms of the differences (a [K, D] temporary), then a gemv
        dist = (X - z).norm(dim=1).double()
        b = 1.0 / dist.clamp_min(eps)
        return (b / b.sum()).float() @ X

    def floor():
        X.sum()
        X.sum()

    fns = {
        "ours": step,
        "naive": naive,
        "geometric_median(iters=1)": lambda: K_.geometric_median(
            X, init=z, out=out, iters=1, tol=0.0, backend="cpu"
        ),
        "floor": floor,
    }
    run_case(
        benchmark, rows.title("geometric_median iteration"), fns,
        nbytes=2 * X.numel() * F32, naive_min=None,
    )  # fmt: skip


def test_clip_rows(benchmark, rows: Rows) -> None:
    """Norm bounding into a reused out: 2 reads of X + 1 write."""
    X, bound = rows.X, rows.bound
    out = torch.empty_like(X)

    def naive():
        return X * (bound / X.norm(dim=1, keepdim=True)).clamp_(max=1.0)

    def floor():
        X.sum()
        out.copy_(X)

    fns = {
        "ours": lambda: K_.clip_rows(X, bound, out=out, backend="cpu"),
        "naive": naive,
        "floor": floor,
    }
    run_case(benchmark, rows.title("clip_rows"), fns, nbytes=3 * X.numel() * F32, naive_min=None)


def test_centered_clip(benchmark, rows: Rows) -> None:
    """One centered-clipping step: a distance pass and a weighted sum, two reads of X."""
    X, tau = rows.X, rows.bound * 0.5
    center = X.mean(0)
    out = torch.empty_like(center)

    def naive():
        diff = X - center
        c = (tau / diff.norm(dim=1)).clamp_(max=1.0) / X.shape[0]
        return center + c @ diff

    def floor():
        X.sum()
        X.sum()

    fns = {
        "ours": lambda: K_.centered_clip(X, center, tau, iters=1, out=out, backend="cpu"),
        "naive": naive,
        "floor": floor,
    }
    run_case(
        benchmark, rows.title("centered_clip(iters=1)"), fns, nbytes=2 * X.numel() * F32,
        naive_min=None,
    )  # fmt: skip
