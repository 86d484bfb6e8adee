"""Sparse wire encodings (COO, bitmap): the choice rule, exact bytes, round trips through the
Decoder with odd chunking, malformed sections refused, and a real gRPC push of a sparse delta."""

from __future__ import annotations

import secrets

import grpc
import numpy as np
import pytest
import torch
from server_helpers import RunningServer, flat, raw_push, tiny_model

from aggsrv import protocol as P
from aggsrv.client.client import Client
from aggsrv.transport import (
    BadChunk,
    Crc32c,
    Decoder,
    Encoding,
    NonFinite,
    StagingSlot,
    WireDtype,
    WrongLength,
    choose_encoding,
    encode_sparse,
    encoded_nbytes,
)
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import Status, UpdateKind


def _gen() -> torch.Generator:
    seed = secrets.randbits(31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def _sparse(numel: int, nnz: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.zeros(numel)
    idx = torch.randperm(numel, generator=gen)[:nnz]
    x[idx] = torch.randn(nnz, generator=gen)
    return x


def _decode(payload: memoryview, encoding: Encoding, numel: int, nnz: int, wd, chunk: int):
    slot = StagingSlot(numel)
    slot.flat.fill_(7.0)  # garbage from an earlier upload must not survive
    dec = Decoder(slot, {"u": numel}, wd, max(chunk, 4), sparse={"u": (encoding, nnz)})
    crc = Crc32c()
    for start in range(0, payload.nbytes, chunk):
        piece = bytes(payload[start : start + chunk])
        crc.update(piece)
        dec.feed("u", start, piece)
    return dec.finish(crc.value, crc.nbytes)["u"]


def test_choice_rule_boundaries() -> None:
    assert choose_encoding(3200, 99) is Encoding.COO  # d < 1/32
    assert choose_encoding(3200, 100) is Encoding.BITMAP  # d = 1/32
    assert choose_encoding(3200, 3099) is Encoding.BITMAP  # d < 31/32
    assert choose_encoding(3200, 3100) is Encoding.DENSE  # d = 31/32
    assert choose_encoding(0, 0) is Encoding.DENSE and choose_encoding(5, 0) is Encoding.COO
    f32 = WireDtype.FLOAT32
    assert encoded_nbytes(Encoding.COO, 1013, 10, f32) == 80
    assert encoded_nbytes(Encoding.BITMAP, 1013, 10, f32) == 4 * 32 + 40
    assert encoded_nbytes(Encoding.BITMAP, 1013, 10, WireDtype.FLOAT16) == 128 + 20


def test_bitmap_and_coo_bytes_by_hand() -> None:
    x = torch.tensor([1.5, 0.0, 0.0, -2.0, 0.0])
    coo, nnz = encode_sparse(x, WireDtype.FLOAT32, Encoding.COO)
    assert nnz == 2
    assert bytes(coo) == (
        np.array([0, 3], "<u4").tobytes() + np.array([1.5, -2.0], "<f4").tobytes()
    )
    bm, _ = encode_sparse(x, WireDtype.FLOAT32, Encoding.BITMAP)
    assert bytes(bm) == bytes([0b1001, 0, 0, 0]) + np.array([1.5, -2.0], "<f4").tobytes()


@pytest.mark.parametrize("encoding", [Encoding.COO, Encoding.BITMAP])
@pytest.mark.parametrize("wd", list(WireDtype), ids=lambda w: w.wire_name)
@pytest.mark.parametrize("nnz", [0, 1, 17, 500])
def test_round_trip_through_the_decoder(encoding, wd, nnz) -> None:
    gen = _gen()
    numel = 1013  # not a multiple of 32
    x = _sparse(numel, nnz, gen)
    x[x == 0] = -0.0 if nnz % 2 else 0.0  # the sign of zero is the one thing not kept
    payload, n = encode_sparse(x, wd, encoding)
    if encoded_nbytes(encoding, numel, nnz, wd) >= numel * wd.itemsize:
        # Not smaller than dense at this density (bitmap, 2-byte values): refused.
        with pytest.raises(WrongLength, match="send it dense"):
            _decode(payload, encoding, numel, nnz, wd, chunk=7)
        return
    assert n == int(torch.count_nonzero(x)) == nnz
    assert payload.nbytes == encoded_nbytes(encoding, numel, nnz, wd)
    got = _decode(payload, encoding, numel, nnz, wd, chunk=7)  # chunks split elements
    want = x.to(wd.torch_dtype).float()
    want[want == 0] = 0.0
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bitwise, +0.0 zeros


def test_malformed_sections_are_refused() -> None:
    wd = WireDtype.FLOAT32
    vals = np.array([1.0, 2.0, 3.0], "<f4").tobytes()
    bad_order = memoryview(np.array([4, 2, 9], "<u4").tobytes() + vals)
    with pytest.raises(BadChunk, match="strictly increasing"):
        _decode(bad_order, Encoding.COO, 100, 3, wd, chunk=8)
    out_of_range = memoryview(np.array([4, 20, 100], "<u4").tobytes() + vals)
    with pytest.raises(BadChunk, match="below 100"):
        _decode(out_of_range, Encoding.COO, 100, 3, wd, chunk=8)
    bits = np.zeros(16, np.uint8)
    bits[0] = 0b11  # two set bits, header says three
    with pytest.raises(WrongLength, match="marks 2"):
        _decode(memoryview(bits.tobytes() + vals), Encoding.BITMAP, 100, 3, wd, chunk=8)
    bits[0] = 0b111
    bits[13] = 0x10  # element 108 > numel: padding
    with pytest.raises(BadChunk, match="padding"):
        _decode(memoryview(bits.tobytes() + vals), Encoding.BITMAP, 100, 3, wd, chunk=8)
    nan = memoryview(np.array([4, 20, 30], "<u4").tobytes() + np.array([1, np.nan, 3], "<f4")
                     .tobytes())  # fmt: skip
    with pytest.raises(NonFinite):
        _decode(nan, Encoding.COO, 100, 3, wd, chunk=8)
    with pytest.raises(WrongLength, match="send it dense"):
        Decoder(StagingSlot(64), {"u": 64}, wd, 1024, sparse={"u": (Encoding.COO, 40)})


# ----------------------------------------------------------------------------- over gRPC


@pytest.fixture
def server():
    srv = RunningServer(
        strategy="fedasync", strategy_config={"alpha": 1.0, "staleness": "constant"}
    )
    yield srv
    srv.stop()


@pytest.mark.parametrize("encoding", ["coo", "bitmap", "auto"])
def test_sparse_delta_over_grpc(server, encoding) -> None:
    gen = _gen()
    model = tiny_model(5)
    x0 = flat(model)
    with Client(server.address, "s") as c:
        c.register(model)
        job = c.get_job()
        delta = _sparse(x0.numel(), 2 if encoding != "bitmap" else 20, gen)
        r = c.push(job, delta, kind=UpdateKind.DELTA, num_samples=3, epochs=1.0, encoding=encoding)
        assert r.status is Status.APPLIED
        # alpha = 1: the new model is exactly the client's weights x0 + delta.
        assert torch.equal(server.model(), x0 + delta)


def test_malformed_sparse_push_is_refused_and_changes_nothing(server) -> None:
    model = tiny_model(6)
    with Client(server.address, "s") as c:
        c.register(model)
        job = c.get_job()
        D = c.layout.numel
        header = pb.UpdateHeader(
            client_id="s", job_id=job.job_id, base_version=job.base_version, update_id="u1",
            num_samples=1, work=pb.WorkDone(epochs=1.0, complete=True),
            kind=pb.UPDATE_KIND_DELTA, dtype=tpb.WIRE_DTYPE_FLOAT32, layout_hash=c.layout.hash,
            tensors=[tpb.TensorInfo(name="update", numel=D, encoding=tpb.TENSOR_ENCODING_COO,
                                    nnz=2)],
        )  # fmt: skip
        payload = memoryview(np.array([5, 5], "<u4").tobytes() + np.ones(2, "<f4").tobytes())
        body = list(P.byte_stream([("update", payload)], 1 << 20, pb.UpdateMessage))
        before = server.state()
        result = raw_push(server.address, [pb.UpdateMessage(header=header), *body])
        assert isinstance(result, grpc.RpcError)
        assert result.code() == grpc.StatusCode.INVALID_ARGUMENT, result.details()
        assert "strictly increasing" in result.details()
        assert torch.equal(server.state()["model"], before["model"])
        header.tensors[0].encoding = 7  # no such encoding
        result = raw_push(server.address, [pb.UpdateMessage(header=header), *body])
        assert result.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown encoding" in result.details()


@pytest.mark.parametrize("wd", [WireDtype.FLOAT32, WireDtype.FLOAT16, WireDtype.BFLOAT16])
def test_the_chosen_encoding_is_the_smallest_and_one_the_receiver_takes(wd) -> None:
    """Whatever numel (not only multiples of 32), nnz and wire dtype: the choice is the smallest
    encoding, and a sparse one is strictly smaller than dense (what the decoder requires)."""
    for numel in range(1, 140):
        for nnz in range(numel + 1):
            chosen = choose_encoding(numel, nnz, wd)
            sizes = {e: encoded_nbytes(e, numel, nnz, wd) for e in Encoding}
            assert sizes[chosen] == min(sizes.values()), (numel, nnz, chosen, sizes)
            if chosen is not Encoding.DENSE:
                assert sizes[chosen] < sizes[Encoding.DENSE], (numel, nnz, chosen, sizes)
