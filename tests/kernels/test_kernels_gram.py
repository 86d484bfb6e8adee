"""`gram_matrix` and `pairwise_sq_distances` against float64 oracles (numpy, scipy's cdist).

Every backend available on a CPU (reference, cpu, triton under TRITON_INTERPRET=1 when there is
no GPU) on small shapes; fresh random inputs, the seed in every assertion message. Accuracy is
norm-wise, as in docs/kernels.md: |G_ij - ref| <= tol |x_i| |y_j| for the Gram and
|d_ij - ref| <= tol (|x_i|^2 + |y_j|^2) for the squared distances.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
import torch
from scipy.spatial.distance import cdist

if not torch.cuda.is_available():
    # Triton reads this when its kernels are decorated, so before the backend is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aggsrv import kernels  # noqa: E402

BACKENDS = ["reference", "cpu", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPE_IDS = ["f32", "f16", "bf16", "f64"]
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 2e-2, torch.bfloat16: 2e-2}
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FNS = {"gram": kernels.gram_matrix, "dist": kernels.pairwise_sq_distances}


class Rng:
    """Seeded draws on the device a backend runs on; the seed goes into every message."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)
        self.device = "cpu"

    def rows(self, K: int, D: int, dtype=torch.float32, strided: bool = True) -> torch.Tensor:
        """[K, D] rows; by default a strided window `big[:, 3:3+D]` of a wider tensor."""
        big = torch.randn(K, D + 11 if strided else D, generator=self.gen, dtype=torch.float64)
        big = big.to(self.device, dtype)
        return big[:, 3 : 3 + D] if strided else big


@pytest.fixture
def rng() -> Rng:
    return Rng(secrets.randbits(31))


def on(backend: str, rng: Rng) -> str:
    """Point `rng` at the backend's device; returns the backend."""
    rng.device = TRITON_DEVICE if backend == "triton" else "cpu"
    return backend


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).numpy()


def oracle(X: torch.Tensor, Y: torch.Tensor | None):
    """(Gram, squared distances, |x_i||y_j|, |x_i|^2 + |y_j|^2) in float64 numpy/scipy."""
    x = np64(X)
    y = x if Y is None else np64(Y)
    nx, ny = (x * x).sum(1), (y * y).sum(1)
    return x @ y.T, cdist(x, y, "sqeuclidean"), np.sqrt(np.outer(nx, ny)), nx[:, None] + ny


def assert_within(ours, ref, scale, tol: float, msg: str) -> None:
    """|ours - ref| <= tol * scale elementwise (plus a denormal-sized floor)."""
    o = np64(ours)
    assert o.shape == ref.shape, f"{msg}: shape {o.shape} vs {ref.shape}"
    assert np.all(np.isfinite(o)), f"{msg}: non-finite values"
    err = np.abs(o - ref)
    bad = err > tol * scale + 1e-30
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{msg}: {int(bad.sum())} entries off; first at {i}: ours {o[i]!r}, ref {ref[i]!r}, "
            f"err {err[i]:.3e} > {tol:.1e} * {scale[i]:.3e}"
        )


def check(X, Y, backend: str, tol: float, msg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both kernels against the oracles (and against backend=reference); self-case rules."""
    G = kernels.gram_matrix(X, other=Y, backend=backend)
    Dd = kernels.pairwise_sq_distances(X, other=Y, backend=backend)
    g_ref, d_ref, g_scale, d_scale = oracle(X, Y)
    for name, t in (("gram", G), ("dist", Dd)):
        assert t.dtype == acc_dtype(X.dtype) and t.device == X.device, f"{msg} {name}"
    assert_within(G, g_ref, g_scale, tol, msg + " gram")
    assert_within(Dd, d_ref, d_scale, tol, msg + " dist")
    assert bool((Dd >= 0).all()), f"{msg}: negative squared distance"
    if Y is None:
        assert torch.equal(G, G.T), f"{msg}: Gram not exactly symmetric"
        assert torch.equal(Dd, Dd.T), f"{msg}: distances not exactly symmetric"
        assert bool((Dd.diagonal() == 0).all()), f"{msg}: diagonal {Dd.diagonal()}"
    if backend != "reference":
        for name, fn in FNS.items():
            want = fn(X, other=Y, backend="reference")
            assert want.dtype == G.dtype
            scale = g_scale if name == "gram" else d_scale
            ours = G if name == "gram" else Dd
            assert_within(ours, np64(want), scale, tol, f"{msg} {name} vs backend=reference")
    return G, Dd


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [1, 7, 1031])
@pytest.mark.parametrize("mode", ["self", "other"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gram_and_distances(backend, dtype, mode, D, rng):
    """Strided rows with a zero row, a scaled copy and an exact duplicate; K != M."""
    on(backend, rng)
    K, M = 7, 5
    X = rng.rows(K, D, dtype)
    X[1] = (X[0].double() * -2.5).to(dtype)
    X[3] = 0.0
    X[5] = X[2]  # duplicate: distance 0 up to the Gram's rounding
    Y = None
    if mode == "other":
        Y = rng.rows(M, D, dtype)
        Y[0] = X[2]
        Y[4] = 0.0
    msg = f"[{backend},{dtype},{mode},D={D}] seed={rng.seed}"
    G, Dd = check(X, Y, backend, TOL[dtype], msg)
    assert (G[3] == 0).all(), f"{msg}: a zero row must give exact zeros in the Gram"


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_rows_both_paths(backend, rng):
    """K, M above one Triton block (64) and a cross product above the CPU thin-path limit
    (K x M > 64 x 64, BLAS plus a norm pass) as well as below it (one numba pass)."""
    on(backend, rng)
    D = 257
    X = rng.rows(70, D)
    X[69] = X[0]
    msg = f"many rows [{backend}] seed={rng.seed}"
    check(X, None, backend, 1e-5, msg + " self K=70")
    check(X, rng.rows(61, D), backend, 1e-5, msg + " other 70x61")
    check(X[:9], rng.rows(66, D), backend, 1e-5, msg + " other 9x66")


@pytest.mark.parametrize("backend", BACKENDS)
def test_k1_and_empty(backend, rng):
    on(backend, rng)
    x = rng.rows(1, 1031)
    n = float((x.double() ** 2).sum())
    for fn in FNS.values():
        assert fn(x, backend=backend).shape == (1, 1)
    assert kernels.gram_matrix(x, backend=backend).item() == pytest.approx(n, rel=1e-6)
    assert kernels.pairwise_sq_distances(x, backend=backend).item() == 0.0
    y = rng.rows(1, 1031)
    check(x, y, backend, 1e-5, f"K=M=1 [{backend}] seed={rng.seed}")
    dev = x.device
    for name, fn in FNS.items():
        msg = f"{name}[{backend}] empty"
        assert fn(torch.empty(0, 5, device=dev), backend=backend).shape == (0, 0), msg
        z = fn(torch.empty(3, 0, device=dev), backend=backend)  # D = 0: all zero
        assert z.shape == (3, 3) and z.dtype == torch.float32 and (z == 0).all(), msg
        e = fn(x, other=torch.empty(0, 1031, device=dev), backend=backend)
        assert e.shape == (1, 0), msg
        h = fn(torch.empty(2, 0, dtype=torch.float64, device=dev), backend=backend)
        assert h.dtype == torch.float64 and (h == 0).all(), msg


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic(backend, rng):
    """Two calls are bitwise equal; `auto` on CPU tensors is the cpu backend, bitwise."""
    on(backend, rng)
    X = rng.rows(9, 1031)
    Y = rng.rows(4, 1031)
    for name, fn in FNS.items():
        for other in (None, Y, X):
            a, b = fn(X, other=other, backend=backend), fn(X, other=other, backend=backend)
            assert torch.equal(a, b), f"{name}[{backend}] not deterministic, seed={rng.seed}"
            if backend == "cpu":
                assert torch.equal(a, fn(X, other=other)), f"{name}: auto != cpu"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_long_close_rows(backend, rng):
    """Long rows much closer to each other than to 0 (model weights): the error stays within
    the norm-wise bound, and subtracting a common point brings it down to the distances."""
    on(backend, rng)
    D = 200_003
    base = rng.rows(1, D, torch.float64, strided=False) * 0.1 + 1.0
    noise = rng.rows(5, D, torch.float64, strided=False)
    scales = torch.tensor([0.0, 1e-4, 1e-3, 1e-2, 0.1], dtype=torch.float64)[:, None]
    X = (base + scales * noise).float()
    msg = f"long close rows [{backend}] seed={rng.seed}"
    check(X, None, backend, 1e-5, msg)
    centred = X - X[0]
    _, d_ref, _, d_scale = oracle(centred, None)
    Dc = kernels.pairwise_sq_distances(centred, backend=backend)
    assert_within(Dc, d_ref, d_scale, 1e-5, msg + " centred")
    # centred, |x_i|^2 + |x_j|^2 is of the order of the distances themselves
    off = ~np.eye(5, dtype=bool) & (d_ref > 0)
    rel = np.abs(np64(Dc) - d_ref)[off] / d_ref[off]
    assert rel.max() <= 1e-3, f"{msg}: centred relative error {rel.max():.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_half_accumulates_in_float32(backend, dtype, rng):
    """Sums of squares beyond float16's range (65504) come out finite and accurate."""
    on(backend, rng)
    X = rng.rows(3, 70_001, dtype) + 1.0
    check(X, None, backend, 2e-2, f"half sums [{backend},{dtype}] seed={rng.seed}")


def test_cpu_gram_in_chunks(monkeypatch, rng):
    """The CPU backend's batched BLAS products over chunks summed in float64, taken when a side
    has fewer than SMALL_GEMM rows (the chunk shrunk here so small shapes take that path): Gram,
    distances (self, and cross products forced off the thin path), cosines per segment; with a
    ragged last chunk and without."""
    from aggsrv.kernels import cpu

    monkeypatch.setattr(cpu, "GRAM_CHUNK", 100)
    X = rng.rows(cpu.SMALL_GEMM - 1, 1031)
    Y = rng.rows(40, 1031)
    X[4] = Y[7]
    msg = f"chunked [cpu] seed={rng.seed}"
    for D in (1031, 1000):
        check(X[:, :D], None, "cpu", 1e-5, f"{msg} self D={D}")
        with monkeypatch.context() as m:
            m.setattr(cpu, "CROSS_DOTS_MAX", 0)
            check(X[:, :D], Y[:, :D], "cpu", 1e-5, f"{msg} other D={D}")
            check(Y[:, :D], X[:3, :D], "cpu", 1e-5, f"{msg} other, few columns D={D}")
    offs = torch.tensor([0, 40, 40, 777, 1031])
    for layerwise in (False, True):
        C = kernels.cosine_matrix(X, offs, layerwise=layerwise, backend="cpu")
        want = kernels.cosine_matrix(X, offs, layerwise=layerwise, backend="reference")
        assert float((C - want).abs().max()) <= 1e-5, f"{msg} cosine layerwise={layerwise}"


def test_cosine_is_the_normalised_gram(rng):
    """cosine_matrix and gram_matrix share the CPU Gram pass: G_ij / (|x_i||x_j|) matches."""
    X = rng.rows(6, 1031)
    G = kernels.gram_matrix(X, backend="cpu").double()
    n = G.diagonal().sqrt()
    C = kernels.cosine_matrix(X, backend="cpu").double()
    assert float((G / (n[:, None] * n[None, :]) - C).abs().max()) <= 1e-6, f"seed={rng.seed}"
    sq = kernels.layer_dots(X, X, backend="cpu").double()
    assert float((G.diagonal() - sq).abs().max() / sq.max()) <= 1e-6, f"seed={rng.seed}"


# --------------------------------------------------------------------------------------------
# argument errors: the same exceptions, with the same messages, as cosine_matrix


def _bad_calls():
    X = torch.randn(3, 37)
    return {
        "one_dim": ((torch.randn(37),), {}),
        "three_dim": ((torch.randn(2, 3, 37),), {}),
        "int_dtype": ((torch.ones(3, 37, dtype=torch.int64),), {}),
        "not_tensor": ((np.ones((3, 37)),), {}),
        "other_dtype": ((X,), {"other": torch.randn(2, 37, dtype=torch.float64)}),
        "other_length": ((X,), {"other": torch.randn(2, 38)}),
        "other_one_dim": ((X,), {"other": torch.randn(37)}),
        "other_int": ((X,), {"other": torch.ones(2, 37, dtype=torch.int32)}),
        "backend": ((X,), {"backend": "cuda"}),
        "cpu_backend_needs_cpu": None,
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_errors_match_cosine_matrix(case):
    spec = _bad_calls()[case]
    if spec is None:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        spec = ((torch.randn(3, 37, device="cuda"),), {"backend": "cpu"})
    args, kw = spec
    with pytest.raises((ValueError, TypeError)) as want:
        kernels.cosine_matrix(*args, **kw)
    for name, fn in FNS.items():
        with pytest.raises(want.type) as got:
            fn(*args, **kw)
        assert str(got.value) == str(want.value), name
