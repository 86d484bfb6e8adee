"""Oracle tests for the public API of `aggsrv.kernels`.

Every backend (reference, cpu, triton under TRITON_INTERPRET=1 when there is no GPU) is checked
against an independent float64 oracle written here with numpy (so `reference` is tested too), and
cpu/triton are cross-checked against `backend="reference"`. Inputs are fresh random draws; the
seed is printed in every assertion message.
"""

from __future__ import annotations

import importlib
import os
import secrets
from dataclasses import dataclass

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when its kernels are decorated, so before the backend is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aggsrv import kernels  # noqa: E402

BACKENDS = ["reference", "cpu", "triton"]
FAST = ["cpu", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPE_IDS = ["f32", "f16", "bf16", "f64"]
# Norm-wise relative tolerance for vectors, absolute for cosines (and dots in cosine units).
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 2e-2, torch.bfloat16: 2e-2}
D_SMALL = 1013  # 1000 + 13: not a multiple of any block size
D_TRITON = 1013
# Triton runs on CUDA tensors when there is a GPU, else on CPU tensors under the interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------
# helpers


def _backend_module(backend: str):
    if backend in ("reference", "auto"):
        return None
    name = {"cpu": "aggsrv.kernels.cpu", "triton": "aggsrv.kernels.triton"}[backend]
    return importlib.import_module(name)


def need(backend: str, fn: str, rng: Rng | None = None) -> None:
    """Check the backend implements `fn` (a missing one fails the test) and point `rng` at the
    backend's device."""
    if rng is not None:
        rng.device = TRITON_DEVICE if backend == "triton" else "cpu"
    mod = _backend_module(backend)
    assert mod is None or hasattr(mod, fn), f"backend {backend!r} has no {fn}"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Rng:
    seed: int
    gen: torch.Generator
    device: str = "cpu"

    def randn(
        self, *shape: int, dtype=torch.float32, scale: float = 1.0, mean: float = 0.0, device=None
    ):
        t = torch.randn(*shape, generator=self.gen, dtype=torch.float64) * scale + mean
        return t.to(device or self.device, dtype)

    def randint(self, lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=self.gen)

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * float(torch.rand((), generator=self.gen, dtype=torch.float64))

    def offsets(self, D: int, n_cuts: int = 6) -> torch.Tensor:
        """Random offsets with empty segments at the start, the end and inside, and a length-1
        segment."""
        cuts = self.randint(2, D - 2, (n_cuts,)).tolist()
        c0 = cuts[0]
        cuts += [c0, c0 + 1]
        offs = [0, 0, *sorted(cuts), D, D]
        return torch.tensor(offs, dtype=torch.int64)

    def rows(self, K: int, D: int, dtype, strided: bool = True, **kw) -> torch.Tensor:
        """[K, D] rows, by default a strided window `big[:, 3:3+D]` of a wider tensor."""
        if not strided:
            return self.randn(K, D, dtype=dtype, **kw)
        big = self.randn(K, D + 11, dtype=dtype, **kw)
        return big[:, 3 : 3 + D]

    def vec(self, D: int, dtype, **kw) -> torch.Tensor:
        """[D] vector at a non-zero storage offset."""
        return self.randn(D + 5, dtype=dtype, **kw)[3 : 3 + D]


@pytest.fixture
def rng() -> Rng:
    seed = secrets.randbits(31)
    return Rng(seed, torch.Generator().manual_seed(seed))


def np64(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().to(torch.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def segs(offs, D: int) -> list[tuple[int, int]]:
    if offs is None:
        return [(0, D)]
    o = [int(v) for v in offs]
    return list(zip(o[:-1], o[1:], strict=True))


def assert_rel(ours, ref, tol: float, msg: str, atol: float = 1e-30) -> None:
    """||ours - ref|| <= tol * ||ref|| + atol (norm-wise, float64)."""
    o, r = np64(ours), np64(ref)
    assert o.shape == r.shape, f"{msg}: shape {o.shape} vs {r.shape}"
    assert np.all(np.isfinite(o)), f"{msg}: non-finite values in result"
    err = float(np.linalg.norm(o - r))
    scale = float(np.linalg.norm(r))
    assert err <= tol * scale + atol, f"{msg}: ||err|| = {err:.3e}, ||ref|| = {scale:.3e}, " + (
        f"rel = {err / scale:.3e} > {tol:.1e}" if scale > 0 else "ref is zero"
    )


def assert_abs(ours, ref, tol: float, msg: str) -> None:
    o, r = np64(ours), np64(ref)
    assert o.shape == r.shape, f"{msg}: shape {o.shape} vs {r.shape}"
    assert np.all(np.isfinite(o)), f"{msg}: non-finite values in result"
    err = np.abs(o - r)
    i = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
    assert err.size == 0 or err[i] <= tol, (
        f"{msg}: max abs err {err[i]:.3e} > {tol:.1e} at {i} (ours {o[i]!r}, ref {r[i]!r})"
    )


def assert_dots(ours, ref, scale, tol: float, msg: str) -> None:
    """|ours - ref| <= tol * |a_seg| |b_seg| elementwise (the error of a dot in cosine units)."""
    o, r, s = np64(ours), np64(ref), np64(scale)
    assert o.shape == r.shape, f"{msg}: shape {o.shape} vs {r.shape}"
    assert np.all(np.isfinite(o)), f"{msg}: non-finite values in result"
    err = np.abs(o - r)
    bad = err > tol * s + 1e-30
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{msg}: {int(bad.sum())} dots off; first at {i}: ours {o[i]!r}, ref {r[i]!r}, "
            f"err {err[i]:.3e} > {tol:.1e} * |a||b| = {tol * s[i]:.3e}"
        )


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view that compares bit patterns (so NaN == NaN and -0 != +0)."""
    t = t.detach().contiguous()
    idt = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.view(idt)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# --------------------------------------------------------------------------------------------
# float64 oracles (numpy), independent of kernels/reference.py


def o_dots(a: np.ndarray, b: np.ndarray, sg) -> tuple[np.ndarray, np.ndarray]:
    """a [K, D], b [K or 1, D] -> dots [K, L] and |a_seg||b_seg| [K, L]."""
    K = a.shape[0]
    b = np.broadcast_to(b, a.shape)
    dots = np.zeros((K, len(sg)))
    scale = np.zeros((K, len(sg)))
    for j, (s, e) in enumerate(sg):
        dots[:, j] = np.einsum("kd,kd->k", a[:, s:e], b[:, s:e])
        scale[:, j] = np.linalg.norm(a[:, s:e], axis=1) * np.linalg.norm(b[:, s:e], axis=1)
    return dots, scale


def o_project(g: np.ndarray, b: np.ndarray, sg, only_conflicting: bool, eps: float):
    """g [K, D], b [D] -> (y [K, D], c [K, L])."""
    y = g.copy()
    c = np.zeros((g.shape[0], len(sg)))
    for j, (s, e) in enumerate(sg):
        bb = float(b[s:e] @ b[s:e])
        if bb <= eps:
            continue
        cj = g[:, s:e] @ b[s:e] / bb
        if only_conflicting:
            cj = np.minimum(cj, 0.0)
        c[:, j] = cj
        y[:, s:e] = g[:, s:e] - cj[:, None] * b[s:e][None, :]
    return y, c


def o_cos(X: np.ndarray, Y: np.ndarray | None) -> np.ndarray:
    Yv = X if Y is None else Y
    G = X @ Yv.T
    nx = np.linalg.norm(X, axis=1)
    ny = np.linalg.norm(Yv, axis=1)
    den = nx[:, None] * ny[None, :]
    C = np.where(den > 0, G / np.where(den > 0, den, 1.0), 0.0)
    return np.clip(C, -1.0, 1.0)


def o_cos_layers(X: np.ndarray, Y: np.ndarray | None, sg) -> np.ndarray:
    return np.stack([o_cos(X[:, s:e], None if Y is None else Y[:, s:e]) for s, e in sg])


# --------------------------------------------------------------------------------------------
# layer_dots


@pytest.mark.parametrize("with_offsets", [False, True], ids=["whole", "offsets"])
@pytest.mark.parametrize("case", ["paired", "broadcast", "vector", "K1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_dots(backend, dtype, case, with_offsets, rng):
    need(backend, "layer_dots", rng)
    D = D_TRITON if backend == "triton" else D_SMALL
    K = 1 if case == "K1" else 5
    offs = rng.offsets(D) if with_offsets else None
    if case == "vector":
        a, b = rng.vec(D, dtype), rng.vec(D, dtype)
    elif case == "paired":
        a, b = rng.rows(K, D, dtype), rng.rows(K, D, dtype)
    else:
        a, b = rng.rows(K, D, dtype), rng.vec(D, dtype)
    a0, b0 = a.clone(), b.clone()
    res = kernels.layer_dots(a, b, offs, backend=backend)
    msg = f"layer_dots[{backend},{dtype},{case}] seed={rng.seed}"

    sg = segs(offs, D)
    ref, scale = o_dots(np64(a).reshape(-1, D), np64(b).reshape(-1, D), sg)
    if a.dim() == 1:
        ref, scale = ref[0], scale[0]
    if offs is None:
        ref, scale = ref[..., 0], scale[..., 0]
    assert res.dtype == acc_dtype(dtype), msg
    assert res.device == a.device, msg
    assert tuple(res.shape) == ref.shape, f"{msg}: shape {tuple(res.shape)} vs {ref.shape}"
    assert_dots(res, ref, scale, TOL[dtype], msg)
    if offs is not None:
        empty = [j for j, (s, e) in enumerate(sg) if s == e]
        assert (res[..., empty] == 0).all(), f"{msg}: empty segments must give 0"
    assert bitwise_equal(a, a0) and bitwise_equal(b, b0), f"{msg}: inputs modified"
    if backend != "reference":
        want = kernels.layer_dots(a, b, offs, backend="reference")
        assert want.dtype == res.dtype
        assert_dots(res, want, scale, TOL[dtype], msg + " vs backend=reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_dots_offsets_whole_matches_none(backend, rng):
    """offsets=[0, D] is the whole-vector case: same numbers as offsets=None."""
    need(backend, "layer_dots", rng)
    D = D_TRITON
    a, b = rng.rows(3, D, torch.float32), rng.rows(3, D, torch.float32)
    whole = kernels.layer_dots(a, b, None, backend=backend)
    one = kernels.layer_dots(a, b, torch.tensor([0, D]), backend=backend)
    assert one.shape == (3, 1) and whole.shape == (3,)
    assert bitwise_equal(one[:, 0], whole), f"seed={rng.seed}: {one[:, 0]} vs {whole}"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_layer_dots_long_positive_accuracy(backend, rng):
    """Model-sized vectors with a non-zero mean (like weights): a naive float32 running sum
    drifts by ~eps*sqrt(D) relative; the contract is 1e-5."""
    need(backend, "layer_dots", rng)
    D = (1 << 20) + 7
    a = rng.randn(2, D, scale=0.1, mean=1.0)
    b = rng.randn(D, scale=0.1, mean=1.0)
    offs = torch.tensor([0, 5, 200_000, D - 3, D])
    res = kernels.layer_dots(a, b, offs, backend=backend)
    ref, scale = o_dots(np64(a), np64(b)[None, :], segs(offs, D))
    assert_dots(res, ref, scale, 1e-5, f"layer_dots long [{backend}] seed={rng.seed}")
    whole = kernels.layer_dots(a, b, backend=backend)
    ref, scale = o_dots(np64(a), np64(b)[None, :], [(0, D)])
    assert_dots(whole, ref[:, 0], scale[:, 0], 1e-5, f"layer_dots long whole seed={rng.seed}")


# --------------------------------------------------------------------------------------------
# project_out


def _project_inputs(rng: Rng, K: int, D: int, dtype, vector: bool):
    """g and b with one zero-basis segment; row 0 has clearly positive/negative dots per
    segment so that only_conflicting has both kinds of segment."""
    offs = rng.offsets(D)
    sg = segs(offs, D)
    g = rng.vec(D, dtype) if vector else rng.rows(K, D, dtype)
    g0 = g if vector else g[0]
    b = rng.randn(D + 4, dtype=torch.float64)[2 : 2 + D]
    g0_64 = g0.double()
    for j, (s, e) in enumerate(sg):
        sign = 1.0 if j % 2 else -1.0
        b[s:e] = sign * g0_64[s:e] + 0.3 * b[s:e]
    nonempty = [j for j, (s, e) in enumerate(sg) if e - s >= 3]
    zero_seg = nonempty[len(nonempty) // 2]
    s, e = sg[zero_seg]
    b[s:e] = 0.0
    b = b.to(dtype)
    return g, b, offs, sg, zero_seg


@pytest.mark.parametrize("only_conflicting", [False, True], ids=["all", "conflicting"])
@pytest.mark.parametrize("case", ["rows", "vector", "K1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_project_out(backend, dtype, case, only_conflicting, rng):
    need(backend, "project_out", rng)
    D = D_TRITON if backend == "triton" else D_SMALL
    K = 1 if case == "K1" else 4
    g, b, offs, sg, zero_seg = _project_inputs(rng, K, D, dtype, case == "vector")
    g0, b0 = g.clone(), b.clone()
    msg = f"project_out[{backend},{dtype},{case},oc={only_conflicting}] seed={rng.seed}"
    res = kernels.project_out(g, b, offs, only_conflicting=only_conflicting, backend=backend)
    assert res.dtype == dtype and res.shape == g.shape and res.device == g.device, msg
    assert bitwise_equal(g, g0) and bitwise_equal(b, b0), f"{msg}: inputs modified"

    g2, b2 = np64(g).reshape(-1, D), np64(b)
    y, c = o_project(g2, b2, sg, only_conflicting, 0.0)
    assert_rel(res.reshape(-1, D), y, TOL[dtype], msg)

    # Bitwise-copy rule: coefficient 0 (zero basis, or only_conflicting with a clearly
    # non-negative dot) -> the segment is an exact copy of g.
    res2 = res.reshape(-1, D)
    gr = g.reshape(-1, D)
    dots, scale = o_dots(g2, b2[None, :], sg)
    for k in range(gr.shape[0]):
        for j, (s, e) in enumerate(sg):
            copy = j == zero_seg or (only_conflicting and dots[k, j] > 1e-2 * scale[k, j])
            if copy:
                assert bitwise_equal(res2[k, s:e], gr[k, s:e]), (
                    f"{msg}: row {k} segment {j} [{s},{e}) has coefficient 0 "
                    f"(dot {dots[k, j]:.3e}) but is not a bitwise copy of g"
                )
    if backend != "reference":
        want = kernels.project_out(
            g, b, offs, only_conflicting=only_conflicting, backend="reference"
        )
        assert want.dtype == dtype
        assert_rel(res, want, TOL[dtype], msg + " vs backend=reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_project_out_whole_vector_and_zero_basis(backend, dtype, rng):
    need(backend, "project_out", rng)
    D = D_TRITON
    g = rng.rows(3, D, dtype)
    b = rng.vec(D, dtype)
    msg = f"project_out whole [{backend},{dtype}] seed={rng.seed}"
    res = kernels.project_out(g, b, backend=backend)
    y, _ = o_project(np64(g), np64(b), [(0, D)], False, 0.0)
    assert_rel(res, y, TOL[dtype], msg)
    # The result is orthogonal to b (in cosine units).
    d, sc = o_dots(np64(res), np64(b)[None, :], [(0, D)])
    assert np.all(np.abs(d) <= TOL[dtype] * 10 * sc + 1e-30), f"{msg}: not orthogonal: {d}"
    zero = torch.zeros(D, dtype=dtype, device=g.device)
    res0 = kernels.project_out(g, zero, backend=backend)
    assert bitwise_equal(res0, g.contiguous()), f"{msg}: zero basis must copy g bitwise"


@pytest.mark.parametrize("backend", BACKENDS)
def test_project_out_eps(backend, rng):
    """c = 0 where <b,b> <= eps: that segment is copied bitwise, the others are projected."""
    need(backend, "project_out", rng)
    D = D_TRITON
    offs = torch.tensor([0, 300, 301, 700, D])
    sg = segs(offs, D)
    g = rng.rows(3, D, torch.float32)
    b = rng.randn(D)
    b[300:301] = 2.0  # <b,b> = 4 on a length-1 segment
    b[301:700] *= 1e-3  # <b,b> ~ 4e-4
    eps = 0.05
    msg = f"project_out eps [{backend}] seed={rng.seed}"
    res = kernels.project_out(g, b, offs, eps=eps, backend=backend)
    y, _ = o_project(np64(g), np64(b), sg, False, eps)
    assert_rel(res, y, 1e-5, msg)
    assert bitwise_equal(res[:, 301:700], g[:, 301:700]), f"{msg}: <b,b> <= eps segment changed"
    # Length-1 segment with a non-zero basis: the projection removes it entirely.
    assert torch.all(res[:, 300].abs() <= 1e-6 * g[:, 300].abs()), f"{msg}: {res[:, 300]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_project_out_out_alias_and_preallocated(backend, dtype, rng):
    """out=g is safe (in place); out= a separate strided tensor is written and only inside its
    view."""
    need(backend, "project_out", rng)
    D = D_TRITON
    offs = rng.offsets(D)
    sg = segs(offs, D)
    big = rng.randn(4, D + 11, dtype=dtype)
    g = big[:, 3 : 3 + D]
    b = rng.vec(D, dtype)
    b[sg[3][0] : sg[3][1]] = 0.0
    y, _ = o_project(np64(g), np64(b), sg, True, 0.0)
    msg = f"project_out out= [{backend},{dtype}] seed={rng.seed}"

    big_o = torch.full((4, D + 11), 7.0, dtype=dtype, device=g.device)
    out = big_o[:, 5 : 5 + D]
    res = kernels.project_out(g, b, offs, only_conflicting=True, out=out, backend=backend)
    assert_rel(out, y, TOL[dtype], msg + " (out=preallocated)")
    assert_rel(res, y, TOL[dtype], msg + " (returned)")
    assert (big_o[:, :5] == 7).all() and (big_o[:, 5 + D :] == 7).all(), (
        f"{msg}: wrote outside the out view"
    )

    before = big.clone()
    g_copy = g.clone()
    res = kernels.project_out(g, b, offs, only_conflicting=True, out=g, backend=backend)
    assert_rel(g, y, TOL[dtype], msg + " (out=g)")
    assert_rel(res, y, TOL[dtype], msg + " (out=g returned)")
    assert bitwise_equal(big[:, :3], before[:, :3]) and bitwise_equal(
        big[:, 3 + D :], before[:, 3 + D :]
    ), f"{msg}: wrote outside g"
    s, e = sg[3]
    assert bitwise_equal(g[:, s:e], g_copy[:, s:e]), f"{msg}: zero-basis segment changed in place"


# --------------------------------------------------------------------------------------------
# orthogonal_calibrate


def _calib_inputs(rng: Rng, D: int, dtype, with_ma: bool):
    offs = rng.offsets(D)
    sg = segs(offs, D)
    L = len(sg)
    x = rng.vec(D, dtype)
    sent = (x.double() + 0.05 * rng.randn(D, dtype=torch.float64)).to(dtype)
    snap = rng.vec(D, dtype)
    w = (snap.double() + 0.05 * rng.randn(D, dtype=torch.float64)).to(dtype)
    nonempty = [j for j, (s, e) in enumerate(sg) if e - s >= 3]
    # one calibrated segment where x == sent (dm = 0, so c = 0)
    j_dm0 = nonempty[0]
    s, e = sg[j_dm0]
    sent[s:e] = x[s:e]
    calibrate = torch.rand(L, generator=rng.gen) < 0.6
    calibrate[j_dm0] = True
    calibrate[nonempty[1]] = False
    calibrate[nonempty[2]] = True
    ma = rng.vec(D, dtype) if with_ma else None
    beta = rng.uniform(0.05, 0.95)
    return x, sent, w, snap, ma, offs, sg, calibrate, beta, j_dm0


def o_calibrate(x, sent, w, snap, ma, sg, calibrate, beta, eps=0.0):
    dm, dg = x - sent, w - snap
    y = x.copy()
    c = np.zeros(len(sg))
    for j, (s, e) in enumerate(sg):
        if calibrate is not None and not calibrate[j]:
            continue
        mm = float(dm[s:e] @ dm[s:e])
        cj = float(dg[s:e] @ dm[s:e]) / mm if mm > eps else 0.0
        c[j] = cj
        y[s:e] = x[s:e] + dg[s:e] - cj * dm[s:e]
    ma_src = w if ma is None else ma
    return y, (1.0 - beta) * ma_src + beta * x, c


def _check_calibrate(res, ref, dtype, sg, calibrate, x, msg, c_expected=True):
    y_ref, ma_ref, c_ref, dm, dg = ref
    y, ma_new = res[0], res[1]
    assert y.dtype == dtype and ma_new.dtype == dtype, msg
    assert y.shape == x.shape and ma_new.shape == x.shape, msg
    assert_rel(y, y_ref, TOL[dtype], msg + " y")
    assert_rel(ma_new, ma_ref, TOL[dtype], msg + " ma_new")
    for j, (s, e) in enumerate(sg):
        if calibrate is not None and not bool(calibrate[j]):
            assert bitwise_equal(y[s:e], x[s:e]), f"{msg}: uncalibrated segment {j} != x bitwise"
    if c_expected:
        assert len(res) == 3, msg
        c = res[2]
        assert c.shape == (len(sg),), f"{msg}: coeffs shape {tuple(c.shape)}"
        assert c.dtype in (acc_dtype(dtype), dtype), f"{msg}: coeffs dtype {c.dtype}"
        # |dc| <= tol * |dg| / |dm| per segment (the coefficient error in cosine units)
        scale = np.array(
            [
                np.linalg.norm(dg[s:e]) / np.linalg.norm(dm[s:e]) if np.any(dm[s:e]) else 0.0
                for s, e in sg
            ]
        )
        assert_dots(c, c_ref, scale, TOL[dtype], msg + " coeffs")
        for j in range(len(sg)):
            if c_ref[j] == 0.0:
                assert float(c[j]) == 0.0, f"{msg}: coefficient {j} must be exactly 0, got {c[j]}"


@pytest.mark.parametrize("with_ma", [True, False], ids=["ma", "ma=w"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_orthogonal_calibrate(backend, dtype, with_ma, rng):
    need(backend, "orthogonal_calibrate", rng)
    D = D_TRITON if backend == "triton" else D_SMALL
    x, sent, w, snap, ma, offs, sg, calibrate, beta, _ = _calib_inputs(rng, D, dtype, with_ma)
    ins = [t.clone() for t in (x, sent, w, snap) + ((ma,) if with_ma else ())]
    msg = f"orthogonal_calibrate[{backend},{dtype},ma={with_ma}] seed={rng.seed} beta={beta:.3f}"
    res = kernels.orthogonal_calibrate(
        x,
        sent,
        w,
        snap,
        offs,
        beta,
        calibrate=calibrate,
        ma=ma,
        return_coeffs=True,
        backend=backend,
    )
    nx, ns, nw, nsn = np64(x), np64(sent), np64(w), np64(snap)
    y, ma_new, c = o_calibrate(
        nx, ns, nw, nsn, None if ma is None else np64(ma), sg, calibrate.numpy(), beta
    )
    ref = (y, ma_new, c, nx - ns, nw - nsn)
    _check_calibrate(res, ref, dtype, sg, calibrate, x, msg)
    after = [x, sent, w, snap] + ([ma] if with_ma else [])
    assert all(bitwise_equal(a, b) for a, b in zip(after, ins, strict=True)), (
        f"{msg}: inputs modified"
    )
    res2 = kernels.orthogonal_calibrate(
        x, sent, w, snap, offs, beta, calibrate=calibrate, ma=ma, backend=backend
    )
    assert len(res2) == 2, f"{msg}: return_coeffs=False must return (y, ma_new)"
    assert bitwise_equal(res2[0], res[0]) and bitwise_equal(res2[1], res[1]), msg
    if backend != "reference":
        want = kernels.orthogonal_calibrate(
            x,
            sent,
            w,
            snap,
            offs,
            beta,
            calibrate=calibrate,
            ma=ma,
            return_coeffs=True,
            backend="reference",
        )
        assert want[0].dtype == dtype and want[1].dtype == dtype
        assert_rel(res[0], want[0], TOL[dtype], msg + " y vs backend=reference")
        assert_rel(res[1], want[1], TOL[dtype], msg + " ma vs backend=reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_orthogonal_calibrate_default_mask_and_eps(backend, rng):
    """calibrate=None calibrates every segment; eps zeroes c where <dm,dm> <= eps."""
    need(backend, "orthogonal_calibrate", rng)
    D = D_TRITON
    dtype = torch.float32
    x, sent, w, snap, ma, offs, sg, _, beta, _ = _calib_inputs(rng, D, dtype, True)
    j_small = max(range(len(sg)), key=lambda j: sg[j][1] - sg[j][0])
    s, e = sg[j_small]
    sent[s:e] = x[s:e] - 1e-4  # <dm,dm> = 1e-8 * (e - s)
    eps = 1e-6 * (e - s)
    msg = f"orthogonal_calibrate eps [{backend}] seed={rng.seed}"
    res = kernels.orthogonal_calibrate(
        x, sent, w, snap, offs, beta, ma=ma, eps=eps, return_coeffs=True, backend=backend
    )
    nx, ns, nw, nsn = np64(x), np64(sent), np64(w), np64(snap)
    y, ma_new, c = o_calibrate(nx, ns, nw, nsn, np64(ma), sg, None, beta, eps=eps)
    assert c[j_small] == 0.0
    _check_calibrate(res, (y, ma_new, c, nx - ns, nw - nsn), dtype, sg, None, x, msg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_orthogonal_calibrate_out_aliases(backend, dtype, rng):
    """out_y=x and out_ma=ma (the documented aliases) are safe."""
    need(backend, "orthogonal_calibrate", rng)
    D = D_TRITON
    x, sent, w, snap, ma, offs, sg, calibrate, beta, _ = _calib_inputs(rng, D, dtype, True)
    nx, ns, nw, nsn, nma = np64(x), np64(sent), np64(w), np64(snap), np64(ma)
    y, ma_new, c = o_calibrate(nx, ns, nw, nsn, nma, sg, calibrate.numpy(), beta)
    x_before = x.clone()
    msg = f"orthogonal_calibrate aliases [{backend},{dtype}] seed={rng.seed}"
    res = kernels.orthogonal_calibrate(
        x,
        sent,
        w,
        snap,
        offs,
        beta,
        calibrate=calibrate,
        ma=ma,
        out_y=x,
        out_ma=ma,
        return_coeffs=True,
        backend=backend,
    )
    _check_calibrate(res, (y, ma_new, c, nx - ns, nw - nsn), dtype, sg, calibrate, x_before, msg)
    assert_rel(x, y, TOL[dtype], msg + " (x written in place)")
    assert_rel(ma, ma_new, TOL[dtype], msg + " (ma written in place)")

    # separate preallocated outputs
    x2, ma2 = (torch.from_numpy(a).to(sent.device, dtype) for a in (nx, nma))
    oy, oma = (torch.empty(D, dtype=dtype, device=sent.device) for _ in range(2))
    res = kernels.orthogonal_calibrate(
        x2,
        sent,
        w,
        snap,
        offs,
        beta,
        calibrate=calibrate,
        ma=ma2,
        out_y=oy,
        out_ma=oma,
        backend=backend,
    )
    assert_rel(oy, y, TOL[dtype], msg + " out_y")
    assert_rel(oma, ma_new, TOL[dtype], msg + " out_ma")
    assert_rel(res[0], y, TOL[dtype], msg + " returned y")


# --------------------------------------------------------------------------------------------
# cosine_matrix / layer_normalized_cosine


def _cos_rows(rng: Rng, K: int, D: int, dtype, offs=None):
    """Rows with a zero row, exact and inexact scalar multiples of row 0, and (with offsets)
    a row that is zero on one segment only."""
    X = rng.rows(K, D, dtype)
    X[1] = X[0] * 2.0  # exact multiple: cosine exactly 1 mathematically
    X[2] = (X[0].double() * -3.7).to(dtype)
    X[3] = 0.0
    if offs is not None:
        sg = segs(offs, D)
        s, e = max(sg, key=lambda p: p[1] - p[0])
        X[4, s:e] = 0.0
    return X


def _check_self_cos(C, X, msg, zero_rows_mask):
    """Exact symmetry, exact unit diagonal for non-zero rows (0 for zero rows), [-1, 1]."""
    assert torch.equal(C, C.transpose(-1, -2)), f"{msg}: not exactly symmetric"
    diag = torch.diagonal(C, dim1=-2, dim2=-1)
    want = torch.where(zero_rows_mask, 0.0, 1.0).to(C.dtype)
    assert torch.equal(diag, want), f"{msg}: diagonal {diag} != {want}"


@pytest.mark.parametrize("mode", ["self", "other", "layer_self", "layer_other"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cosine_matrix(backend, dtype, mode, rng):
    need(backend, "cosine_matrix", rng)
    D = D_TRITON if backend == "triton" else D_SMALL
    K, M = 7, 5
    layerwise = mode.startswith("layer")
    offs = rng.offsets(D) if layerwise else None
    X = _cos_rows(rng, K, D, dtype, offs)
    other = None
    if mode.endswith("other"):
        other = rng.rows(M, D, dtype)
        other[0] = (X[0].double() * 0.5).to(dtype)
        other[1] = (X[0].double() * -2.0).to(dtype)
        other[2] = 0.0
    msg = f"cosine_matrix[{backend},{dtype},{mode}] seed={rng.seed}"
    C = kernels.cosine_matrix(X, offs, other=other, layerwise=layerwise, backend=backend)
    nX = np64(X)
    nO = None if other is None else np64(other)
    sg = segs(offs, D)
    ref = o_cos_layers(nX, nO, sg) if layerwise else o_cos(nX, nO)
    assert C.dtype == acc_dtype(dtype) and C.device == X.device, msg
    assert_abs(C, ref, TOL[dtype], msg)
    assert bool((C.abs() <= 1).all()), f"{msg}: values outside [-1, 1]: max |C| {C.abs().max()}"
    Cl = C if layerwise else C[None]
    # scalar multiples of row 0 give +-1 (within tolerance); zero rows give exactly 0
    for li, (s, e) in enumerate(sg):
        if s == e:
            assert (Cl[li] == 0).all(), f"{msg}: empty segment {li} must give a zero matrix"
            continue
        if not (X[0, s:e] != 0).any():
            continue
        assert (Cl[li, 3] == 0).all(), f"{msg}: zero row must give exactly 0"
        if other is not None:
            assert abs(float(Cl[li, 0, 0]) - 1) <= TOL[dtype], f"{msg}: cos(x, x/2) {Cl[li, 0, 0]}"
            assert abs(float(Cl[li, 0, 1]) + 1) <= TOL[dtype], f"{msg}: cos(x, -2x) {Cl[li, 0, 1]}"
            assert abs(float(Cl[li, 1, 1]) + 1) <= TOL[dtype], f"{msg}: cos(2x, -2x)"
            assert (Cl[li, :, 2] == 0).all(), f"{msg}: zero row of other must give exactly 0"
        else:
            assert abs(float(Cl[li, 0, 1]) - 1) <= TOL[dtype], f"{msg}: cos(x, 2x) {Cl[li, 0, 1]}"
            assert abs(float(Cl[li, 0, 2]) + 1) <= TOL[dtype], f"{msg}: cos(x, -3.7x)"
            assert abs(float(Cl[li, 1, 2]) + 1) <= TOL[dtype], f"{msg}: cos(2x, -3.7x)"
            assert (Cl[li, :, 3] == 0).all(), f"{msg}: zero column must give exactly 0"
    if other is None:
        zero = torch.stack([(X[:, s:e] == 0).all(dim=1) for s, e in sg])
        _check_self_cos(C, X, msg, zero if layerwise else zero[0])
    if backend != "reference":
        want = kernels.cosine_matrix(X, offs, other=other, layerwise=layerwise, backend="reference")
        assert want.dtype == C.dtype
        assert_abs(C, want, TOL[dtype], msg + " vs backend=reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosine_matrix_whole_offsets_and_K1(backend, rng):
    """Without layerwise, offsets do not change the whole-vector result; K = 1 works."""
    need(backend, "cosine_matrix", rng)
    D = D_TRITON
    X = rng.rows(1, D, torch.float32)
    C = kernels.cosine_matrix(X, backend=backend)
    assert C.shape == (1, 1) and float(C[0, 0]) == 1.0, f"seed={rng.seed}: {C}"
    X = rng.rows(4, D, torch.float32)
    offs = rng.offsets(D)
    C1 = kernels.cosine_matrix(X, backend=backend)
    C2 = kernels.cosine_matrix(X, offs, backend=backend)
    assert C2.shape == (4, 4)
    assert_abs(C2, o_cos(np64(X), None), 1e-5, f"cosine_matrix offsets seed={rng.seed}")
    assert_abs(C1, C2, 1e-5, f"cosine_matrix offsets vs none seed={rng.seed}")
    Cl = kernels.cosine_matrix(X, offs, layerwise=True, backend=backend)
    assert Cl.shape == (len(offs) - 1, 4, 4)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_cosine_matrix_near_parallel_long(backend, rng):
    """Long, nearly parallel rows (like model weights): cosines close to 1 stay within 1e-5,
    and never exceed 1."""
    need(backend, "cosine_matrix", rng)
    D = 200_003
    base = rng.randn(D, scale=0.1, mean=1.0, dtype=torch.float64)
    X = torch.stack(
        [base + rng.randn(D, scale=s, dtype=torch.float64) for s in (0.0, 1e-4, 1e-3, 1e-2, 0.1)]
    ).float()
    C = kernels.cosine_matrix(X, backend=backend)
    msg = f"cosine_matrix long [{backend}] seed={rng.seed}"
    assert_abs(C, o_cos(np64(X), None), 1e-5, msg)
    assert bool((C.abs() <= 1).all()), msg
    _check_self_cos(C, X, msg, torch.zeros(5, dtype=torch.bool))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_normalized_cosine(backend, dtype, rng):
    need(backend, "layer_normalized_cosine", rng)
    D = D_TRITON if backend == "triton" else D_SMALL
    K = 6
    offs = rng.offsets(D)
    X = _cos_rows(rng, K, D, dtype, offs)
    msg = f"layer_normalized_cosine[{backend},{dtype}] seed={rng.seed}"
    C = kernels.layer_normalized_cosine(X, offs, backend=backend)
    sg = [(s, e) for s, e in segs(offs, D) if e > s]
    ref = np.mean([o_cos(np64(X[:, s:e]), None) for s, e in sg], axis=0)  # by hand
    assert C.shape == (K, K) and C.dtype == acc_dtype(dtype) and C.device == X.device, msg
    assert_abs(C, ref, TOL[dtype], msg)
    assert torch.equal(C, C.T), f"{msg}: not exactly symmetric"
    assert bool((C.abs() <= 1).all()), msg
    assert (C[3] == 0).all(), f"{msg}: zero row must give 0"
    # rows that are non-zero on every non-empty segment average exact ones on the diagonal
    for k in (0, 1, 2, 5):
        assert float(C[k, k]) == 1.0, f"{msg}: diagonal [{k},{k}] = {float(C[k, k])!r}"
    need(backend, "cosine_matrix", rng)
    Cl = kernels.cosine_matrix(X, offs, layerwise=True, backend=backend)
    keep = [j for j, (s, e) in enumerate(segs(offs, D)) if e > s]
    assert_abs(C, Cl[keep].double().mean(0), TOL[dtype], msg + " vs layerwise mean")
    if backend != "reference":
        want = kernels.layer_normalized_cosine(X, offs, backend="reference")
        assert_abs(C, want, TOL[dtype], msg + " vs backend=reference")


# --------------------------------------------------------------------------------------------
# group_means


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_means(backend, dtype, rng):
    need(backend, "group_means", rng)
    D = D_TRITON if backend == "triton" else D_SMALL
    K, G = 8, 4
    X = rng.rows(K, D, dtype)
    groups = torch.tensor([0, -1, 3, 0, 1, -1, 3, 0], dtype=torch.int64)
    groups = groups[torch.randperm(K, generator=rng.gen)]
    X[groups == -1] = float("nan")  # must never be read
    X[(groups == -1).nonzero()[0, 0], :5] = float("inf")
    X0 = X.clone()
    msg = f"group_means[{backend},{dtype}] seed={rng.seed} groups={groups.tolist()}"
    res = kernels.group_means(X, groups, G, backend=backend)
    assert res.shape == (G, D) and res.dtype == dtype and res.device == X.device, msg
    nX = np64(X)
    ref = np.zeros((G, D))
    for gid in range(G):
        sel = (groups == gid).numpy()
        if sel.any():
            ref[gid] = nX[sel].mean(axis=0)
    assert_rel(res, ref, TOL[dtype], msg)
    assert (res[2] == 0).all(), f"{msg}: empty group must give a zero row"
    assert bitwise_equal(X, X0), f"{msg}: input modified"
    if backend != "reference":
        want = kernels.group_means(X, groups, G, backend="reference")
        assert want.dtype == dtype
        assert_rel(res, want, TOL[dtype], msg + " vs backend=reference")


def test_cpu_group_means_every_group_size_to_21(rng):
    """Groups of 0 to 21 rows: the CPU kernel adds rows eight, then four, then the last one to
    three at a time, starting and ending a group's sum outside the tile accumulator; every
    split of a group into those passes meets the float64 mean, over several tiles (D odd)."""
    D = 3 * 16384 + 77
    sizes = list(range(22))
    groups = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    groups = torch.cat([groups, torch.full((5,), -1)])
    groups = groups[torch.randperm(groups.numel(), generator=rng.gen)]
    X = rng.rows(groups.numel(), D, torch.float32)
    X[groups == -1] = float("nan")  # never read
    out = torch.full((len(sizes), D), float("nan"))
    kernels.group_means(X, groups, len(sizes), out=out, backend="cpu")
    nX = np64(X)
    for g, n in enumerate(sizes):
        want = nX[(groups == g).numpy()].mean(axis=0) if n else np.zeros(D)
        assert_rel(out[g], want, 1e-6, f"group of {n} rows, seed={rng.seed}")


@pytest.mark.parametrize("K", [8, 9, 11, 12, 13, 15, 16, 19, 27])
def test_cpu_weighted_sum_passes_with_beta(K, rng):
    """beta*out + alpha*sum_k w_k X_k for K rows that split into passes of 8, 4 and 1-3: the
    old out is read once, on the last pass, whatever the split (float64 oracle)."""
    D = 2 * 16384 + 33
    X = rng.rows(K, D, torch.float32)
    w = rng.randn(K, dtype=torch.float64, device="cpu")
    out = rng.rows(1, D, torch.float32)[0]
    alpha, beta = rng.uniform(0.5, 2.0), rng.uniform(0.2, 0.9)
    want = beta * np64(out) + alpha * (np64(w)[:, None] * np64(X)).sum(axis=0)
    kernels.weighted_sum(X, w, out=out, alpha=alpha, beta=beta, backend="cpu")
    assert_rel(out, want, 1e-6, f"K={K} seed={rng.seed}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_means_single_row_and_all_excluded(backend, rng):
    need(backend, "group_means", rng)
    D = D_TRITON
    X = rng.rows(1, D, torch.float32)
    res = kernels.group_means(X, torch.tensor([1]), 2, backend=backend)
    assert (res[0] == 0).all() and torch.equal(res[1], X[0]), f"seed={rng.seed}"
    X = torch.full((3, D), float("nan"), device=rng.device)
    res = kernels.group_means(X, torch.tensor([-1, -1, -1]), 2, backend=backend)
    assert res.shape == (2, D) and (res == 0).all(), "all rows excluded: zero rows, no NaN"


# --------------------------------------------------------------------------------------------
# weighted_sum


@pytest.mark.parametrize("mode", ["new", "beta", "beta0_nan_out", "K1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_weighted_sum(backend, dtype, mode, rng):
    need(backend, "weighted_sum", rng)
    D = D_TRITON if backend == "triton" else D_SMALL
    K = 1 if mode == "K1" else 6
    X = rng.rows(K, D, dtype)
    weights = rng.randn(K, dtype=torch.float64, device="cpu").abs() + 0.1
    alpha = rng.uniform(0.5, 2.0)
    beta = rng.uniform(0.2, 0.9) if mode == "beta" else 0.0
    msg = f"weighted_sum[{backend},{dtype},{mode}] seed={rng.seed} a={alpha:.3f} b={beta:.3f}"
    ref = alpha * (np64(weights)[:, None] * np64(X)).sum(axis=0)
    X0 = X.clone()
    if mode in ("new", "K1"):
        res = kernels.weighted_sum(X, weights, alpha=alpha, backend=backend)
    else:
        big = rng.randn(D + 6, dtype=dtype)
        out = big[2 : 2 + D]
        if mode == "beta":
            ref = ref + beta * np64(out)
        else:
            out.fill_(float("nan"))
        edge = big[:2].clone(), big[2 + D :].clone()
        res = kernels.weighted_sum(X, weights, out=out, alpha=alpha, beta=beta, backend=backend)
        assert_rel(out, ref, TOL[dtype], msg + " (out written)")
        assert bitwise_equal(big[:2], edge[0]) and bitwise_equal(big[2 + D :], edge[1]), (
            f"{msg}: wrote outside out"
        )
    assert res.shape == (D,) and res.dtype == dtype and res.device == X.device, msg
    assert_rel(res, ref, TOL[dtype], msg)
    assert bitwise_equal(X, X0), f"{msg}: input modified"
    if backend != "reference":
        want = kernels.weighted_sum(X, weights, alpha=alpha, backend="reference")
        base = alpha * (np64(weights)[:, None] * np64(X)).sum(axis=0)
        assert_rel(want, base, TOL[dtype], msg + " reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_weighted_sum_float32_weights_and_negative(backend, rng):
    """Weights given as a float32 CPU tensor, with mixed signs."""
    need(backend, "weighted_sum", rng)
    D = D_TRITON
    X = rng.rows(5, D, torch.float32)
    w = rng.randn(5, dtype=torch.float32, device="cpu")
    res = kernels.weighted_sum(X, w, backend=backend)
    ref = (np64(w)[:, None] * np64(X)).sum(axis=0)
    assert_rel(res, ref, 1e-5, f"weighted_sum f32 weights [{backend}] seed={rng.seed}")


# --------------------------------------------------------------------------------------------
# determinism, auto, non-unit inner stride


def _all_calls(rng: Rng, D: int):
    offs = rng.offsets(D)
    X = rng.rows(5, D, torch.float32)
    b = rng.vec(D, torch.float32)
    x, sent, w, snap = (rng.vec(D, torch.float32) for _ in range(4))
    ma = rng.vec(D, torch.float32)
    groups = torch.tensor([0, 1, 0, -1, 1])
    weights = rng.randn(5, dtype=torch.float64, device="cpu")
    cal = torch.ones(len(offs) - 1, dtype=torch.bool)
    return {
        "layer_dots": lambda be: kernels.layer_dots(X, b, offs, backend=be),
        "project_out": lambda be: kernels.project_out(X, b, offs, backend=be),
        "orthogonal_calibrate": lambda be: torch.cat(
            kernels.orthogonal_calibrate(
                x,
                sent,
                w,
                snap,
                offs,
                0.3,
                calibrate=cal,
                ma=ma,
                return_coeffs=True,
                backend=be,
            )
        ),
        "cosine_matrix": lambda be: kernels.cosine_matrix(X, offs, other=X[:3], backend=be),
        "cosine_matrix_layerwise": lambda be: kernels.cosine_matrix(
            X, offs, layerwise=True, backend=be
        ),
        "layer_normalized_cosine": lambda be: kernels.layer_normalized_cosine(X, offs, backend=be),
        "group_means": lambda be: kernels.group_means(X, groups, 2, backend=be),
        "weighted_sum": lambda be: kernels.weighted_sum(X, weights, backend=be),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_determinism(backend, rng):
    """Two calls give bitwise equal results."""
    D = D_TRITON
    need(backend, "layer_dots", rng)
    for name, call in _all_calls(rng, D).items():
        need(backend, name.removesuffix("_layerwise"))
        r1, r2 = call(backend), call(backend)
        assert bitwise_equal(r1, r2), f"{name}[{backend}] not deterministic, seed={rng.seed}"


def test_auto_is_cpu_on_cpu_tensors(rng):
    """auto picks the CPU implementation for CPU tensors: bitwise the same as backend='cpu'."""
    for name, call in _all_calls(rng, D_SMALL).items():
        need("cpu", name.removesuffix("_layerwise"))
        assert bitwise_equal(call("auto"), call("cpu")), f"{name}: auto != cpu, seed={rng.seed}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_unit_inner_stride(backend, rng):
    """A column-strided input is either rejected with ValueError/TypeError or handled
    correctly; it must never give wrong numbers."""
    need(backend, "layer_dots", rng)
    D = 301
    a = rng.randn(3, 2 * D)[:, ::2]
    b = rng.randn(D)
    try:
        res = kernels.layer_dots(a, b, backend=backend)
    except (ValueError, TypeError):
        return
    ref, scale = o_dots(np64(a), np64(b)[None, :], [(0, D)])
    assert_dots(res, ref[:, 0], scale[:, 0], 1e-5, f"strided layer_dots seed={rng.seed}")
    X = rng.randn(2 * D, 4).T  # [4, 2D] with stride (1, 4)
    try:
        C = kernels.cosine_matrix(X, backend=backend)
    except (ValueError, TypeError):
        return
    assert_abs(C, o_cos(np64(X), None), 1e-5, f"transposed cosine_matrix seed={rng.seed}")


# --------------------------------------------------------------------------------------------
# many rows (tiles of the Gram / row kernels), long vectors on triton


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cosine_matrix_many_rows(backend, layerwise, rng):
    """K and M larger than one tile: exact symmetry across tiles, unit diagonal, accuracy."""
    need(backend, "cosine_matrix", rng)
    D, K, M = 257, 37, 19
    offs = rng.offsets(D) if layerwise else None
    X = rng.rows(K, D, torch.float32)
    X[K - 1] = X[0] * 4.0
    Y = rng.rows(M, D, torch.float32)
    msg = f"cosine_matrix many rows [{backend},layerwise={layerwise}] seed={rng.seed}"
    sg = segs(offs, D)
    C = kernels.cosine_matrix(X, offs, layerwise=layerwise, backend=backend)
    ref = o_cos_layers(np64(X), None, sg) if layerwise else o_cos(np64(X), None)
    assert_abs(C, ref, 1e-5, msg)
    assert bool((C.abs() <= 1).all()), msg
    zero = torch.stack([(X[:, s:e] == 0).all(dim=1) for s, e in sg])
    _check_self_cos(C, X, msg, zero if layerwise else zero[0])
    C2 = kernels.cosine_matrix(X, offs, other=Y, layerwise=layerwise, backend=backend)
    ref2 = o_cos_layers(np64(X), np64(Y), sg) if layerwise else o_cos(np64(X), np64(Y))
    assert_abs(C2, ref2, 1e-5, msg + " other")
    lnc = kernels.layer_normalized_cosine(X, rng.offsets(D), backend=backend)
    assert torch.equal(lnc, lnc.T), f"{msg}: layer_normalized_cosine not exactly symmetric"


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_kernels_many_rows(backend, rng):
    need(backend, "group_means", rng)
    need(backend, "weighted_sum", rng)
    D, K, G = 257, 67, 9
    X = rng.rows(K, D, torch.float32)
    groups = rng.randint(-1, G, (K,))
    groups[groups == 4] = 5  # group 4 empty
    X[groups == -1] = float("nan")
    msg = f"many rows [{backend}] seed={rng.seed}"
    res = kernels.group_means(X, groups, G, backend=backend)
    nX = np64(X)
    ref = np.stack(
        [
            nX[(groups == g).numpy()].mean(0) if (groups == g).any() else np.zeros(D)
            for g in range(G)
        ]
    )
    assert_rel(res, ref, 1e-5, msg + " group_means")
    keep = groups >= 0
    w = rng.randn(int(keep.sum()), dtype=torch.float64, device="cpu")
    Xk = X[keep]
    out = rng.randn(D)
    ref = 0.5 * np64(out) + 1.5 * (np64(w)[:, None] * np64(Xk)).sum(0)
    kernels.weighted_sum(Xk, w, out=out, alpha=1.5, beta=0.5, backend=backend)
    assert_rel(out, ref, 1e-5, msg + " weighted_sum")


@pytest.mark.parametrize("backend", ["triton"])
def test_layer_dots_long_positive_accuracy_triton(backend, rng):
    need(backend, "layer_dots", rng)
    D = (1 << 17) + 3
    a = rng.randn(1, D, scale=0.1, mean=1.0)
    b = rng.randn(D, scale=0.1, mean=1.0)
    offs = torch.tensor([0, 5, 50_000, D - 3, D])
    res = kernels.layer_dots(a, b, offs, backend=backend)
    ref, scale = o_dots(np64(a), np64(b)[None, :], segs(offs, D))
    assert_dots(res, ref, scale, 1e-5, f"layer_dots long [{backend}] seed={rng.seed}")
    y = kernels.project_out(a, b, offs, backend=backend)
    yr, _ = o_project(np64(a), np64(b), segs(offs, D), False, 0.0)
    assert_rel(y, yr, 1e-5, f"project_out long [{backend}] seed={rng.seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_normalized_cosine_exactly_symmetric(backend, dtype, rng):
    """A self-similarity matrix is exactly symmetric, whatever the draw (several draws: an
    order-dependent reduction over segments breaks symmetry only for some inputs)."""
    need(backend, "layer_normalized_cosine", rng)
    D = 301
    for draw in range(3 if backend == "triton" else 12):
        X = rng.rows(6, D, dtype)
        offs = rng.offsets(D, n_cuts=3 + draw % 8)
        C = kernels.layer_normalized_cosine(X, offs, backend=backend)
        asym = (C - C.T).abs().max().item()
        assert torch.equal(C, C.T), (
            f"layer_normalized_cosine[{backend},{dtype}] seed={rng.seed} draw={draw} "
            f"L={len(offs) - 1}: not exactly symmetric, max |C - C^T| = {asym:.3e}"
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_project_out_vector_in_place(backend, rng):
    """[D] g with out=g."""
    need(backend, "project_out", rng)
    D = D_TRITON
    offs = rng.offsets(D)
    g = rng.vec(D, torch.float32)
    b = rng.vec(D, torch.float32)
    y, _ = o_project(np64(g)[None], np64(b), segs(offs, D), False, 0.0)
    res = kernels.project_out(g, b, offs, out=g, backend=backend)
    assert res.shape == (D,)
    assert_rel(g, y[0], 1e-5, f"project_out [D] out=g [{backend}] seed={rng.seed}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_inputs_accumulate_in_float32(backend, dtype, rng):
    """Half-precision data whose sums overflow float16 (|x|^2 ~ 1.5e5 > 65504) or stall in
    bfloat16 (a running sum of ~1000 positive terms): the contract accumulates in float32."""
    need(backend, "layer_dots", rng)
    D = D_TRITON
    offs = torch.tensor([0, 3, 500, D])
    sg = segs(offs, D)
    if dtype == torch.float16:
        a = rng.rows(3, D, dtype, scale=12.0)
    else:
        a = rng.rows(3, D, dtype, scale=0.1, mean=1.0)
    msg = f"half accumulation [{backend},{dtype}] seed={rng.seed}"
    na = np64(a)
    res = kernels.layer_dots(a, a, offs, backend=backend)
    ref, scale = o_dots(na, na, sg)
    assert_dots(res, ref, scale, 2e-2, msg + " layer_dots")

    C = kernels.cosine_matrix(a, offs, layerwise=True, backend=backend)
    assert_abs(C, o_cos_layers(na, None, sg), 2e-2, msg + " cosine_matrix")

    g = rng.rows(2, D, dtype)
    y = kernels.project_out(g, a[0], offs, backend=backend)
    yr, _ = o_project(np64(g), na[0], sg, False, 0.0)
    assert_rel(y, yr, 2e-2, msg + " project_out")

    # group mean of rows whose sum overflows float16 (3 * 3e4 > 65504)
    X = (rng.rows(4, D, torch.float64, scale=100.0) + 30000.0).to(dtype)
    gm = kernels.group_means(X, torch.tensor([0, 0, 0, 1]), 2, backend=backend)
    nX = np64(X)
    assert_rel(gm, np.stack([nX[:3].mean(0), nX[3]]), 2e-2, msg + " group_means")

    # weighted sum whose partial sums overflow float16 but whose result is small
    base = torch.round(rng.randn(D, dtype=torch.float64) * 3) * 32 + 40000.0
    noise = torch.round(rng.randn(D, dtype=torch.float64) * 8) * 32
    X = torch.stack([base, base + noise, base, base]).to(dtype)
    w = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    ws = kernels.weighted_sum(X, w, backend=backend)
    assert_rel(ws, (np64(w)[:, None] * np64(X)).sum(0), 2e-2, msg + " weighted_sum")


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_group_means_into_out(backend, rng):
    """out= receives the means in place (the buffer a strategy keeps between calls)."""
    need(backend, "group_means", rng)
    K, D, G = 7, 1031, 3
    X = rng.randn(K, D)
    groups = torch.tensor([0, 2, -1, 0, 2, 2, -1])
    out = torch.full((G, D), float("nan"), device=X.device)
    ptr = out.data_ptr()
    res = kernels.group_means(X, groups, G, out=out, backend=backend)
    assert res.data_ptr() == ptr
    X64 = np64(X)
    want = np.stack([X64[[0, 3]].mean(0), np.zeros(D), X64[[1, 4, 5]].mean(0)])
    np.testing.assert_allclose(np64(out), want, rtol=0, atol=1e-6, err_msg=f"seed={rng.seed}")
    with pytest.raises(ValueError, match="out"):
        kernels.group_means(X, groups, G, out=X.new_empty(G, D + 1), backend=backend)
    with pytest.raises(ValueError, match="out"):
        kernels.group_means(X, groups, G, out=X.new_empty(D, G).T, backend=backend)


def test_cross_cosines_of_thin_shapes_span_several_tiles() -> None:
    """FedHist's shape (10 local rows against 53 history rows) over D spanning several of the
    CPU backend's cross-dot tiles plus a ragged end, remainder blocks of 4 on both sides, and a
    zero row: float64 oracle."""
    from aggsrv.kernels import cpu

    g = torch.Generator().manual_seed(11)
    D = 3 * cpu.CROSS_TILE + 5
    X = torch.randn(10, D, generator=g)
    Y = torch.randn(53, D, generator=g)
    X[9] = 0.0
    Y[52] = X[0] * -3.0
    C = kernels.cosine_matrix(X, other=Y, backend="cpu")
    x, y = X.double(), Y.double()
    den = x.norm(dim=1)[:, None] * y.norm(dim=1)[None]
    ref = torch.where(den > 0, (x @ y.T) / torch.where(den > 0, den, 1.0), 0.0)
    assert C.dtype == torch.float32 and C.shape == (10, 53)
    assert float((C.double() - ref).abs().max()) < 1e-6
    assert (C[9] == 0).all() and float(C[0, 52]) == pytest.approx(-1.0, abs=1e-6)
