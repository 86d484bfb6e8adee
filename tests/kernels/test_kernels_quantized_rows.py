"""The quantized row cache (kernels/quantized_rows.py) on every backend against numpy oracles
written here: `quantize_rows` bit for bit against a float32 numpy encoder and the wire's
deterministic int8 encoder (`aggsrv.transport.quantize`), `dequantize_rows` bit for bit against
``float32(code) * scale``, the weighted sums, group means and Gram against float64 sums of the
decoded values, the argument checks, and the memory target (1,000 ResNet-34 rows under 24 GB).

Fresh random inputs each run (the seed is printed); sizes are odd on purpose (D not a multiple
of the block, blocks of 1, 7, 128 and one wider than D). Triton runs under its interpreter on a
CPU-only machine, on smaller shapes (it is slow there)."""

from __future__ import annotations

import importlib
import math
import os
import secrets

import numpy as np
import pytest
import torch
from triton_scalars import compiled_scalar_types

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aggsrv import kernels  # noqa: E402
from aggsrv.transport import Quantization, quantize  # noqa: E402

QuantizedRows = kernels.QuantizedRows

BACKENDS = ["reference", "cpu", "triton"]
DEVICE = {"reference": "cpu", "cpu": "cpu",
          "triton": "cuda" if torch.cuda.is_available() else "cpu"}  # fmt: skip
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
EPS32 = float(np.finfo(np.float32).eps)

# (K, D, block): D never a multiple of a block > 1; the last block is wider than D.
SHAPES = [(1, 1, 1), (17, 257, 1), (3, 517, 7), (17, 2_003, 128), (3, 700, 1_000)]
SHAPE_IDS = [f"K{k}-D{d}-b{b}" for k, d, b in SHAPES]


@pytest.fixture(autouse=True)
def _gpu_scalar_types(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRETED:
        compiled_scalar_types(monkeypatch)


def _rng() -> np.random.Generator:
    seed = secrets.randbits(31)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _shape(backend: str, K: int, D: int, block: int) -> tuple[int, int, int]:
    """The interpreter runs one program per (row, block): at most 5 rows there."""
    return (min(K, 5), D, block) if backend == "triton" and INTERPRETED else (K, D, block)


def _backend_module(backend: str):
    return importlib.import_module(f"aggsrv.kernels.{backend}")


def _rows(rng: np.random.Generator, K: int, D: int) -> np.ndarray:
    """float32 rows whose magnitudes differ by row and by column range (so blocks differ)."""
    X = rng.standard_normal((K, D)) * np.exp(rng.uniform(-6, 6, (K, 1)))
    X *= np.exp(rng.uniform(-3, 3, (1, D)))
    return X.astype(np.float32)


def numpy_quantize(X: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The oracle: per block, scale = float32(absmax) / float32(127) and code = rint(x / scale),
    both float32 divisions in numpy (ties to even), clamped to +-127; an all-zero block (or one
    whose scale underflows to 0) has scale 0 and codes 0."""
    X = np.asarray(X, dtype=np.float32)
    K, D = X.shape
    nb = math.ceil(D / block)
    codes = np.zeros((K, D), dtype=np.int8)
    scales = np.zeros((K, nb), dtype=np.float32)
    for b in range(nb):
        blk = X[:, b * block : (b + 1) * block]
        s = np.abs(blk).max(axis=1) / np.float32(127)
        assert s.dtype == np.float32
        scales[:, b] = s
        safe = np.where(s > 0, s, np.float32(1))
        ratio = blk / safe[:, None]
        assert ratio.dtype == np.float32
        q = np.clip(np.rint(ratio), -127, 127)
        q[s == 0] = 0
        codes[:, b * block : (b + 1) * block] = q.astype(np.int8)
    return codes, scales


def numpy_decode(codes: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """float32 [K, D]: each value the binary32 product float32(code) * scale."""
    per = np.repeat(scales, block, axis=1)[:, : codes.shape[1]]
    out = codes.astype(np.float32) * per
    assert out.dtype == np.float32
    return out


def _wire(values: np.ndarray, block: int) -> bytes:
    return quantize(torch.from_numpy(values), Quantization.INT8, block)[0]


def _random_q(rng: np.random.Generator, K: int, D: int, block: int, dev: str) -> QuantizedRows:
    """Random codes in [-127, 127] and non-negative scales of varied magnitude (some 0)."""
    nb = math.ceil(D / block)
    codes = rng.integers(-127, 128, (K, D)).astype(np.int8)
    scales = (rng.random((K, nb)) * np.exp(rng.uniform(-8, 8, (K, 1)))).astype(np.float32)
    scales[rng.random((K, nb)) < 0.1] = 0.0
    return QuantizedRows(torch.from_numpy(codes).to(dev), torch.from_numpy(scales).to(dev), block)


def _spoil(Q: QuantizedRows, rows: np.ndarray, rng: np.random.Generator) -> None:
    """Garbage in rows that must never be read: any byte (-128 too) and NaN scales."""
    for r in rows:
        g = rng.integers(-128, 128, Q.codes.shape[1]).astype(np.int8)
        Q.codes[r] = torch.from_numpy(g).to(Q.device)
        Q.scales[r] = float("nan")


def _q_numpy(Q: QuantizedRows) -> tuple[np.ndarray, np.ndarray]:
    return Q.codes.cpu().numpy(), Q.scales.cpu().numpy()


def _assert_same_q(Q: QuantizedRows, codes: np.ndarray, scales: np.ndarray) -> None:
    got_c, got_s = _q_numpy(Q)
    np.testing.assert_array_equal(got_c, codes)
    np.testing.assert_array_equal(got_s.view(np.int32), scales.view(np.int32))  # bits


# --------------------------------------------------------------------------------------------
# quantize_rows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("K", "D", "block"), SHAPES, ids=SHAPE_IDS)
def test_quantize_rows_is_the_numpy_oracle_and_the_wire_encoder(backend, K, D, block) -> None:
    K, D, block = _shape(backend, K, D, block)
    rng = _rng()
    X = _rows(rng, K, D)
    if 2 * block <= D:
        X[K - 1, block : 2 * block] = 0.0  # an all-zero block
    X[0, : min(D, block)] *= np.float32(1e-3)  # a quiet block next to loud ones
    dev = DEVICE[backend]
    Q = kernels.quantize_rows(torch.from_numpy(X).to(dev), block, backend=backend)
    assert isinstance(Q, QuantizedRows) and Q.block == block and Q.shape == (K, D)
    assert Q.codes.dtype == torch.int8 and Q.scales.dtype == torch.float32
    assert tuple(Q.scales.shape) == (K, math.ceil(D / block))
    codes, scales = numpy_quantize(X, block)
    _assert_same_q(Q, codes, scales)
    got_c, got_s = _q_numpy(Q)
    for k in range(K):  # the wire: float32 LE scales, then the int8 codes
        assert _wire(X[k], block) == got_s[k].astype("<f4").tobytes() + got_c[k].tobytes()
    if 2 * block <= D:
        assert got_s[K - 1, 1] == 0.0 and not got_c[K - 1, block : 2 * block].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_rows_ties_go_to_even(backend) -> None:
    # Scale 1 (absmax 127) and scale 1/8 (absmax 127/8): every x / scale below is exact, so the
    # halves are exact ties.
    halves = np.arange(-126.5, 127.0, 1.0, dtype=np.float32)  # -126.5 .. 126.5
    row = np.concatenate([[np.float32(127.0)], halves, [np.float32(0.5), np.float32(-0.5)]])
    block = row.size
    X = np.stack([row, row / np.float32(8)]).astype(np.float32)
    dev = DEVICE[backend]
    Q = kernels.quantize_rows(torch.from_numpy(X).to(dev), block, backend=backend)
    codes, scales = _q_numpy(Q)
    np.testing.assert_array_equal(scales, np.array([[1.0], [0.125]], dtype=np.float32))
    even = 2 * np.round(row / 2)  # the even neighbour of each half (exact in float32)
    want = np.where(row == np.trunc(row), row, even).astype(np.int64)
    for v, c in zip(row.tolist(), codes[0].tolist(), strict=True):
        lo = math.floor(v)
        if v != lo:
            assert c == (lo if lo % 2 == 0 else lo + 1), (v, c)
    np.testing.assert_array_equal(codes[0], want)
    np.testing.assert_array_equal(codes[1], want)
    _assert_same_q(Q, *numpy_quantize(X, block))
    for k in range(2):
        assert _wire(X[k], block) == scales[k].astype("<f4").tobytes() + codes[k].tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_rows_zero_and_subnormal_blocks(backend) -> None:
    """All-zero blocks: scale 0, codes 0. Subnormal blocks: the scale rounds coarsely (or to 0
    below 63.5 * 2^-149), so codes reach the clamp at 127: still the oracle and the wire."""
    tiny = np.float32(2.0**-149)
    block = 4
    X = np.zeros((3, 13), dtype=np.float32)
    X[1, 0:4] = np.array([1, -2, 63, -5], dtype=np.float32) * tiny  # scale underflows to 0
    X[1, 4:8] = np.array([64, 1, -3, 0], dtype=np.float32) * tiny
    X[1, 8:12] = np.array([190, -190, 95, 1], dtype=np.float32) * tiny  # ratio 190: clamped
    X[2, 12] = -np.float32(3.0)
    dev = DEVICE[backend]
    Q = kernels.quantize_rows(torch.from_numpy(X).to(dev), block, backend=backend)
    codes, scales = numpy_quantize(X, block)
    assert not codes[0].any() and not scales[0].any()
    assert scales[1, 0] == 0 and codes[1, 8] == 127 and codes[1, 9] == -127
    _assert_same_q(Q, codes, scales)
    got_c, got_s = _q_numpy(Q)
    for k in range(3):
        assert _wire(X[k], block) == got_s[k].astype("<f4").tobytes() + got_c[k].tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_quantize_rows_converts_other_dtypes_to_float32_first(backend, dtype) -> None:
    rng = _rng()
    K, D, block = 3, 301, 7
    X = torch.from_numpy(_rows(rng, K, D).astype(np.float64) * (1 + 1e-9)).to(dtype)
    if dtype == torch.float16:
        X = X.clamp(-6e4, 6e4)
    X32 = X.to(torch.float32)
    dev = DEVICE[backend]
    Q = kernels.quantize_rows(X.to(dev), block, backend=backend)
    _assert_same_q(Q, *numpy_quantize(X32.numpy(), block))
    _assert_same_q(kernels.quantize_rows(X32.to(dev), block, backend=backend), *_q_numpy(Q))


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_rows_1d_strided_and_in_place(backend) -> None:
    rng = _rng()
    dev = DEVICE[backend]
    big = torch.from_numpy(_rows(rng, 4, 2 * 203)).to(dev)
    X = big[::2, ::2]  # neither row nor column stride is the plain one
    want = numpy_quantize(X.cpu().numpy(), 7)
    _assert_same_q(kernels.quantize_rows(X, 7, backend=backend), *want)
    out = QuantizedRows.empty(2, 203, 7, dev)
    out.codes.fill_(99)
    out.scales.fill_(float("nan"))
    got = kernels.quantize_rows(X, 7, out=out, backend=backend)
    assert got.codes.data_ptr() == out.codes.data_ptr()
    assert got.scales.data_ptr() == out.scales.data_ptr()
    _assert_same_q(out, *want)
    one = kernels.quantize_rows(X[1], 7, backend=backend)  # 1-D: one row
    assert one.shape == (1, 203)
    _assert_same_q(one, want[0][1:2], want[1][1:2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_rows_refuses_a_non_finite_row_by_its_index(backend, bad) -> None:
    rng = _rng()
    K, D, block = 5, 100, 7
    X = _rows(rng, K, D)
    X[3, 50] = bad
    X[4, 0] = bad
    with pytest.raises(ValueError, match=r"row 3 is not finite"):
        kernels.quantize_rows(torch.from_numpy(X).to(DEVICE[backend]), block, backend=backend)
    X = _rows(rng, K, D).astype(np.float64)
    X[2, 99] = 1e39  # finite in float64, infinite once converted to float32
    with pytest.raises(ValueError, match=r"row 2 is not finite"):
        kernels.quantize_rows(torch.from_numpy(X).to(DEVICE[backend]), block, backend=backend)


# --------------------------------------------------------------------------------------------
# dequantize_rows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("K", "D", "block"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dequantize_rows_writes_each_binary32_product(backend, K, D, block, dtype) -> None:
    K, D, block = _shape(backend, K, D, block)
    rng = _rng()
    dev = DEVICE[backend]
    Q = _random_q(rng, K, D, block, dev)
    want = numpy_decode(*_q_numpy(Q), block)
    got = kernels.dequantize_rows(Q, backend=backend)
    assert got.dtype == torch.float32 and got.shape == (K, D)
    np.testing.assert_array_equal(got.cpu().numpy().view(np.int32), want.view(np.int32))
    rows = [K - 1, 0, K - 1]
    out = torch.full((3, D), float("nan"), dtype=dtype, device=dev)
    got = kernels.dequantize_rows(Q, rows, out=out, backend=backend)
    assert got is out
    bits = np.int64 if dtype == torch.float64 else np.int32
    want_rows = want[rows].astype(np.float64 if dtype == torch.float64 else np.float32)
    np.testing.assert_array_equal(out.cpu().numpy().view(bits), want_rows.view(bits))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantize_rows_gives_what_the_wire_encoder_decodes(backend) -> None:
    rng = _rng()
    K, D, block = 3, 1_001, 128
    X = _rows(rng, K, D)
    dev = DEVICE[backend]
    Q = kernels.quantize_rows(torch.from_numpy(X).to(dev), block, backend=backend)
    got = kernels.dequantize_rows(Q, backend=backend).cpu()
    for k in range(K):
        decoded = quantize(torch.from_numpy(X[k]), Quantization.INT8, block)[1]
        assert torch.equal(got[k].view(torch.int32), decoded.view(torch.int32))


# --------------------------------------------------------------------------------------------
# quantized_weighted_sum / quantized_group_means
# --------------------------------------------------------------------------------------------


def _check_close(backend, got, want, mag, dtype, terms) -> None:
    """float64 sums (cpu, reference): one rounding to out's dtype, rtol 1e-6 (float32) or 1e-12
    (float64), plus float64 reordering (relative to the sum of magnitudes). Triton sums in out's
    dtype, so float32 sums there are bounded by the terms' count times eps."""
    got = got.cpu().to(torch.float64).numpy()
    if dtype == torch.float32 and backend == "triton":
        bound = (terms + 3) * EPS32 * mag
    elif dtype == torch.float32:
        bound = 1e-6 * np.abs(want) + 1e-12 * mag
    else:
        bound = 1e-12 * np.abs(want) + 1e-13 * mag
    err = np.abs(got - want)
    assert np.all(err <= bound + 1e-300), float(np.max(err - bound))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("K", "D", "block"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantized_weighted_sum(backend, K, D, block, dtype) -> None:
    K, D, block = _shape(backend, K, D, block)
    rng = _rng()
    dev = DEVICE[backend]
    Q = _random_q(rng, K, D, block, dev)
    w = rng.standard_normal(K)
    skipped = np.flatnonzero(rng.random(K) < 0.3) if K > 1 else np.array([], dtype=np.int64)
    w[skipped] = 0.0
    codes, scales = _q_numpy(Q)
    dec = numpy_decode(codes, scales, block).astype(np.float64)
    _spoil(Q, skipped, rng)
    alpha, beta = float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2))
    start = rng.standard_normal(D) * np.abs(dec).max()
    out = torch.from_numpy(start).to(device=dev, dtype=dtype)
    start = out.cpu().to(torch.float64).numpy().copy()  # (a float64 out is written in place)
    got = kernels.quantized_weighted_sum(
        Q, torch.from_numpy(w), out=out, alpha=alpha, beta=beta, backend=backend
    )
    assert got is out
    terms = w[:, None] * dec
    want = beta * start + alpha * terms.sum(axis=0)
    mag = np.abs(beta * start) + abs(alpha) * np.abs(terms).sum(axis=0)
    _check_close(backend, out, want, mag, dtype, K + 1)
    # No out: a fresh float32 [D], beta 0; weights as a numpy array. (Not a list of floats:
    # torch.as_tensor makes that float32, rounding the weights before the float64 sums.)
    fresh = kernels.quantized_weighted_sum(Q, w, backend=backend)
    assert fresh.dtype == torch.float32 and fresh.shape == (D,)
    want = terms.sum(axis=0)
    _check_close(backend, fresh, want, np.abs(terms).sum(axis=0), torch.float32, K)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_weighted_sum_with_every_weight_zero_only_scales_out(backend) -> None:
    rng = _rng()
    dev = DEVICE[backend]
    Q = _random_q(rng, 3, 50, 7, dev)
    _spoil(Q, np.arange(3), rng)
    out = torch.from_numpy(rng.standard_normal(50)).to(dev)
    want = 0.5 * out.clone()
    kernels.quantized_weighted_sum(Q, [0.0, 0.0, 0.0], out=out, beta=0.5, backend=backend)
    assert torch.equal(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("K", "D", "block"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantized_group_means(backend, K, D, block, dtype) -> None:
    K, D, block = _shape(backend, K, D, block)
    rng = _rng()
    dev = DEVICE[backend]
    Q = _random_q(rng, K, D, block, dev)
    G = 4  # group 3 is left empty
    groups = rng.integers(-1, 3, K)
    groups[0] = 0
    codes, scales = _q_numpy(Q)
    dec = numpy_decode(codes, scales, block).astype(np.float64)
    _spoil(Q, np.flatnonzero(groups == -1), rng)
    out = torch.full((G, D), float("nan"), dtype=dtype, device=dev)
    got = kernels.quantized_group_means(Q, torch.from_numpy(groups), G, out=out, backend=backend)
    assert got is out
    want = np.zeros((G, D))
    mag = np.zeros((G, D))
    counts = np.zeros(G, dtype=np.int64)
    for g in range(G):
        members = dec[groups == g]
        counts[g] = len(members)
        if len(members):
            want[g] = members.sum(axis=0) / len(members)
            mag[g] = np.abs(members).sum(axis=0) / len(members)
    _check_close(backend, out, want, mag, dtype, int(counts.max()) + 1)
    assert not out[3].any()  # the empty group: zeros
    fresh = kernels.quantized_group_means(Q, groups.tolist(), G, backend=backend)
    assert fresh.dtype == torch.float32 and fresh.shape == (G, D)
    _check_close(backend, fresh, want, mag, torch.float32, int(counts.max()) + 1)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_small_tiles_and_gram_chunks_split_the_columns(backend, monkeypatch) -> None:
    """The CPU column tiles and both Gram decode buffers made small, so that many tiles and
    chunks (each whole blocks) meet the oracle: nothing is lost or doubled at their edges."""
    mod = _backend_module(backend)
    if backend == "cpu":
        monkeypatch.setattr(mod, "TILE", 64)
        monkeypatch.setattr(mod, "_GRAM_DECODE_BYTES", 4 * 5 * 7 * 9)
    else:
        qr = importlib.import_module("aggsrv.kernels.triton.quantized_rows")
        monkeypatch.setattr(qr, "_GRAM_DECODE_BYTES", 4 * 5 * 7 * 9)
    rng = _rng()
    K, D, block = 5, 1_003, 7
    dev = DEVICE[backend]
    Q = _random_q(rng, K, D, block, dev)
    dec = numpy_decode(*_q_numpy(Q), block).astype(np.float64)
    w = rng.standard_normal(K)
    got = kernels.quantized_weighted_sum(
        Q, w, out=torch.empty(D, dtype=torch.float64, device=dev), backend=backend
    )
    terms = w[:, None] * dec
    _check_close(backend, got, terms.sum(axis=0), np.abs(terms).sum(axis=0), torch.float64, K)
    gram = kernels.quantized_gram(Q, backend=backend).cpu().to(torch.float64).numpy()
    want = dec @ dec.T
    np.testing.assert_allclose(gram, want, rtol=0, atol=1e-5 * np.abs(want).max())


# --------------------------------------------------------------------------------------------
# quantized_gram
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("K", "D", "block"), SHAPES, ids=SHAPE_IDS)
def test_quantized_gram(backend, K, D, block) -> None:
    K, D, block = _shape(backend, K, D, block)
    rng = _rng()
    dev = DEVICE[backend]
    X = _rows(rng, K, D)
    X[:, : D // 2] += X[0, : D // 2]  # correlated rows: off-diagonal entries of both signs
    Q = kernels.quantize_rows(torch.from_numpy(X).to(dev), block, backend=backend)
    dec = numpy_decode(*_q_numpy(Q), block).astype(np.float64)
    want = dec @ dec.T  # the float64 oracle, numpy only
    got = kernels.quantized_gram(Q, backend=backend)
    assert got.dtype == torch.float32 and got.shape == (K, K) and got.device == Q.device
    got = got.cpu()
    assert torch.equal(got, got.T)  # exactly symmetric
    g = got.to(torch.float64).numpy()
    np.testing.assert_allclose(g, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert np.all(np.diag(g) >= 0)
    if backend == "reference":  # the float64 Gram rounded once: within one float32 spacing
        w32 = want.astype(np.float32)
        assert np.all(np.abs(g - want) <= np.spacing(np.abs(w32)).astype(np.float64))


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def _q(K: int = 3, D: int = 10, block: int = 4) -> QuantizedRows:
    return QuantizedRows.empty(K, D, block)


@pytest.mark.parametrize(
    ("Q", "error", "message"),
    [
        ("not rows", TypeError, "must be a QuantizedRows"),
        (QuantizedRows(torch.zeros(3, 10, dtype=torch.uint8), torch.zeros(3, 3), 4), TypeError,
         "codes must be a 2-D int8"),
        (QuantizedRows(torch.zeros(30, dtype=torch.int8), torch.zeros(3, 3), 4), TypeError,
         "codes must be a 2-D int8"),
        (QuantizedRows(torch.zeros(3, 10, dtype=torch.int8), torch.zeros(3, 3,
         dtype=torch.float64), 4), TypeError, "scales must be a float32"),
        (QuantizedRows(torch.zeros(3, 10, dtype=torch.int8), torch.zeros(3, 2), 4), ValueError,
         r"take scales of shape \(3, 3\), got \(3, 2\)"),
        (QuantizedRows(torch.zeros(3, 10, dtype=torch.int8), torch.zeros(3), 4), ValueError,
         "take scales of shape"),
        (QuantizedRows(torch.zeros(3, 20, dtype=torch.int8)[:, ::2], torch.zeros(3, 3), 4),
         ValueError, "contiguous"),
        (QuantizedRows(torch.zeros(10, 3, dtype=torch.int8).T, torch.zeros(3, 3), 4),
         ValueError, "contiguous"),
        (QuantizedRows(torch.zeros(3, 10, dtype=torch.int8), torch.zeros(3, 6)[:, ::2], 4),
         ValueError, "contiguous"),
        (QuantizedRows(torch.zeros(3, 10, dtype=torch.int8), torch.zeros(3, 3), 0), ValueError,
         "block must be an integer >= 1"),
        (QuantizedRows(torch.zeros(3, 10, dtype=torch.int8), torch.zeros(3, 3), 4.0),
         ValueError, "block must be an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_rows_are_refused_by_every_kernel(Q, error, message) -> None:
    calls = [
        lambda: kernels.quantized_weighted_sum(Q, [1.0, 1.0, 1.0]),
        lambda: kernels.quantized_group_means(Q, [0, 0, 0], 1),
        lambda: kernels.quantized_gram(Q),
        lambda: kernels.dequantize_rows(Q),
        lambda: kernels.quantize_rows(torch.zeros(3, 10), 4, out=Q),
    ]
    for call in calls:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize(
    ("weights", "kwargs", "error", "message"),
    [
        ([1.0, 2.0], {}, ValueError, r"weights must have shape \(3,\)"),
        ([[1.0, 2.0, 3.0]], {}, ValueError, r"weights must have shape \(3,\)"),
        ([1.0, float("nan"), 0.0], {}, ValueError, "weights must be finite"),
        ([1.0, float("inf"), 0.0], {}, ValueError, "weights must be finite"),
        ([True, False, True], {}, TypeError, "weights must be real numbers"),
        ([1.0, 2.0, 3.0], {"alpha": float("nan")}, ValueError, "alpha must be finite"),
        ([1.0, 2.0, 3.0], {"beta": 1.0}, ValueError, "beta != 0 needs out="),
        ([1.0, 2.0, 3.0], {"out": torch.zeros(9)}, ValueError, r"must have shape \(10,\)"),
        ([1.0, 2.0, 3.0], {"out": torch.zeros(10, dtype=torch.float16)}, TypeError,
         "float32 or float64"),
        ([1.0, 2.0, 3.0], {"out": torch.zeros(20)[::2]}, ValueError, "stride|contiguous"),
        ([1.0, 2.0, 3.0], {"backend": "gpu"}, ValueError, "backend must be one of"),
    ],
)  # fmt: skip
def test_bad_weighted_sum_arguments_are_refused(weights, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        kernels.quantized_weighted_sum(_q(), weights, **kwargs)


@pytest.mark.parametrize(
    ("groups", "num_groups", "kwargs", "error", "message"),
    [
        ([0, 1, 2], 2, {}, ValueError, r"groups must lie in \[-1, 2\)"),
        ([0, -2, 1], 2, {}, ValueError, r"groups must lie in \[-1, 2\)"),
        ([0, 1], 2, {}, ValueError, r"groups must have shape \(3,\)"),
        ([0.0, 1.0, 1.0], 2, {}, TypeError, "groups must be an integer tensor"),
        ([True, False, True], 2, {}, TypeError, "groups must be an integer tensor"),
        ([0, 1, 1], 2.0, {}, TypeError, "num_groups must be an int"),
        ([0, 1, 1], -1, {}, ValueError, "num_groups must be >= 0"),
        ([0, 1, 1], 2, {"out": torch.zeros(3, 10)}, ValueError, r"must have shape \(2, 10\)"),
        ([0, 1, 1], 2, {"out": torch.zeros(2, 10, dtype=torch.int32)}, TypeError,
         "float32 or float64"),
    ],
)  # fmt: skip
def test_bad_group_arguments_are_refused(groups, num_groups, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        kernels.quantized_group_means(_q(), groups, num_groups, **kwargs)


def test_bad_quantize_and_dequantize_arguments_are_refused() -> None:
    X = torch.zeros(3, 10)
    with pytest.raises(TypeError, match="float torch.Tensor"):
        kernels.quantize_rows(torch.zeros(3, 10, dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="float torch.Tensor"):
        kernels.quantize_rows(np.zeros((3, 10), dtype=np.float32), 4)
    with pytest.raises(ValueError, match="1-D or 2-D"):
        kernels.quantize_rows(torch.zeros(2, 3, 10), 4)
    for block in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match="block must be an integer >= 1"):
            kernels.quantize_rows(X, block)
    with pytest.raises(ValueError, match="out holds"):
        kernels.quantize_rows(X, 4, out=_q(K=2))
    with pytest.raises(ValueError, match="out has blocks of 5"):
        kernels.quantize_rows(X, 4, out=_q(block=5))
    with pytest.raises(IndexError, match="row 3 is out of range"):
        kernels.dequantize_rows(_q(), [0, 3])
    with pytest.raises(IndexError, match="row -1 is out of range"):
        kernels.dequantize_rows(_q(), [-1])
    with pytest.raises(ValueError, match=r"must have shape \(2, 10\)"):
        kernels.dequantize_rows(_q(), [0, 1], out=torch.zeros(3, 10))
    with pytest.raises(TypeError, match="float torch.Tensor"):
        kernels.dequantize_rows(_q(), out=torch.zeros(3, 10, dtype=torch.int32))
    with pytest.raises(ValueError, match="block must be an integer >= 1"):
        kernels.quantized_row_bytes(10, 0)


def test_empty_and_views() -> None:
    Q = QuantizedRows.empty(4, 10, 3)
    assert Q.shape == (4, 10) and tuple(Q.scales.shape) == (4, 4) and Q.device.type == "cpu"
    assert not Q.codes.any() and not Q.scales.any()
    Q.codes[2, 5] = 7
    Q.scales[2, 1] = 0.5
    r = Q.row(2)
    assert r.shape == (1, 10) and r.block == 3 and r.codes.data_ptr() == Q.codes[2].data_ptr()
    assert kernels.dequantize_rows(r)[0, 5] == 3.5
    h = Q.head(3)
    assert h.shape == (3, 10) and h.codes.data_ptr() == Q.codes.data_ptr()
    assert kernels.quantized_gram(h).shape == (3, 3)
    assert kernels.quantized_row_bytes(10, 3) == 10 + 4 * 4
    assert kernels.quantized_row_bytes(10, 128) == 14


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("K", "D"), [(0, 5), (3, 0), (0, 0)])
def test_no_rows_or_no_columns(backend, K, D) -> None:
    dev = DEVICE[backend]
    Q = kernels.quantize_rows(torch.zeros(K, D, device=dev), 3, backend=backend)
    assert Q.shape == (K, D) and tuple(Q.scales.shape) == (K, math.ceil(D / 3))
    ws = kernels.quantized_weighted_sum(Q, np.ones(K), backend=backend)
    assert ws.shape == (D,) and not ws.any()
    gm = kernels.quantized_group_means(Q, np.zeros(K, dtype=np.int64), 2, backend=backend)
    assert gm.shape == (2, D) and not gm.any()
    gram = kernels.quantized_gram(Q, backend=backend)
    assert gram.shape == (K, K) and not gram.any()
    assert kernels.dequantize_rows(Q, backend=backend).shape == (K, D)


def test_no_groups_at_all_is_an_empty_result() -> None:
    assert kernels.group_means(torch.zeros(3, 4), [-1, -1, -1], 0).shape == (0, 4)
    got = kernels.quantized_group_means(QuantizedRows.empty(3, 4, 2), [-1, -1, -1], 0)
    assert got.shape == (0, 4)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_weights_given_as_python_floats_keep_float64_precision(backend: str) -> None:
    # 0.1 is not a float32: a list of Python floats must not be rounded to float32 on the way.
    Q = QuantizedRows.empty(1, 1, 1)
    Q.codes[0, 0], Q.scales[0, 0] = 127, 1.0
    out = torch.empty(1, dtype=torch.float64)
    kernels.quantized_weighted_sum(Q, [0.1], out=out, backend=backend)
    assert out.item() == 127 * 0.1
    X = torch.tensor([[127.0]], dtype=torch.float64)
    assert kernels.weighted_sum(X, [0.1], backend=backend).item() == 127 * 0.1


# --------------------------------------------------------------------------------------------
# The memory target
# --------------------------------------------------------------------------------------------

RESNET34 = 21_797_672


def _bytes_per_row(make, D: int, K: int = 3) -> float:
    tensors = make(K, D)
    return sum(t.untyped_storage().nbytes() for t in tensors) / K


def test_a_thousand_resnet34_rows_fit_in_24_gb() -> None:
    """Measured, not computed: real rows at two smaller D, bytes per row fitted as a*D + b and
    extrapolated to 1,000 rows of ResNet-34 (21,797,672 values): under 24 GB in int8 with
    blocks of 128, where float32 rows would take more than 86 GB."""
    block, rows = 128, 1_000
    # D / 512 and D / 256, moved onto D's remainder modulo the block: ceil(D / block) is then
    # linear along the three sizes, so the straight line through two is exact at the third.
    D1, D2 = (RESNET34 // n // block * block + RESNET34 % block for n in (512, 256))
    gen = torch.Generator().manual_seed(0)

    def int8_rows(K: int, D: int) -> tuple[torch.Tensor, ...]:
        Q = kernels.quantize_rows(torch.randn(K, D, generator=gen), block, backend="cpu")
        return (Q.codes, Q.scales)

    def float32_rows(K: int, D: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(K, D, generator=gen),)

    def extrapolated(make) -> float:
        p1, p2 = _bytes_per_row(make, D1), _bytes_per_row(make, D2)
        a = (p2 - p1) / (D2 - D1)
        b = p1 - a * D1
        return (a * RESNET34 + b) * rows

    q8 = extrapolated(int8_rows)
    assert q8 < 24e9, q8
    assert abs(q8 - kernels.quantized_row_bytes(RESNET34, block) * rows) <= 2 * rows
    f32 = extrapolated(float32_rows)
    assert f32 > 86e9, f32
    assert abs(f32 - 4 * RESNET34 * rows) <= 2 * rows


# --------------------------------------------------------------------------------------------
# Similarities of chosen rows, decoded a chunk at a time (FedDGIC)
# --------------------------------------------------------------------------------------------


def _np_cos(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_bytes", [64, 8 << 20], ids=["many-chunks", "one-chunk"])
def test_similarities_of_chosen_rows_against_float64(backend, chunk_bytes, monkeypatch) -> None:
    from aggsrv.kernels import quantized_rows

    rng = _rng()
    K, D, block = _shape(backend, 7, 1_003, 7)
    Q = _random_q(rng, K, D, block, DEVICE[backend])
    Q.codes[1, :400] = 0  # a row empty on the first segments: its cosines there are 0
    rows = [int(r) for r in rng.permutation(K)[: max(2, K - 2)]]
    if backend == "triton" and INTERPRETED and chunk_bytes == 64:
        # The interpreter runs each chunk's launches in Python: 140 columns a chunk there (8
        # chunks, the last of 23; segments still span chunk boundaries), one block elsewhere.
        chunk_bytes = 4 * len(rows) * block * 20
    monkeypatch.setattr(quantized_rows, "_SIMILARITY_CHUNK_BYTES", chunk_bytes)
    _spoil(Q, np.setdiff1d(np.arange(K), rows), rng)  # rows not chosen are never read
    offsets = [0, 5, 5, 400, 401, D]  # an empty segment and a one-element one
    X = numpy_decode(*_q_numpy(Q), block)[rows].astype(np.float64)
    spans = [(b, e) for b, e in zip(offsets[:-1], offsets[1:], strict=True) if e > b]
    m = len(rows)
    whole = np.array([[_np_cos(X[i], X[j]) for j in range(m)] for i in range(m)])
    per = np.array([[[_np_cos(X[i, b:e], X[j, b:e]) for j in range(m)] for i in range(m)]
                    for b, e in zip(offsets[:-1], offsets[1:], strict=True)])  # fmt: skip
    np.fill_diagonal(whole, [1.0 if np.any(X[i]) else 0.0 for i in range(m)])
    for li, (b, e) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        np.fill_diagonal(per[li], [1.0 if np.any(X[i, b:e]) else 0.0 for i in range(m)])
    nonempty = [li for li, (b, e) in enumerate(zip(offsets[:-1], offsets[1:], strict=True))
                if e > b]  # fmt: skip
    normalized = per[nonempty].mean(axis=0)
    assert len(spans) == len(nonempty)

    got = kernels.quantized_cosine_matrix(Q, rows=rows, backend=backend).cpu().double().numpy()
    np.testing.assert_allclose(got, whole, atol=2e-6)
    got = kernels.quantized_cosine_matrix(Q, offsets, rows=rows, layerwise=True, backend=backend)
    np.testing.assert_allclose(got.cpu().double().numpy(), per, atol=2e-6)
    for reduce in (None, lambda t: t):  # a federation of one shard
        got = kernels.quantized_layer_normalized_cosine(
            Q, offsets, rows=rows, reduce=reduce, backend=backend
        )
        np.testing.assert_allclose(got.cpu().double().numpy(), normalized, atol=2e-6)
        assert torch.equal(got, got.T)


def test_similarities_refuse_bad_arguments() -> None:
    Q = QuantizedRows.empty(3, 10, 4)
    with pytest.raises(IndexError, match="row 3 is out of range for 3 rows"):
        kernels.quantized_cosine_matrix(Q, rows=[0, 3])
    with pytest.raises(ValueError, match="layerwise=True needs offsets"):
        kernels.quantized_cosine_matrix(Q, layerwise=True)
    with pytest.raises(ValueError, match="offsets is required"):
        kernels.quantized_layer_normalized_cosine(Q, None)
    with pytest.raises(ValueError, match="offsets"):
        kernels.quantized_layer_normalized_cosine(Q, [0, 4, 9])


@pytest.mark.parametrize("chunk_bytes", [64, 8 << 20], ids=["many-chunks", "one-chunk"])
def test_similarities_sum_over_two_shards_with_one_reduce_each(chunk_bytes, monkeypatch) -> None:
    """Two shards holding column slices (a cut inside a segment): each call hands exactly one
    packed partial to ``reduce``, whatever its chunks, and the sum of both gives the cosines
    of the whole rows."""
    from aggsrv.kernels import quantized_rows

    monkeypatch.setattr(quantized_rows, "_SIMILARITY_CHUNK_BYTES", chunk_bytes)
    rng = _rng()
    K, D, cut = 5, 901, 333
    X = _rows(rng, K, D)
    offsets = [0, 100, 500, D]  # the cut lies inside the second segment
    halves = [(0, cut), (cut, D)]
    Qs = [kernels.quantize_rows(torch.from_numpy(X[:, a:b].copy()), 16) for a, b in halves]
    local = [[min(max(o, a), b) - a for o in offsets] for a, b in halves]
    whole = np.concatenate([numpy_decode(*_q_numpy(Q), 16) for Q in Qs], axis=1)
    rows = [3, 1, 4]

    for call, want in (
        (lambda Q, offs, red: kernels.quantized_layer_normalized_cosine(
            Q, offs, rows=rows, reduce=red, backend="cpu"),
         kernels.layer_normalized_cosine(torch.from_numpy(whole[rows]), offsets, backend="cpu")),
        (lambda Q, offs, red: kernels.quantized_cosine_matrix(
            Q, offs, rows=rows, layerwise=True, reduce=red, backend="cpu"),
         kernels.cosine_matrix(torch.from_numpy(whole[rows]), offsets, layerwise=True,
                               backend="cpu")),
    ):  # fmt: skip
        seen: list[torch.Tensor] = []
        call(Qs[1], local[1], lambda t, seen=seen: seen.append(t.clone()) or t)
        assert len(seen) == 1, "one reduce per call"
        calls: list[torch.Tensor] = []
        got = call(
            Qs[0], local[0], lambda t, calls=calls, other=seen[0]: calls.append(t) or t + other
        )
        assert len(calls) == 1
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
