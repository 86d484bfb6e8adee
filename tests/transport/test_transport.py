"""Tests for aggsrv.transport: wire bytes, chunking, CRC-32C, decoding and every codec error.

Oracles: torch's own dtype conversions and numpy's little-endian encodings for the wire bytes, a
table-driven pure-Python CRC-32C (checked against the standard check value) for the checksum.
Inputs are fresh random draws; the seed is in every assertion message.
"""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from crc_oracle import crc32c_oracle

from aggsrv import transport as T
from aggsrv.transport import dtypes as dtypes_mod

# --------------------------------------------------------------------------------------------
# Oracles and helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture
def seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


def make_tensors(seed: int, shapes: list[tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
    """Named random float32 tensors (normal, some large and tiny magnitudes mixed in)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        t = torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-3, 4, shape, generator=g)
        out.append((f"layer{i}.weight", t))
    return out


SHAPES = [(13, 7), (1,), (5, 3, 2), (101,), (0,), (64, 9)]  # odd sizes, one empty tensor


def layout_of(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    return {name: t.numel() for name, t in tensors}


def oracle_wire_bytes(t: torch.Tensor, wd: T.WireDtype) -> bytes:
    """The tensor's little-endian wire bytes via numpy (bfloat16: torch's rounding, LE u16)."""
    flat = t.detach().reshape(-1)
    if wd is T.WireDtype.FLOAT32:
        return flat.numpy().astype("<f4").tobytes()
    if wd is T.WireDtype.FLOAT16:
        return flat.numpy().astype("<f2").tobytes()
    return flat.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()


def encode_all(tensors, wd, chunk_bytes):
    enc = T.Encoder(tensors, wd, chunk_bytes)
    chunks = [(c.name, c.byte_offset, bytes(c.data)) for c in enc.chunks()]
    return enc, chunks


def decoder_for(tensors, wd, max_chunk_bytes, slot=None):
    lay = layout_of(tensors)
    slot = slot or T.StagingSlot(sum(lay.values()))
    return slot, T.Decoder(slot, lay, wd, max_chunk_bytes)


# --------------------------------------------------------------------------------------------
# CRC-32C
# --------------------------------------------------------------------------------------------


def test_crc_oracle_check_value():
    assert crc32c_oracle(b"123456789") == 0xE3069283
    assert T.crc32c(b"123456789") == 0xE3069283


def test_crc_matches_oracle_streaming(seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8).tobytes()
    assert T.crc32c(data) == crc32c_oracle(data), seed
    # Streaming in random pieces, over memoryviews (no copies), gives the same value.
    cuts = sorted(rng.integers(0, len(data), 5).tolist())
    crc = T.Crc32c()
    mv = memoryview(data)
    for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
        crc.update(mv[a:b])
    assert crc.value == crc32c_oracle(data) and crc.nbytes == len(data), seed
    assert T.crc32c(b"") == 0


# --------------------------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------------------------


def test_wire_dtype_parse():
    W = T.WireDtype
    assert [(w.wire_name, w.itemsize) for w in W] == [
        ("float32", 4),
        ("float16", 2),
        ("bfloat16", 2),
    ]
    assert W.parse("float16") is W.FLOAT16
    assert W.parse("DTYPE_BFLOAT16") is W.BFLOAT16
    assert W.parse("bf16") is W.BFLOAT16
    assert W.parse(torch.float32) is W.FLOAT32
    assert W.parse(W.FLOAT16) is W.FLOAT16
    for bad in ("float64", "int8", torch.float64, 3):
        with pytest.raises(T.UnsupportedDtype) as ei:
            W.parse(bad)
        assert ei.value.grpc_code_name == "INVALID_ARGUMENT"
        assert "float32, float16, bfloat16" in str(ei.value)


def test_bfloat16_is_high_half_of_float32(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(257, generator=g).to(torch.bfloat16).float()  # exactly representable
    wire = T.to_wire(x, T.WireDtype.BFLOAT16).numpy().view("<u2")
    high = (x.numpy().view("<u4") >> 16).astype(np.uint16)
    np.testing.assert_array_equal(wire, high, err_msg=str(seed))


def test_float32_wire_is_zero_copy():
    x = torch.randn(1000)
    u8 = T.to_wire(x, T.WireDtype.FLOAT32)
    assert u8.data_ptr() == x.data_ptr()
    chunk = next(iter(T.Encoder([("x", x)], "float32", 400).chunks()))
    assert np.frombuffer(chunk.data, np.uint8).ctypes.data == x.data_ptr()


def test_to_wire_rejects_integer_tensor():
    with pytest.raises(T.UnsupportedDtype, match="int64"):
        list(T.iter_chunks([("step", torch.arange(3))], "float32"))


# --------------------------------------------------------------------------------------------
# Encoder
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wd", list(T.WireDtype), ids=lambda w: w.wire_name)
def test_encoder_chunks_and_crc(seed, wd):
    tensors = make_tensors(seed, SHAPES)
    chunk_bytes = 7 * wd.itemsize + 1  # rounded down to 7 whole elements
    enc, chunks = encode_all(tensors, wd, chunk_bytes)
    assert enc.chunk_bytes == 7 * wd.itemsize
    payload = b"".join(data for _, _, data in chunks)
    expected = b"".join(oracle_wire_bytes(t, wd) for _, t in tensors)
    assert payload == expected, seed
    assert enc.crc32c == crc32c_oracle(expected), seed
    assert enc.nbytes == enc.total_bytes == len(expected)
    # Per tensor: contiguous ascending offsets, whole elements, at most the chunk size.
    for name, t in tensors:
        mine = [(off, len(data)) for n, off, data in chunks if n == name]
        nbytes = t.numel() * wd.itemsize
        assert [off for off, _ in mine] == list(range(0, nbytes, enc.chunk_bytes))
        assert all(0 < ln <= enc.chunk_bytes and ln % wd.itemsize == 0 for _, ln in mine)
        assert sum(ln for _, ln in mine) == nbytes
    assert [n for n, _, _ in chunks] == sorted(
        (n for n, _, _ in chunks), key=[name for name, _ in tensors].index
    )


def test_encoder_validation():
    x = [("x", torch.randn(10))]
    with pytest.raises(ValueError, match="smaller than one float32 element"):
        T.Encoder(x, "float32", 3)
    with pytest.raises(ValueError, match="appears twice"):
        T.Encoder([("x", torch.randn(2)), ("x", torch.randn(2))])
    enc = T.Encoder(x, "bfloat16", 5)
    assert enc.chunk_bytes == 4
    it = enc.chunks()
    next(it)
    with pytest.raises(RuntimeError, match="to the end"):
        _ = enc.crc32c
    assert T.chunk_limit(4 << 20, T.WireDtype.FLOAT32) == 1 << 20
    assert T.chunk_limit(1000, T.WireDtype.FLOAT32) == 936  # below the limit less 64 bytes


def test_big_endian_host_path(monkeypatch, seed):
    """Declared big-endian, the host byte-swaps each element on encode and back on decode."""
    tensors = make_tensors(seed, [(9, 5), (3,)])
    for wd in T.WireDtype:
        _, native = encode_all(tensors, wd, 64)
        monkeypatch.setattr(dtypes_mod, "_NATIVE_LITTLE", False)
        enc, swapped = encode_all(tensors, wd, 64)
        for (_, _, a), (_, _, b) in zip(native, swapped, strict=True):
            rev = np.frombuffer(a, np.uint8).reshape(-1, wd.itemsize)[:, ::-1].tobytes()
            assert b == rev, (seed, wd)
        _, dec = decoder_for(tensors, wd, 64)
        for c in swapped:
            dec.feed(*c)
        out = dec.finish(enc.crc32c)
        monkeypatch.setattr(dtypes_mod, "_NATIVE_LITTLE", True)
        for name, t in tensors:
            assert torch.equal(out[name], t.reshape(-1).to(wd.torch_dtype).float()), (seed, wd)


# --------------------------------------------------------------------------------------------
# Decoder: round trips and slot reuse
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wd", list(T.WireDtype), ids=lambda w: w.wire_name)
def test_round_trip(seed, wd):
    tensors = make_tensors(seed, SHAPES)
    chunk_bytes = 7 * wd.itemsize
    enc, chunks = encode_all(tensors, wd, chunk_bytes)
    slot, dec = decoder_for(tensors, wd, chunk_bytes)
    for c in chunks:
        dec.feed(*c)
    out = dec.finish(enc.crc32c)
    assert list(out) == [n for n, _ in tensors]
    for name, t in tensors:
        # float32 bit-exact; half types bit-equal to torch's own conversion.
        want = t.reshape(-1).to(wd.torch_dtype).float()
        assert torch.equal(out[name].view(torch.int32), want.view(torch.int32)), (seed, name)
    # Packed in layout order into the slot's flat buffer.
    flat = torch.cat([t.reshape(-1).to(wd.torch_dtype).float() for _, t in tensors])
    assert torch.equal(dec.flat, flat) and dec.flat.data_ptr() == slot.flat.data_ptr()


def test_slot_reused_without_reallocation(seed):
    wd = T.WireDtype.BFLOAT16
    first = make_tensors(seed, [(50, 3), (17,)])
    second = make_tensors(seed + 1, [(50, 3), (17,)])
    slot = T.StagingSlot(sum(t.numel() for _, t in first))
    ptr = slot.flat.data_ptr()
    dec = T.Decoder(slot, layout_of(first), wd, 1 << 20)
    for tensors in (first, second):
        dec.reset()
        enc, chunks = encode_all(tensors, wd, 40)
        for c in chunks:
            dec.feed(*c)
        out = dec.finish(enc.crc32c)
        assert slot.flat.data_ptr() == ptr
        for name, t in tensors:
            assert out[name].data_ptr() >= ptr
            assert torch.equal(out[name], t.reshape(-1).to(wd.torch_dtype).float()), seed
    # A fresh decoder over the same slot lands in the same memory too.
    dec2 = T.Decoder(slot, layout_of(first), wd, 1 << 20)
    assert dec2.flat.data_ptr() == ptr


def test_extras_and_interleaved_tensors(seed):
    """A name that is a slot extra lands there; tensors may interleave (CRC in arrival order)."""
    g = torch.Generator().manual_seed(seed)
    delta, weights = torch.randn(37, generator=g), torch.rand(37, generator=g)
    slot = T.StagingSlot(37, {"weights": 40})
    dec = T.Decoder(slot, {"delta": 37, "weights": 37}, "float32", 32)
    a = list(T.iter_chunks([("delta", delta)], "float32", 32))
    b = list(T.iter_chunks([("weights", weights)], "float32", 32))
    order = [c for pair in zip(a, b, strict=True) for c in pair]
    for c in order:
        dec.feed(*c)
    out = dec.finish(crc32c_oracle(b"".join(bytes(c.data) for c in order)))
    assert torch.equal(out["delta"], delta) and torch.equal(out["weights"], weights), seed
    assert out["weights"].data_ptr() == slot.extras["weights"].data_ptr()


def test_finite_check_survives_sum_overflow():
    x = torch.full((64,), 3e38)  # every value finite, the sum is +inf
    enc, chunks = encode_all([("x", x)], "float32", 1 << 20)
    _, dec = decoder_for([("x", x)], "float32", 1 << 20)
    for c in chunks:
        dec.feed(*c)
    assert torch.equal(dec.finish(enc.crc32c)["x"], x)


def test_slot_and_decoder_validation():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            T.StagingSlot(10, pin_memory=True)
    slot = T.StagingSlot(10)
    with pytest.raises(ValueError, match="more than the slot"):
        T.Decoder(slot, {"a": 6, "b": 5}, "float32", 64)
    with pytest.raises(ValueError, match="smaller than one"):
        T.Decoder(slot, {"a": 6}, "float32", 2)
    dec = T.Decoder(slot, {"a": 1}, "float32", 64)
    dec.feed("a", 0, np.float32([1.5]).tobytes())
    dec.finish(crc32c_oracle(np.float32([1.5]).tobytes()))
    with pytest.raises(RuntimeError, match="reset"):
        dec.feed("a", 0, b"\0\0\0\0")


def test_no_grpc_or_protobuf_import():
    code = (
        "import sys, aggsrv.transport; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('grpc', 'google')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------
# Decoder: every error
# --------------------------------------------------------------------------------------------

NAME = "layer1.weight"  # the second tensor of ERR_SHAPES: 60 float32 elements, 240 bytes
ERR_SHAPES = [(5,), (12, 5)]
CHUNK = 40  # 10 float32 elements


def _feed_all(dec, chunks):
    for c in chunks:
        dec.feed(*c)


def _with_value(tensors, value):
    """A copy of the tensors with `value` at a random element of NAME."""
    out = [(n, t.clone()) for n, t in tensors]
    t = out[1][1].view(-1)
    t[int(torch.randint(0, t.numel(), ()))] = value
    return out


def _scenarios():
    """(id, error class, grpc code, action(dec, tensors, enc, chunks), text in the message)."""
    mine = lambda chunks: [c for c in chunks if c[0] == NAME]  # noqa: E731
    return [
        ("unknown_name", T.BadChunk, "INVALID_ARGUMENT",
         lambda d, ts, e, cs: d.feed("fc.bias", 0, b"\0" * 4), "'fc.bias'"),
        ("misaligned_offset", T.BadChunk, "INVALID_ARGUMENT",
         lambda d, ts, e, cs: d.feed(NAME, 2, b"\0" * 8), "multiple of the float32 element"),
        ("gap", T.BadChunk, "INVALID_ARGUMENT",
         lambda d, ts, e, cs: _feed_all(d, mine(cs)[1:]), "gap"),
        ("overlap", T.BadChunk, "INVALID_ARGUMENT",
         lambda d, ts, e, cs: _feed_all(d, [*mine(cs)[:2], mine(cs)[1]]), "overlap"),
        ("overlap_mid", T.BadChunk, "INVALID_ARGUMENT",
         lambda d, ts, e, cs: (d.feed(NAME, 0, b"\0" * 40), d.feed(NAME, 20, b"\0" * 40)),
         "expected byte offset 40"),
        ("oversized", T.ChunkTooLarge, "RESOURCE_EXHAUSTED",
         lambda d, ts, e, cs: d.feed(NAME, 0, b"\0" * (CHUNK + 4)), "44 bytes"),
        ("past_end", T.WrongLength, "INVALID_ARGUMENT",
         lambda d, ts, e, cs: (_feed_all(d, mine(cs)), d.feed(NAME, 240, b"\0" * 4)),
         "has 240 bytes"),
        ("partial_element", T.BadChunk, "INVALID_ARGUMENT",
         lambda d, ts, e, cs: d.feed(NAME, 0, b"\0" * 6), "partial float32 element"),
        ("truncated", T.Truncated, "DATA_LOSS",
         lambda d, ts, e, cs: (_feed_all(d, cs[:-1]), d.finish(e.crc32c)), "200 of 240 bytes"),
        ("bad_crc", T.ChecksumMismatch, "DATA_LOSS",
         lambda d, ts, e, cs: (_feed_all(d, cs), d.finish(e.crc32c ^ 1)), "trailer says 0x"),
        ("corrupted_byte", T.ChecksumMismatch, "DATA_LOSS",
         lambda d, ts, e, cs: (
             _feed_all(d, cs[:-1]),
             d.feed(cs[-1][0], cs[-1][1], bytes([cs[-1][2][0] ^ 0x10]) + cs[-1][2][1:]),
             d.finish(e.crc32c),
         ), "mismatch"),
    ]  # fmt: skip


@pytest.mark.parametrize("scenario", _scenarios(), ids=lambda s: s[0])
def test_decoder_errors(seed, scenario):
    _, cls, code, action, text = scenario
    tensors = make_tensors(seed, ERR_SHAPES)
    enc, chunks = encode_all(tensors, "float32", CHUNK)
    _, dec = decoder_for(tensors, "float32", CHUNK)
    with pytest.raises(cls) as ei:
        action(dec, tensors, enc, chunks)
    err = ei.value
    assert isinstance(err, T.CodecError)
    assert err.grpc_code_name == code == type(err).grpc_code_name
    assert text in str(err), str(err)
    if cls is not T.ChecksumMismatch:  # a checksum covers the whole payload, not one tensor
        assert err.tensor is not None and repr(err.tensor) in str(err), str(err)
    # The decoder refuses to go on until reset, then decodes a good upload.
    with pytest.raises(RuntimeError, match="reset"):
        dec.feed(*chunks[0])
    dec.reset()
    _feed_all(dec, chunks)
    out = dec.finish(enc.crc32c)
    assert torch.equal(out[NAME], tensors[1][1].reshape(-1)), seed


@pytest.mark.parametrize("wd", list(T.WireDtype), ids=lambda w: w.wire_name)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_decoder_rejects_non_finite(seed, wd, value):
    tensors = _with_value(make_tensors(seed, ERR_SHAPES), value)
    enc, chunks = encode_all(tensors, wd, 10 * wd.itemsize)
    _, dec = decoder_for(tensors, wd, 10 * wd.itemsize)
    _feed_all(dec, chunks)
    with pytest.raises(T.NonFinite) as ei:
        dec.finish(enc.crc32c)
    elem = int((~torch.isfinite(tensors[1][1].reshape(-1))).nonzero()[0])
    msg = str(ei.value)
    assert ei.value.grpc_code_name == "INVALID_ARGUMENT"
    assert repr(NAME) in msg and f"element {elem} " in msg, (seed, msg)


@pytest.mark.parametrize("wd", list(T.WireDtype), ids=lambda w: w.wire_name)
def test_non_finite_found_wherever_chunks_interleave(seed, wd):
    """NaN/Inf at random places of the tensors packed in the slot's flat buffer (beside one in
    an extras buffer), chunks of the tensors interleaved: the error names the first bad element
    in layout order and counts them all, as a full pass over the upload would (oracle: numpy)."""
    rng = np.random.default_rng(seed)
    tensors = make_tensors(seed, [(37,), (11, 7), (3,), (129,)])
    poisoned = [(n, t.clone()) for n, t in tensors]
    for _ in range(int(rng.integers(1, 6))):
        i = int(rng.integers(0, 3))  # the first three tensors land in flat, the last in extras
        t = poisoned[i][1].view(-1)
        t[int(rng.integers(0, t.numel()))] = rng.choice([np.nan, np.inf, -np.inf])
    chunk = 6 * wd.itemsize
    enc, chunks = encode_all(poisoned, wd, chunk)
    # Tensors interleave (a random order among equal offsets); each one's chunks stay in order.
    chunks = sorted(chunks, key=lambda c: (c[1], rng.random()))
    lay = layout_of(poisoned)
    slot = T.StagingSlot(sum(v for k, v in lay.items() if k != "layer3.weight"),
                         {"layer3.weight": 129})  # fmt: skip
    dec = T.Decoder(slot, lay, wd, chunk)
    _feed_all(dec, chunks)
    with pytest.raises(T.NonFinite) as ei:
        dec.finish(crc32c_oracle(b"".join(c[2] for c in chunks)))  # CRC in arrival order
    flat = np.concatenate([t.reshape(-1).to(wd.torch_dtype).float().numpy()
                           for _, t in poisoned[:3]])  # fmt: skip
    bad = np.flatnonzero(~np.isfinite(flat))
    first = int(bad[0])
    starts = np.cumsum([0] + [t.numel() for _, t in poisoned[:3]])
    which = int(np.searchsorted(starts, first, side="right") - 1)
    msg = str(ei.value)
    assert repr(poisoned[which][0]) in msg and f"element {first - starts[which]} " in msg, msg
    assert f"{bad.size} non-finite values" in msg, msg


def test_checksum_mismatch_outranks_non_finite(seed):
    """A corrupted upload that also decodes to a NaN is DATA_LOSS (resend), not
    INVALID_ARGUMENT (fix the training): the CRC is checked before finiteness."""
    tensors = _with_value(make_tensors(seed, ERR_SHAPES), float("nan"))
    enc, chunks = encode_all(tensors, "float32", CHUNK)
    _, dec = decoder_for(tensors, "float32", CHUNK)
    _feed_all(dec, chunks)
    with pytest.raises(T.ChecksumMismatch):
        dec.finish(enc.crc32c ^ 1)


def test_grpc_code_names_are_real_status_codes():
    grpc = pytest.importorskip("grpc")
    classes = [T.CodecError, *T.CodecError.__subclasses__()]
    assert len(classes) == 8
    for cls in classes:
        assert grpc.StatusCode[cls.grpc_code_name] is not None


@pytest.mark.parametrize("wd", list(T.WireDtype), ids=lambda w: w.wire_name)
def test_round_trip_strided_and_float64_sources(seed, wd):
    """Non-contiguous and float64 tensors encode to the same wire bytes as contiguous float32."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(11, 13, generator=g)
    tensors = [("t", base.t()), ("d", torch.randn(23, generator=g, dtype=torch.float64))]
    enc, chunks = encode_all(tensors, wd, 5 * wd.itemsize)
    want = b"".join(oracle_wire_bytes(t.contiguous().float(), wd) for _, t in tensors)
    assert b"".join(c[2] for c in chunks) == want, seed
    _, dec = decoder_for(tensors, wd, 5 * wd.itemsize)
    _feed_all(dec, chunks)
    out = dec.finish(enc.crc32c)
    assert torch.equal(out["t"], base.t().reshape(-1).to(wd.torch_dtype).float()), seed


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), 3e38])
def test_a_reference_direction_gives_norm_and_cosine_from_the_check(seed, value):
    """With a reference direction the check, the norm and the cosine come from one fused pass;
    NaN/Inf are still refused, and finite values whose float32 squares overflow still pass."""
    g = torch.Generator().manual_seed(seed)
    n = 10_007
    x = torch.randn(n, generator=g)
    if value is not None:
        x[n // 3] = value
    r = torch.randn(n, generator=g)
    r_norm = float(torch.linalg.vector_norm(r.double()))
    enc, chunks = encode_all([("x", x)], "float32", 4096)
    lay = layout_of([("x", x)])
    source = types.SimpleNamespace(current=(r, r_norm), generation=2)
    dec = T.Decoder(T.StagingSlot(n), lay, "float32", 4096, reference=source)
    for c in chunks:
        dec.feed(*c)
    if value is not None and not np.isfinite(value):
        with pytest.raises(T.NonFinite):
            dec.finish(enc.crc32c)
        return
    dec.finish(enc.crc32c)
    x64, r64 = x.double(), r.double()
    norm = float(torch.linalg.vector_norm(x64))
    assert dec.norm == pytest.approx(norm, rel=1e-12)
    assert dec.cosine == pytest.approx(float(x64 @ r64) / (norm * r_norm), rel=1e-9, abs=1e-12)
    for current, generation in (((r[:-1], r_norm), 2), ((r, r_norm), 3)):  # wrong size; writing
        other = T.Decoder(
            T.StagingSlot(n), lay, "float32", 4096,
            reference=types.SimpleNamespace(current=current, generation=generation),
        )  # fmt: skip
        for c in chunks:
            other.feed(*c)
        other.finish(enc.crc32c)
        assert other.cosine is None and other.norm == pytest.approx(norm, rel=1e-4)


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), 3e38])
def test_the_exact_norm_for_clipping_is_the_decoded_updates_float64_norm(seed, wire, value):
    """Differential privacy's clipping reads the norm of the streamed update: with exact_norm
    it is the float64 norm of what was decoded (to 1e-12, from the same pass as the NaN/Inf
    check, over chunks of odd sizes), NaN/Inf are still refused, and finite values
    whose float32 squares overflow still pass."""
    g = torch.Generator().manual_seed(seed)
    n = 20_011
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) * 7
    if value is not None and wire == "float32":
        x[n // 5] = value
    enc, chunks = encode_all([("x", x)], wire, 3 * 4096)
    dec = T.Decoder(T.StagingSlot(n), layout_of([("x", x)]), wire, 3 * 4096, exact_norm=True)
    for c in chunks:
        dec.feed(*c)
    if value is not None and wire == "float32" and not np.isfinite(value):
        with pytest.raises(T.NonFinite):
            dec.finish(enc.crc32c)
        return
    out = dec.finish(enc.crc32c)["x"]
    assert dec.norm_exact
    assert dec.norm == pytest.approx(float(torch.linalg.vector_norm(out.double())), rel=1e-12)
    plain = T.Decoder(T.StagingSlot(n), layout_of([("x", x)]), wire, 3 * 4096)
    for c in chunks:
        plain.feed(*c)
    plain.finish(enc.crc32c)
    assert not plain.norm_exact  # the float32 pass: good for metrics, not for clipping
