"""Order statistics per coordinate: `coordinate_median` and `trimmed_mean` on every backend.

Oracles are float64 numpy/scipy written here (`np.median(axis=0)`, `scipy.stats.trim_mean`, a
brute-force sort of each column), on fresh random inputs (the seed is in every message): odd and
even K from 1 on, ties (small integers), every dtype, strided rows, `out=`. The CPU backend runs
on a D above its task width (_cpu_order.TASK_COLUMNS), so tasks, blocks and ragged tails are all
exercised, and at K above NETWORK_MAX_K (its quickselect path); Triton runs under the
interpreter on small shapes, and above MAX_SORT_ROWS (its torch fallback).

Exactness: a median is one input value (odd K) or the float64 mean of two rounded once (even
K), so the reference and CPU backends equal the oracle bitwise, and so does Triton for float32
and float64 (two float32 values add exactly in float64 and their float32 sum is rounded once).
Triton's half results get one unit in the last place: the interpreter converts float32 to
bfloat16 by truncation, a GPU rounds to nearest. Trimmed means use the norm-wise tolerances of
tests/kernels/kernel_tolerances.py.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
import torch
from scipy.stats import trim_mean

if not torch.cuda.is_available():
    # Triton reads this when its kernels are decorated, so before the backend is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aggsrv.kernels import _cpu_order, trimmed_count  # noqa: E402
from aggsrv.kernels.triton import order as triton_order  # noqa: E402
from kernel_tolerances import HALF, assert_close_normwise, vec_tol  # noqa: E402

from aggsrv import kernels  # noqa: E402

BACKENDS = ["reference", "cpu", "triton"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f64", "f16", "bf16"]
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The CPU backend cuts D into tasks of TASK_COLUMNS columns and blocks of up to 256: two tasks,
# the second ragged.
D_CPU = _cpu_order.TASK_COLUMNS + 1013
D_SMALL = 203  # reference and Triton (interpreter): odd, not a multiple of any block
K_ODD_EVEN = [1, 2, 3, 4, 5, 8, 13, 16, 33]


def device(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


def width(backend: str) -> int:
    return D_CPU if backend == "cpu" else D_SMALL


@pytest.fixture
def seed() -> int:
    return secrets.randbits(31)


def strided(X: torch.Tensor, dev: str, a: int = 3) -> torch.Tensor:
    """X as a window big[:, a:a+D] of a wider tensor on `dev` (rows with stride D + 11)."""
    K, D = X.shape
    # A large value around the window: a kernel reading past it would show.
    big = torch.full((K, D + 11), 6e4, dtype=X.dtype, device=dev)
    big[:, a : a + D] = X.to(dev)
    return big[:, a : a + D]


def normal(K: int, D: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(K, D, generator=gen, dtype=torch.float64).to(dtype)


def small_ints(K: int, D: int, dtype: torch.dtype, seed: int, hi: int = 2) -> torch.Tensor:
    """Many ties: integers in [-hi, hi] (exact in every dtype)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-hi, hi + 1, (K, D), generator=gen).to(dtype)


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).numpy()


def brute_trimmed(X: torch.Tensor, cut: int) -> np.ndarray:
    """Mean of each column's sorted values cut..K-cut-1, in float64."""
    K = X.shape[0]
    return np.sort(f64(X), axis=0)[cut : K - cut].mean(axis=0)


def assert_median(got: torch.Tensor, X: torch.Tensor, backend: str, msg: str) -> None:
    """got equals np.median rounded to X's dtype (Triton halves: within one ulp)."""
    want = torch.from_numpy(np.median(f64(X), axis=0)).to(X.dtype)
    assert got.dtype == X.dtype and got.shape == want.shape, msg
    g, w = got.cpu(), want
    if backend == "triton" and X.dtype in HALF:
        ulp = torch.finfo(X.dtype).eps * w.double().abs() + torch.finfo(X.dtype).tiny
        err = (g.double() - w.double()).abs()
        assert bool((err <= ulp).all()), f"{msg}: max err {float(err.max()):.3g} > 1 ulp"
    else:
        bad = (g != w).nonzero().flatten()
        assert bad.numel() == 0, (
            f"{msg}: {bad.numel()} medians differ; first at {int(bad[0])}: "
            f"got {float(g[bad[0]])!r}, want {float(w[bad[0]])!r}"
        )


# --------------------------------------------------------------------------------------------
# coordinate_median


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_median_matches_numpy(backend: str, dtype: torch.dtype, seed: int) -> None:
    """Odd and even K from 1 on, strided rows: the median of every column, exactly."""
    D = width(backend)
    for i, K in enumerate(K_ODD_EVEN):
        X = strided(normal(K, D, dtype, seed + i), device(backend))
        got = kernels.coordinate_median(X, backend=backend)
        assert_median(got, X, backend, f"seed={seed} K={K} {dtype} {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_median_ties(backend: str, seed: int) -> None:
    """Many equal values (integers in [-2, 2]): exact (the results are integers or halves)."""
    D = width(backend)
    for i, K in enumerate([2, 3, 6, 7, 16, 31]):
        for dtype in (torch.float32, torch.bfloat16):
            X = small_ints(K, D, dtype, seed + i).to(device(backend))
            got = kernels.coordinate_median(X, backend=backend).cpu()
            want = torch.from_numpy(np.median(f64(X), axis=0)).to(dtype)
            assert torch.equal(got, want), f"seed={seed} K={K} {dtype} {backend}"


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_median_many_rows(backend: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the in-register limits: CPU quickselect (K > NETWORK_MAX_K), Triton's fallback."""
    K0 = _cpu_order.NETWORK_MAX_K if backend == "cpu" else triton_order.MAX_SORT_ROWS
    # A small fallback chunk makes the Triton fallback loop over several column chunks.
    monkeypatch.setattr(triton_order, "FALLBACK_BYTES", 4096)
    D = 1013
    for i, K in enumerate([K0 + 1, K0 + 2]):
        X = strided(normal(K, D, torch.float32, seed + i), device(backend))
        assert_median(kernels.coordinate_median(X, backend=backend), X, backend, f"seed={seed}")
        T = strided(small_ints(K, D, torch.float64, seed + i, hi=3), device(backend))
        assert_median(kernels.coordinate_median(T, backend=backend), T, backend, f"ties {seed}")
        for cut in (0, 1, K // 5, (K - 1) // 2):
            got = kernels.trimmed_mean(T, cut=cut, backend=backend)
            assert_close_normwise(got, torch.from_numpy(brute_trimmed(T, cut)), 1e-12)


# --------------------------------------------------------------------------------------------
# trimmed_mean


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_trimmed_mean_matches_scipy(backend: str, dtype: torch.dtype, seed: int) -> None:
    """trim fractions against scipy.stats.trim_mean (trim * K away from an integer, where
    scipy's int() and our floor with slack agree)."""
    D = width(backend)
    for i, (K, trim) in enumerate([(1, 0.2), (2, 0.25), (5, 0.1), (7, 0.2), (16, 0.1), (33, 0.4)]):
        X = strided(normal(K, D, dtype, seed + i), device(backend))
        got = kernels.trimmed_mean(X, trim, backend=backend)
        assert got.dtype == dtype
        want = torch.from_numpy(trim_mean(f64(X), trim, axis=0))
        msg = f"seed={seed} K={K} trim={trim} {dtype} {backend}"
        try:
            assert_close_normwise(got, want, vec_tol(dtype))
        except AssertionError as e:
            raise AssertionError(f"{msg}: {e}") from None


@pytest.mark.parametrize("backend", BACKENDS)
def test_trimmed_mean_every_cut(backend: str, seed: int) -> None:
    """`cut=` from 0 to the largest allowed, against a brute-force sort; normal and tied data."""
    D = width(backend)
    for i, K in enumerate([9, 12]):
        for X in (normal(K, D, torch.float64, seed + i), small_ints(K, D, torch.float64, seed)):
            Xd = strided(X, device(backend))
            for cut in range((K - 1) // 2 + 1):
                got = kernels.trimmed_mean(Xd, cut=cut, backend=backend)
                want = torch.from_numpy(brute_trimmed(X, cut))
                assert_close_normwise(got, want, 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_trimmed_count_floor_rule(backend: str, seed: int) -> None:
    """trim=0.1 with K=30 cuts 3 (0.1 * 30 = 3.0000000000000004), trim=0.3 with K=10 cuts 3
    (0.3 * 10 = 2.9999999999999996; scipy's int() would cut 2 there), trim=0.25 with K=10 cuts 2;
    the results equal the `cut=` form bitwise."""
    assert trimmed_count(30, 0.1) == 3
    assert trimmed_count(10, 0.3) == 3
    assert trimmed_count(10, 0.25) == 2
    for i, (K, trim, cut) in enumerate([(30, 0.1, 3), (10, 0.3, 3), (10, 0.25, 2)]):
        # Skewed data: cutting 2 or 3 gives clearly different means.
        X = normal(K, width(backend), torch.float32, seed + i).exp().to(device(backend))
        got = kernels.trimmed_mean(X, trim, backend=backend)
        assert torch.equal(got, kernels.trimmed_mean(X, cut=cut, backend=backend))
        assert_close_normwise(got, torch.from_numpy(brute_trimmed(X, cut)), 1e-5)
        wrong = torch.from_numpy(brute_trimmed(X, cut - 1))
        assert float((got.double().cpu() - wrong).abs().max()) > 1e-3


def test_cpu_networks_select_the_middle(seed: int) -> None:
    """The pruned, paired networks of the CPU backend, run here with numpy (min/max per row
    pair over many columns): the rows they name hold the middle order statistics' multiset."""
    rng = np.random.default_rng(seed)
    for K in range(1, 40):
        X = rng.integers(-3, 4, size=(K, 64)).astype(np.float64)  # ties too
        X[:, 32:] = rng.standard_normal((K, 32))
        for cut in {0, 1, K // 5, (K - 1) // 2}:
            if 2 * cut >= K:
                continue
            net, rows = _cpu_order.order_network(K, cut, K - cut)
            steps = _cpu_order.paired(net)
            assert (
                steps.shape[0] <= net.shape[0]
                and (steps[:, :2].size + (steps[:, 2] >= 0).sum() * 2) == net.size
            )
            T = X.copy()
            for a, b, c, d in steps:
                for p, q in ((a, b), (c, d)) if c >= 0 else ((a, b),):
                    T[p], T[q] = np.minimum(T[p], T[q]), np.maximum(T[p], T[q])
            want = np.sort(X, axis=0)[cut : K - cut]
            got = T[rows]
            assert np.array_equal(np.sort(got, axis=0), want), f"seed={seed} K={K} cut={cut}"


# --------------------------------------------------------------------------------------------
# out=, shapes, errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_given(backend: str, seed: int) -> None:
    """`out=` (a window of a bigger buffer) is written and returned; its neighbours are not."""
    dev = device(backend)
    for dtype in (torch.float32, torch.bfloat16):
        K, D = 6, width(backend)
        X = strided(normal(K, D, dtype, seed), dev)
        buf = torch.full((D + 8,), 7.0, dtype=dtype, device=dev)
        out = buf[4 : 4 + D]
        assert kernels.coordinate_median(X, out=out, backend=backend) is out
        assert_median(out, X, backend, f"seed={seed} {dtype} {backend} out=")
        assert kernels.trimmed_mean(X, cut=1, out=out, backend=backend) is out
        assert_close_normwise(out, torch.from_numpy(brute_trimmed(X, 1)), vec_tol(dtype))
        assert bool((buf[:4] == 7).all()) and bool((buf[4 + D :] == 7).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_columns(backend: str) -> None:
    X = torch.empty(3, 0, device=device(backend))
    assert kernels.coordinate_median(X, backend=backend).shape == (0,)
    assert kernels.trimmed_mean(X, 0.2, backend=backend).shape == (0,)


def test_errors() -> None:
    X = torch.randn(10, 7)
    with pytest.raises(ValueError, match="zero rows"):
        kernels.coordinate_median(torch.empty(0, 7))
    with pytest.raises(ValueError, match="zero rows"):
        kernels.trimmed_mean(torch.empty(0, 7), 0.1)
    with pytest.raises(ValueError, match="2 \\* cut < K"):
        kernels.trimmed_mean(X, cut=5)
    with pytest.raises(ValueError, match="2 \\* cut < K"):
        kernels.trimmed_mean(torch.randn(1, 7), cut=1)
    for bad in (-0.1, 0.5, 0.7):
        with pytest.raises(ValueError, match="trim must be in"):
            kernels.trimmed_mean(X, bad)
    with pytest.raises(ValueError, match="finite"):
        kernels.trimmed_mean(X, float("nan"))
    with pytest.raises(ValueError, match="exactly one"):
        kernels.trimmed_mean(X)
    with pytest.raises(ValueError, match="exactly one"):
        kernels.trimmed_mean(X, 0.1, cut=1)
    with pytest.raises(ValueError, match="cut must be >= 0"):
        kernels.trimmed_mean(X, cut=-1)
    with pytest.raises(TypeError, match="cut must be an int"):
        kernels.trimmed_mean(X, cut=1.0)
    with pytest.raises(TypeError, match="cut must be an int"):
        kernels.trimmed_mean(X, cut=True)
    with pytest.raises(ValueError, match="2-D"):
        kernels.coordinate_median(torch.randn(7))
    with pytest.raises(TypeError, match="out must have dtype"):
        kernels.coordinate_median(X, out=torch.empty(7, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must have shape"):
        kernels.trimmed_mean(X, 0.1, out=torch.empty(8))


# --------------------------------------------------------------------------------------------
# mean_around_median: Bulyan's coordinate-wise step
# --------------------------------------------------------------------------------------------


def around_median_oracle(X: torch.Tensor, keep: int) -> np.ndarray:
    """Per column, the mean of the keep values nearest the median, ordered by (distance, value):
    the greedy walk's choice written as a sort (a tie in distance takes the lower value)."""
    x = X.double().cpu().numpy()
    med = np.median(x, axis=0)
    out = np.empty(x.shape[1])
    for d in range(x.shape[1]):
        col = x[:, d]
        order = np.lexsort((col, np.abs(col - med[d])))
        out[d] = col[order[:keep]].mean()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("K", "keep"), [(1, 1), (2, 1), (2, 2), (3, 1), (5, 3), (6, 2), (11, 3), (16, 9), (23, 15)]
)
def test_mean_around_median_takes_the_values_nearest_the_median(backend, K, keep, seed) -> None:
    D = width(backend) if backend != "cpu" else 3001
    X = normal(K, D, torch.float32, seed)
    X[:, : D // 4] = small_ints(K, D // 4, torch.float32, seed + 1)  # ties in value and distance
    got = kernels.mean_around_median(strided(X, device(backend)), keep, backend=backend)
    want = around_median_oracle(X, keep)
    # The chosen set is the oracle's (distances are exact in float64); only the float32
    # rounding of the sum's result differs.
    np.testing.assert_allclose(got.double().cpu().numpy(), want, rtol=2e-7, atol=1e-7,
                               err_msg=f"seed {seed}")  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_mean_around_median_is_the_trimmed_mean_on_symmetric_columns(backend, seed) -> None:
    # Columns symmetric about their median: the window is centred, a trim of (K - keep) / 2.
    half = normal(6, 257, torch.float64, seed).abs() + 0.1
    centre = normal(1, 257, torch.float64, seed + 1)
    X = torch.cat([centre - half, centre, centre + half])  # K = 13
    got = kernels.mean_around_median(X, 7, backend=backend)
    torch.testing.assert_close(got, kernels.trimmed_mean(X, cut=3, backend="reference"))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_mean_around_median_above_the_register_rows(backend, seed) -> None:
    K = (_cpu_order.NETWORK_MAX_K if backend == "cpu" else triton_order.MAX_SORT_ROWS) + 3
    X = normal(K, 67, torch.float32, seed)
    got = kernels.mean_around_median(X.to(device(backend)), K // 3, backend=backend)
    np.testing.assert_allclose(got.double().cpu().numpy(), around_median_oracle(X, K // 3),
                               rtol=2e-7, atol=1e-7, err_msg=f"seed {seed}")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_mean_around_median_other_dtypes(dtype, seed) -> None:
    X = normal(9, 301, dtype, seed)
    got = kernels.mean_around_median(X, 5, backend="cpu")
    assert got.dtype == dtype
    want = torch.from_numpy(around_median_oracle(X, 5)).to(dtype)
    # Rounded once from float64 (half inputs are exact in float32): at most one unit apart.
    tol = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_mean_around_median_refuses_a_bad_keep() -> None:
    X = torch.zeros(4, 5)
    with pytest.raises(ValueError, match="keep=5 values of 4 rows"):
        kernels.mean_around_median(X, 5)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        kernels.mean_around_median(X, 0)
    with pytest.raises(ValueError, match="zero rows"):
        kernels.mean_around_median(torch.zeros(0, 5), 1)
