"""Property-based fuzzing (hypothesis) of the tensor codec, chunk assembly and wire-header helpers.

The promise under test (docs/design.md "Wire and numeric conventions"): any sequence of chunks and
trailer values gives either exactly the tensors the sender encoded or a clean ``CodecError``
whose ``grpc_code_name`` is INVALID_ARGUMENT, DATA_LOSS or RESOURCE_EXHAUSTED; never another
exception type, never a write outside the staging slot's announced tensors, never a "success"
with values other than the ones sent.

Oracles, written apart from the decoder: ``StreamModel`` applies the wire rules of docs/design.md
and tensor.proto to a stream (which chunk breaks which rule, what the trailer must say) and decodes
the accepted bytes with numpy (little-endian float32 / float16, bfloat16 as the high half of a
float32); torch's own casts give the values the sender meant. Where a stream breaks several rules
at once the decoder may report any of them; where one mutation has one documented status
(checksum -> DATA_LOSS, NaN -> INVALID_ARGUMENT, oversized chunk -> RESOURCE_EXHAUSTED) that
exact status is required. The CRC of the model is the ``crc32c`` library the codec uses (checked
against a table-driven oracle in test_transport.py).

Inputs are fresh each run (``derandomize=False``; no example database is written).
"""

from __future__ import annotations

import contextlib
from typing import Any

import crc32c as _crc32c
import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aggsrv import protocol as P
from aggsrv.layout import ModelLayout
from aggsrv.transport import (
    BadChunk,
    ChecksumMismatch,
    ChunkTooLarge,
    CodecError,
    Decoder,
    Encoder,
    Encoding,
    NonFinite,
    StagingSlot,
    Truncated,
    WireDtype,
    WrongLength,
    encode_sparse,
)
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import Recipe

CODES = {"INVALID_ARGUMENT", "DATA_LOSS", "RESOURCE_EXHAUSTED"}
SENTINEL = 0x5EADBEEF  # a finite float32 bit pattern (about 6.2e18) for untouched memory
UNUSED = "\x00unused-extra"  # a slot extra that no layout names


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


def crc(data: bytes, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


# --------------------------------------------------------------------------------------------
# Oracles: wire bytes -> float32 values, sparse sections, the stream rules
# --------------------------------------------------------------------------------------------


def decode_oracle(raw: bytes, wd: WireDtype) -> np.ndarray:
    """float32 values of little-endian wire bytes (numpy only; bfloat16 = high half of f32)."""
    if wd is WireDtype.FLOAT32:
        return np.frombuffer(raw, "<f4").astype(np.float32)
    if wd is WireDtype.FLOAT16:
        return np.frombuffer(raw, "<f2").astype(np.float32)
    return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)


def section_nbytes(encoding: Encoding, numel: int, nnz: int, itemsize: int) -> int:
    """tensor.proto: COO = nnz uint32 indices + values; BITMAP = ceil(numel/32) words + values."""
    if encoding is Encoding.COO:
        return 4 * nnz + itemsize * nnz
    return 4 * ((numel + 31) // 32) + itemsize * nnz


def sparse_oracle(
    raw: bytes, encoding: Encoding, numel: int, nnz: int, wd: WireDtype
) -> np.ndarray | None:
    """Dense float32 values of a sparse section, or None when the section is malformed."""
    if encoding is Encoding.COO:
        head = 4 * nnz
        idx = [int.from_bytes(raw[4 * k : 4 * k + 4], "little") for k in range(nnz)]
        if any(i >= numel for i in idx) or any(b <= a for a, b in zip(idx, idx[1:], strict=False)):
            return None
    else:
        words = (numel + 31) // 32
        head = 4 * words
        idx = []
        for w in range(words):
            word = int.from_bytes(raw[4 * w : 4 * w + 4], "little")
            for bit in range(32):
                if word >> bit & 1:
                    if 32 * w + bit >= numel:
                        return None  # a padding bit is set
                    idx.append(32 * w + bit)
        if len(idx) != nnz:
            return None
    out = np.zeros(numel, np.float32)
    out[np.asarray(idx, dtype=np.int64)] = decode_oracle(raw[head:], wd)
    return out


def same_bits(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    b = b.numpy() if isinstance(b, torch.Tensor) else b
    return a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a, np.float32).view(np.uint32),
        np.ascontiguousarray(b, np.float32).view(np.uint32),
    )


class StreamModel:
    """The wire rules, applied to one stream independently of the decoder.

    ``feed`` and ``finish`` return the set of error classes the rules allow at that point (empty:
    the message must be accepted); ``finish`` also returns the exact values a success must give.
    """

    def __init__(
        self,
        layout: dict[str, int],
        wd: WireDtype,
        max_chunk: int,
        sparse: dict[str, tuple[Encoding, int]] | None = None,
    ) -> None:
        self.layout, self.wd, self.max_chunk = dict(layout), wd, max_chunk
        self.sparse = {n: s for n, s in (sparse or {}).items() if s[0] is not Encoding.DENSE}
        item = wd.itemsize
        self.nbytes = {
            n: section_nbytes(self.sparse[n][0], numel, self.sparse[n][1], item)
            if n in self.sparse
            else numel * item
            for n, numel in layout.items()
        }
        self.got = {n: bytearray() for n in layout}
        self.crc = 0
        self.total = 0

    def constructor_errors(self) -> set[type]:
        """A sparse section must be smaller than dense and 0 <= nnz <= numel."""
        for name, (_, nnz) in self.sparse.items():
            if name not in self.layout:
                continue
            numel = self.layout[name]
            if not 0 <= nnz <= numel or self.nbytes[name] >= numel * self.wd.itemsize:
                return {WrongLength}
        return set()

    def feed(self, name: str, offset: int, data: bytes) -> set[type]:
        n, item, bad = len(data), self.wd.itemsize, set()
        if n == 0 and name in self.layout:
            bad.add(BadChunk)  # tensor.proto: a chunk is never empty
        if n > self.max_chunk:
            bad.add(ChunkTooLarge)
        if name not in self.layout:
            return bad | {BadChunk}
        if name not in self.sparse and (offset % item or n % item):
            bad.add(BadChunk)  # chunks of dense tensors hold whole elements
        if offset != len(self.got[name]):
            bad.add(BadChunk)  # in order, no gap, no overlap
        if offset + n > self.nbytes[name]:
            bad.add(WrongLength)
        if not bad:
            self.got[name] += data
            self.crc = crc(data, self.crc)
            self.total += n
        return bad

    def finish(
        self, trailer_crc: Any, payload_bytes: int | None
    ) -> tuple[set[type], dict[str, np.ndarray] | None]:
        bad: set[type] = set()
        if payload_bytes is not None and payload_bytes != self.total:
            bad.add(Truncated)
        if any(len(self.got[n]) != self.nbytes[n] for n in self.layout):
            return bad | {Truncated}, None
        if trailer_crc != self.crc:
            bad.add(ChecksumMismatch)
        values = {}
        for name, numel in self.layout.items():
            raw = bytes(self.got[name])
            if name in self.sparse:
                encoding, nnz = self.sparse[name]
                v = sparse_oracle(raw, encoding, numel, nnz, self.wd)
                if v is None:
                    bad |= {BadChunk, WrongLength}
                    # values of a malformed section: only finiteness matters now
                    head = section_nbytes(encoding, numel, 0, self.wd.itemsize)
                    v = decode_oracle(raw[head:], self.wd)
            else:
                v = decode_oracle(raw, self.wd)
            if not np.isfinite(v).all():
                bad.add(NonFinite)
            values[name] = v
        return bad, (None if bad else values)


# --------------------------------------------------------------------------------------------
# Slot with sentinels, and a runner that checks the decoder against the model
# --------------------------------------------------------------------------------------------


def make_slot(
    layout: dict[str, int], extras: set[str], slack_flat: int, slack_extra: int
) -> StagingSlot:
    """A slot with `slack` spare elements everywhere, all filled with SENTINEL bits."""
    packed = sum(n for name, n in layout.items() if name not in extras)
    sizes = {name: layout[name] + slack_extra for name in extras}
    sizes[UNUSED] = 3
    slot = StagingSlot(packed + slack_flat, sizes)
    slot.flat.view(torch.int32).fill_(SENTINEL)
    for buf in slot.extras.values():
        buf.view(torch.int32).fill_(SENTINEL)
    return slot


def assert_outside_untouched(slot: StagingSlot, layout: dict[str, int]) -> None:
    """Nothing outside the announced tensors' elements was written."""
    packed = sum(n for name, n in layout.items() if name not in slot.extras)
    spare = [slot.flat[packed:], slot.extras[UNUSED]]
    spare += [buf[layout[name] :] for name, buf in slot.extras.items() if name in layout]
    for buf in spare:
        assert (buf.view(torch.int32) == SENTINEL).all(), "decoder wrote outside its tensors"


def outcome(result: Any) -> str:
    """A label for hypothesis statistics (pytest --hypothesis-show-statistics)."""
    return "ok" if isinstance(result, dict) else type(result).__name__


def check_error(exc: BaseException, allowed: set[type]) -> None:
    assert isinstance(exc, CodecError), repr(exc)
    assert exc.grpc_code_name in CODES, exc.grpc_code_name
    assert isinstance(exc, tuple(allowed)), (type(exc).__name__, {c.__name__ for c in allowed})


def run_stream(
    dec: Decoder,
    model: StreamModel,
    chunks: list[tuple[str, int, bytes]],
    trailer_crc: Any,
    payload_bytes: int | None,
) -> CodecError | dict[str, torch.Tensor]:
    """Feed `chunks` and finish; the decoder must do what the model allows. Returns the error
    or the decoded tensors."""
    for name, offset, data in chunks:
        allowed = model.feed(name, offset, data)
        if allowed:
            with pytest.raises(CodecError) as info:
                dec.feed(name, offset, data)
            check_error(info.value, allowed)
            return info.value
        dec.feed(name, offset, data)
    allowed, values = model.finish(trailer_crc, payload_bytes)
    if allowed:
        with pytest.raises(CodecError) as info:
            dec.finish(trailer_crc, payload_bytes)
        check_error(info.value, allowed)
        return info.value
    out = dec.finish(trailer_crc, payload_bytes)
    assert list(out) == list(model.layout)
    for name, want in values.items():
        assert out[name].dtype == torch.float32 and same_bits(out[name], want), name
    return out


def assert_closed_then_reusable(
    dec: Decoder,
    slot: StagingSlot,
    layout: dict[str, int],
    good: list[tuple[str, int, bytes]],
    good_crc: int,
    want: dict[str, np.ndarray],
) -> None:
    """After a success or a failure the decoder refuses input until reset (documented:
    RuntimeError "call reset()"); after reset a valid upload decodes exactly."""
    with pytest.raises(RuntimeError, match="reset"):
        dec.feed(*good[0])
    with pytest.raises(RuntimeError, match="reset"):
        dec.finish(good_crc)
    dec.reset()
    for c in good:
        dec.feed(*c)
    out = dec.finish(good_crc, sum(len(c[2]) for c in good))
    for name, v in want.items():
        assert same_bits(out[name], v), name
    assert_outside_untouched(slot, layout)


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------

DTYPES = st.sampled_from(list(WireDtype))
NAMES = st.text(max_size=8).filter(lambda s: s != UNUSED)


@st.composite
def layouts(draw, max_total: int, max_tensors: int = 4):
    """(layout name -> numel, names kept in slot extras); some sizes 0, total >= 1."""
    n = draw(st.integers(1, max_tensors))
    names = draw(st.lists(NAMES, min_size=n, max_size=n, unique=True))
    per = max_total // n
    numels = draw(st.lists(st.integers(0, per), min_size=n, max_size=n))
    if not any(numels):
        numels[draw(st.integers(0, n - 1))] = draw(st.integers(1, per))
    in_extras = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    layout = dict(zip(names, numels, strict=True))
    return layout, {nm for nm, e in zip(names, in_extras, strict=True) if e}


def random_values(rng: np.random.Generator, numel: int, wd: WireDtype) -> np.ndarray:
    """float64 values mixing normal draws over 16 decades, raw float32 bit patterns (subnormals
    included), zeros and -0.0, all finite in `wd` after the sender's cast."""
    with np.errstate(all="ignore"):
        normal = rng.standard_normal(numel) * 10.0 ** rng.integers(-8, 9, numel)
        bits = rng.integers(0, 1 << 32, numel, dtype=np.uint64).astype(np.uint32).view(np.float32)
        pick = rng.integers(0, 4, numel)
        x = np.where(pick == 0, normal, bits.astype(np.float64))
        x = np.where(pick == 2, 0.0, x)
        x = np.where(pick == 3, -0.0 * rng.integers(0, 2, numel), x)
    x[~np.isfinite(x)] = 1.5
    cast = torch.from_numpy(x).to(wd.torch_dtype).float().numpy()
    x[~np.isfinite(cast)] = -0.25  # beyond float16's range: the sender would send Inf
    return x


def chunk_sizes(wd: WireDtype) -> st.SearchStrategy[int]:
    """Requested chunk sizes, mostly small; not always whole elements (the encoder rounds)."""
    item = wd.itemsize
    return st.one_of(
        st.integers(1, 16).map(lambda k: k * item),
        st.integers(item, 4096),
    )


def encode(tensors: dict[str, torch.Tensor], wd: WireDtype, chunk_bytes: int):
    enc = Encoder(tensors, wd, chunk_bytes)
    chunks = [(c.name, c.byte_offset, bytes(c.data)) for c in enc.chunks()]
    return enc, chunks


def fresh(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor with unit strides (torch.tensor / from_numpy keep an empty numpy result's
    stride 0, which trips the to_wire bug pinned in test_encoder_empty_strided_float32)."""
    return torch.empty(x.shape, dtype=dtype).copy_(torch.from_numpy(np.asarray(x)))


def make_tensors(
    layout: dict[str, int],
    wd: WireDtype,
    seed: int,
    src: torch.dtype = torch.float32,
    strided: str = "none",
    chunk_elems: int = 1,
) -> dict[str, torch.Tensor]:
    """Named random tensors of dtype `src`; `strided` makes them non-contiguous: "transposed"
    (a 2-D transpose, copied by reshape) or "step" (a 1-D view x[::2], sliced chunk by chunk;
    only where no chunk holds a single element: see test_encoder_strided_single_element_chunk)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, numel in layout.items():
        t = fresh(random_values(rng, numel, wd), src)
        step_ok = numel >= 2 and chunk_elems >= 2 and numel % chunk_elems != 1
        if strided == "step" and step_ok:
            big = torch.zeros(2 * numel, dtype=src)
            big[::2] = t
            t = big[::2]
        elif strided == "transposed" and any(numel % d == 0 for d in (2, 3, 5, 7)):
            rows = next(d for d in (2, 3, 5, 7) if numel % d == 0)
            m = torch.zeros(numel // rows, rows, dtype=src).t()  # [rows, cols], not contiguous
            m.copy_(t.reshape(rows, numel // rows))
            t = m
        elif numel % 3 == 0 and numel:
            t = t.reshape(3, numel // 3)
        out[name] = t
    return out


def sent_values(t: torch.Tensor, wd: WireDtype) -> torch.Tensor:
    """What the sender means: torch's cast to the wire dtype, widened to float32."""
    return t.detach().reshape(-1).to(wd.torch_dtype).float()


# --------------------------------------------------------------------------------------------
# 1. Round trip, in the encoder's order, interleaved, shuffled and through protobuf
# --------------------------------------------------------------------------------------------

ORDERS = ["sent", "interleave", "interleave_old_crc", "shuffle", "protobuf"]


@fuzz(200)
@given(
    case=layouts(5000),
    wd=DTYPES,
    data=st.data(),
    seed=st.integers(0, 2**63 - 1),
    src=st.sampled_from([torch.float32, torch.float64]),
    strided=st.sampled_from(["none", "transposed", "step"]),
    order=st.sampled_from(ORDERS),
    slack=st.tuples(st.integers(0, 5), st.integers(0, 5)),
)
def test_round_trip(case, wd, data, seed, src, strided, order, slack) -> None:
    layout, extras = case
    chunk_req = data.draw(chunk_sizes(wd))
    chunk_elems = chunk_req // wd.itemsize
    tensors = make_tensors(layout, wd, seed, src, strided, chunk_elems)
    want = {n: sent_values(t, wd) for n, t in tensors.items()}
    enc, chunks = encode(tensors, wd, chunk_req)
    max_chunk = enc.chunk_bytes
    assert max_chunk % wd.itemsize == 0 and wd.itemsize <= max_chunk <= chunk_req
    # The encoder's contract: whole elements, at most the chunk size, per-tensor ascending
    # offsets, little-endian bytes of torch's cast, CRC over the bytes in order.
    per: dict[str, bytearray] = {n: bytearray() for n in layout}
    for name, offset, piece in chunks:
        assert 0 < len(piece) <= max_chunk and len(piece) % wd.itemsize == 0
        assert offset == len(per[name])
        per[name] += piece
    for name in layout:
        assert same_bits(decode_oracle(bytes(per[name]), wd), want[name]), name
    assert enc.crc32c == crc(b"".join(c[2] for c in chunks))
    assert enc.nbytes == enc.total_bytes == sum(len(c[2]) for c in chunks)

    trailer_crc, payload_bytes = enc.crc32c, enc.nbytes
    rng = np.random.default_rng(seed ^ 0x5A5A)
    if order == "protobuf":
        infos = [tpb.TensorInfo.FromString(i.SerializeToString()) for i in P.tensor_infos(tensors)]
        assert {i.name: int(i.numel) for i in infos} == layout
        msgs = [
            pb.UpdateMessage.FromString(m.SerializeToString())
            for m in P.chunk_stream(tensors, wd, chunk_req, pb.UpdateMessage)
        ]
        assert [m.WhichOneof("kind") for m in msgs] == ["chunk"] * len(chunks) + ["trailer"]
        assert [(m.chunk.tensor, m.chunk.offset, m.chunk.data) for m in msgs[:-1]] == chunks
        trailer_crc, payload_bytes = msgs[-1].trailer.crc32c, msgs[-1].trailer.payload_bytes
    elif order != "sent":
        if order == "shuffle":
            perm = rng.permutation(len(chunks))
        else:  # a random merge that keeps each tensor's chunks in order
            queues: dict[str, list[int]] = {}
            for i, c in enumerate(chunks):
                queues.setdefault(c[0], []).append(i)
            perm = []
            while queues:
                name = list(queues)[rng.integers(len(queues))]
                perm.append(queues[name].pop(0))
                if not queues[name]:
                    del queues[name]
        chunks = [chunks[i] for i in perm]
        if order != "interleave_old_crc":
            trailer_crc = crc(b"".join(c[2] for c in chunks))  # the sender's CRC, arrival order

    slot = make_slot(layout, extras, *slack)
    dec = Decoder(slot, layout, wd, max_chunk)
    model = StreamModel(layout, wd, max_chunk)
    result = run_stream(dec, model, chunks, trailer_crc, payload_bytes)
    event(f"{order}: {outcome(result)}")
    event(f"D >= 1000: {sum(layout.values()) >= 1000}")
    assert_outside_untouched(slot, layout)
    in_order = all(
        [c[1] for c in chunks if c[0] == n] == sorted(c[1] for c in chunks if c[0] == n)
        for n in layout
    )
    if order in ("sent", "interleave", "protobuf") or (order == "shuffle" and in_order):
        assert isinstance(result, dict), result  # tensors may interleave (decoder docstring)
    elif order == "shuffle":
        assert isinstance(result, BadChunk) and result.grpc_code_name == "INVALID_ARGUMENT"
    elif isinstance(result, CodecError):
        assert result.grpc_code_name == "DATA_LOSS"  # interleaved, CRC of the original order
    if isinstance(result, dict):
        for name in layout:
            assert same_bits(result[name], want[name]), name
            view = result[name]
            base = slot.extras[name] if name in extras else slot.flat
            if view.numel():  # a view of the slot, not a copy
                assert base.data_ptr() <= view.data_ptr() < base.data_ptr() + base.nbytes


STRIDED_SOURCES = {
    # 1-D strided views whose chunking leaves a one-element piece (x[::2] of 3 elements, 2 per
    # chunk), a one-element view with a step, an expanded scalar; every wire dtype.
    "step_tail": lambda: torch.arange(6.0)[::2],
    "step_tail_f64": lambda: torch.arange(6.0, dtype=torch.float64)[::2],
    "one_element_step": lambda: torch.arange(5.0)[::5],
    "expanded_scalar": lambda: torch.tensor(2.5).expand(1),
}


# Found by this file: to_wire raised for 1-element pieces with a non-unit stride.
@pytest.mark.parametrize("wd", list(WireDtype), ids=lambda w: w.wire_name)
@pytest.mark.parametrize("source", list(STRIDED_SOURCES))
def test_encoder_strided_single_element_chunk(source, wd) -> None:
    src = STRIDED_SOURCES[source]()
    step = 2 * wd.itemsize  # two elements per chunk
    want = [(c.name, c.byte_offset, bytes(c.data)) for c in Encoder({"w": src.clone()}, wd, step)]
    got = [(c.name, c.byte_offset, bytes(c.data)) for c in Encoder({"w": src}, wd, step)]
    assert got == want


# Found by this file: the same for empty float32 tensors with a non-unit stride.
@pytest.mark.parametrize(
    "make",
    [lambda: torch.empty(0, 3)[:, 0], lambda: torch.from_numpy(np.arange(0, dtype="f4") + 0.5)],
    ids=["column_of_empty", "numpy_empty"],
)
def test_encoder_empty_strided_float32(make) -> None:
    assert list(Encoder({"w": make()}, WireDtype.FLOAT32, 8)) == []


# --------------------------------------------------------------------------------------------
# 2. Mutations of a valid stream
# --------------------------------------------------------------------------------------------

MODEL = "model"  # the outcome is whatever the rules say (no single documented status)
MUTATIONS = [
    "drop",
    "duplicate",
    "offset",
    "truncate",
    "flip",
    "flip_back",
    "rename_unknown",
    "rename_other",
    "oversize",
    "crc",
    "payload_bytes",
    "nonfinite",
    "swap",
    "swap_recrc",
    "empty_chunk",
]


def nonfinite_pattern(draw, wd: WireDtype) -> int:
    sign = draw(st.integers(0, 1))
    if wd is WireDtype.FLOAT32:
        return sign << 31 | 0xFF << 23 | draw(st.integers(0, (1 << 23) - 1))
    if wd is WireDtype.FLOAT16:
        return sign << 15 | 0x1F << 10 | draw(st.integers(0, (1 << 10) - 1))
    return sign << 15 | 0xFF << 7 | draw(st.integers(0, (1 << 7) - 1))


def later_chunk_of(chunks: list[list], i: int) -> bool:
    return any(c[0] == chunks[i][0] for c in chunks[i + 1 :])


def mutate(draw, kind: str, chunks: list[list], trailer: list, layout, wd, max_chunk):
    """Apply one mutation in place; returns the documented status, None (no-op) or MODEL."""
    item = wd.itemsize
    i = draw(st.integers(0, len(chunks) - 1)) if chunks else None
    if i is None and kind not in ("crc", "payload_bytes", "empty_chunk"):
        return MODEL
    if kind == "drop":
        code = "INVALID_ARGUMENT" if later_chunk_of(chunks, i) else "DATA_LOSS"
        if not chunks[i][2]:
            return MODEL
        del chunks[i]
        return code
    if kind == "duplicate":
        if not chunks[i][2]:
            return MODEL
        chunks.insert(draw(st.integers(0, len(chunks))), list(chunks[i]))
        return "INVALID_ARGUMENT"
    if kind == "offset":
        old = chunks[i][1]
        new = draw(
            st.one_of(
                st.sampled_from([old - item, old + item, old + 1, old - 1, 0, -old]),
                st.integers(-(2**65), 2**65),
            ).filter(lambda v: v != old)
        )
        chunks[i][1] = new
        return "INVALID_ARGUMENT"
    if kind == "truncate":
        n = len(chunks[i][2])
        if n == 0:
            return MODEL
        k = draw(st.integers(1, min(3, n)))
        chunks[i][2] = chunks[i][2][: n - k]
        if n == k or (n - k) % item or later_chunk_of(chunks, i):
            return "INVALID_ARGUMENT"  # n == k: the chunk is now empty
        return "DATA_LOSS"
    if kind in ("flip", "flip_back"):
        n = len(chunks[i][2])
        if n == 0:
            return MODEL
        bit = draw(st.integers(0, 8 * n - 1))
        b = bytearray(chunks[i][2])
        b[bit // 8] ^= 1 << (bit % 8)
        if kind == "flip_back":
            b[bit // 8] ^= 1 << (bit % 8)
        chunks[i][2] = bytes(b)
        return "DATA_LOSS" if kind == "flip" else None  # CRC-32C catches every 1-bit error
    if kind == "rename_unknown":
        name = draw(st.text(max_size=10))
        chunks[i][0] = name if name not in layout else name + "\x7f" * 9  # layout names <= 8
        return "INVALID_ARGUMENT"
    if kind == "rename_other":
        chunks[i][0] = draw(st.sampled_from(list(layout)))
        return MODEL
    if kind == "oversize":
        extra = draw(st.integers(1, 8)) * item
        grow = max(max_chunk - len(chunks[i][2]), 0) + extra  # past the chunk size
        chunks[i][2] = chunks[i][2] + draw(st.binary(min_size=grow, max_size=grow))
        return "RESOURCE_EXHAUSTED"
    if kind == "crc":
        trailer[0] ^= draw(st.integers(1, 2**32 - 1))
        return "DATA_LOSS"
    if kind == "payload_bytes":
        old = trailer[1]
        trailer[1] = draw(
            st.one_of(st.integers(-(2**40), 2**40), st.sampled_from([old + 1, old - 1, 0])).filter(
                lambda v: v != old
            )
        )
        return "DATA_LOSS"
    if kind == "nonfinite":
        n = len(chunks[i][2]) // item
        if n == 0:
            return MODEL
        j = draw(st.integers(0, n - 1))
        pattern = nonfinite_pattern(draw, wd).to_bytes(item, "little")
        d = chunks[i][2]
        chunks[i][2] = d[: j * item] + pattern + d[(j + 1) * item :]
        # The sender's own checksum and length: only the finiteness check can catch it.
        trailer[0] = crc(b"".join(c[2] for c in chunks))
        trailer[1] = sum(len(c[2]) for c in chunks)
        return "INVALID_ARGUMENT"
    if kind in ("swap", "swap_recrc"):
        j = draw(st.integers(0, len(chunks) - 1))
        chunks[i], chunks[j] = chunks[j], chunks[i]
        if kind == "swap_recrc":
            trailer[0] = crc(b"".join(c[2] for c in chunks))
        return MODEL if i != j else None
    # empty_chunk: tensor.proto says chunks are never empty: refused wherever it is
    name = draw(st.sampled_from(list(layout)))
    at = draw(st.integers(0, len(chunks)))
    offset = draw(st.sampled_from([0, item, sum(len(c[2]) for c in chunks[:at] if c[0] == name)]))
    chunks.insert(at, [name, offset, b""])
    return MODEL


@pytest.mark.parametrize("first", MUTATIONS)
@fuzz(50)
@given(
    case=layouts(400),
    wd=DTYPES,
    data=st.data(),
    seed=st.integers(0, 2**63 - 1),
    more=st.lists(st.sampled_from(MUTATIONS), max_size=2),
    slack=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    with_length=st.booleans(),
)
def test_mutated_stream(first, case, wd, data, seed, more, slack, with_length) -> None:
    """One mutation (`first`: the documented status where there is one), sometimes more."""
    layout, extras = case
    kinds = [first, *more]
    tensors = make_tensors(layout, wd, seed)
    enc, good = encode(tensors, wd, data.draw(st.integers(1, 24)) * wd.itemsize)
    max_chunk = enc.chunk_bytes
    want = {n: sent_values(t, wd).numpy() for n, t in tensors.items()}
    chunks = [list(c) for c in good]
    trailer = [enc.crc32c, enc.nbytes]
    codes = [mutate(data.draw, k, chunks, trailer, layout, wd, max_chunk) for k in kinds]
    chunks = [tuple(c) for c in chunks]
    if not with_length and "payload_bytes" not in kinds:
        trailer[1] = None  # the length check is optional in finish()

    slot = make_slot(layout, extras, *slack)
    dec = Decoder(slot, layout, wd, max_chunk)
    result = run_stream(dec, StreamModel(layout, wd, max_chunk), chunks, *trailer)
    event(f"{kinds[0] if len(kinds) == 1 else 'several'}: {outcome(result)}")
    assert_outside_untouched(slot, layout)
    if len(codes) == 1 and codes[0] != MODEL:
        if codes[0] is None:  # a no-op mutation: exact success
            assert isinstance(result, dict), result
        else:
            assert isinstance(result, CodecError), kinds
            assert result.grpc_code_name == codes[0], (kinds, result)
    # Every success gives what the encoder sent, unless a mutation re-signed changed bytes (a
    # new CRC over them: then the sender sent those, and run_stream checked them exactly).
    if isinstance(result, dict) and not {"nonfinite", "swap_recrc"} & set(kinds):
        for name in layout:
            assert same_bits(result[name], want[name]), (kinds, name)
    assert_closed_then_reusable(dec, slot, layout, good, enc.crc32c, want)


# --------------------------------------------------------------------------------------------
# 3. Garbage streams
# --------------------------------------------------------------------------------------------

SHORT_NAMES = st.text(alphabet="ab", max_size=2)
OFFSETS = st.one_of(
    st.integers(-8, 80),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
)
OPS = st.one_of(
    # the next chunk of a layout tensor: right offset, whole elements, random value bytes
    st.tuples(
        st.just("next"), st.integers(0, 7), st.integers(0, 12), st.binary(min_size=48, max_size=48)
    ),
    st.tuples(st.just("raw"), SHORT_NAMES, OFFSETS, st.binary(max_size=64)),
)
TRAILER_CRC = st.one_of(
    st.just("right"), st.integers(0, 2**32 - 1), st.integers(-(2**70), 2**70), st.none()
)
TRAILER_LEN = st.one_of(st.just("right"), st.none(), st.integers(-(2**70), 2**70))


@fuzz(600)
@given(
    names=st.lists(SHORT_NAMES, min_size=1, max_size=3, unique=True),
    numels=st.lists(st.integers(0, 30), min_size=3, max_size=3),
    wd=DTYPES,
    max_chunk=st.integers(2, 48),
    ops=st.lists(OPS, max_size=14),
    complete=st.booleans(),
    fill=st.binary(min_size=256, max_size=256),
    trailer_crc=TRAILER_CRC,
    trailer_len=TRAILER_LEN,
    in_extras=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_garbage_stream(
    names, numels, wd, max_chunk, ops, complete, fill, trailer_crc, trailer_len, in_extras
) -> None:
    layout = dict(zip(names, numels, strict=False))
    extras = {n for n, e in zip(names, in_extras, strict=False) if e}
    max_chunk = max(max_chunk, wd.itemsize)
    item = wd.itemsize
    model = StreamModel(layout, wd, max_chunk)
    # Resolve the abstract ops against the model's progress (so success stays reachable).
    chunks, received = [], {n: 0 for n in layout}
    for op in ops:
        if op[0] == "next":
            name = names[op[1] % len(names)]
            room = (layout[name] * item - received[name]) // item
            n = max(0, min(op[2], room, max_chunk // item))
            chunk = (name, received[name], op[3][: n * item])
        else:
            chunk = op[1:]
        if chunk[0] in received and chunk[1] == received[chunk[0]]:
            received[chunk[0]] += len(chunk[2])
        chunks.append(chunk)
    if complete:  # the rest of every tensor, with finite values mostly
        for name in layout:
            while 0 <= received[name] < layout[name] * item:
                n = min(layout[name] * item - received[name], max_chunk // item * item)
                values = (fill * (n // len(fill) + 1))[:n]
                chunks.append((name, received[name], values))
                received[name] += n
    sim = StreamModel(layout, wd, max_chunk)
    for c in chunks:
        if sim.feed(*c):
            break
    right_crc, right_len = sim.crc, sim.total
    crc_value = right_crc if trailer_crc == "right" else trailer_crc
    length = right_len if trailer_len == "right" else trailer_len

    slot = make_slot(layout, extras, 2, 2)
    dec = Decoder(slot, layout, wd, max_chunk)
    result = run_stream(dec, model, chunks, crc_value, length)
    event(outcome(result))
    assert_outside_untouched(slot, layout)
    # Closed after success or failure, until reset; then the same stream gives the same answer.
    with pytest.raises(RuntimeError, match="reset"):
        dec.feed(names[0], 0, b"")
    dec.reset()
    again = run_stream(dec, StreamModel(layout, wd, max_chunk), chunks, crc_value, length)
    assert type(again) is type(result)
    assert_outside_untouched(slot, layout)


# --------------------------------------------------------------------------------------------
# 4. Sparse sections (COO, bitmap): garbage indices and bitmaps
# --------------------------------------------------------------------------------------------


@st.composite
def sparse_sections(draw, numel: int, wd: WireDtype):
    """(encoding, nnz, section bytes): valid, garbage-index or garbage-bitmap, any length."""
    item = wd.itemsize
    encoding = draw(st.sampled_from([Encoding.COO, Encoding.BITMAP]))
    kind = draw(st.sampled_from(["valid", "indices", "bitmap_bits", "random"]))
    if kind == "valid":
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        x = torch.zeros(numel)
        nnz = draw(st.integers(0, numel))
        where = torch.from_numpy(rng.permutation(numel)[:nnz])
        x[where] = torch.from_numpy(rng.standard_normal(nnz).astype(np.float32))
        x[x.to(wd.torch_dtype) == 0] = 0.0
        section, nnz = encode_sparse(x, wd, encoding)
        section = bytes(section)
    else:
        nnz = draw(st.integers(0, numel))
        values = draw(st.binary(min_size=nnz * item, max_size=nnz * item))
        if kind == "indices" and encoding is Encoding.COO:
            idx = draw(
                st.lists(
                    st.one_of(st.integers(0, numel + 3), st.just(2**32 - 1)),
                    min_size=nnz,
                    max_size=nnz,
                )
            )
            if draw(st.booleans()):
                idx.sort()
            section = np.asarray(idx, "<u4").tobytes() + values
        elif kind in ("indices", "bitmap_bits"):
            words = (numel + 31) // 32
            on = draw(st.lists(st.integers(0, 32 * words - 1), max_size=nnz + 2, unique=True))
            bits = np.zeros(32 * words, np.uint8)
            bits[on] = 1
            head = np.packbits(bits, bitorder="little").tobytes()
            if encoding is Encoding.COO:
                head = np.asarray(sorted(on)[:nnz], "<u4").tobytes()
            section = head + values
        else:
            size = section_nbytes(encoding, numel, nnz, item)
            section = draw(st.binary(min_size=size, max_size=size))
    if draw(st.integers(0, 3)) == 0:  # sometimes the wrong length
        section = section[: len(section) - draw(st.integers(0, 2))] + draw(st.binary(max_size=2))
    return encoding, nnz, section


@fuzz(500)
@given(
    numel=st.integers(1, 300),
    wd=DTYPES,
    data=st.data(),
    max_chunk=st.integers(4, 64),
    dense_numel=st.integers(0, 9),
    in_extras=st.booleans(),
)
def test_sparse_sections(numel, wd, data, max_chunk, dense_numel, in_extras) -> None:
    encoding, nnz, section = data.draw(sparse_sections(numel, wd))
    layout = {"u": numel, "b": dense_numel}
    sparse = {"u": (encoding, nnz)}
    model = StreamModel(layout, wd, max_chunk, sparse)
    slot = make_slot(layout, {"u"} if in_extras else set(), 3, 3)
    if model.constructor_errors():
        with pytest.raises(CodecError) as info:
            Decoder(slot, layout, wd, max_chunk, sparse=sparse)
        check_error(info.value, model.constructor_errors())
        return
    dec = Decoder(slot, layout, wd, max_chunk, sparse=sparse)
    # Sparse chunks end anywhere (not whole elements); the dense tensor goes in between.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(section)), max_size=12)))
    chunks, start = [], 0
    for cut in [*cuts, len(section)]:
        while cut - start > max_chunk:
            chunks.append(("u", start, section[start : start + max_chunk]))
            start += max_chunk
        if cut > start:
            chunks.append(("u", start, section[start:cut]))
            start = cut
    step = max_chunk // wd.itemsize * wd.itemsize
    dense = to_wire_np(np.arange(dense_numel, dtype=np.float32) + 0.5, wd)
    at = data.draw(st.integers(0, len(chunks)))
    chunks[at:at] = [("b", k, dense[k : k + step]) for k in range(0, len(dense), step)]
    trailer = crc(b"".join(c[2] for c in chunks))
    result = run_stream(dec, model, chunks, trailer, sum(len(c[2]) for c in chunks))
    event(f"{encoding.value}: {outcome(result)}")
    assert_outside_untouched(slot, layout)
    if isinstance(result, dict):
        assert len(section) == section_nbytes(encoding, numel, nnz, wd.itemsize)


def to_wire_np(x: np.ndarray, wd: WireDtype) -> bytes:
    return bytes(fresh(x, wd.torch_dtype).view(torch.uint8).numpy())


@fuzz(200)
@given(
    numel=st.integers(0, 2000),
    encoding=st.sampled_from(list(Encoding)),
    nnz=st.one_of(st.integers(-5, 2005), st.integers(-(2**70), 2**70)),
    wd=DTYPES,
)
def test_sparse_announcement_any_nnz(numel, encoding, nnz, wd) -> None:
    """Any (encoding, nnz) announced for a tensor: a decoder, or WrongLength; no huge buffer."""
    model = StreamModel({"u": numel}, wd, 64, {"u": (encoding, nnz)})
    slot = StagingSlot(numel)
    if model.constructor_errors():
        with pytest.raises(CodecError) as info:
            Decoder(slot, {"u": numel}, wd, 64, sparse={"u": (encoding, nnz)})
        check_error(info.value, model.constructor_errors())
    else:
        Decoder(slot, {"u": numel}, wd, 64, sparse={"u": (encoding, nnz)})


# --------------------------------------------------------------------------------------------
# 5. protocol helpers over random protobuf messages
# --------------------------------------------------------------------------------------------

BIG_NAMES = st.one_of(
    st.text(max_size=6), st.just(""), st.text(alphabet="x", min_size=3000, max_size=3000)
)
DIMS = st.one_of(
    st.integers(0, 5), st.integers(0, 2**64 - 1), st.sampled_from([2**63, 2**64 - 1, 10**15])
)
LAYOUT_TENSORS = st.builds(
    lambda name, shape, norm: tpb.LayoutTensor(name=name, shape=shape, is_norm=norm),
    BIG_NAMES,
    st.lists(DIMS, max_size=5),
    st.booleans(),
)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@fuzz(300)
@given(
    tensors=st.lists(LAYOUT_TENSORS, max_size=6),
    buffers=st.lists(LAYOUT_TENSORS, max_size=3),
)
def test_layout_from_pb_any_message(tensors, buffers) -> None:
    """A layout or ValueError (LayoutMismatchError is one); sizes are only arithmetic (a layout
    of 10**15 or 2**128 elements is accepted without allocating: the server must bound it)."""
    msg = tpb.ModelLayout.FromString(
        tpb.ModelLayout(tensors=tensors, buffers=buffers).SerializeToString()
    )
    try:
        layout = P.layout_from_pb(msg)
    except ValueError:
        names = [t.name for t in tensors] + [b.name for b in buffers]
        assert "" in names or len(set(names)) < len(names)
        return
    assert isinstance(layout, ModelLayout)
    assert layout.names == tuple(t.name for t in tensors)
    assert layout.numel == sum(_numel(t.shape) for t in tensors)
    assert layout.buffer_numel == sum(_numel(b.shape) for b in buffers)
    assert [bool(x) for x in layout.is_norm.tolist()] == [t.is_norm for t in tensors]
    assert len(layout.hash) == 64
    back = P.layout_from_pb(P.layout_to_pb(layout))
    assert back == layout and back.hash == layout.hash


TENSOR_INFOS = st.builds(
    lambda name, numel, encoding, nnz: tpb.TensorInfo(
        name=name, numel=numel, encoding=encoding, nnz=nnz
    ),
    st.text(max_size=6),
    st.integers(0, 2**64 - 1),
    st.one_of(st.integers(0, 4), st.integers(-(2**31), 2**31 - 1)),
    st.integers(0, 2**64 - 1),
)


@fuzz(300)
@given(infos=st.lists(TENSOR_INFOS, max_size=6))
def test_sparse_infos_any_message(infos) -> None:
    infos = [tpb.TensorInfo.FromString(i.SerializeToString()) for i in infos]
    try:
        out = P.sparse_infos(infos)
    except ValueError as exc:
        assert any(i.encoding not in P.PB_TO_ENCODING for i in infos), exc
        return
    sparse = {i.name: i for i in infos if P.PB_TO_ENCODING[i.encoding] is not Encoding.DENSE}
    assert set(out) == set(sparse)
    for encoding, nnz in out.values():
        assert encoding in (Encoding.COO, Encoding.BITMAP) and isinstance(nnz, int) and nnz >= 0
    # What the server does next: a decoder for bounded tensors, or WrongLength.
    layout = {i.name: min(int(i.numel), 500) for i in infos}
    model = StreamModel(layout, WireDtype.FLOAT32, 64, out)
    slot = StagingSlot(sum(layout.values()))
    if model.constructor_errors():
        with pytest.raises(WrongLength):
            Decoder(slot, layout, WireDtype.FLOAT32, 64, sparse=out)
    else:
        Decoder(slot, layout, WireDtype.FLOAT32, 64, sparse=out)


@fuzz(200)
@given(value=st.one_of(st.integers(-5, 10), st.integers(-(2**80), 2**80)))
def test_wire_dtype_any_int(value) -> None:
    """A header's dtype must name a wire dtype (UNSPECIFIED refused); a request's may leave it
    unspecified, meaning float32."""
    want = {1: WireDtype.FLOAT32, 2: WireDtype.FLOAT16, 3: WireDtype.BFLOAT16}
    try:
        wd = P.wire_dtype(value)
    except ValueError:
        assert value not in want
    else:
        assert wd is want[value]
    try:
        asked = P.requested_dtype(value)
    except ValueError:
        assert value not in (0, *want)
    else:
        assert asked is {0: WireDtype.FLOAT32, **want}[value]


FLOATS = st.floats(allow_nan=True, allow_infinity=True)
RECIPES = st.builds(
    lambda epochs, steps, lr, bs, mom, wdec, mode, only, lam, alpha, anchor, solver, excl, mu, ex: (
        pb.Recipe(
            local_epochs=epochs,
            local_steps=steps,
            learning_rate=lr,
            batch_size=bs,
            momentum=mom,
            weight_decay=wdec,
            projection=pb.Projection(mode=mode, only_conflicting=only),
            elastic_net=pb.ElasticNet(
                penalty_lambda=lam,
                mixing_alpha=alpha,
                anchor=anchor,
                solver=solver,
                exclude_biases=excl,
            ),
            proximal_mu=mu,
            extra=ex,
        )
    ),
    st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    st.one_of(st.none(), FLOATS),
    st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    st.one_of(st.none(), FLOATS),
    st.one_of(st.none(), FLOATS),
    st.integers(-3, 6),
    st.booleans(),
    FLOATS,
    FLOATS,
    st.integers(-2, 4),
    st.integers(-2, 4),
    st.booleans(),
    st.one_of(st.none(), FLOATS),
    st.dictionaries(
        st.sampled_from(["local_epochs", "elastic_centre", "elastic_solver", "x", ""]), FLOATS
    ),
)


@fuzz(300)
@given(msg=RECIPES)
def test_recipe_from_pb_any_message(msg) -> None:
    msg = pb.Recipe.FromString(msg.SerializeToString())
    try:
        recipe = P.recipe_from_pb(msg)
    except ValueError:
        return
    assert isinstance(recipe, Recipe)
    assert recipe.learning_rate > 0 and recipe.batch_size >= 1 and recipe.work_target > 0


# Found by this file: NaN passed Recipe's `x < 0` checks.
@pytest.mark.parametrize("field", ["momentum", "weight_decay", "proximal_mu", "penalty_lambda"])
def test_recipe_from_pb_refuses_nan(field) -> None:
    msg = pb.Recipe()
    target = msg.elastic_net if field == "penalty_lambda" else msg
    setattr(target, field, float("nan"))
    try:
        P.recipe_from_pb(msg)
    except ValueError:
        return
    raise AssertionError(f"a Recipe with {field}=nan was accepted")


def test_recipe_from_pb_both_epochs_and_steps_is_refused() -> None:
    """The proto said "whichever comes first"; servers set one, so the contract now says a job
    with both is malformed, and the client says so."""
    with pytest.raises(ValueError, match="exactly one of local_epochs and local_steps"):
        P.recipe_from_pb(pb.Recipe(local_epochs=2, local_steps=10))


# --------------------------------------------------------------------------------------------
# 6. Raw bytes as messages
# --------------------------------------------------------------------------------------------


@fuzz(500)
@given(raw=st.binary(max_size=200), cls=st.sampled_from([pb.UpdateMessage, pb.RegisterRequest]))
def test_raw_bytes_parse_or_decode_error(raw, cls) -> None:
    """protobuf's own guarantee, then what the server does with whatever parsed."""
    try:
        msg = cls.FromString(raw)
    except DecodeError:
        return
    kind = msg.WhichOneof("kind")
    assert kind in (None, "header", "chunk", "trailer")
    if kind == "chunk":
        layout = {"update": 8, msg.chunk.tensor: 3}
        dec = Decoder(StagingSlot(sum(layout.values())), layout, WireDtype.FLOAT16, 16)
        model = StreamModel(layout, WireDtype.FLOAT16, 16)
        run_stream(dec, model, [(msg.chunk.tensor, msg.chunk.offset, msg.chunk.data)], 0, None)
    elif kind == "header" and cls is pb.RegisterRequest:
        with contextlib.suppress(ValueError):
            P.layout_from_pb(msg.header.layout)
