"""Blockwise absmax INT8/INT4 values (aggsrv.transport.quantized, docs/wire.md "Quantized values"):
the decoder against an independent reference of the format (bytes packed by hand, products in
float64, which are exact here, rounded once to binary32); the encoder against a numpy reference
of its documented rule; stochastic rounding unbiased; every malformed section refused.
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import pytest
import torch

from aggsrv.transport.errors import BadChunk, WrongLength
from aggsrv.transport.quantized import (
    Quantization,
    decode_quantized,
    quantize,
    quantized_nbytes,
    quantized_values,
)

INT8, INT4 = Quantization.INT8, Quantization.INT4


def _rng() -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


def _pack(q: Quantization, scales: list[float], codes: list[int]) -> bytes:
    """The section as the format describes it, written out by hand."""
    out = b"".join(struct.pack("<f", s) for s in scales)
    if q is INT8:
        return out + bytes(c & 0xFF for c in codes)
    nibbles = [c & 0x0F for c in codes] + ([0] if len(codes) % 2 else [])
    return out + bytes(lo | (hi << 4) for lo, hi in zip(nibbles[0::2], nibbles[1::2], strict=True))


@pytest.mark.parametrize("q", [INT8, INT4])
@pytest.mark.parametrize(("n", "block"), [(1, 1), (7, 3), (1_001, 128), (257, 256), (64, 64)])
def test_the_decoder_gives_each_code_times_its_blocks_scale(q, n: int, block: int) -> None:
    rng = _rng()
    nblocks = math.ceil(n / block)
    scales = rng.standard_normal(nblocks).astype(np.float32) ** 2
    scales[rng.random(nblocks) < 0.2] = 0.0
    codes = rng.integers(-q.qmax, q.qmax + 1, n)
    got = decode_quantized(_pack(q, scales.tolist(), codes.tolist()), q, n, block, "update")
    want = [np.float32(float(c) * float(scales[i // block])) for i, c in enumerate(codes)]
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), np.array(want, dtype=np.float32))
    assert quantized_nbytes(q, n, block) == len(_pack(q, scales.tolist(), codes.tolist()))


def _reference_codes(x: np.ndarray, q: Quantization, block: int) -> tuple[np.ndarray, np.ndarray]:
    """docs/wire.md's encoder rule in numpy: binary32 absmax / Q, round half to even, clamp."""
    n = x.size
    absmax = [np.float32(np.abs(x[b : b + block]).max()) for b in range(0, n, block)]
    scales = np.array([a / np.float32(q.qmax) for a in absmax], dtype=np.float32)
    codes = np.zeros(n, dtype=np.int64)
    for i in range(n):
        s = scales[i // block]
        if s > 0:
            codes[i] = int(np.clip(np.rint(np.float32(x[i]) / s), -q.qmax, q.qmax))
    return scales, codes


@pytest.mark.parametrize("q", [INT8, INT4])
@pytest.mark.parametrize(("n", "block"), [(5, 4), (999, 128), (300, 7), (128, 128)])
def test_the_encoder_follows_its_rule_and_says_what_the_receiver_decodes(q, n, block) -> None:
    rng = _rng()
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32)
    x[rng.random(n) < 0.05] = 0.0
    if n > block:
        x[:block] = 0.0  # a block of zeros: scale 0, codes 0
    wire, decoded = quantize(torch.from_numpy(x), q, block)
    scales, codes = _reference_codes(x, q, block)
    assert wire == _pack(q, scales.tolist(), codes.tolist())
    assert torch.equal(decoded, decode_quantized(wire, q, n, block, "update"))
    # Nearest rounding: every value within half a step of its block's scale.
    step = np.repeat(scales, block)[:n]
    assert np.all(np.abs(decoded.numpy() - x) <= step / 2 * (1 + 1e-6) + 1e-30)


def test_stochastic_rounding_is_unbiased() -> None:
    rng = _rng()
    x = torch.from_numpy(rng.standard_normal(64).astype(np.float32))
    g = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    draws = torch.stack([quantize(x, INT4, 16, generator=g)[1] for _ in range(4_000)])
    step = x.view(4, 16).abs().amax(dim=1).repeat_interleave(16) / 7
    # The mean of 4,000 draws lies within 5 standard errors (each draw within one step).
    assert torch.all((draws.mean(0) - x).abs() <= 5 * step / math.sqrt(4_000) + 1e-7)
    assert not torch.equal(draws[0], draws[1])


def test_quantizing_refuses_non_finite_values() -> None:
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.tensor([1.0, float("inf")]), INT8, 2)


@pytest.mark.parametrize(
    ("q", "section", "n", "block", "error", "message"),
    [
        (INT8, _pack(INT8, [float("nan")], [1, 2]), 2, 2, BadChunk, "scale of block 0"),
        (INT8, _pack(INT8, [1.0, float("inf")], [1, 2, 3]), 3, 2, BadChunk, "scale of block 1"),
        (INT8, _pack(INT8, [-0.5], [1]), 1, 4, BadChunk, "not negative"),
        (INT8, _pack(INT8, [1.0], [3, -128]), 2, 2, BadChunk, "-128 at value 1"),
        (INT4, _pack(INT4, [1.0], [1, -8, 2]), 3, 4, BadChunk, "-8\\) at value 1"),
        (INT4, _pack(INT4, [1.0], [1, 2, 3])[:-1] + bytes([0x53]), 3, 4, BadChunk, "padding"),
        (INT8, _pack(INT8, [1.0], [1, 2]), 3, 4, WrongLength, "take 7 bytes"),
        (INT8, _pack(INT8, [1.0, 1.0], [1, 2]), 2, 4, WrongLength, "blocks of 4"),
        (INT4, _pack(INT4, [1.0], [1, 2]) + b"\0", 2, 2, WrongLength, "int4"),
    ],
)
def test_a_malformed_section_is_refused(q, section, n, block, error, message) -> None:
    with pytest.raises(error, match=message):
        decode_quantized(section, q, n, block, "update")


def test_the_worked_example_of_docs_wire_md() -> None:
    x = torch.tensor([0.5, -1.0, 0.25, 2.0, -0.75])
    int8, decoded8 = quantize(x, INT8, 4)
    int4, decoded4 = quantize(x, INT4, 4)
    assert int8.hex(" ") == "04 02 81 3c 06 83 c1 3b 20 c0 10 7f 81"
    assert int4.hex(" ") == "25 49 92 3e b7 6d db 3d d2 71 09"
    assert [round(v, 8) for v in decoded8.tolist()] == [
        0.50393701,
        -1.00787401,
        0.2519685,
        2.0,
        -0.75,
    ]
    assert [round(v, 8) for v in decoded4.tolist()] == [
        0.5714286,
        -0.85714293,
        0.2857143,
        2.0,
        -0.75,
    ]


@pytest.mark.parametrize(("q", "most"), [(INT8, 0.26), (INT4, 0.14)])
def test_the_default_block_keeps_quantized_values_under_their_share_of_float32(q, most) -> None:
    from aggsrv.transport import DEFAULT_BLOCK

    for n in (128, 12_801, 1_000_003, 21_797_672):  # ResNet-34's D last
        share = quantized_nbytes(q, n, DEFAULT_BLOCK) / (4 * n)
        assert share <= most, (n, share)
    # A short tensor pays a whole scale for its last, partial block.
    assert quantized_nbytes(q, 129, DEFAULT_BLOCK) / (4 * 129) > most


# ---------------------------------------------------------------------------------------------
# Kept as codes: quantized_values and the decoder's keep_quantized
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [INT8, INT4])
@pytest.mark.parametrize(("n", "block"), [(1, 1), (7, 3), (1_001, 128), (257, 256), (999, 1000)])
def test_codes_kept_decode_as_the_section_does_and_carry_their_norm(q, n: int, block: int) -> None:
    rng = _rng()
    nblocks = math.ceil(n / block)
    scales = rng.standard_normal(nblocks).astype(np.float32) ** 2
    scales[rng.random(nblocks) < 0.2] = 0.0
    codes = rng.integers(-q.qmax, q.qmax + 1, n)
    section = _pack(q, scales.tolist(), codes.tolist())
    kept = quantized_values(section, q, n, block, "update")
    assert kept is not None
    assert (kept.numel, kept.block, kept.bits) == (n, block, {INT8: 8, INT4: 4}[q])
    assert torch.equal(kept.decode(torch.empty(n)), decode_quantized(section, q, n, block, "u"))
    # The norm from the codes: the exact products code * scale (float64 holds them), squared.
    exact = math.fsum((float(c) * float(scales[i // block])) ** 2 for i, c in enumerate(codes))
    assert kept.norm == pytest.approx(math.sqrt(exact), rel=1e-12, abs=0.0)


@pytest.mark.parametrize(
    ("q", "section", "n", "block", "error", "message"),
    [
        (INT8, _pack(INT8, [float("nan")], [1, 2]), 2, 2, BadChunk, "scale of block 0"),
        (INT8, _pack(INT8, [1.0], [3, -128]), 2, 2, BadChunk, "-128 at value 1"),
        (INT4, _pack(INT4, [1.0], [1, -8, 2]), 3, 4, BadChunk, "-8\\) at value 1"),
        (INT4, _pack(INT4, [1.0], [1, 2, 3])[:-1] + bytes([0x53]), 3, 4, BadChunk, "padding"),
        (INT8, _pack(INT8, [1.0], [1, 2]), 3, 4, WrongLength, "take 7 bytes"),
    ],
)
def test_codes_are_kept_only_after_the_decoders_checks(q, section, n, block, error, message):
    with pytest.raises(error, match=message):
        quantized_values(section, q, n, block, "update")


def test_a_scale_too_large_to_prove_the_values_finite_is_not_kept() -> None:
    big = float(np.finfo(np.float32).max) / 100  # 127 * it overflows binary32
    assert quantized_values(_pack(INT8, [1.0, big], [1, 2, 127]), INT8, 3, 2, "u") is None
    assert quantized_values(_pack(INT4, [big * 25], [1, 2, 7]), INT4, 3, 4, "u") is None
    # INT4's codes are 16 times smaller: the same scale is kept there.
    assert quantized_values(_pack(INT4, [big], [1, 2, 7]), INT4, 3, 4, "u") is not None


def _decoder(q: Quantization, n: int, block: int, keep: bool, section: bytes):
    from aggsrv.transport.crc import Crc32c
    from aggsrv.transport.decoder import Decoder, StagingSlot

    slot = StagingSlot(n, {"buffers": 3})
    slot.flat.fill_(7.0)  # what a kept section leaves in the slot
    decoder = Decoder(slot, {"update": n, "buffers": 3}, "float32", 1 << 20,
                      quantized={"update": (q, block)}, keep_quantized=keep)  # fmt: skip
    buffers = np.arange(3, dtype="<f4").tobytes()
    decoder.feed("update", 0, section)
    decoder.feed("buffers", 0, buffers)
    crc = Crc32c()
    crc.update(section)
    crc.update(buffers)
    return decoder, decoder.finish(crc.value), slot


@pytest.mark.parametrize("q", [INT8, INT4])
def test_the_decoder_keeps_a_quantized_main_tensor_as_codes(q) -> None:
    rng = _rng()
    n, block = 1_003, 64
    x = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    section, sent = quantize(x, q, block)
    decoder, views, slot = _decoder(q, n, block, True, section)
    kept = decoder.quantized["update"]
    assert torch.equal(kept.decode(torch.empty(n)), sent)
    assert bool((views["update"] == 7.0).all())  # not decoded into the slot
    assert torch.equal(views["buffers"], torch.arange(3, dtype=torch.float32))
    assert decoder.norm is None and decoder.cosine is None  # the codes have it
    assert kept.norm == pytest.approx(float(sent.double().norm()), rel=1e-6)
    # Without keep_quantized the same upload is decoded into the slot, as before.
    plain, views, _ = _decoder(q, n, block, False, section)
    assert plain.quantized == {} and torch.equal(views["update"], sent)
    assert plain.norm is None or plain.norm == pytest.approx(kept.norm, rel=1e-6)


def test_a_kept_section_whose_scale_is_too_large_is_decoded_and_its_overflow_refused() -> None:
    from aggsrv.transport.errors import NonFinite

    big = float(np.finfo(np.float32).max) / 100
    section = _pack(INT8, [1.0, big], [1, 2, 127, 3])
    with pytest.raises(NonFinite, match="'update' holds inf at element 2"):
        _decoder(INT8, 4, 2, True, section)
