"""Oracle tests of the distance-based robust kernels (kernels/robust.py): `sq_distances_to`,
`clip_rows`, `geometric_median`, `centered_clip`, and the Krum / Multi-Krum / Bulyan selections.

Every backend (reference, cpu, triton under TRITON_INTERPRET=1 without a GPU, on small shapes)
is checked against float64 numpy written here: the sums, Weiszfeld's iteration, the centered
clipping formula, the optimality condition of the geometric median and scipy's minimiser of its
objective, brute-force Krum scores and Bulyan's recursion. The sharded cases replay the
partial sums over a `ShardMap` as tests/kernels/test_kernels_reduce.py does. Inputs are fresh random
draws; the seed is printed (AGGSRV_TEST_SEED replays it).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from kernel_tolerances import assert_close_normwise

from aggsrv import kernels
from aggsrv.sharding import LocalReducer, ShardMap

BACKENDS = ["reference", "cpu", "triton"]
# Triton runs on CUDA tensors where there is a GPU, elsewhere under TRITON_INTERPRET=1
# (conftest.py sets it).
TRITON_DEV = "cuda" if torch.cuda.is_available() else "cpu"
HALF = (torch.float16, torch.bfloat16)


def tol(dtype: torch.dtype) -> float:
    """Relative tolerance of a value summed from data of `dtype` (sums in float32 at least)."""
    return 1e-12 if dtype == torch.float64 else 1e-5


def out_tol(dtype: torch.dtype) -> float:
    """Relative tolerance of a result rounded to `dtype`."""
    return 2e-2 if dtype in HALF else tol(dtype)


def dev(backend: str) -> str:
    return TRITON_DEV if backend == "triton" else "cpu"


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("AGGSRV_TEST_SEED") or random.randrange(1 << 30))
    print(f"seed {seed} (AGGSRV_TEST_SEED replays it)")  # shown with a failure
    return torch.Generator().manual_seed(seed)


def rand(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


# ------------------------------------------------------------------------- sq_distances_to


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"]
)
def test_sq_distances_to(backend, dtype, gen):
    K, D = 7, 1013
    big = rand(K, D + 9, gen=gen).to(dev(backend), dtype)
    X = big[:, 5 : 5 + D]  # strided rows
    point = rand(D, gen=gen).to(dev(backend), dtype)
    want = ((np64(X) - np64(point)) ** 2).sum(axis=1)
    got = kernels.sq_distances_to(X, point, backend=backend)
    assert got.dtype == torch.float64 and got.shape == (K,) and got.device == X.device
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=tol(dtype))
    # The point may be a row of X: that row's distance is exactly 0.
    self_d = kernels.sq_distances_to(X, X[3], backend=backend)
    assert self_d[3] == 0.0
    np.testing.assert_allclose(
        self_d.cpu().numpy(), ((np64(X) - np64(X[3])) ** 2).sum(axis=1), rtol=tol(dtype)
    )
    # Deterministic.
    assert torch.equal(got, kernels.sq_distances_to(X, point, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_sq_distances_to_rows_close_to_the_point(backend, dtype, gen):
    """|x - p| a millionth of |x|: a Gram route (|x|^2 + |p|^2 - 2 <x, p>) cancels every digit
    in float32; the difference route keeps the relative accuracy of the sum."""
    K, D = 6, 2000
    point = (rand(D, gen=gen) + 10.0).to(dtype)
    X = (point.double() + rand(K, D, gen=gen, scale=1e-5)).to(dtype)
    X[2] = point  # distance exactly 0
    X, point = X.to(dev(backend)), point.to(dev(backend))
    want = ((np64(X) - np64(point)) ** 2).sum(axis=1)
    assert want[0] < 1e-8 * (np64(X[0]) ** 2).sum()  # really close
    got = kernels.sq_distances_to(X, point, backend=backend).cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=tol(dtype))
    assert got[2] == 0.0
    # The Gram route on the same float32 data is off by far more than the distance itself.
    if dtype == torch.float32:
        X32, p32 = X.cpu(), point.cpu()
        gram = (X32 * X32).sum(1) + (p32 * p32).sum() - 2 * (X32 @ p32)
        assert np.abs(gram.double().numpy() - want).max() > 10 * want.max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sq_distances_to_empty_shapes(backend):
    d = dev(backend)
    assert kernels.sq_distances_to(torch.empty(0, 5, device=d), torch.zeros(5, device=d),
                                   backend=backend).shape == (0,)  # fmt: skip
    got = kernels.sq_distances_to(torch.empty(3, 0, device=d), torch.zeros(0, device=d),
                                  backend=backend)  # fmt: skip
    assert torch.equal(got.cpu(), torch.zeros(3, dtype=torch.float64))


def test_sq_distances_to_errors(gen):
    X = rand(3, 10, gen=gen).float()
    with pytest.raises(ValueError, match="point has length 9"):
        kernels.sq_distances_to(X, X[0, :9])
    with pytest.raises(TypeError, match="point has dtype"):
        kernels.sq_distances_to(X, X[0].double())
    with pytest.raises(ValueError, match="point must be 1-D"):
        kernels.sq_distances_to(X, X)


# ------------------------------------------------------------------------------ clip_rows


def _rows_with_norms(K: int, D: int, norms: list[float], gen: torch.Generator) -> torch.Tensor:
    X = rand(K, D, gen=gen)
    return X / X.norm(dim=1, keepdim=True) * torch.tensor(norms, dtype=torch.float64)[:, None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,in_place",
    [(torch.float32, False), (torch.float32, True), (torch.float64, True), (torch.float16, False)],
    ids=["f32", "f32-inplace", "f64-inplace", "f16"],
)
def test_clip_rows(backend, dtype, in_place, gen):
    K, D, bound = 8, 517, 2.0
    X = _rows_with_norms(K, D, [0.5, 3.0, 2.0 * (1 - 1e-3), 10.0, 1.0, 2.5, 1e3, 1.9], gen)
    X = X.to(dev(backend), dtype)
    X[4] = 0.0  # a zero row: norm 0, copied
    X0 = X.clone()
    x64 = np64(X0)
    n64 = np.sqrt((x64 * x64).sum(axis=1))
    within = n64 <= bound
    assert within.sum() >= 3 and (~within).sum() >= 3

    out, norms = kernels.clip_rows(
        X, bound, out=X if in_place else None, return_norms=True, backend=backend
    )
    assert (out is X) == in_place and out.dtype == dtype and out.shape == (K, D)
    assert norms.dtype == torch.float64 and norms.shape == (K,)
    np.testing.assert_allclose(norms.cpu().numpy(), n64, rtol=tol(dtype))
    o64 = np64(out)
    for k in range(K):
        if within[k]:
            assert torch.equal(out[k], X0[k]), k  # bitwise, in place too
        else:
            # Norm exactly at the bound (to the output precision), direction kept.
            want = x64[k] * (bound / n64[k])
            err = np.linalg.norm(o64[k] - want) / np.linalg.norm(want)
            assert err <= out_tol(dtype), (k, err)
    got_norms = np.sqrt((o64 * o64).sum(axis=1))
    np.testing.assert_allclose(got_norms, np.minimum(n64, bound), rtol=out_tol(dtype))
    if not in_place:
        assert torch.equal(X, X0)  # input untouched
    # Without return_norms: just the tensor, the same values.
    again = kernels.clip_rows(X0, bound, backend=backend)
    assert isinstance(again, torch.Tensor) and torch.equal(again, out)


def test_clip_rows_errors(gen):
    X = rand(3, 10, gen=gen).float()
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="max_norm must be > 0"):
            kernels.clip_rows(X, bad)
    with pytest.raises(ValueError, match="max_norm must be finite"):
        kernels.clip_rows(X, float("inf"))
    buf = torch.zeros(40)
    with pytest.raises(ValueError, match="out overlaps X"):
        kernels.clip_rows(buf[:30].view(3, 10), 1.0, out=buf[5:35].view(3, 10))
    with pytest.raises(ValueError, match="out must have shape"):
        kernels.clip_rows(X, 1.0, out=torch.empty(3, 9))


# ------------------------------------------------------------------------ geometric median


def weiszfeld(
    X: np.ndarray, w: np.ndarray, z: np.ndarray, iters: int, eps: float = 1e-8
) -> np.ndarray:
    """Smoothed Weiszfeld in float64: z <- sum_k b_k x_k / sum_k b_k with
    b_k = w_k / max(eps, |x_k - z|)."""
    for _ in range(iters):
        b = w / np.maximum(eps, np.linalg.norm(X - z, axis=1))
        z = (b[:, None] * X).sum(axis=0) / b.sum()
    return z


def gm_objective(X: np.ndarray, w: np.ndarray, z: np.ndarray) -> float:
    return float((w * np.linalg.norm(X - z, axis=1)).sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometric_median_follows_weiszfeld(backend, gen):
    """A fixed number of iterations (tol = 0) from the weighted mean: the numpy iterates."""
    K, D, iters = 9, 301, 4
    X = rand(K, D, gen=gen)
    # Two rows far out: the mean is far from the median, so every step still gains clearly
    # more than float32 rounding (tol = 0 stops at the first step that gains nothing).
    X[[0, 4]] += 3.0
    X = X.to(dev(backend), torch.float32)
    w = torch.rand(K, generator=gen, dtype=torch.float64) + 0.1
    x64, w64 = np64(X), w.numpy()
    res = kernels.geometric_median(X, w, iters=iters, tol=0.0, backend=backend)
    z0 = (w64[:, None] * x64).sum(0) / w64.sum()
    want = weiszfeld(x64, w64, z0, iters)
    assert res.median.dtype == torch.float32 and res.median.shape == (D,)
    # Every step runs (tol = 0 stops only at a step that gains nothing; the last steps' gains
    # can be float32 rounding, so `converged` may be set at the last one).
    assert res.iterations == iters
    assert_close_normwise(res.median, torch.from_numpy(want), 1e-5)
    z = np64(res.median)
    assert res.objective == pytest.approx(gm_objective(x64, w64, z), rel=1e-6)
    # iters = 0: the weighted mean, and its objective.
    res0 = kernels.geometric_median(X, w.tolist(), iters=0, backend=backend)
    assert res0.iterations == 0 and not res0.converged
    assert_close_normwise(res0.median, torch.from_numpy(z0), 1e-6)
    assert res0.objective == pytest.approx(gm_objective(x64, w64, z0), rel=1e-6)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_geometric_median_is_the_minimiser(backend, gen):
    """float64, run to convergence: the weighted sum of unit vectors (z - x_k)/|z - x_k| is ~0,
    and scipy's minimiser of sum_k w_k |x_k - z| finds no lower objective."""
    from scipy.optimize import minimize

    K, D = 10, 5
    X = rand(K, D, gen=gen)
    w = torch.rand(K, generator=gen, dtype=torch.float64) + 0.2
    res = kernels.geometric_median(X, w, iters=5000, tol=1e-15, backend=backend)
    assert res.converged and 0 < res.iterations < 5000
    x64, w64, z = X.numpy(), w.numpy(), res.median.numpy()
    diff = z - x64
    dist = np.linalg.norm(diff, axis=1)
    assert dist.min() > 1e-6  # the median is no data point here (continuous draws)
    grad = (w64[:, None] * diff / dist[:, None]).sum(axis=0)
    assert np.linalg.norm(grad) <= 1e-5 * w64.sum()
    opt = minimize(lambda v: gm_objective(x64, w64, v), x64.mean(0), method="Nelder-Mead",
                   options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000})  # fmt: skip
    assert res.objective <= opt.fun * (1 + 1e-9)
    assert res.objective == pytest.approx(gm_objective(x64, w64, z), rel=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometric_median_resists_planted_outliers(backend, gen):
    """K = 11, 3 rows far away: the mean moves by ~27, the median stays with the honest 8."""
    K, D = 11, 200
    center = rand(D, gen=gen)
    X = center + rand(K, D, gen=gen, scale=0.1)  # honest rows about 1.4 from their centre
    X[[2, 5, 9]] += 100.0 / np.sqrt(D)  # |shift| = 100
    X = X.to(dev(backend), torch.float32)
    honest = np64(X)[[i for i in range(K) if i not in (2, 5, 9)]].mean(0)
    res = kernels.geometric_median(X, iters=100, tol=1e-7, backend=backend)
    mean = np64(X).mean(0)
    assert np.linalg.norm(mean - honest) > 20
    assert np.linalg.norm(np64(res.median) - honest) < 1.0
    assert res.converged and res.iterations < 100


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometric_median_init_and_out(backend, gen):
    K, D, iters = 7, 150, 4
    X = rand(K, D, gen=gen).to(dev(backend), torch.float32)
    init = X[1].clone()
    out = torch.empty(D, device=X.device)
    res = kernels.geometric_median(X, init=init, out=out, iters=iters, tol=0.0, backend=backend)
    assert res.median is out and torch.equal(init, X[1])  # init is not written
    want = weiszfeld(np64(X), np.ones(K), np64(init), iters)
    assert_close_normwise(out, torch.from_numpy(want), 1e-5)
    # out = init: updated in place, same result; init a row of X is read, not written.
    res2 = kernels.geometric_median(X, init=init, out=init, iters=iters, tol=0.0, backend=backend)
    assert res2.median is init and torch.equal(init, out)
    x1 = X[1].clone()
    res3 = kernels.geometric_median(X, init=X[1], iters=iters, tol=0.0, backend=backend)
    assert torch.equal(res3.median, out) and torch.equal(X[1], x1)


def test_geometric_median_errors(gen):
    X = rand(4, 10, gen=gen).float()
    with pytest.raises(ValueError, match="zero rows"):
        kernels.geometric_median(X[:0])
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        kernels.geometric_median(X, [1.0, -1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="must not all be 0"):
        kernels.geometric_median(X, [0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"weights must have shape \(4,\)"):
        kernels.geometric_median(X, [1.0, 1.0])
    with pytest.raises(TypeError, match="weights must be real numbers"):
        kernels.geometric_median(X, ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="init has length"):
        kernels.geometric_median(X, init=X[0, :9])
    with pytest.raises(ValueError, match="out overlaps X"):
        kernels.geometric_median(X, out=X[0])
    buf = torch.zeros(20)
    with pytest.raises(ValueError, match="out overlaps init"):
        kernels.geometric_median(X, init=buf[:10], out=buf[5:15])
    with pytest.raises(ValueError, match="need tol >= 0 and eps > 0"):
        kernels.geometric_median(X, eps=0.0)
    with pytest.raises(ValueError, match="iters must be >= 0"):
        kernels.geometric_median(X, iters=-1)


def test_geometric_median_list_weights_are_float64(gen):
    """Weights given as a list keep float64 precision (torch.as_tensor would make them
    float32 first)."""
    X = rand(3, 4, gen=gen)
    w = [0.1, 1.0 / 3.0, 0.7]
    got = kernels.geometric_median(X, w, iters=0, backend="reference").median.numpy()
    w64 = np.asarray(w)
    want = (w64[:, None] * X.numpy()).sum(0) / w64.sum()
    # float32 weights would be off by ~1e-8 of the values; float64 ones by rounding alone
    # (an absolute bound too: a coordinate near 0 magnifies it relatively).
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-15 * np.abs(want).max())


# -------------------------------------------------------------------------- centered_clip


def cc_numpy(X: np.ndarray, v: np.ndarray, tau: float, iters: int, p: np.ndarray) -> np.ndarray:
    """v <- v + sum_k p_k (x_k - v) min(1, tau / |x_k - v|), p normalised."""
    p = p / p.sum()
    for _ in range(iters):
        d = np.linalg.norm(X - v, axis=1)
        c = p * np.minimum(1.0, tau / np.maximum(d, 1e-300))
        v = v + (c[:, None] * (X - v)).sum(axis=0)
    return v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("iters", [1, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_centered_clip(backend, iters, weighted, gen):
    K, D = 9, 257
    X = rand(K, D, gen=gen)
    X[[1, 6]] *= 50.0  # far rows: clipped
    X = X.to(dev(backend), torch.float32)
    center = rand(D, gen=gen, scale=0.2).to(dev(backend), torch.float32)
    w = torch.rand(K, generator=gen, dtype=torch.float64) + 0.1 if weighted else None
    p = w.numpy() if weighted else np.ones(K)
    d0 = np.linalg.norm(np64(X) - np64(center), axis=1)
    tau = float(np.median(d0))  # about half the rows clipped in the first step
    got = kernels.centered_clip(X, center, tau, iters=iters, weights=w, backend=backend)
    want = cc_numpy(np64(X), np64(center), tau, iters, p)
    assert got.dtype == torch.float32 and got.shape == (D,)
    assert_close_normwise(got, torch.from_numpy(want), 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_centered_clip_large_tau_is_the_weighted_mean(backend, gen):
    K, D = 6, 120
    X = rand(K, D, gen=gen).to(dev(backend), torch.float64)
    w = torch.rand(K, generator=gen, dtype=torch.float64) + 0.1
    center = rand(D, gen=gen, scale=30.0).to(dev(backend), torch.float64)  # anywhere
    got = kernels.centered_clip(X, center, 1e6, weights=w, backend=backend)
    want = (w.numpy()[:, None] * np64(X)).sum(0) / w.numpy().sum()
    assert_close_normwise(got, torch.from_numpy(want), 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_centered_clip_in_place(backend, gen):
    K, D = 5, 90
    X = rand(K, D, gen=gen).to(dev(backend), torch.float32)
    center = rand(D, gen=gen).to(dev(backend), torch.float32)
    c0 = center.clone()
    fresh = kernels.centered_clip(X, center, 1.0, iters=2, backend=backend)
    assert torch.equal(center, c0)  # out=None leaves center alone
    got = kernels.centered_clip(X, center, 1.0, iters=2, out=center, backend=backend)
    assert got is center and torch.equal(center, fresh)
    with pytest.raises(ValueError, match="out overlaps X"):
        kernels.centered_clip(X, X[0], 1.0, out=X[0], backend=backend)


def test_centered_clip_errors(gen):
    X = rand(4, 10, gen=gen).float()
    with pytest.raises(ValueError, match="tau must be > 0"):
        kernels.centered_clip(X, X[0], 0.0)
    with pytest.raises(ValueError, match="iters must be >= 1"):
        kernels.centered_clip(X, X[0], 1.0, iters=0)
    with pytest.raises(ValueError, match="center has length"):
        kernels.centered_clip(X, X[0, :5], 1.0)
    with pytest.raises(ValueError, match="zero rows"):
        kernels.centered_clip(X[:0], X[0], 1.0)


# ---------------------------------------------------------------------- Krum and Bulyan


def sq_dists(X: np.ndarray) -> np.ndarray:
    return ((X[:, None, :] - X[None, :, :]) ** 2).sum(axis=2)


def krum_brute(D2: np.ndarray, f: int) -> np.ndarray:
    K = D2.shape[0]
    return np.array(
        [sum(sorted(D2[i, j] for j in range(K) if j != i)[: K - f - 2]) for i in range(K)]
    )


def planted(K: int, f: int, D: int, gen: torch.Generator) -> tuple[np.ndarray, list[int]]:
    """K rows: K - f near 0, f far away (at distinct far points)."""
    X = rand(K, D, gen=gen).numpy()
    far = sorted(torch.randperm(K, generator=gen)[:f].tolist())
    for j, i in enumerate(far):
        X[i] += 50.0 * (j + 1)
    return X, far


def test_krum_scores_brute_force(gen):
    for K, f in ((5, 0), (7, 2), (12, 3)):
        X = rand(K, 6, gen=gen).numpy()
        D2 = sq_dists(X)
        got = kernels.krum_scores(torch.from_numpy(D2), f)
        assert got.dtype == torch.float64 and got.shape == (K,)
        np.testing.assert_allclose(got.numpy(), krum_brute(D2, f), rtol=1e-13)
        # float32 input (as pairwise_sq_distances gives it) is read in float64.
        D2_32 = D2.astype(np.float32)
        got32 = kernels.krum_scores(torch.from_numpy(D2_32), f)
        np.testing.assert_allclose(got32.numpy(), krum_brute(D2_32.astype(np.float64), f),
                                   rtol=1e-13)  # fmt: skip


def test_krum_select_avoids_planted_rows(gen):
    K, f = 11, 3
    X, far = planted(K, f, 20, gen)
    D2 = torch.from_numpy(sq_dists(X))
    one = kernels.krum_select(D2, f)
    assert one.dtype == torch.int64 and one.shape == (1,)
    scores = krum_brute(D2.numpy(), f)
    assert int(one[0]) == int(np.argmin(scores)) and int(one[0]) not in far
    many = kernels.krum_select(D2, f, m=K - f)
    assert many.tolist() == np.argsort(scores, kind="stable")[: K - f].tolist()
    assert not set(many.tolist()) & set(far)
    # From the pairwise_sq_distances kernel (float32 Gram): the same honest rows.
    Xt = torch.from_numpy(X).float()
    via_gram = kernels.krum_select(kernels.pairwise_sq_distances(Xt), f, m=K - f)
    assert sorted(via_gram.tolist()) == sorted(many.tolist())


def test_krum_ties_go_to_the_lower_index(gen):
    # Every row at the same distance from every other: all scores tie.
    D2 = torch.ones(6, 6, dtype=torch.float64) - torch.eye(6, dtype=torch.float64)
    assert kernels.krum_select(D2, 1, m=6).tolist() == list(range(6))
    # Two identical rows at the cluster's centre tie for the best score: the lower one first.
    # Two identical rows tie exactly: the lower one comes first, right before the other.
    X = rand(8, 5, gen=gen).numpy()
    X[6] = X[3]
    D2 = torch.from_numpy(sq_dists(X))
    scores = kernels.krum_scores(D2, 1)
    assert scores[3] == scores[6]
    order = kernels.krum_select(D2, 1, m=8).tolist()
    assert order.index(6) == order.index(3) + 1


def bulyan_brute(D2: np.ndarray, f: int) -> list[int]:
    """theta = K - 2f picks, each the (lowest-index) Krum choice among the rows left."""
    left = list(range(D2.shape[0]))
    chosen = []
    for _ in range(D2.shape[0] - 2 * f):
        sub = D2[np.ix_(left, left)]
        scores = krum_brute(sub, f)
        chosen.append(left.pop(int(np.argmin(scores))))  # argmin: first of equal minima
    return chosen


@pytest.mark.parametrize("K,f", [(11, 2), (14, 2), (15, 3)])
def test_bulyan_select(K, f, gen):
    X, far = planted(K, f, 12, gen)
    D2 = sq_dists(X)
    got = kernels.bulyan_select(torch.from_numpy(D2), f)
    assert got.dtype == torch.int64 and got.shape == (K - 2 * f,)
    assert len(set(got.tolist())) == K - 2 * f
    assert not set(got.tolist()) & set(far)
    assert got.tolist() == bulyan_brute(D2, f)
    assert int(got[0]) == int(kernels.krum_select(torch.from_numpy(D2), f)[0])


def test_selection_errors(gen):
    D2 = torch.from_numpy(sq_dists(rand(6, 3, gen=gen).numpy()))
    with pytest.raises(ValueError, match="Krum needs K >= f \\+ 3"):
        kernels.krum_scores(D2, 4)
    with pytest.raises(ValueError, match="Krum needs K >= f \\+ 3"):
        kernels.krum_select(D2[:2, :2], 0)
    with pytest.raises(ValueError, match="square"):
        kernels.krum_scores(D2[:, :5], 1)
    with pytest.raises(ValueError, match="square"):
        kernels.bulyan_select(D2[0], 0)
    bad = D2.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        kernels.krum_select(bad, 1)
    with pytest.raises(ValueError, match="Bulyan needs K >= 4f \\+ 3"):
        kernels.bulyan_select(D2, 1)  # 6 < 7
    with pytest.raises(ValueError, match="f must be >= 0"):
        kernels.krum_scores(D2, -1)
    with pytest.raises(ValueError, match="cannot select m=7"):
        kernels.krum_select(D2, 1, m=7)
    with pytest.raises(TypeError, match="f must be an int"):
        kernels.krum_scores(D2, 1.0)
    with pytest.raises(TypeError, match="D2 must be a torch.Tensor"):
        kernels.krum_scores(D2.numpy(), 1)


# ------------------------------------------------------------------------- sharded reduce=


class _Stop(Exception):
    """Raised by `_Prefix` once it has recorded the partial sums of the call it was sent for."""


class _Prefix:
    """A shard's reduce for a call made of several collectives: the first calls return the sums
    over the shards already known, the next one records its argument and stops the run."""

    def __init__(self, totals: list[torch.Tensor]) -> None:
        self.totals = totals
        self.calls = 0
        self.recorded: torch.Tensor | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        assert t.dtype == torch.float64 and t.is_contiguous()
        i = self.calls
        self.calls += 1
        if i < len(self.totals):
            return self.totals[i].clone()
        self.recorded = t.clone()
        raise _Stop


def sharded(call: Callable[[int, Any], Any], smap: ShardMap) -> tuple[list[Any], int]:
    """Run ``call(rank, reduce)`` on every shard, one shard after another, as if each reduce were
    a collective: shards are run again and again, each run replaying the sums known so far and
    recording the next partial sums, summed in float64 in rank order. Returns the results by
    rank and the number of reduce calls (the same on every shard, or the collective hangs)."""
    totals: list[torch.Tensor] = []
    while True:
        partials, results = [], []
        for rank in range(smap.shards):
            red = _Prefix(totals)
            try:
                results.append(call(rank, red))
            except _Stop:
                partials.append(red.recorded)
            else:
                assert red.calls == len(totals)
        if not partials:
            return results, len(totals)
        assert len(partials) == smap.shards, "shards disagree on the number of reduce calls"
        assert len({p.shape for p in partials}) == 1, "packed shapes differ between shards"
        total = torch.zeros_like(partials[0])
        for p in partials:
            total += p
        totals.append(total)


D_SHARD = 301
MAPS = [
    ShardMap.even(D_SHARD, 1),
    ShardMap.even(D_SHARD, 3, align=8),
    ShardMap((0, 64, 64, D_SHARD)),  # an empty shard in the middle
]


def maps_for(backend: str) -> list[ShardMap]:
    return MAPS[1:] if backend == "triton" else MAPS


def same_on_every_shard(values: list[torch.Tensor]) -> torch.Tensor:
    for v in values[1:]:
        assert torch.equal(v, values[0])
    return values[0]


def local(smap: ShardMap, rank: int, t: torch.Tensor) -> torch.Tensor:
    lo, hi = smap.slice(rank)
    return t[..., lo:hi]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_sq_distances_and_clip_rows(backend, gen):
    K = 6
    X = rand(K, D_SHARD, gen=gen).to(dev(backend), torch.float32)
    X[2] *= 0.01  # within the bound
    p = rand(D_SHARD, gen=gen).to(dev(backend), torch.float32)
    want_d = kernels.sq_distances_to(X, p, backend=backend)
    want_out, want_n = kernels.clip_rows(X, 5.0, return_norms=True, backend=backend)
    # Sums split differently: float64 tile sums (cpu, reference); float32 within a tile (triton).
    rtol = 1e-6 if backend == "triton" else 1e-12
    for smap in maps_for(backend):

        def dist(r, red, smap=smap):
            return kernels.sq_distances_to(local(smap, r, X), local(smap, r, p), reduce=red,
                                           backend=backend)  # fmt: skip

        def clip(r, red, smap=smap):
            Xl = local(smap, r, X.clone())  # in place, on strided rows
            return kernels.clip_rows(Xl, 5.0, out=Xl, return_norms=True, reduce=red,
                                     backend=backend)  # fmt: skip

        res, calls = sharded(dist, smap)
        assert calls == 1
        got_d = same_on_every_shard(res)
        assert got_d.shape == (K,) and got_d.dtype == torch.float64
        np.testing.assert_allclose(got_d.cpu().numpy(), want_d.cpu().numpy(), rtol=rtol)
        res, calls = sharded(clip, smap)
        assert calls == 1
        got_n = same_on_every_shard([n for _, n in res])
        np.testing.assert_allclose(got_n.cpu().numpy(), want_n.cpu().numpy(), rtol=rtol)
        got_out = smap.join([o for o, _ in res])
        assert_close_normwise(got_out, want_out, 1e-6)
        assert torch.equal(got_out[2], X[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_geometric_median(backend, gen):
    # The replay runs call i of every shard i + 1 times: few iterations under the interpreter.
    K, iters = 7, 2 if backend == "triton" else 4
    X = rand(K, D_SHARD, gen=gen).to(dev(backend), torch.float32)
    w = torch.rand(K, generator=gen, dtype=torch.float64) + 0.1
    want = kernels.geometric_median(X, w, iters=iters, tol=0.0, backend=backend)
    for smap in maps_for(backend):

        def call(r, red, smap=smap):
            return kernels.geometric_median(local(smap, r, X), w, iters=iters, tol=0.0,
                                            reduce=red, backend=backend)  # fmt: skip

        res, calls = sharded(call, smap)
        assert calls == iters + 1  # one distance pass per iteration, one at the start
        for r in res:
            assert r.iterations == want.iterations and r.converged == want.converged
            assert r.objective == pytest.approx(want.objective, rel=1e-6)
            assert r.objective == res[0].objective  # identical decisions on every shard
        assert_close_normwise(smap.join([r.median for r in res]), want.median, 1e-6)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_sharded_centered_clip(backend, gen):
    K, iters = 6, 3
    X = rand(K, D_SHARD, gen=gen)
    center = rand(D_SHARD, gen=gen, scale=0.1)
    want = kernels.centered_clip(X, center, 15.0, iters=iters, backend=backend)
    for smap in maps_for(backend):

        def call(r, red, smap=smap):
            return kernels.centered_clip(local(smap, r, X), local(smap, r, center), 15.0,
                                         iters=iters, reduce=red, backend=backend)  # fmt: skip

        res, calls = sharded(call, smap)
        assert calls == iters
        assert_close_normwise(smap.join(res), want, 1e-12)


def test_cpu_identity_reduce_is_bitwise_the_single_server(gen):
    X = rand(5, 1000, gen=gen).float()
    p = rand(1000, gen=gen).float()
    ident = LocalReducer().sum_
    assert torch.equal(kernels.sq_distances_to(X, p), kernels.sq_distances_to(X, p, reduce=ident))
    a, na = kernels.clip_rows(X, 20.0, return_norms=True)
    b, nb = kernels.clip_rows(X, 20.0, return_norms=True, reduce=ident)
    assert torch.equal(a, b) and torch.equal(na, nb)
    g1 = kernels.geometric_median(X, iters=3)
    g2 = kernels.geometric_median(X, iters=3, reduce=ident)
    assert torch.equal(g1.median, g2.median) and g1.objective == g2.objective
