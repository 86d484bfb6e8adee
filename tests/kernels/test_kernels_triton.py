"""Triton backend against the float64 reference (under TRITON_INTERPRET=1 on a CPU machine).

Backends take validated, normalised arguments (kernels/BACKENDS.md), so these tests call the
backend functions directly with [K, D] rows and CPU int64 offsets, on small shapes: the
interpreter runs about 1 ms per program.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from kernel_tolerances import HALF, assert_close_normwise, cos_tol, vec_tol

if not torch.cuda.is_available():
    # conftest.py does this already; kept so the file also runs on its own.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402, F401  (a dev dependency: a missing one must fail, not skip)
from aggsrv.kernels import reference as ref  # noqa: E402
from aggsrv.kernels import triton as tk  # noqa: E402
from aggsrv.kernels.triton import _common  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Ragged layout: an empty first and middle segment, lengths that are not multiples of a block.
OFFS = torch.tensor([0, 0, 37, 37, 300, 301, 1000], dtype=torch.int64)
D = int(OFFS[-1])


def _group_means(backend, X, groups, num_groups):
    """Call a backend's group_means, which writes into a caller-provided [G, D] buffer."""
    out = torch.empty(num_groups, X.shape[1], dtype=X.dtype, device=X.device)
    backend.group_means(X, torch.as_tensor(groups).cpu(), num_groups, out)
    return out


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEV, dtype)


@pytest.fixture(params=["default", "small"])
def blocks(request, monkeypatch):
    """Run under the default blocks and under tiny ones, so segments span several tiles and
    blocks end mid-segment even on small shapes."""
    if request.param == "small":
        monkeypatch.setattr(_common, "INTERP", _common.LaunchConfig(block=32, tile=96, num_warps=4))
    return request.param


# ------------------------------------------------------------------------------------ layer_dots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 5])
def test_layer_dots(dtype, K, blocks):
    a = rand(K, D, dtype=dtype, seed=1)
    b = rand(1, D, dtype=dtype, seed=2)
    got = tk.layer_dots(a, b, OFFS)
    want = ref.layer_dots(a, b, OFFS)
    assert got.dtype == want.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.shape == (K, len(OFFS) - 1)
    assert_close_normwise(got, want, vec_tol(dtype))
    # Empty segments are exactly zero.
    assert torch.all(got[:, 0] == 0) and torch.all(got[:, 2] == 0)
    paired = tk.layer_dots(a, a, OFFS)
    assert_close_normwise(paired, ref.layer_dots(a, a, OFFS), vec_tol(dtype))


def test_layer_dots_strided_rows_and_whole_vector():
    wide = rand(4, D + 50, seed=3)
    a = wide[:, 20 : 20 + D]  # column slice: row stride D + 50
    b = rand(4, D, seed=4)
    assert a.stride(0) == D + 50
    assert_close_normwise(tk.layer_dots(a, b, OFFS), ref.layer_dots(a, b, OFFS), 1e-5)
    whole = torch.tensor([0, D])
    assert_close_normwise(tk.layer_dots(a, b, whole), ref.layer_dots(a, b, whole), 1e-5)


# ----------------------------------------------------------------------------------- project_out


def _segments():
    o = OFFS.tolist()
    return list(zip(o[:-1], o[1:], strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("only_conflicting", [False, True])
def test_project_out(dtype, only_conflicting, blocks):
    K = 4
    g = rand(K, D, dtype=dtype, seed=5)
    b = rand(1, D, dtype=dtype, seed=6)
    b[:, 37:300] = 0  # zero basis on one segment: coefficient 0, bitwise copy
    # Row 1 points along b on segment [301, 1000): positive dot, dropped by only_conflicting.
    g[1, 301:] = b[0, 301:] * 3
    got = torch.full_like(g, float("nan"))
    want = torch.empty_like(g)
    tk.project_out(g, b, OFFS, only_conflicting, 1e-12, got)
    ref.project_out(g, b, OFFS, only_conflicting, 1e-12, want)
    assert_close_normwise(got, want, vec_tol(dtype))
    assert torch.equal(got[:, 37:300], g[:, 37:300])
    if only_conflicting:
        assert torch.equal(got[1, 301:], g[1, 301:])
    # Every segment whose reference kept g bitwise is a bitwise copy here too.
    for s, e in _segments():
        for k in range(K):
            if torch.equal(want[k, s:e], g[k, s:e]):
                assert torch.equal(got[k, s:e], g[k, s:e])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_project_out_in_place(dtype, blocks):
    g = rand(3, D, dtype=dtype, seed=7)
    b = rand(1, D, dtype=dtype, seed=8)
    b[:, 301:] = 0
    want = torch.empty_like(g)
    ref.project_out(g, b, OFFS, False, 1e-12, want)
    g_copy = g.clone()
    tk.project_out(g, b, OFFS, False, 1e-12, g)  # out = g
    assert_close_normwise(g, want, vec_tol(dtype))
    assert torch.equal(g[:, 301:], g_copy[:, 301:])


def test_project_out_strided_and_k1():
    wide = rand(1, D + 16, seed=9)
    g = wide[:, 16:]
    b = rand(1, D, seed=10)
    got = torch.empty(1, D, device=DEV)
    want = torch.empty(1, D, device=DEV)
    tk.project_out(g, b, OFFS, False, 1e-12, got)
    ref.project_out(g, b, OFFS, False, 1e-12, want)
    assert_close_normwise(got, want, 1e-5)
    # The projected vector is orthogonal to b per segment.
    assert torch.all(ref.layer_dots(got, b, OFFS).abs() < 1e-3)


# ------------------------------------------------------------------------- orthogonal_calibrate


def _calib_inputs(dtype, seed=11):
    x, sent, w, snap, ma = (rand(1, D, dtype=dtype, seed=seed + i) for i in range(5))
    sent[:, 301:] = x[:, 301:]  # dm = 0 there: coefficient 0 though calibrated
    calibrate = torch.tensor([True, True, True, False, True, True])
    return x, sent, w, snap, ma, calibrate


@pytest.mark.parametrize("dtype", DTYPES)
def test_orthogonal_calibrate(dtype, blocks):
    x, sent, w, snap, ma, cal = _calib_inputs(dtype)
    y1, m1 = torch.empty_like(x), torch.empty_like(x)
    y2, m2 = torch.empty_like(x), torch.empty_like(x)
    c1 = tk.orthogonal_calibrate(x, sent, w, snap, ma, OFFS, 0.25, cal, 1e-12, y1, m1)
    c2 = ref.orthogonal_calibrate(x, sent, w, snap, ma, OFFS, 0.25, cal, 1e-12, y2, m2)
    assert c1.dtype == c2.dtype and c1.shape == c2.shape
    tol = vec_tol(dtype)
    assert_close_normwise(c1, c2, tol if dtype not in HALF else 5e-2)
    assert_close_normwise(y1, y2, tol)
    assert_close_normwise(m1, m2, tol)
    assert c1[3] == 0 and c1[5] == 0
    assert torch.equal(y1[:, 300:301], x[:, 300:301])  # segment 3 not calibrated: bitwise x


def test_orthogonal_calibrate_aliases(blocks):
    x, sent, w, snap, _, cal = _calib_inputs(torch.float32, seed=21)
    ma = w  # ma may be the same tensor as w
    y2, m2 = torch.empty_like(x), torch.empty_like(x)
    c2 = ref.orthogonal_calibrate(x, sent, w, snap, ma, OFFS, 0.5, cal, 1e-12, y2, m2)
    x0 = x.clone()
    # out_y = x and out_ma = ma (= w): pass 1 must finish reading before pass 2 writes.
    c1 = tk.orthogonal_calibrate(x, sent, w, snap, ma, OFFS, 0.5, cal, 1e-12, x, ma)
    assert_close_normwise(c1, c2, 1e-5)
    assert_close_normwise(x, y2, 1e-5)
    assert_close_normwise(ma, m2, 1e-5)
    assert torch.equal(x[:, 300:301], x0[:, 300:301])


# -------------------------------------------------------------------------------- cosine_matrix


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layerwise", [False, True])
def test_cosine_matrix_self(dtype, layerwise, blocks):
    X = rand(6, D, dtype=dtype, seed=30)
    X[2] = 0  # zero row: zero cosines, zero diagonal
    X[4, 37:300] = 0  # zero on one segment only
    X[5] = X[0] * 2  # parallel rows: cosine 1 up to rounding
    got = tk.cosine_matrix(X, OFFS, None, layerwise)
    want = ref.cosine_matrix(X, OFFS, None, layerwise)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max().item() <= cos_tol(dtype)
    mats = got if layerwise else got[None]
    assert torch.equal(mats, mats.transpose(-1, -2))  # exactly symmetric
    assert mats.abs().max() <= 1
    assert torch.equal(
        torch.diagonal(mats, dim1=-2, dim2=-1),
        torch.diagonal(want if layerwise else want[None], dim1=-2, dim2=-1),
    )
    assert torch.all(mats[:, 2] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layerwise", [False, True])
def test_cosine_matrix_other(dtype, layerwise, blocks):
    X = rand(5, D, dtype=dtype, seed=31)
    Y = rand(19, D, dtype=dtype, seed=32)  # M not a power of two, larger than K
    Y[3] = 0
    got = tk.cosine_matrix(X, OFFS, Y, layerwise)
    want = ref.cosine_matrix(X, OFFS, Y, layerwise)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max().item() <= cos_tol(dtype)
    assert torch.all(got[..., 3] == 0)


def test_cosine_matrix_k1_and_strided():
    wide = rand(3, D + 40, seed=33)
    X = wide[:, 40:]
    diff = tk.cosine_matrix(X, OFFS, None, True) - ref.cosine_matrix(X, OFFS, None, True)
    assert diff.abs().max() <= 1e-5
    one = X[:1]
    got = tk.cosine_matrix(one, OFFS, None, False)
    assert got.shape == (1, 1) and got.item() == 1.0


def test_cosine_matrix_many_rows():
    # More rows than one block (64): several (i, j) block pairs and mirrored off-diagonal blocks.
    offs = torch.tensor([0, 70, 150])
    X = rand(70, 150, seed=34)
    got = tk.cosine_matrix(X, offs, None, False)
    assert (got - ref.cosine_matrix(X, offs, None, False)).abs().max() <= 1e-5
    assert torch.equal(got, got.T) and torch.all(torch.diagonal(got) == 1)
    Y = rand(67, 150, seed=35)
    got = tk.cosine_matrix(X, offs, Y, True)
    assert (got - ref.cosine_matrix(X, offs, Y, True)).abs().max() <= 1e-5


# ---------------------------------------------------------------------- layer_normalized_cosine


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_layer_normalized_cosine(dtype, blocks):
    X = rand(5, D, dtype=dtype, seed=40)
    X[1, 301:] = 0  # zero on one non-empty segment: contributes 0 there
    got = tk.layer_normalized_cosine(X, OFFS)
    want = ref.layer_normalized_cosine(X, OFFS)
    assert got.dtype == want.dtype
    assert (got - want).abs().max().item() <= cos_tol(dtype)
    assert torch.equal(got, got.T)
    diag = torch.diagonal(got)
    assert diag[0] == 1 and diag[2] == 1 and diag[1] < 1


def test_layer_normalized_cosine_no_nonempty_segment():
    X = rand(3, 0, seed=41)
    got = tk.layer_normalized_cosine(X, torch.tensor([0, 0, 0]))
    assert got.shape == (3, 3) and torch.all(got == 0)


# ---------------------------------------------------------------------------------- group_means


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_means(dtype, blocks):
    X = rand(7, D, dtype=dtype, seed=50)
    groups = torch.tensor([0, -1, 2, 0, -1, 2, 0])
    X[1] = float("nan")  # excluded rows are never read
    X[4] = float("inf")
    got = _group_means(tk, X, groups, 4)
    want = _group_means(ref, X, groups, 4)
    assert got.dtype == X.dtype and got.shape == (4, D)
    assert torch.all(got[1] == 0) and torch.all(got[3] == 0)  # empty groups
    assert_close_normwise(got, want, vec_tol(dtype))


def test_group_means_strided_all_excluded():
    wide = rand(3, D + 8, seed=51)
    X = wide[:, 8:]
    groups = torch.tensor([1, 1, 0])
    assert_close_normwise(_group_means(tk, X, groups, 2), _group_means(ref, X, groups, 2), 1e-5)
    got = _group_means(tk, X, torch.tensor([-1, -1, -1]), 2)
    assert torch.all(got == 0)


# --------------------------------------------------------------------------------- weighted_sum


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_weighted_sum(dtype, beta, blocks):
    X = rand(6, D, dtype=dtype, seed=60)
    w = torch.rand(6, generator=torch.Generator().manual_seed(61), dtype=torch.float64)
    init = rand(D, dtype=dtype, seed=62)
    if beta == 0.0:
        init[::7] = float("nan")  # old content is ignored, NaN included
    got, want = init.clone(), init.clone()
    tk.weighted_sum(X, w, got, 1.5, beta)
    ref.weighted_sum(X, w, want, 1.5, beta)
    assert not torch.isnan(got).any()
    assert_close_normwise(got, want, vec_tol(dtype))


def test_weighted_sum_strided():
    wide = rand(4, D + 30, seed=63)
    X = wide[:, 30:]
    w = torch.tensor([0.1, -2.0, 0.0, 3.0], dtype=torch.float64)
    got = torch.empty(D, device=DEV)
    want = torch.empty(D, device=DEV)
    tk.weighted_sum(X, w, got, 1.0, 0.0)
    ref.weighted_sum(X, w, want, 1.0, 0.0)
    assert_close_normwise(got, want, 1e-5)


# -------------------------------------------------------------------------------- determinism


def test_determinism():
    X = rand(9, D, seed=70)
    b = rand(1, D, seed=71)
    assert torch.equal(tk.layer_dots(X, b, OFFS), tk.layer_dots(X, b, OFFS))
    o1, o2 = torch.empty_like(X), torch.empty_like(X)
    tk.project_out(X, b, OFFS, True, 1e-12, o1)
    tk.project_out(X, b, OFFS, True, 1e-12, o2)
    assert torch.equal(o1, o2)
    assert torch.equal(tk.cosine_matrix(X, OFFS, None, True), tk.cosine_matrix(X, OFFS, None, True))
    assert torch.equal(tk.layer_normalized_cosine(X, OFFS), tk.layer_normalized_cosine(X, OFFS))
    groups = torch.tensor([0, 1, 0, 1, 0, -1, 2, 2, 0])
    assert torch.equal(_group_means(tk, X, groups, 3), _group_means(tk, X, groups, 3))
    w = torch.linspace(-1, 1, 9, dtype=torch.float64)
    s1, s2 = torch.empty(D, device=DEV), torch.empty(D, device=DEV)
    tk.weighted_sum(X, w, s1, 1.0, 0.0)
    tk.weighted_sum(X, w, s2, 1.0, 0.0)
    assert torch.equal(s1, s2)
    x, sent, ww, snap, ma, cal = _calib_inputs(torch.float32, seed=72)
    outs = []
    for _ in range(2):
        y, m = torch.empty_like(x), torch.empty_like(x)
        c = tk.orthogonal_calibrate(x, sent, ww, snap, ma, OFFS, 0.1, cal, 1e-12, y, m)
        outs.append((c, y, m))
    assert all(torch.equal(p, q) for p, q in zip(outs[0], outs[1], strict=True))


# ---------------------------------------------------------------------------- linkage + public


def test_average_linkage_delegates_to_cpu():
    from scipy.cluster.hierarchy import linkage

    d = np.random.default_rng(80).random(15)  # n = 6
    Z = tk.average_linkage(d)
    Zs = linkage(d, method="average")
    np.testing.assert_array_equal(Z[:, [0, 1, 3]], Zs[:, [0, 1, 3]])
    np.testing.assert_allclose(Z[:, 2], Zs[:, 2], rtol=1e-9)


def test_public_api_dispatches_to_triton():
    from aggsrv import kernels

    X = rand(3, D, seed=90)
    got = kernels.cosine_matrix(X, offsets=OFFS, layerwise=True, backend="triton")
    want = kernels.cosine_matrix(X, offsets=OFFS, layerwise=True, backend="reference")
    assert (got - want).abs().max() <= 1e-5
