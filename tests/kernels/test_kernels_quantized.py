"""quantized_accumulate on every backend against a numpy float64 oracle of the wire format
(docs/wire.md "Quantized values"): each value the binary32 product of its code and its block's
scale, added with the weight in float64 and rounded once; and the same bits as decoding with
the transport's decoder, then adding."""

from __future__ import annotations

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
from aggsrv.transport import Quantization, decode_quantized, quantize  # noqa: E402

BACKENDS = ["reference", "cpu", "triton"]
DEVICE = {"reference": "cpu", "cpu": "cpu",
          "triton": "cuda" if torch.cuda.is_available() else "cpu"}  # fmt: skip


@pytest.fixture(autouse=True)
def _gpu_scalar_types(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        compiled_scalar_types(monkeypatch)


def _rng() -> np.random.Generator:
    seed = secrets.randbits(31)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _codes(rng: np.random.Generator, bits: int, n: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random codes in the format's range: the values, and the tensor the kernel takes."""
    q = 127 if bits == 8 else 7
    values = rng.integers(-q, q + 1, n)
    if bits == 8:
        return values, torch.from_numpy(values.astype(np.int8))
    nib = (values & 0x0F).astype(np.uint8)
    if n % 2:
        nib = np.append(nib, np.uint8(0))
    return values, torch.from_numpy(nib[0::2] | (nib[1::2] << 4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "block"), [(1, 1), (257, 64), (1_001, 128), (4_099, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accumulates_code_times_scale_times_weight(backend, bits, n, block, dtype) -> None:
    rng = _rng()
    values, codes = _codes(rng, bits, n)
    scales = (rng.standard_normal(math.ceil(n / block)) ** 2).astype(np.float32)
    scales[rng.random(scales.size) < 0.2] = 0.0
    start = rng.standard_normal(n).astype(np.float64)
    weight = float(rng.uniform(-2, 2))
    dev = DEVICE[backend]
    out = torch.tensor(start, dtype=dtype, device=dev)
    got = kernels.quantized_accumulate(
        out, codes.to(dev), torch.from_numpy(scales).to(dev), block, weight, bits=bits,
        backend=backend,
    )  # fmt: skip
    assert got is out
    decoded = np.array([np.float32(float(c) * float(scales[i // block]))
                        for i, c in enumerate(values)], dtype=np.float64)  # fmt: skip
    acc = start.astype(np.dtype(str(dtype).split(".")[-1])).astype(np.float64)
    want = acc + weight * decoded
    got64 = out.cpu().to(torch.float64).numpy()
    if backend == "triton" and dtype == torch.float32:
        # float32 accumulation on the GPU: the product and the sum each rounded in float32.
        bound = 2 * np.finfo(np.float32).eps * (np.abs(acc) + np.abs(weight * decoded))
        assert np.all(np.abs(got64 - want) <= bound + 1e-30)
    else:
        assert np.array_equal(got64, torch.tensor(want).to(dtype).to(torch.float64).numpy())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "block"), [(1, 1), (1_001, 128), (4_099, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_with_a_base_out_is_base_plus_the_weighted_values(backend, bits, n, block, dtype) -> None:
    """``base=``: out = base + weight * values in one pass (FedAsync's x + a delta into the
    next version); base is left as it was, and out's old content (even NaN) is never read."""
    rng = _rng()
    values, codes = _codes(rng, bits, n)
    scales = (rng.standard_normal(math.ceil(n / block)) ** 2).astype(np.float32)
    dev = DEVICE[backend]
    base = torch.tensor(rng.standard_normal(n), dtype=dtype, device=dev)
    kept = base.clone()
    weight = float(rng.uniform(-2, 2))
    out = torch.full((n,), float("nan"), dtype=dtype, device=dev)
    got = kernels.quantized_accumulate(
        out, codes.to(dev), torch.from_numpy(scales).to(dev), block, weight, bits=bits,
        base=base, backend=backend,
    )  # fmt: skip
    assert got is out and torch.equal(base, kept)
    alone = kernels.quantized_accumulate(
        kept.clone(), codes.to(dev), torch.from_numpy(scales).to(dev), block, weight, bits=bits,
        backend=backend,
    )  # fmt: skip
    assert torch.equal(out, alone)  # the same bits as adding into a copy of base


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "block"), [(1, 1), (1_001, 128), (4_099, 5), (70_001, 64)])
@pytest.mark.parametrize("in_place", [True, False])
def test_squares_receive_the_norm_of_the_codes_in_the_same_call(backend, bits, n, block, in_place):
    """``squares=``: sum_b scale_b^2 sum code^2, the exact products' squares summed (math.fsum
    here), with the accumulation's result unchanged; many parallel tasks at n = 70,001."""
    rng = _rng()
    values, codes = _codes(rng, bits, n)
    scales = (rng.standard_normal(math.ceil(n / block)) ** 2).astype(np.float32)
    scales[rng.random(scales.size) < 0.2] = 0.0
    dev = DEVICE[backend]
    start = torch.tensor(rng.standard_normal(n), dtype=torch.float32, device=dev)
    base = None if in_place else start
    out = start.clone() if in_place else torch.empty(n, device=dev)
    squares = torch.full((1,), float("nan"), dtype=torch.float64, device=dev)
    args = (codes.to(dev), torch.from_numpy(scales).to(dev), block, 0.3)
    kernels.quantized_accumulate(out, *args, bits=bits, base=base, squares=squares,
                                 backend=backend)  # fmt: skip
    exact = math.fsum((float(c) * float(scales[i // block])) ** 2 for i, c in enumerate(values))
    assert float(squares) == pytest.approx(exact, rel=1e-12, abs=0.0)
    plain = start.clone() if in_place else torch.empty(n, device=dev)
    kernels.quantized_accumulate(plain, *args, bits=bits, base=base, backend=backend)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "block"), [(1, 1), (7, 2), (1_001, 128), (4_099, 5), (3, 64)])
def test_code_squares_is_the_norm_of_the_codes(backend, bits, n, block) -> None:
    """kernels.code_squares against math.fsum of the exact products squared; an INT4 padding
    nibble (after an odd last value) is not a value, whatever it holds."""
    rng = _rng()
    values, codes = _codes(rng, bits, n)
    if bits == 4 and n % 2:
        codes[-1] |= 0x70  # padding the format refuses: still not counted
    scales = (rng.standard_normal(math.ceil(n / block)) ** 2).astype(np.float32)
    dev = DEVICE[backend]
    got = kernels.code_squares(codes.to(dev), torch.from_numpy(scales).to(dev), block, n,
                               bits=bits, backend=backend)  # fmt: skip
    exact = math.fsum((float(c) * float(scales[i // block])) ** 2 for i, c in enumerate(values))
    assert isinstance(got, float) and got == pytest.approx(exact, rel=1e-12, abs=0.0)


def test_code_squares_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="take 2 entries"):
        kernels.code_squares(torch.zeros(3, dtype=torch.uint8), torch.ones(1), 4, 3, bits=4)
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        kernels.code_squares(torch.zeros(3, dtype=torch.int8), torch.ones(1), 4, -1)
    assert kernels.code_squares(torch.zeros(0, dtype=torch.int8), torch.ones(0), 4, 0) == 0.0


def test_squares_must_be_one_float64() -> None:
    args = (torch.zeros(4), torch.zeros(4, dtype=torch.int8), torch.ones(1), 4, 1.0)
    with pytest.raises(TypeError, match=r"float64 tensor of shape \(1,\), got .*\(2,\)"):
        kernels.quantized_accumulate(*args, squares=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="float64 tensor"):
        kernels.quantized_accumulate(*args, squares=torch.zeros(1))
    empty = torch.full((1,), 5.0, dtype=torch.float64)
    kernels.quantized_accumulate(torch.zeros(0), torch.zeros(0, dtype=torch.int8),
                                 torch.ones(0), 4, 1.0, squares=empty)  # fmt: skip
    assert float(empty) == 0.0


def test_a_base_is_checked_like_out() -> None:
    codes, scales = torch.zeros(10, dtype=torch.int8), torch.ones(4)
    with pytest.raises(ValueError, match="base must have shape"):
        kernels.quantized_accumulate(torch.zeros(10), codes, scales, 3, base=torch.zeros(9))
    with pytest.raises(TypeError, match="base has dtype"):
        kernels.quantized_accumulate(
            torch.zeros(10), codes, scales, 3, base=torch.zeros(10, dtype=torch.float64)
        )
    out = torch.zeros(20)
    with pytest.raises(ValueError, match="overlaps base"):
        kernels.quantized_accumulate(out[:10], codes, scales, 3, base=out[5:15])


@pytest.mark.parametrize("q", [Quantization.INT8, Quantization.INT4])
def test_the_same_bits_as_decoding_the_wire_then_adding(q) -> None:
    rng = _rng()
    n, block = 10_007, 128
    wire, _ = quantize(torch.from_numpy(rng.standard_normal(n).astype(np.float32)), q, block)
    nblocks = math.ceil(n / block)
    scales = torch.frombuffer(bytearray(wire[: 4 * nblocks]), dtype=torch.float32)
    body = torch.frombuffer(bytearray(wire[4 * nblocks :]), dtype=torch.uint8)
    codes = body.view(torch.int8) if q is Quantization.INT8 else body
    base = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    fused = kernels.quantized_accumulate(
        base.clone(), codes, scales, block, 0.3, bits=8 if q is Quantization.INT8 else 4,
        backend="cpu",
    )  # fmt: skip
    two_pass = base.clone()
    kernels.sparse_accumulate(two_pass, torch.arange(n), decode_quantized(wire, q, n, block, "u"),
                              0.3, backend="cpu")  # fmt: skip
    assert torch.equal(fused, two_pass)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bits": 6}, ValueError, "bits must be 4 or 8"),
        ({"block": 0}, ValueError, "block must be"),
        ({"codes": torch.zeros(10, dtype=torch.uint8)}, TypeError, "int8"),
        ({"codes": torch.zeros(9, dtype=torch.int8)}, ValueError, "take 10 entries"),
        ({"scales": torch.zeros(3)}, ValueError, "take 4 scales"),
        ({"scales": torch.zeros(4, dtype=torch.float64)}, TypeError, "float32"),
        ({"weight": float("nan")}, ValueError, "weight"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, message) -> None:
    args = {"out": torch.zeros(10), "codes": torch.zeros(10, dtype=torch.int8),
            "scales": torch.ones(4), "block": 3, "weight": 1.0, "bits": 8}  # fmt: skip
    args.update(kwargs)
    with pytest.raises(error, match=message):
        kernels.quantized_accumulate(
            args["out"], args["codes"], args["scales"], args["block"], args["weight"],
            bits=args["bits"],
        )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "block"), [(1, 1), (257, 64), (1_001, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dequantize_writes_each_binary32_product_bit_for_bit(backend, bits, n, block, dtype):
    rng = _rng()
    values, codes = _codes(rng, bits, n)
    scales = (rng.standard_normal(math.ceil(n / block)) ** 2).astype(np.float32)
    scales[rng.random(scales.size) < 0.3] = 0.0  # negative codes then give -0.0
    dev = DEVICE[backend]
    out = torch.full((n,), float("nan"), dtype=dtype, device=dev)
    got = kernels.dequantize(codes.to(dev), torch.from_numpy(scales).to(dev), block, bits=bits,
                             out=out, backend=backend)  # fmt: skip
    assert got is out
    want = np.array([np.float32(c) * scales[i // block] for i, c in enumerate(values)],
                    dtype=np.float32)  # fmt: skip
    want_t = torch.from_numpy(want).to(dtype)
    bits_of = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
    got_bits, want_bits = out.cpu().view(bits_of[dtype]), want_t.view(bits_of[dtype])
    if backend == "triton" and dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET"):
        # The interpreter truncates to bfloat16 where a GPU rounds to nearest: one unit apart.
        assert (got_bits.to(torch.int32) - want_bits.to(torch.int32)).abs().max() <= 1
    else:  # bit for bit, the sign of zero included
        assert torch.equal(got_bits, want_bits)
