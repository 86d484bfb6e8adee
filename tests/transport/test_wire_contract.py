"""The wire contract as a client written in another language reads it (proto/aggsrv/v1/*.proto,
docs/wire.md): dtypes, chunks, unparseable bytes and the negotiated chunk size, each over real
gRPC on loopback, each refusal leaving the model bit-identical."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import pytest
import torch
from server_helpers import flat, raw_push, register_messages, update_messages

from aggsrv import protocol as P
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.transport import BadChunk, Decoder, StagingSlot, WireDtype
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb

SC = grpc.StatusCode
CALL_S = 20.0


def odd_model(seed: int, width: int = 7) -> torch.nn.Module:
    """A small model with odd sizes and a BatchNorm (float buffers travel too)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)
    )
    bn = model[1]
    bn.running_mean.copy_(torch.randn(5))
    bn.running_var.copy_(torch.rand(5) + 0.5)
    return model


def rpc_error(fn: Callable[[], object]) -> grpc.RpcError:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


# ----------------------------------------------------------------------------- 1. dtypes


def test_unspecified_dtype_on_an_upload_is_invalid_argument_and_changes_nothing(servers) -> None:
    srv = servers(strategy="fedasync")
    model = odd_model(11)
    layout = ModelLayout.from_module(model)
    offered = {"weights": flat(model), "buffers": layout.flatten_buffers(model)}
    # An empty server does not adopt a model whose dtype is unspecified.
    msgs = register_messages(layout, "c1", offered)
    msgs[0].header.initial_dtype = tpb.WIRE_DTYPE_UNSPECIFIED
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.AggregationStub(channel)
        err = rpc_error(lambda: stub.Register(iter(msgs), timeout=CALL_S))
        assert err.code() == SC.INVALID_ARGUMENT, err.details()
        assert "initial_dtype" in err.details() and "UNSPECIFIED" in err.details()
        assert srv.federation.strategy is None
        assert not stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_S).has_model
    with Client(srv.address, "c1") as client:
        assert client.register(model).initial_model_adopted
        before = srv.model()
        job = client.get_job()
        # A server with a model checks offered weights too: unspecified is refused there.
        msgs = register_messages(layout, "c2", offered)
        msgs[0].header.initial_dtype = tpb.WIRE_DTYPE_UNSPECIFIED
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.AggregationStub(channel)
            err = rpc_error(lambda: stub.Register(iter(msgs), timeout=CALL_S))
        assert err.code() == SC.INVALID_ARGUMENT and "initial_dtype" in err.details()
        assert "c2" not in srv.federation.clients
        values = {"update": torch.randn(layout.numel), "buffers": offered["buffers"]}
        result = raw_push(
            srv.address, update_messages(client, job, values, dtype=tpb.WIRE_DTYPE_UNSPECIFIED)
        )
        assert isinstance(result, grpc.RpcError), result
        assert result.code() == SC.INVALID_ARGUMENT and "UNSPECIFIED" in result.details()
        assert torch.equal(srv.model(), before) and srv.strategy.version == 0
        # The same push with its dtype named is applied.
        ok = raw_push(srv.address, update_messages(client, job, values))
        assert isinstance(ok, pb.PushUpdateResponse) and ok.version == 1


def test_a_download_request_without_dtype_gets_float32(servers) -> None:
    """GetJobRequest.dtype and GetModelRequest.dtype UNSPECIFIED: FLOAT32 (the protos say so)."""
    srv = servers(strategy="fedasync")
    model = odd_model(12)
    with Client(srv.address, "c1") as client:
        client.register(model)
        layout = client.layout
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.AggregationStub(channel)
        request = pb.GetJobRequest(client_id="c1", layout_hash=layout.hash)
        job = list(stub.GetJob(request, timeout=CALL_S))
        header = next(m.header for m in job if m.WhichOneof("kind") == "header")
        assert header.dtype == tpb.WIRE_DTYPE_FLOAT32
        data = b"".join(m.chunk.data for m in job if m.WhichOneof("kind") == "chunk")
        assert len(data) == 4 * (layout.numel + layout.buffer_numel)
        got = torch.frombuffer(bytearray(data[: 4 * layout.numel]), dtype=torch.float32)
        assert torch.equal(got, flat(model))
        reply = list(stub.GetModel(pb.GetModelRequest(), timeout=CALL_S))
        assert reply[0].header.dtype == tpb.WIRE_DTYPE_FLOAT32
        # An enum value the wire does not know is refused, not guessed.
        err = rpc_error(lambda: list(stub.GetModel(pb.GetModelRequest(dtype=9), timeout=CALL_S)))
        assert err.code() == SC.INVALID_ARGUMENT and "9" in err.details()


class Recorder(grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Keeps every request message our client sends (stream requests as they are sent)."""

    def __init__(self) -> None:
        self.sent: list = []

    def intercept_unary_stream(self, continuation, details, request):
        self.sent.append(request)
        return continuation(details, request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        def tee():
            for msg in request_iterator:
                self.sent.append(msg)
                yield msg

        return continuation(details, tee())


def test_our_client_names_every_dtype_it_sends_or_asks_for(servers, monkeypatch) -> None:
    import aggsrv.client.client as client_module

    recorder = Recorder()
    opened = client_module.open_channel

    def recording(*args, **kwargs):
        channel, stubs_on = opened(*args, **kwargs)
        return channel, grpc.intercept_channel(stubs_on, recorder)

    monkeypatch.setattr(client_module, "open_channel", recording)
    srv = servers(strategy="fedasync")
    model = odd_model(13)
    with Client(srv.address, "c1", upload_dtype="bfloat16", download_dtype="float16") as c:
        c.register(model)
        job = c.get_job()
        c.push(job, torch.randn(c.layout.numel), buffers=job.buffers, epochs=1.0)
        c.get_model(include_buffers=True)
    kinds = {}
    for msg in recorder.sent:
        if isinstance(msg, pb.RegisterRequest) and msg.WhichOneof("kind") == "header":
            kinds["register"] = msg.header.initial_dtype
        elif isinstance(msg, pb.UpdateMessage) and msg.WhichOneof("kind") == "header":
            kinds["push"] = msg.header.dtype
        elif isinstance(msg, pb.GetJobRequest | pb.GetModelRequest):
            kinds[type(msg).__name__] = msg.dtype
    assert kinds == {
        "register": tpb.WIRE_DTYPE_FLOAT32,
        "push": tpb.WIRE_DTYPE_BFLOAT16,
        "GetJobRequest": tpb.WIRE_DTYPE_FLOAT16,
        "GetModelRequest": tpb.WIRE_DTYPE_FLOAT16,
    }


# ----------------------------------------------------------------------------- 2. empty chunks


def test_an_empty_chunk_is_invalid_argument(servers) -> None:
    # The decoder alone: at the right offset, between two good chunks.
    slot = StagingSlot(9)
    decoder = Decoder(slot, {"update": 9}, WireDtype.FLOAT32, 64)
    decoder.feed("update", 0, bytes(16))
    with pytest.raises(BadChunk, match="empty"):
        decoder.feed("update", 16, b"")
    # Over the wire: a push with an empty chunk changes nothing.
    srv = servers(strategy="fedasync")
    model = odd_model(14)
    with Client(srv.address, "c1") as client:
        client.register(model)
        job = client.get_job()
        before = srv.model()
        values = {"update": torch.randn(client.layout.numel), "buffers": job.buffers}
        msgs = update_messages(client, job, values, chunk_bytes=32)
        at = 2  # after the first chunk of "update": its offset is 32
        msgs.insert(at, pb.UpdateMessage(chunk=tpb.TensorChunk(tensor="update", offset=32)))
        result = raw_push(srv.address, msgs)
        assert isinstance(result, grpc.RpcError), result
        assert result.code() == SC.INVALID_ARGUMENT and "empty" in result.details()
        assert torch.equal(srv.model(), before)
        del msgs[at]
        assert isinstance(raw_push(srv.address, msgs), pb.PushUpdateResponse)


# ----------------------------------------------------------------------- 3. unparseable bytes

METHODS = {  # name: (request streams?, response streams?), as the service declares them
    m.name: (m.client_streaming, m.server_streaming)
    for m in pb.DESCRIPTOR.services_by_name["Aggregation"].methods
}
# Bytes protobuf refuses: a truncated varint, an invalid wire type, a length running past the
# end; and a string field holding invalid UTF-8.
GARBAGE = [b"\xff\xff\xff", b"\x0f", b"\x0a\x7f\x00"]
BAD_UTF8 = b"\x0a\x02\xc3\x28"


def call_raw(channel: grpc.Channel, method: str, payloads: list[bytes]) -> grpc.RpcError | None:
    """Call `method` with raw request bytes (identity serializers); the error it ended with."""
    streams_in, streams_out = METHODS[method]
    path = f"/aggsrv.v1.Aggregation/{method}"
    same = lambda b: b  # noqa: E731
    kw = {"request_serializer": same, "response_deserializer": same}
    try:
        if streams_in:
            channel.stream_unary(path, **kw)(iter(payloads), timeout=CALL_S)
        elif streams_out:
            list(channel.unary_stream(path, **kw)(payloads[0], timeout=CALL_S))
        else:
            channel.unary_unary(path, **kw)(payloads[0], timeout=CALL_S)
    except grpc.RpcError as exc:
        return exc
    return None


def test_unparseable_requests_are_invalid_argument_and_logged_once_per_peer(
    servers, caplog
) -> None:
    srv = servers(strategy="fedasync")
    model = odd_model(15)
    with Client(srv.address, "c1") as client:
        client.register(model)
        job = client.get_job()
        values = {"update": torch.zeros(client.layout.numel), "buffers": job.buffers}
        good_header = update_messages(client, job, values)[0]
    before = srv.model()
    caplog.set_level(logging.INFO)  # (grpc itself logs a DEBUG line per call)
    caplog.clear()
    answers = []
    with grpc.insecure_channel(srv.address) as channel:
        for method in METHODS:
            for garbage in GARBAGE:
                answers.append((method, call_raw(channel, method, [garbage])))
        for method in ("GetJob", "Heartbeat"):  # field 1 is client_id
            answers.append((method, call_raw(channel, method, [BAD_UTF8])))
        # Streams whose first message parses and a later one does not.
        header = good_header.SerializeToString()
        answers.append(("PushUpdate", call_raw(channel, "PushUpdate", [header, GARBAGE[0]])))
        offered = {"weights": flat(model), "buffers": client.layout.flatten_buffers(model)}
        reg = register_messages(client.layout, "c1", offered)[0]
        answers.append(
            ("Register", call_raw(channel, "Register", [reg.SerializeToString(), b"\x0f"]))
        )
    for method, err in answers:
        assert err is not None, f"{method}: accepted"
        assert err.code() == SC.INVALID_ARGUMENT, (method, err.code(), err.details())
        details = err.details()
        assert "not a valid aggsrv.v1." in details and len(details) < 200, (method, details)
        assert "Traceback" not in details and "DecodeError" not in details, details
    assert torch.equal(srv.model(), before) and not srv.server.stop_requested.is_set()
    # One line for this peer and interval, however many calls; no traceback anywhere.
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Traceback" not in text and not any(r.exc_info for r in caplog.records), text
    unparseable = [r for r in caplog.records if "unparseable" in r.getMessage()]
    assert len(unparseable) == 1, text
    assert "127.0.0.1" in unparseable[0].getMessage()
    assert len(caplog.records) <= 3, text
    # The server still serves.
    with Client(srv.address, "c1") as client:
        client.register(model)
        assert client.get_model()[0] == 0


# ------------------------------------------------------------------- 4. negotiated chunk size


def test_chunks_fit_under_the_receive_limit_a_client_declares(servers) -> None:
    limit = 4096
    # The server's chunks are 16x that; the client's channel refuses any message over `limit`.
    srv = servers(strategy="fedasync", chunk_bytes=64 * 1024)
    model = odd_model(16, width=301)  # D = 1528 + 5 + 18 elements: several chunks of 4 KiB
    layout = ModelLayout.from_module(model)
    with Client(srv.address, "c1", max_message_bytes=limit) as client:
        resp = client.register(model)
        negotiated = limit - 64
        assert resp.limits.chunk_bytes == negotiated
        job = client.get_job()
        assert torch.equal(job.weights, flat(model))
        assert torch.equal(job.buffers, layout.flatten_buffers(model))
        delta = torch.randn(layout.numel)
        assert client.push(job, delta, buffers=job.buffers, epochs=1.0).version == 1
        version, weights, buffers = client.get_model(include_buffers=True)
        assert version == 1 and torch.equal(weights, srv.model())
    # Every message of a job and of a model stays under the limit, the chunks 64 bytes below.
    options = [("grpc.max_receive_message_length", limit)]
    with grpc.insecure_channel(srv.address, options=options) as channel:
        stub = pb_grpc.AggregationStub(channel)
        job_msgs = list(
            stub.GetJob(pb.GetJobRequest(client_id="c1", layout_hash=layout.hash), timeout=CALL_S)
        )
        by_id = pb.GetModelRequest(client_id="c1", include_buffers=True)
        model_msgs = list(stub.GetModel(by_id, timeout=CALL_S))
        # A reader that never registered states its limit in the request itself.
        small = 1024
        reader = pb.GetModelRequest(max_receive_message_bytes=small)
        reader_msgs = list(stub.GetModel(reader, timeout=CALL_S))
    with grpc.insecure_channel(srv.address) as channel:
        # Without a limit of its own: the gRPC default, 4 MiB, so the server's 64 KiB chunks.
        plain = list(
            pb_grpc.AggregationStub(channel).GetModel(pb.GetModelRequest(), timeout=CALL_S)
        )
    for msgs, cap in ((job_msgs, limit), (model_msgs, limit), (reader_msgs, small)):
        chunks = [m.chunk for m in msgs if m.WhichOneof("kind") == "chunk"]
        assert len(chunks) > 2
        assert max(m.ByteSize() for m in msgs) <= cap
        assert max(len(c.data) for c in chunks) == cap - 64
    assert (
        max(len(m.chunk.data) for m in plain if m.WhichOneof("kind") == "chunk") == 4 * layout.numel
    )


def test_a_receive_limit_too_small_for_any_chunk_is_invalid_argument(servers) -> None:
    srv = servers(strategy="fedasync")
    model = odd_model(17)
    with Client(srv.address, "c1") as client:
        client.register(model)
        layout = client.layout
    header = pb.RegisterHeader(
        client_id="c2", layout=P.layout_to_pb(layout), layout_hash=layout.hash,
        capabilities=pb.ClientCapabilities(max_receive_message_bytes=100),
    )  # fmt: skip
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.AggregationStub(channel)
        err = rpc_error(
            lambda: stub.Register(iter([pb.RegisterRequest(header=header)]), timeout=CALL_S)
        )
        assert err.code() == SC.INVALID_ARGUMENT and "max_receive_message_bytes" in err.details()
        assert "c2" not in srv.federation.clients
        request = pb.GetModelRequest(max_receive_message_bytes=100)
        err = rpc_error(lambda: list(stub.GetModel(request, timeout=CALL_S)))
        assert err.code() == SC.INVALID_ARGUMENT and "max_receive_message_bytes" in err.details()


# ----------------------------------------------------------- 10. the status table, row by row


class Table:
    """Two servers for the table's rows: one without a model, one (fedasync, 2 retained
    versions) with a model at version 2, client "c1" registered and holding a job."""

    def __init__(self) -> None:
        from server_helpers import RunningServer

        self.empty = RunningServer(strategy="fedasync")
        self.srv = RunningServer(
            strategy="fedasync", retained_versions=2, rate_limit_per_second=0,
            strategy_config={"max_update_norm": 1e6},
        )  # fmt: skip
        self.model = odd_model(21)
        self.client = Client(self.srv.address, "c1")
        self.client.register(self.model)
        for _ in range(2):
            job = self.client.get_job()
            self.client.push(job, torch.randn(self.layout.numel), buffers=job.buffers)
        self.job = self.client.get_job()
        self.channel = grpc.insecure_channel(self.srv.address)
        self.stub = pb_grpc.AggregationStub(self.channel)
        self.empty_channel = grpc.insecure_channel(self.empty.address)
        self.empty_stub = pb_grpc.AggregationStub(self.empty_channel)

    @property
    def layout(self) -> ModelLayout:
        return self.client.layout

    def update(self, **header) -> list:
        values = {"update": torch.randn(self.layout.numel), "buffers": self.job.buffers}
        return update_messages(self.client, self.job, values, **header)

    def push(self, msgs: list):
        return self.stub.PushUpdate(iter(msgs), timeout=CALL_S)

    def get_job(self, **fields):
        request = pb.GetJobRequest(client_id="c1", layout_hash=self.layout.hash, **fields)
        return list(self.stub.GetJob(request, timeout=CALL_S))

    def close(self) -> None:
        self.client.close()
        self.channel.close()
        self.empty_channel.close()
        self.srv.stop()
        self.empty.stop()


@pytest.fixture(scope="module")
def table():
    t = Table()
    yield t
    t.close()


def _header_first(t: Table, msgs: list) -> list:
    return [msgs[1], msgs[0], *msgs[2:]]


def _trailer_then(t: Table, msgs: list) -> list:
    return [*msgs, pb.UpdateMessage(chunk=msgs[1].chunk)]


def _bare_register(client_id: str = "c9", **fields) -> pb.RegisterRequest:
    return pb.RegisterRequest(header=pb.RegisterHeader(client_id=client_id, **fields))


ROWS: dict[str, tuple[SC, Callable[[Table], object]]] = {
    # calls before the model exists
    "GetJob before the model": (
        SC.FAILED_PRECONDITION,
        lambda t: list(t.empty_stub.GetJob(pb.GetJobRequest(client_id="c1"), timeout=CALL_S)),
    ),
    "GetModel before the model": (
        SC.FAILED_PRECONDITION,
        lambda t: list(t.empty_stub.GetModel(pb.GetModelRequest(), timeout=CALL_S)),
    ),
    "PushUpdate before the model": (
        SC.FAILED_PRECONDITION,
        lambda t: t.empty_stub.PushUpdate(iter(t.update()), timeout=CALL_S),
    ),
    "Register without a model offering none": (
        SC.FAILED_PRECONDITION,
        lambda t: t.empty_stub.Register(
            iter([_bare_register(layout=P.layout_to_pb(t.layout), layout_hash=t.layout.hash)]),
            timeout=CALL_S,
        ),
    ),
    "Checkpoint without a state_dir": (
        SC.FAILED_PRECONDITION,
        lambda t: t.stub.Checkpoint(pb.CheckpointRequest(), timeout=CALL_S),
    ),
    # malformed ids
    "malformed client_id (GetJob)": (
        SC.INVALID_ARGUMENT,
        lambda t: list(t.stub.GetJob(pb.GetJobRequest(client_id="a b"), timeout=CALL_S)),
    ),
    "malformed client_id (Heartbeat)": (
        SC.INVALID_ARGUMENT,
        lambda t: t.stub.Heartbeat(pb.HeartbeatRequest(client_id="x" * 129), timeout=CALL_S),
    ),
    "malformed client_id (Register)": (
        SC.INVALID_ARGUMENT,
        lambda t: t.stub.Register(iter([_bare_register("é")]), timeout=CALL_S),
    ),
    "malformed update_id": (SC.INVALID_ARGUMENT, lambda t: t.push(t.update(update_id="u/1"))),
    "job_id not the server's decimal string": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push(t.update(job_id="0" + t.job.job_id)),
    ),
    "unknown client": (
        SC.NOT_FOUND,
        lambda t: t.stub.Heartbeat(pb.HeartbeatRequest(client_id="nobody"), timeout=CALL_S),
    ),
    # stream structure
    "a stream not starting with its header": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push(_header_first(t, t.update())),
    ),
    "Register not starting with its header": (
        SC.INVALID_ARGUMENT,
        lambda t: t.stub.Register(
            iter([pb.RegisterRequest(trailer=tpb.StreamTrailer())]), timeout=CALL_S
        ),
    ),
    "a message after the trailer": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push(_trailer_then(t, t.update())),
    ),
    "a second header in the stream": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push([t.update()[0], *t.update()]),
    ),
    "an empty chunk": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push(
            [*t.update()[:1], pb.UpdateMessage(chunk=tpb.TensorChunk(tensor="update"))]
        ),
    ),
    "Register tensors without initial_tensors": (
        SC.INVALID_ARGUMENT,
        lambda t: t.stub.Register(
            iter(
                [
                    _bare_register(
                        "c1", layout=P.layout_to_pb(t.layout), layout_hash=t.layout.hash
                    ),
                    pb.RegisterRequest(chunk=tpb.TensorChunk(tensor="weights", data=bytes(4))),
                ]
            ),
            timeout=CALL_S,
        ),
    ),
    "payload_bytes not what was sent": (
        SC.DATA_LOSS,
        lambda t: t.push(
            [
                *t.update()[:-1],
                pb.UpdateMessage(
                    trailer=tpb.StreamTrailer(
                        crc32c=t.update()[-1].trailer.crc32c,
                        payload_bytes=t.update()[-1].trailer.payload_bytes + 4,
                    )
                ),
            ]
        ),
    ),
    # header fields
    "unspecified dtype": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push(t.update(dtype=tpb.WIRE_DTYPE_UNSPECIFIED)),
    ),
    "unspecified update kind": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push(t.update(kind=pb.UPDATE_KIND_UNSPECIFIED)),
    ),
    "unknown tensor encoding": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push(
            t.update(
                tensors=[
                    tpb.TensorInfo(name="update", numel=t.layout.numel, encoding=9),
                    tpb.TensorInfo(name="buffers", numel=t.layout.buffer_numel),
                ]
            )
        ),
    ),
    "a dtype the wire does not know (GetJob)": (SC.INVALID_ARGUMENT, lambda t: t.get_job(dtype=7)),
    "a receive limit below 1024 bytes (GetJob)": (
        SC.INVALID_ARGUMENT,
        lambda t: t.get_job(max_receive_message_bytes=1023),
    ),
    # the strategy's bounds (an update that would overflow the model: test_strategy_guards.py)
    "num_samples above max_num_samples": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push(t.update(num_samples=1_000_001)),
    ),
    "an update above max_update_norm": (
        SC.INVALID_ARGUMENT,
        lambda t: t.push(
            update_messages(
                t.client,
                t.job,
                {"update": torch.full((t.layout.numel,), 1e6), "buffers": t.job.buffers},
            )  # fmt: skip
        ),
    ),
    # sharding fields on a single server
    "shard_rank on a single server": (
        SC.FAILED_PRECONDITION,
        lambda t: t.push(t.update(shard_rank=1)),
    ),
    "job_id on a single server's GetJob": (
        SC.INVALID_ARGUMENT,
        lambda t: t.get_job(job_id=t.job.job_id),
    ),
    # versions
    "GetModel of a version not yet made": (
        SC.OUT_OF_RANGE,
        lambda t: list(t.stub.GetModel(pb.GetModelRequest(version=3), timeout=CALL_S)),
    ),
    "GetModel of a version no longer retained": (
        SC.NOT_FOUND,
        lambda t: list(t.stub.GetModel(pb.GetModelRequest(version=0), timeout=CALL_S)),
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_each_refusal_of_the_status_table_gets_its_code_and_changes_nothing(table, row) -> None:
    code, call = ROWS[row]
    srv = table.srv
    before, version = srv.model(), srv.strategy.version
    clients = set(srv.federation.clients)
    err = rpc_error(lambda: call(table))
    assert err.code() == code, (row, err.code(), err.details())
    assert err.details() and "Traceback" not in err.details()
    assert torch.equal(srv.model(), before) and srv.strategy.version == version == 2
    assert set(srv.federation.clients) == clients and table.empty.federation.strategy is None
    # the client's job is still the open one
    assert srv.strategy.job_state("c1", int(table.job.job_id)) == "current"
