"""nnz_per_layer and sparse_accumulate on every backend against numpy float64 oracles."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
import torch
from triton_scalars import compiled_scalar_types

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from aggsrv import kernels  # noqa: E402

BACKENDS = ["reference", "cpu", "triton"]
DEVICE = {
    "reference": "cpu",
    "cpu": "cpu",
    "triton": "cuda" if torch.cuda.is_available() else "cpu",
}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _gpu_scalar_types(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter, type Python float kernel arguments as the GPU launcher does."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        compiled_scalar_types(monkeypatch)


@triton.jit
def _store_scalar_kernel(out_ptr, x):
    tl.store(out_ptr, x)


def test_a_python_float_kernel_argument_arrives_as_float32() -> None:
    """The hazard the sparse kernel fell into: on the GPU a Python float argument is float32,
    and (through the fixture above) so it is under the interpreter."""
    x = 0.1 + 2.0**-40  # float32 rounding changes it
    out = torch.zeros(1, dtype=torch.float64, device=DEVICE["triton"])
    _store_scalar_kernel[(1,)](out, x)
    assert float(out[0]) == float(np.float32(x)) != x


def _seed() -> int:
    seed = secrets.randbits(31)
    print(f"seed {seed}")
    return seed


def _sparse_rows(K: int, D: int, density: float, gen: torch.Generator) -> torch.Tensor:
    X = torch.randn(K, D, generator=gen)
    X[torch.rand(K, D, generator=gen) > density] = 0.0
    return X


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64", "f16", "bf16"])
def test_nnz_per_layer_counts(backend: str, dtype: torch.dtype) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    D = 1013
    # Odd segments, an empty one in the middle and one at the end.
    offsets = torch.tensor([0, 7, 300, 300, 1000, D, D])
    X = _sparse_rows(5, D, 0.3, gen)
    X[1, 10] = float("nan")  # NaN is not zero
    X[2, 11] = -0.0  # -0.0 is zero
    Xd = X.to(dtype).to(DEVICE[backend])
    got = kernels.nnz_per_layer(Xd, offsets, backend=backend).cpu().numpy()
    x = Xd.cpu().double().numpy()
    o = offsets.numpy()
    want = np.stack(
        [[np.count_nonzero(x[k, o[i] : o[i + 1]] != 0) for i in range(len(o) - 1)]
         for k in range(x.shape[0])]
    )  # fmt: skip
    assert got.dtype == np.int64 and np.array_equal(got, want), seed
    # A [D] input gives [L]; no offsets: the whole vector.
    one = kernels.nnz_per_layer(Xd[3], offsets, backend=backend).cpu().numpy()
    assert np.array_equal(one, want[3])
    whole = kernels.nnz_per_layer(Xd, backend=backend).cpu().numpy()
    assert np.array_equal(whole[:, 0], want.sum(axis=1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nnz_of_zeros_and_k1(backend: str) -> None:
    z = torch.zeros(1, 77, device=DEVICE[backend])
    assert kernels.nnz_per_layer(z, [0, 50, 77], backend=backend).tolist() == [[0, 0]]
    dense = torch.ones(77, device=DEVICE[backend])
    assert kernels.nnz_per_layer(dense, [0, 50, 77], backend=backend).tolist() == [50, 27]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_sparse_accumulate_matches_float64_oracle(backend: str, dtype: torch.dtype) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    D, n = 1013, 137
    idx = torch.sort(torch.randperm(D, generator=gen)[:n]).values
    vals = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    row = torch.randn(D, generator=gen, dtype=torch.float64).to(dtype)
    w = -0.37
    out = row.clone().to(DEVICE[backend])
    res = kernels.sparse_accumulate(out, idx.to(DEVICE[backend]), vals.to(DEVICE[backend]), w,
                                    backend=backend)  # fmt: skip
    assert res is out
    want = row.double().numpy().copy()
    want[idx.numpy()] += w * vals.double().numpy()
    got = out.cpu().double().numpy()
    untouched = np.ones(D, dtype=bool)
    untouched[idx.numpy()] = False
    assert np.array_equal(got[untouched], row.double().numpy()[untouched]), seed  # bitwise
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=str(seed))
    if backend != "triton":  # float64 arithmetic, one rounding: identical to the reference
        ref = row.clone()
        kernels.sparse_accumulate(ref, idx, vals, w, backend="reference")
        assert torch.equal(out.cpu(), ref), seed


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_accumulate_keeps_a_float64_weight_exact(backend: str) -> None:
    """A float64 row takes the weight in float64: 1 + 2^-40 is 1.0 in float32, and every
    product and sum below is exact in float64, so the result is known bit for bit."""
    D = 37
    w = 1.0 + 2.0**-40
    idx = torch.tensor([0, 5, 36], device=DEVICE[backend])
    vals = torch.tensor([2.0**20, -(2.0**21), 3.0], dtype=torch.float64, device=DEVICE[backend])
    out = torch.zeros(D, dtype=torch.float64, device=DEVICE[backend])
    out[5] = 1.0
    kernels.sparse_accumulate(out, idx, vals, w, backend=backend)
    want = torch.zeros(D, dtype=torch.float64)
    want[0] = 2.0**20 + 2.0**-20
    want[5] = 1.0 - 2.0**21 - 2.0**-19
    want[36] = 3.0 + 3.0 * 2.0**-40
    assert torch.equal(out.cpu(), want), (out.cpu() - want)[[0, 5, 36]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_accumulate_equals_dense_add_into_a_cache_row(backend: str) -> None:
    """Into a row of a [K, D] cache with int32 indices; same as adding the densified update."""
    gen = torch.Generator().manual_seed(_seed())
    K, D = 3, 501
    cache = torch.randn(K, D, generator=gen).to(DEVICE[backend])
    dense = _sparse_rows(1, D, 0.05, gen)[0]
    idx = torch.nonzero(dense).flatten().to(torch.int32)
    before = cache.clone()
    kernels.sparse_accumulate(cache[1], idx.to(cache.device), dense[idx.long()].to(cache.device),
                              backend=backend)  # fmt: skip
    torch.testing.assert_close(cache[1].cpu(), before[1].cpu() + dense, rtol=1e-6, atol=1e-6)
    assert torch.equal(cache[0], before[0]) and torch.equal(cache[2], before[2])
    empty = torch.empty(0, dtype=torch.int64, device=cache.device)
    kernels.sparse_accumulate(cache[0], empty, torch.empty(0, device=cache.device),
                              backend=backend)  # fmt: skip
    assert torch.equal(cache[0], before[0])


def test_sparse_accumulate_rejects_bad_input() -> None:
    out = torch.zeros(10)
    v = torch.ones(3)
    with pytest.raises(ValueError, match="strictly increasing"):
        kernels.sparse_accumulate(out, torch.tensor([1, 5, 5]), v)
    with pytest.raises(ValueError, match="strictly increasing"):
        kernels.sparse_accumulate(out, torch.tensor([3, 2, 7]), v)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        kernels.sparse_accumulate(out, torch.tensor([1, 2, 10]), v)
    with pytest.raises(IndexError):
        kernels.sparse_accumulate(out, torch.tensor([-1, 2, 3]), v)
    with pytest.raises(TypeError, match="int32 or int64"):
        kernels.sparse_accumulate(out, torch.tensor([1.0, 2.0, 3.0]), v)
    with pytest.raises(ValueError, match="one entry per index"):
        kernels.sparse_accumulate(out, torch.tensor([1, 2]), v)
    with pytest.raises(TypeError, match="dtype"):
        kernels.sparse_accumulate(out, torch.tensor([1, 2, 3]), v.double())
    with pytest.raises(ValueError, match="finite"):
        kernels.sparse_accumulate(out, torch.tensor([1, 2, 3]), v, float("inf"))
    with pytest.raises(ValueError, match="unit stride"):
        kernels.sparse_accumulate(torch.zeros(20)[::2], torch.tensor([1, 2, 3]), v)
    assert torch.equal(out, torch.zeros(10))  # nothing written by a refused call
    with pytest.raises(ValueError, match="1-D or 2-D"):
        kernels.nnz_per_layer(torch.zeros(2, 2, 2))
