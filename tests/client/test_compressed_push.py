"""Compressed updates over a real gRPC round trip (docs/compression.md): a client with INT8/INT4
values and top-k sends what the recipe offers, the server applies exactly what the format decodes
(FedBuff with one update a buffer and server_lr 1: the model moves by the decoded delta), error
feedback carries what was not sent into the next update, and malformed or unoffered quantized
uploads are refused with the model untouched.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import RunningServer

from aggsrv import protocol as P
from aggsrv.client.client import Client
from aggsrv.client.compression import Compression
from aggsrv.layout import ModelLayout
from aggsrv.transport import Quantization, decode_quantized, quantize
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import Status, UpdateKind

D = 3_001  # odd: the last block is short


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _server(**config) -> RunningServer:
    settings = {"strategy": "fedbuff", "rate_limit_per_second": 0.0,
                "strategy_config": {"buffer_size": 1, "server_lr": 1.0}, **config}  # fmt: skip
    return RunningServer(**settings)


def _layout() -> ModelLayout:
    return ModelLayout.from_named_shapes([("w", (D,))])


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_the_server_applies_what_the_quantized_update_decodes_to(q: str) -> None:
    g = _gen()
    srv = _server(quantization_block=64)
    try:
        with Client(srv.address, "a", compression=Compression(quantization=q)) as c:
            w0 = torch.randn(D, generator=g)
            c.register(layout=_layout(), initial=w0)
            job = c.get_job()
            assert job.recipe.update_quantizations == ("int8", "int4")
            assert job.recipe.quantization_block == 64
            delta = torch.randn(D, generator=g) * 0.01
            result = c.push(job, delta, kind=UpdateKind.DELTA)
            assert result.status is Status.APPLIED
            _, model = c.get_model()
        # The bytes it reports sending are the section's, counted by hand from the format.
        nblocks = -(-D // 64)
        assert result.payload_bytes == 4 * nblocks + (D if q == "int8" else (D + 1) // 2)
        _, sent = quantize(delta, Quantization.parse(q), 64)
        assert torch.allclose(model, w0 + sent, rtol=0, atol=1e-6)
        assert not torch.allclose(model, w0 + delta, rtol=0, atol=1e-7)  # it was quantized
    finally:
        srv.stop()


def test_error_feedback_sends_what_was_left_out_later(tmp_path: Path) -> None:
    """Each update sends Q(delta + residual); the residual is what that left out, so what the
    server received plus the last residual is the sum of the deltas. The residual survives a
    new client given the same state path."""
    g = _gen()
    srv = _server()
    state = tmp_path / "residual.pt"
    spec = Compression(quantization="int4", top_k=0.1, state_path=str(state))
    deltas = [torch.randn(D, generator=g) * 0.01 for _ in range(4)]
    try:
        w0 = torch.randn(D, generator=g)
        with Client(srv.address, "a", compression=spec) as c:
            c.register(layout=_layout(), initial=w0)
            for delta in deltas[:2]:
                c.push(c.get_job(), delta)
            saved = c._compressor.residual.clone()
        assert torch.equal(torch.load(state, weights_only=True), saved)
        with Client(srv.address, "a", compression=spec) as c:  # a restarted client
            c.register(layout=_layout())
            for delta in deltas[2:]:
                job = c.get_job()
                residual = c._compressor.residual.clone() if c._compressor else saved
                c.push(job, delta)
                target = delta + residual
                changed = c._compressor.residual
                # Only the top 10 % of |delta + residual| was sent.
                kept = (target - changed) != 0
                assert int(kept.sum()) <= round(0.1 * D)
            _, model = c.get_model()
            residual = c._compressor.residual
        received = model - w0
        assert torch.allclose(received + residual, sum(deltas), rtol=0, atol=1e-5)
    finally:
        srv.stop()


def test_a_client_sends_plain_values_when_the_recipe_offers_no_quantization() -> None:
    g = _gen()
    srv = _server(update_quantizations=[])
    try:
        with Client(srv.address, "a", compression=Compression(quantization="int8")) as c:
            w0 = torch.randn(D, generator=g)
            c.register(layout=_layout(), initial=w0)
            job = c.get_job()
            assert job.recipe.update_quantizations == ()
            delta = torch.randn(D, generator=g) * 0.01
            c.push(job, delta)
            _, model = c.get_model()
            assert torch.equal(c._compressor.residual, torch.zeros(D))
        assert torch.allclose(model, w0 + delta, rtol=0, atol=1e-6)
    finally:
        srv.stop()


def _raw_push(c: Client, job, section: bytes, q: int, block: int, update_id: str):
    header = pb.UpdateHeader(
        client_id=c.client_id, job_id=job.job_id, base_version=job.base_version,
        update_id=update_id, kind=pb.UPDATE_KIND_DELTA, dtype=tpb.WIRE_DTYPE_FLOAT32,
        layout_hash=_layout().hash,
        tensors=[tpb.TensorInfo(name="update", numel=D, quantization=q, block_size=block)],
    )  # fmt: skip
    messages = [pb.UpdateMessage(header=header)]
    messages += list(P.byte_stream([("update", memoryview(section))], 1 << 16, pb.UpdateMessage))
    return c._stub.PushUpdate(iter(messages), timeout=10)


@pytest.mark.parametrize(
    ("what", "offered", "code", "message"),
    [
        ("nan scale", ["int8"], grpc.StatusCode.INVALID_ARGUMENT, "scale of block 1"),
        ("code -128", ["int8"], grpc.StatusCode.INVALID_ARGUMENT, "-128"),
        ("short section", ["int8"], grpc.StatusCode.DATA_LOSS, "has 3096 of 3097 bytes;"),
        ("block 0", ["int8"], grpc.StatusCode.INVALID_ARGUMENT, "block size"),
        ("not offered", ["int4"], grpc.StatusCode.INVALID_ARGUMENT, "update_quantizations"),
    ],
)
def test_a_bad_quantized_upload_is_refused_and_changes_nothing(what, offered, code, message):
    g = _gen()
    srv = _server(update_quantizations=offered)
    try:
        with Client(srv.address, "a") as c:
            c.register(layout=_layout(), initial=torch.randn(D, generator=g))
            _, before = c.get_model()
            job = c.get_job()
            section, _ = quantize(torch.randn(D, generator=g), Quantization.INT8, 128)
            section = bytearray(section)
            block = 128
            if what == "nan scale":
                section[4:8] = bytes.fromhex("0000c07f")
            elif what == "code -128":
                section[4 * 24 + 7] = 0x80
            elif what == "short section":
                section = section[:-1]
            elif what == "block 0":
                block = 0
            with pytest.raises(grpc.RpcError) as refused:
                _raw_push(c, job, bytes(section), tpb.VALUE_QUANTIZATION_INT8, block, "bad")
            assert refused.value.code() is code
            assert message in refused.value.details()
            _, after = c.get_model()
            assert torch.equal(before, after)
            # The same bytes, well formed, go through and decode as the format says.
            good, sent = quantize(torch.randn(D, generator=g) * 0.01, Quantization.INT8, 128)
            if "int8" in offered:
                _raw_push(c, job, good, tpb.VALUE_QUANTIZATION_INT8, 128, "good")
                _, applied = c.get_model()
                decoded = decode_quantized(good, Quantization.INT8, D, 128, "update")
                assert torch.equal(decoded, sent)
                assert torch.allclose(applied, before + sent, rtol=0, atol=1e-6)
    finally:
        srv.stop()


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_fedasync_folds_a_quantized_delta_as_sent_over_the_wire(q: str, monkeypatch) -> None:
    """Without a log the server hands FedAsync the codes; the model moves by alpha times what they
    decode to, each element in float64 and rounded once."""
    from aggsrv.strategies.fedasync import FedAsync

    folded: list[int] = []
    fold = FedAsync._apply_codes

    def counted(s, u, j, a):
        folded.append(u.quantized.bits)
        return fold(s, u, j, a)

    monkeypatch.setattr(FedAsync, "_apply_codes", counted)
    g = _gen()
    srv = RunningServer(strategy="fedasync", rate_limit_per_second=0.0,
                        strategy_config={"alpha": 0.4, "staleness": "constant"})  # fmt: skip
    try:
        with Client(srv.address, "a", compression=Compression(quantization=q)) as c:
            w0 = torch.randn(D, generator=g)
            c.register(layout=_layout(), initial=w0)
            delta = torch.randn(D, generator=g) * 0.01
            assert c.push(c.get_job(), delta, kind=UpdateKind.DELTA).status is Status.APPLIED
            _, model = c.get_model()
    finally:
        srv.stop()
    assert folded == [8 if q == "int8" else 4]
    _, sent = quantize(delta, Quantization.parse(q), 128)
    assert torch.equal(model, (w0.double() + 0.4 * sent.double()).float())


@pytest.mark.parametrize(
    ("scale", "code", "folded"),
    [(3e38 / 100, 1, False), (3e38 / 100, 127, None), (3e38 / 200, 127, True)],
)
def test_a_scale_too_large_to_prove_finiteness_is_decoded_and_checked(
    scale: float, code: int, folded: bool | None, monkeypatch
) -> None:
    """Above FLT_MAX / 128 the server cannot prove the values finite from the scales: it decodes
    them (FedAsync's float path) and refuses an overflow; at or below it folds the codes."""
    from aggsrv.strategies.fedasync import FedAsync

    calls: list[int] = []
    fold = FedAsync._apply_codes

    def counted(s, u, j, a):
        calls.append(1)
        return fold(s, u, j, a)

    monkeypatch.setattr(FedAsync, "_apply_codes", counted)
    srv = RunningServer(strategy="fedasync", rate_limit_per_second=0.0,
                        strategy_config={"alpha": 0.5, "staleness": "constant"})  # fmt: skip
    try:
        with Client(srv.address, "a") as c:
            c.register(layout=_layout(), initial=torch.zeros(D))
            job = c.get_job()
            nblocks = -(-D // 128)
            section = torch.full((nblocks,), scale).numpy().astype("<f4").tobytes()
            section += bytes([code]) * D
            if folded is None:  # 127 * FLT_MAX / 100 overflows: refused, the model untouched
                with pytest.raises(grpc.RpcError) as refused:
                    _raw_push(c, job, section, tpb.VALUE_QUANTIZATION_INT8, 128, "big")
                assert "NaN/Inf" in refused.value.details()
                assert torch.equal(c.get_model()[1], torch.zeros(D))
            else:
                _raw_push(c, job, section, tpb.VALUE_QUANTIZATION_INT8, 128, "big")
                value = float(torch.tensor(float(code), dtype=torch.float32) * torch.tensor(scale))
                assert torch.equal(c.get_model()[1], torch.full((D,), value * 0.5))
    finally:
        srv.stop()
    assert calls == ([1] if folded else [])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(("numel", "zeros"), [(24, 1), (1000, 32), (3200, 101)])
def test_a_delta_with_a_few_zeros_is_sent_in_an_encoding_the_server_takes(dtype, numel, zeros):
    """The client picks sparse encodings by their exact wire size in its upload dtype: at these
    sizes a bitmap is not smaller than dense, which the server refuses."""
    srv = _server()
    try:
        with Client(srv.address, "a", upload_dtype=dtype) as c:
            layout = ModelLayout.from_named_shapes([("w", (numel,))])
            c.register(layout=layout, initial=torch.zeros(numel))
            delta = torch.full((numel,), 0.5)
            delta[:zeros] = 0.0
            assert c.push(c.get_job(), delta, kind=UpdateKind.DELTA).status is Status.APPLIED
            _, model = c.get_model()
        assert torch.equal(model, delta)
    finally:
        srv.stop()
