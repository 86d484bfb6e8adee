"""The wire contract (proto/aggsrv/v1): committed stubs equal a fresh generation, the service has
the documented shape, the main messages round-trip, and the stubs work over a real gRPC channel.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import struct
from pathlib import Path

import grpc
import pytest
from crc_oracle import crc32c_oracle
from google.protobuf import descriptor_pb2, duration_pb2, timestamp_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb

ROOT = Path(__file__).resolve().parents[2]
STUB_DIR = ROOT / "aggsrv" / "v1"
PROTO_DIR = ROOT / "proto" / "aggsrv" / "v1"


def _load_generate():
    spec = importlib.util.spec_from_file_location(
        "_aggsrv_proto_generate", ROOT / "proto" / "generate.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------ CRC-32C oracle


crc32c = crc32c_oracle


def test_crc32c_oracle_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283  # incremental over chunks


# -------------------------------------------------------------------------- (1) regeneration


def test_committed_stubs_equal_regenerated(tmp_path: Path) -> None:
    gen = _load_generate()
    installed = importlib.metadata.version("grpcio-tools")  # a dev dependency: fail if missing
    if not installed.startswith("1.81."):
        pytest.skip(
            f"grpcio-tools {installed} is installed; the stubs are generated with 1.81.x "
            f"({gen.GRPC_TOOLS_VERSION}), whose output differs from other releases"
        )
    written = gen.generate(tmp_path)
    names = sorted(p.name for p in written)
    committed = sorted(
        p.name
        for p in STUB_DIR.iterdir()
        if p.is_file() and re.search(r"_pb2(_grpc)?\.pyi?$", p.name)
    )
    assert names == committed, "stale or missing stubs in aggsrv/v1: run python proto/generate.py"

    def normalise(text: str) -> str:
        # Another 1.81 patch release only changes the recorded grpcio version.
        if installed == gen.GRPC_TOOLS_VERSION:
            return text
        return re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = ''", text)

    for path in written:
        fresh = normalise(path.read_text())
        old = normalise((STUB_DIR / path.name).read_text())
        assert fresh == old, f"aggsrv/v1/{path.name} differs: run python proto/generate.py"
    assert (STUB_DIR / "__init__.py").is_file()


# -------------------------------------------------------------------------- (2) descriptors


def test_service_methods_and_streaming_kinds() -> None:
    service = pb.DESCRIPTOR.services_by_name["Aggregation"]
    assert service.full_name == "aggsrv.v1.Aggregation"
    kinds = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert kinds == {
        "Register": (True, False),
        "GetJob": (False, True),
        "PushUpdate": (True, False),
        "GetModel": (False, True),
        "Heartbeat": (False, False),
        "GetStatus": (False, False),
        "Checkpoint": (False, False),
        "Shutdown": (False, False),
    }
    io = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in service.methods}
    assert io["PushUpdate"] == ("aggsrv.v1.UpdateMessage", "aggsrv.v1.PushUpdateResponse")
    assert io["GetJob"] == ("aggsrv.v1.GetJobRequest", "aggsrv.v1.JobMessage")
    # Streamed messages put header / chunk / trailer in one oneof, chunks share one type.
    for name in ("RegisterRequest", "JobMessage", "UpdateMessage", "ModelMessage"):
        desc = pb.DESCRIPTOR.message_types_by_name[name]
        oneof = desc.oneofs_by_name["kind"]
        fields = {f.name: f for f in oneof.fields}
        assert {"header", "chunk", "trailer"} <= set(fields)
        assert fields["chunk"].message_type.full_name == "aggsrv.v1.TensorChunk"
        assert fields["trailer"].message_type.full_name == "aggsrv.v1.StreamTrailer"
    trailer = tpb.StreamTrailer.DESCRIPTOR.fields_by_name["crc32c"]
    assert trailer.type == trailer.TYPE_FIXED32


def test_enums_have_prefixed_unspecified_zero() -> None:
    enums = [
        *pb.DESCRIPTOR.enum_types_by_name.values(),
        *tpb.DESCRIPTOR.enum_types_by_name.values(),
    ]
    assert {e.name for e in enums} >= {"WireDtype", "UpdateKind", "Outcome", "ProjectionMode"}
    for enum in enums:
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
        assert enum.values_by_number[0].name == prefix + "UNSPECIFIED"
        assert all(v.name.startswith(prefix) for v in enum.values)
    assert [v.name for v in tpb.WireDtype.DESCRIPTOR.values] == [
        "WIRE_DTYPE_UNSPECIFIED",
        "WIRE_DTYPE_FLOAT32",
        "WIRE_DTYPE_FLOAT16",
        "WIRE_DTYPE_BFLOAT16",
    ]


def test_every_field_and_message_is_documented() -> None:
    """Each field, enum value, message, enum and rpc is preceded by a // comment."""
    decl = re.compile(
        r"^\s*((message|enum|rpc|service)\s+\w+|(optional\s+|repeated\s+)?"
        r"[\w.<>, ]+\s+\w+\s*=\s*\d+;|[A-Z][A-Z0-9_]*\s*=\s*\d+;)"
    )
    missing = []
    for path in sorted(PROTO_DIR.glob("*.proto")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not decl.match(line) or line.strip().startswith("//"):
                continue
            prev = next((p.strip() for p in reversed(lines[:i]) if p.strip()), "")
            if not prev.startswith("//") and not prev.startswith("oneof"):
                missing.append(f"{path.name}:{i + 1}: {line.strip()}")
    assert not missing, "undocumented declarations:\n" + "\n".join(missing)


# -------------------------------------------------------------------------- (3) round trips


def _layout() -> tpb.ModelLayout:
    return tpb.ModelLayout(
        tensors=[
            tpb.LayoutTensor(name="fc.weight", shape=[2, 3]),
            tpb.LayoutTensor(name="fc.bias", shape=[2]),
            tpb.LayoutTensor(name="bn.weight", shape=[2], is_norm=True),
        ],
        buffers=[tpb.LayoutTensor(name="bn.running_mean", shape=[2])],
    )


def _hash_of(layout: tpb.ModelLayout) -> str:
    manifest = [[t.name, list(t.shape)] for t in layout.tensors]
    return hashlib.sha256(json.dumps(manifest, separators=(",", ":")).encode()).hexdigest()


def _roundtrip(msg):
    data = msg.SerializeToString()
    back = type(msg).FromString(data)
    assert back == msg
    assert back.SerializeToString(deterministic=True) == msg.SerializeToString(deterministic=True)
    return back


def test_layout_hash_rule_matches_model_layout() -> None:
    from aggsrv.layout import ModelLayout

    layout = _layout()
    expected = ModelLayout.from_named_shapes([(t.name, list(t.shape)) for t in layout.tensors])
    assert _hash_of(layout) == expected.hash
    # Shapes only, no spaces: the exact bytes hashed.
    assert expected.manifest_json() == '[["fc.weight",[2,3]],["fc.bias",[2]],["bn.weight",[2]]]'


def test_register_and_job_messages_roundtrip() -> None:
    layout = _layout()
    header = pb.RegisterHeader(
        client_id="client-07",
        layout=layout,
        layout_hash=_hash_of(layout),
        capabilities=pb.ClientCapabilities(
            upload_dtypes=[tpb.WIRE_DTYPE_FLOAT32, tpb.WIRE_DTYPE_BFLOAT16],
            projection_modes=[pb.PROJECTION_MODE_WHOLE, pb.PROJECTION_MODE_LAYERWISE],
            elastic_net=True,
            max_receive_message_bytes=8 << 20,
        ),
        initial_dtype=tpb.WIRE_DTYPE_FLOAT32,
        initial_tensors=[
            tpb.TensorInfo(name="weights", numel=10),
            tpb.TensorInfo(name="buffers", numel=2),
        ],
        labels={"host": "edge-3"},
    )
    back = _roundtrip(pb.RegisterRequest(header=header))
    assert back.WhichOneof("kind") == "header"
    assert list(back.header.layout.tensors[0].shape) == [2, 3]

    limits = pb.ServerLimits(
        chunk_bytes=(1 << 20), max_concurrent_uploads=4, remembered_update_ids=1024
    )
    assert not limits.HasField("max_staleness")  # unset: no bound
    limits.max_staleness = 0  # a real bound of 0, distinct from unset
    back = _roundtrip(
        pb.RegisterResponse(
            client_id="client-07",
            initial_model_adopted=True,
            strategy="fedogd",
            limits=limits,
            next_heartbeat=duration_pb2.Duration(seconds=10),
        )
    )
    assert back.limits.HasField("max_staleness") and back.limits.max_staleness == 0

    recipe = pb.Recipe(
        local_epochs=2,
        learning_rate=0.01,
        batch_size=32,
        projection=pb.Projection(
            mode=pb.PROJECTION_MODE_WHOLE,
            only_conflicting=True,
            basis_tensor="basis",
            basis_norm_sq=2.5,
        ),
        elastic_net=pb.ElasticNet(
            penalty_lambda=1e-3, mixing_alpha=0.5, anchor=pb.ELASTIC_NET_ANCHOR_START
        ),
        proximal_mu=0.01,
        extra={"server_lr": 1.0},
    )
    job = pb.JobHeader(
        job_id="job-42",
        client_id="client-07",
        base_version=17,
        deadline=timestamp_pb2.Timestamp(seconds=1_900_000_000, nanos=5),
        time_budget=duration_pb2.Duration(seconds=30),
        recipe=recipe,
        dtype=tpb.WIRE_DTYPE_FLOAT16,
        tensors=[tpb.TensorInfo(name="weights", numel=10), tpb.TensorInfo(name="basis", numel=10)],
        update_kind=pb.UPDATE_KIND_DELTA,
    )
    back = _roundtrip(pb.JobMessage(header=job))
    assert back.header.recipe.HasField("local_epochs") and not back.header.recipe.HasField(
        "local_steps"
    )
    assert back.header.recipe.projection.only_conflicting
    assert (
        _roundtrip(pb.JobMessage(pending=pb.JobPending(reason="round full"))).WhichOneof("kind")
        == "pending"
    )


def test_update_model_and_status_messages_roundtrip() -> None:
    values = [0.5, -1.25, 0.375, 7.0]  # exact in float32
    data = struct.pack("<4f", *values)
    header = pb.UpdateHeader(
        client_id="client-07",
        job_id="job-42",
        base_version=17,
        update_id="2f1e6c1a-4b8e-4c1e-9a7d-3f0c2b9d8e11",
        num_samples=1200,
        work=pb.WorkDone(
            steps=75, epochs=2.0, examples=2400, complete=True, metrics={"train_loss": 0.31}
        ),
        kind=pb.UPDATE_KIND_DELTA,
        dtype=tpb.WIRE_DTYPE_FLOAT32,
        tensors=[tpb.TensorInfo(name="update", numel=4)],
    )
    stream = [
        pb.UpdateMessage(header=header),
        pb.UpdateMessage(chunk=tpb.TensorChunk(tensor="update", offset=0, data=data[:8])),
        pb.UpdateMessage(chunk=tpb.TensorChunk(tensor="update", offset=8, data=data[8:])),
        pb.UpdateMessage(trailer=tpb.StreamTrailer(crc32c=crc32c(data), payload_bytes=len(data))),
    ]
    backs = [_roundtrip(m) for m in stream]
    assert [m.WhichOneof("kind") for m in backs] == ["header", "chunk", "chunk", "trailer"]
    payload = b"".join(m.chunk.data for m in backs[1:3])
    assert struct.unpack("<4f", payload) == tuple(values)
    assert backs[3].trailer.crc32c == crc32c(payload)

    dup = _roundtrip(
        pb.PushUpdateResponse(
            outcome=pb.OUTCOME_DUPLICATE,
            original_outcome=pb.OUTCOME_BUFFERED,
            version=18,
            staleness=1,
        )
    )
    assert dup.original_outcome == pb.OUTCOME_BUFFERED

    model = pb.ModelHeader(
        version=18,
        latest_version=19,
        layout_hash=_hash_of(_layout()),
        layout=_layout(),
        dtype=tpb.WIRE_DTYPE_BFLOAT16,
        tensors=[tpb.TensorInfo(name="weights", numel=10)],
        strategy="fedasync",
    )
    _roundtrip(pb.ModelMessage(header=model))
    req = _roundtrip(pb.GetModelRequest(dtype=tpb.WIRE_DTYPE_FLOAT16))
    assert not req.HasField("version")  # latest
    assert _roundtrip(pb.GetModelRequest(version=0)).HasField("version")

    _roundtrip(
        pb.HeartbeatResponse(
            lease=duration_pb2.Duration(seconds=30),
            job_state=pb.JOB_STATE_SUPERSEDED,
            latest_version=19,
        )
    )
    _roundtrip(
        pb.StatusResponse(
            has_model=True,
            version=19,
            strategy="fedasync",
            clients_known=12,
            clients_active=9,
            updates_applied=19,
            updates_rejected=3,
            rejected_by_code={"ABORTED": 2, "DATA_LOSS": 1},
            queue_depth=2,
        )
    )


# ---------------------------------------------------------------------------- (4) end to end


class _DummyAggregation(pb_grpc.AggregationServicer):
    """Implements PushUpdate only: reassembles the chunks and checks the trailer."""

    def __init__(self) -> None:
        self.received: list[bytes] = []

    async def PushUpdate(self, request_iterator, context):  # noqa: N802 (generated name)
        header, parts, trailer = None, [], None
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "header":
                header = msg.header
            elif kind == "chunk":
                data = msg.chunk.data
                if msg.chunk.offset != sum(len(p) for p in parts):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "chunk out of order")
                parts.append(data)
            else:
                trailer = msg.trailer
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no header")
        if trailer is None:
            await context.abort(grpc.StatusCode.DATA_LOSS, "stream ended before the trailer")
        payload = b"".join(parts)
        if crc32c(payload) != trailer.crc32c:
            await context.abort(grpc.StatusCode.DATA_LOSS, "CRC-32C mismatch")
        self.received.append(payload)
        return pb.PushUpdateResponse(
            outcome=pb.OUTCOME_APPLIED,
            version=header.base_version + 1,
            update_id=header.update_id,
        )


def _update_stream(payload: bytes, chunk: int, with_trailer: bool = True):
    yield pb.UpdateMessage(
        header=pb.UpdateHeader(
            client_id="c1",
            job_id="j1",
            base_version=5,
            update_id="u-1",
            kind=pb.UPDATE_KIND_WEIGHTS,
            dtype=tpb.WIRE_DTYPE_FLOAT32,
            tensors=[tpb.TensorInfo(name="update", numel=len(payload) // 4)],
        )
    )
    for off in range(0, len(payload), chunk):
        yield pb.UpdateMessage(
            chunk=tpb.TensorChunk(tensor="update", offset=off, data=payload[off : off + chunk])
        )
    if with_trailer:
        yield pb.UpdateMessage(
            trailer=tpb.StreamTrailer(crc32c=crc32c(payload), payload_bytes=len(payload))
        )


async def _serve_and_push() -> None:
    servicer = _DummyAggregation()
    server = grpc.aio.server()
    pb_grpc.add_AggregationServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_names = (
        pb.DESCRIPTOR.services_by_name["Aggregation"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(service_names, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await health_servicer.set("aggsrv.v1.Aggregation", health_pb2.HealthCheckResponse.SERVING)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="aggsrv.v1.Aggregation"), timeout=5
            )
            assert check.status == health_pb2.HealthCheckResponse.SERVING

            # Reflection serves the contract (with tensor.proto) to tools such as grpcurl.
            ask = reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="aggsrv.v1.Aggregation"
            )
            refl = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([ask]), timeout=5
            )
            blobs = [r.file_descriptor_response.file_descriptor_proto async for r in refl]
            names = {descriptor_pb2.FileDescriptorProto.FromString(b).name for b in blobs[0]}
            assert "aggsrv/v1/aggregation.proto" in names

            stub = pb_grpc.AggregationStub(channel)
            payload = struct.pack("<300f", *(0.1 * i - 7.0 for i in range(300)))
            reply = await stub.PushUpdate(_update_stream(payload, chunk=256), timeout=5)
            assert reply.outcome == pb.OUTCOME_APPLIED and reply.version == 6
            assert reply.update_id == "u-1"
            assert servicer.received == [payload]

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PushUpdate(_update_stream(payload, 256, with_trailer=False), timeout=5)
            assert err.value.code() == grpc.StatusCode.DATA_LOSS

            with pytest.raises(grpc.aio.AioRpcError) as err:  # not implemented by the dummy
                await stub.GetStatus(pb.GetStatusRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)


def test_stubs_work_over_a_real_aio_channel() -> None:
    asyncio.run(_serve_and_push())


# ------------------------------------------------------------------ docs/wire.md worked example


def test_wire_doc_worked_example_is_consistent() -> None:
    """The update push in docs/wire.md parses, and its hash, bytes and CRC are the real ones."""
    from google.protobuf import text_format

    doc = (ROOT / "docs" / "wire.md").read_text()
    example = doc[doc.index("## Worked example") :]
    block = re.search(r"sends four messages.*?```text\n(.*?)```", example, flags=re.S).group(1)
    texts = re.findall(r"^(header \{.*?^\}|(?:chunk|trailer) \{[^\n]*)$", block, re.S | re.M)
    msgs = [text_format.Parse(t, pb.UpdateMessage()) for t in texts]
    assert [m.WhichOneof("kind") for m in msgs] == ["header", "chunk", "chunk", "trailer"]
    header, trailer = msgs[0].header, msgs[3].trailer
    manifest = '[["fc.weight",[2,3]],["fc.bias",[2]]]'
    assert manifest in example
    assert header.layout_hash == hashlib.sha256(manifest.encode()).hexdigest()
    payload = b""
    for m in msgs[1:3]:
        assert m.chunk.offset == len(payload)
        payload += m.chunk.data
    values = (0.5, -0.25, 0.125, 1.0, -2.0, 0.75, 0.0625, -1.5)
    assert struct.unpack("<8f", payload) == values
    assert payload.hex(" ") in example.replace("   (elements 0-3)\n", " ").replace("\n", " ")
    assert trailer.payload_bytes == len(payload) == 4 * header.tensors[0].numel
    assert trailer.crc32c == crc32c(payload) and f"{crc32c(payload):#010x}" in example
    bf16 = b"".join(
        struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:] for v in values
    )
    assert bf16.hex(" ") in example and f"{crc32c(bf16):#010x}" in example
