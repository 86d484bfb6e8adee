"""CPU kernels vs the naive torch code a user would write vs this machine's memory floor.

Two shapes: K = 64 rows of D = 4M (2**22) float32 with a skewed 62-segment layout, and K = 16 rows
of a CIFAR ResNet-18 (D = 11.2M, its 62 tensors). Every benchmark times its candidates
interleaved in one run (bench/conftest.py) and reports medians and per-round median ratios.

Floors are plain torch passes over the benchmark's own tensors moving the kernel's minimal
traffic: `X.sum()` per read, `Y.copy_(X)` per read + write. Memory: one [K, D] data tensor is
shared by a shape's tests (1 GiB at K = 64); a test adds at most two more of that size.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import (
    fmt_size,
    offsets_of,
    random_tensor,
    rescale_sizes,
    resnet18_sizes,
    run_case,
    scaled,
    segments,
    skewed_layout,
)

from aggsrv import kernels as K_

F32 = 4  # bytes per float32 value
G = 4  # groups in group_means


@dataclass
class Shape:
    K: int
    D: int
    offsets: torch.Tensor
    segs: list[tuple[int, int]]
    X: torch.Tensor  # [K, D] float32, shared read-only by the shape's tests

    def title(self, name: str, rows: bool = True) -> str:
        k = f"K={self.K} " if rows else ""
        return f"{name} {k}D={fmt_size(self.D)} L={len(self.segs)}"


SHAPES = {
    "K64-D4M": (64, 4 * 2**20, "skewed"),
    "K16-resnet18": (16, 11_173_962, "resnet18"),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request: pytest.FixtureRequest) -> Shape:
    K, D_full, kind = SHAPES[request.param]
    D = scaled(D_full)
    if kind == "skewed":
        sizes = skewed_layout(D, 62, seed=62)
    else:
        sizes = rescale_sizes(resnet18_sizes(), D)
    offs = offsets_of(sizes)
    return Shape(K, D, offs, segments(offs), random_tensor(K, D, seed=K))


# --------------------------------------------------------------------------------------------
# Streaming kernels: targets <= 1.25x floor and >= 2x faster than naive
# --------------------------------------------------------------------------------------------


def test_layer_dots(benchmark, shape: Shape) -> None:
    """[K, L] dots of every row with one direction b [D]; minimal traffic: 1 read of X."""
    X, offs, segs = shape.X, shape.offsets, shape.segs
    b = random_tensor(shape.D, seed=1)

    def naive():
        return torch.stack([(X[:, s:e] * b[s:e]).sum(1) for s, e in segs], 1)

    fns = {
        "ours": lambda: K_.layer_dots(X, b, offs, backend="cpu"),
        "naive": naive,
        "floor": lambda: X.sum(),
    }
    run_case(benchmark, shape.title("layer_dots"), fns, nbytes=X.numel() * F32)


def test_project_out(benchmark, shape: Shape) -> None:
    """out = g - c*b per segment; minimal traffic: 2 reads of g + 1 write of out."""
    g, offs, segs = shape.X, shape.offsets, shape.segs
    b = random_tensor(shape.D, seed=2)
    out = torch.empty_like(g)  # shared by every candidate: same pages, same cache state

    def naive():
        for s, e in segs:
            c = (g[:, s:e] @ b[s:e]) / (b[s:e] @ b[s:e])
            out[:, s:e] = g[:, s:e] - c[:, None] * b[s:e]
        return out

    def floor():
        g.sum()
        out.copy_(g)

    fns = {
        "ours": lambda: K_.project_out(g, b, offs, out=out, backend="cpu"),
        "naive": naive,
        "floor": floor,
    }
    run_case(benchmark, shape.title("project_out"), fns, nbytes=3 * g.numel() * F32)


def test_orthogonal_calibrate(benchmark, shape: Shape) -> None:
    """ORTHOFL's per-arrival update on [D] vectors (ma = w); minimal traffic: pass 1 reads x,
    sent, w, snap; pass 2 reads them again and writes y and ma: 8 reads + 2 writes."""
    D, offs, segs = shape.D, shape.offsets, shape.segs
    x, sent, w, snap = (random_tensor(D, seed=10 + i) for i in range(4))
    y, ma = torch.empty(D), torch.empty(D)
    beta = 0.1

    def naive():  # per-segment torch code, as ORTHOFL's authors would write it per tensor
        for s, e in segs:
            dm = x[s:e] - sent[s:e]
            dg = w[s:e] - snap[s:e]
            c = (dg * dm).sum() / (dm * dm).sum()
            y[s:e] = x[s:e] + dg - c * dm
            ma[s:e] = (1 - beta) * w[s:e] + beta * x[s:e]
        return y, ma

    def floor():
        for t in (x, sent, w, snap, w, snap):
            t.sum()
        y.copy_(x)
        ma.copy_(sent)

    fns = {
        "ours": lambda: K_.orthogonal_calibrate(
            x, sent, w, snap, offs, beta, out_y=y, out_ma=ma, backend="cpu"
        ),
        "naive": naive,
        "floor": floor,
    }
    run_case(benchmark, shape.title("orthogonal_calibrate", rows=False), fns, nbytes=10 * D * F32)


def test_group_means(benchmark, shape: Shape) -> None:
    """[G, D] means of G = 4 groups with a few rows excluded (-1, never read); minimal traffic:
    1 read of the included rows (the [G, D] output is not counted)."""
    X, K = shape.X, shape.K
    gen = torch.Generator().manual_seed(3)
    excluded = max(1, K // 16)
    groups = torch.arange(K - excluded) % G
    groups = torch.cat([groups, torch.full((excluded,), -1)])[torch.randperm(K, generator=gen)]
    n_in = K - excluded

    def naive():
        return torch.stack([X[groups == g].mean(0) for g in range(G)])

    out = torch.empty(G, shape.D)  # a strategy keeps its bases between calls

    fns = {
        "ours": lambda: K_.group_means(X, groups, G, out=out, backend="cpu"),
        "ours_fresh_out": lambda: K_.group_means(X, groups, G, backend="cpu"),
        "naive": naive,
        "floor": lambda: X[:n_in].sum(),  # the same number of rows, contiguous
        # The floor leaves out writing the [G, D] result; with G = 4 of K = 16 rows
        # that write is a quarter of the bytes read, so show the floor with it as well.
        "floor_with_write": lambda: (X[:n_in].sum(), out.zero_()),
    }
    title = shape.title("group_means") + f" G={G} rows={n_in}"
    run_case(benchmark, title, fns, nbytes=n_in * shape.D * F32)


def test_weighted_sum(benchmark, shape: Shape) -> None:
    """sum_k w_k X_k; minimal traffic: 1 read of X. Targets: <= 1.25x floor and no slower than
    the BLAS gemv `weights @ X` (ratio <= 1.0)."""
    X = shape.X
    weights = torch.rand(shape.K, generator=torch.Generator().manual_seed(4))
    weights /= weights.sum()
    out = torch.empty(shape.D)

    fns = {
        "ours": lambda: K_.weighted_sum(X, weights, out=out, backend="cpu"),
        "naive": lambda: (weights[:, None] * X).sum(0),
        "weights@X": lambda: weights @ X,
        "floor": lambda: X.sum(),
    }
    run_case(
        benchmark, shape.title("weighted_sum"), fns, nbytes=X.numel() * F32,
        naive_min=None, baseline="weights@X", baseline_max=1.0,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Gram-matrix kernels: target <= 1.2x one torch.mm(X, X.T) on the same X
# --------------------------------------------------------------------------------------------


def _cos(A: torch.Tensor) -> torch.Tensor:
    """Cosine matrix the way a user writes it: normalise the rows, then one mm."""
    An = A / A.norm(dim=1, keepdim=True)
    return An @ An.T


def _cosine_case(benchmark, shape: Shape, name: str, ours, naive) -> None:
    X = shape.X
    fns = {"ours": ours, "naive": naive, "mm": lambda: torch.mm(X, X.T)}
    flops = 2.0 * shape.K * shape.K * shape.D  # counted as one full mm
    run_case(
        benchmark, shape.title(name), fns, flops=flops,
        floor="mm", floor_max=1.2, naive_min=None,
    )  # fmt: skip


def test_cosine_matrix(benchmark, shape: Shape) -> None:
    X = shape.X
    _cosine_case(
        benchmark, shape, "cosine_matrix",
        lambda: K_.cosine_matrix(X, backend="cpu"), lambda: _cos(X),
    )  # fmt: skip


def test_cosine_matrix_layerwise(benchmark, shape: Shape) -> None:
    X, offs, segs = shape.X, shape.offsets, shape.segs
    _cosine_case(
        benchmark, shape, "cosine_matrix layerwise",
        lambda: K_.cosine_matrix(X, offs, layerwise=True, backend="cpu"),
        lambda: torch.stack([_cos(X[:, s:e]) for s, e in segs]),
    )  # fmt: skip


def test_layer_normalized_cosine(benchmark, shape: Shape) -> None:
    X, offs, segs = shape.X, shape.offsets, shape.segs
    _cosine_case(
        benchmark, shape, "layer_normalized_cosine",
        lambda: K_.layer_normalized_cosine(X, offs, backend="cpu"),
        lambda: torch.stack([_cos(X[:, s:e]) for s, e in segs]).mean(0),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Raw Gram and squared distances (Krum, Multi-Krum, Bulyan): target <= 1.2x one torch.mm


def test_gram_matrix(benchmark, shape: Shape) -> None:
    """G = X X^T, exactly symmetric: BLAS in chunks summed in float64, one triangle mirrored."""
    X = shape.X
    fns = {"ours": lambda: K_.gram_matrix(X, backend="cpu"), "mm": lambda: torch.mm(X, X.T)}
    run_case(
        benchmark, shape.title("gram_matrix"), fns, flops=2.0 * shape.K * shape.K * shape.D,
        floor="mm", floor_max=1.2, naive=None,
    )  # fmt: skip


def _sq_dists_via_cosines(X: torch.Tensor) -> torch.Tensor:
    """Before gram_matrix: the Gram rebuilt from cosine_matrix and the norms of layer_dots (one
    more pass over X), as bench/test_bench_flower.py's Krum did."""
    n = K_.layer_dots(X, X, backend="cpu").double()
    r = n.sqrt()
    gram = K_.cosine_matrix(X, backend="cpu").double() * r[:, None] * r[None, :]
    return (n[:, None] + n[None, :] - 2.0 * gram).clamp_min_(0.0)


def test_pairwise_sq_distances(benchmark, shape: Shape) -> None:
    """|x_i - x_j|^2 from the same Gram pass (norms from its diagonal); `naive` is the cosine
    route it replaces, `cdist` what a torch user writes."""
    X = shape.X
    fns = {
        "ours": lambda: K_.pairwise_sq_distances(X, backend="cpu"),
        "naive": lambda: _sq_dists_via_cosines(X),
        "cdist": lambda: torch.cdist(X, X).square_(),
        "mm": lambda: torch.mm(X, X.T),
    }
    run_case(
        benchmark, shape.title("pairwise_sq_distances"), fns,
        flops=2.0 * shape.K * shape.K * shape.D, floor="mm", floor_max=1.2, naive_min=None,
    )  # fmt: skip
