"""Bad input over real gRPC: every refusal of the status table answered with its code while the
strategy's whole state dict stays bit-identical, the same update id on two streams, staleness
bounds, trailers that lie, a corrupt initial model, and a client killed mid-stream (a real
process, SIGKILL) leaving no trace."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from push_helpers import (
    assert_close_to_hand,
    call_or_error,
    fresh_gen,
    rand,
    register_with_hash,
    registered_clients,
)
from server_helpers import (
    RunningServer,
    flat,
    raw_push,
    register_messages,
    tiny_model,
    update_messages,
)
from state_helpers import assert_same_state as _assert_same

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import Status

REPO = Path(__file__).resolve().parents[2]


def test_late_registration_with_corrupt_initial_weights_is_refused(servers) -> None:
    model = tiny_model(34)
    srv = servers(strategy="fedasync")
    with Client(srv.address, "first") as c:
        c.register(model)
    layout = ModelLayout.from_module(model)
    messages = register_messages(layout, "late", {"weights": flat(model)})
    messages[-1].trailer.crc32c ^= 1
    before = srv.state()
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.AggregationStub(channel)
        result = call_or_error(lambda: stub.Register(iter(messages)))
    assert isinstance(result, grpc.RpcError), "accepted"
    assert result.code() == grpc.StatusCode.DATA_LOSS
    _assert_same(srv.state(), before)


# ----------------------------------------------------------------------------- concurrency


def test_same_update_id_on_two_streams_is_aborted(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedasync", strategy_config={"alpha": 0.5, "staleness": "constant"})
    model = tiny_model(19)
    x0 = flat(model)
    with Client(srv.address, "a") as a:
        a.register(model)
        job = a.get_job()
        delta = rand(x0.numel(), gen)
        msgs = update_messages(a, job, delta, update_id="same-id")
        release = threading.Event()

        def slow() -> Iterator[pb.UpdateMessage]:
            yield msgs[0]
            yield msgs[1]
            release.wait(20)
            yield from msgs[2:]

        first: list = []
        t = threading.Thread(target=lambda: first.append(raw_push(srv.address, slow())))
        t.start()
        deadline = time.monotonic() + 10
        while a.status().uploads_in_progress < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        before = srv.state()
        second = raw_push(srv.address, msgs)
        assert isinstance(second, grpc.RpcError) and second.code() == grpc.StatusCode.ABORTED
        _assert_same(srv.state(), before)
        release.set()
        t.join(timeout=20)
        assert first[0].outcome == pb.OUTCOME_APPLIED and first[0].version == 1
        assert_close_to_hand(srv.model(), x0.double() + 0.5 * delta.double())
        # Now the id is known: a replay is DUPLICATE, applied once.
        again = raw_push(srv.address, msgs)
        assert again.outcome == pb.OUTCOME_DUPLICATE and again.version == 1
        assert srv.strategy.version == 1


# ----------------------------------------------------------------------------- bad inputs


def _bad_push_cases(client: Client, job, other_job, good: torch.Tensor, chunk_bytes: int):
    """(messages, expected code) for every bad PushUpdate input, built for `client`'s `job`."""
    D = client.layout.numel
    nan = good.clone()
    nan[D // 2] = float("nan")
    inf = good.clone()
    inf[3] = float("inf")
    ninf = good.clone()
    ninf[-1] = float("-inf")
    msgs = update_messages
    cases = {
        "unknown client": (msgs(client, job, good, client_id="nobody"), "NOT_FOUND"),
        "wrong layout hash": (
            msgs(client, job, good, layout_hash="ab" * 32),
            "FAILED_PRECONDITION",
        ),
        "announced length D-1": (
            msgs(client, job, good[:-1], tensors=[tpb.TensorInfo(name="update", numel=D - 1)]),
            "INVALID_ARGUMENT",
        ),
        "announced length D+1": (
            msgs(
                client,
                job,
                torch.cat([good, good[:1]]),
                tensors=[tpb.TensorInfo(name="update", numel=D + 1)],
            ),
            "INVALID_ARGUMENT",
        ),
        "extra announced tensor": (
            msgs(
                client,
                job,
                good,
                tensors=[
                    tpb.TensorInfo(name="update", numel=D),
                    tpb.TensorInfo(name="buffers", numel=4),
                ],
            ),
            "INVALID_ARGUMENT",
        ),
        "a chunk past the tensor's end": (
            msgs(client, job, torch.cat([good, good[:1]])),
            "INVALID_ARGUMENT",
        ),
        "unsupported dtype enum 7": (msgs(client, job, good, dtype=7), "INVALID_ARGUMENT"),
        "unsupported dtype enum 99": (msgs(client, job, good, dtype=99), "INVALID_ARGUMENT"),
        "kind UNSPECIFIED": (msgs(client, job, good, kind=0), "INVALID_ARGUMENT"),
        "empty update id": (msgs(client, job, good, update_id=""), "INVALID_ARGUMENT"),
        "NaN": (msgs(client, job, nan), "INVALID_ARGUMENT"),
        "+Inf": (msgs(client, job, inf), "INVALID_ARGUMENT"),
        "-Inf": (msgs(client, job, ninf), "INVALID_ARGUMENT"),
        "base version not the job's": (
            msgs(client, job, good, base_version=job.base_version + 5),
            "INVALID_ARGUMENT",
        ),
        "another client's job": (msgs(client, other_job, good), "INVALID_ARGUMENT"),
        "never issued job id": (msgs(client, job, good, job_id="999"), "INVALID_ARGUMENT"),
        "job id not a number": (msgs(client, job, good, job_id="job-x"), "INVALID_ARGUMENT"),
        "no messages at all": ([], "INVALID_ARGUMENT"),
    }
    ok = msgs(client, job, good)
    header, chunks, trailer = ok[0], ok[1:-1], ok[-1]
    assert len(chunks) >= 3
    cases["header not first"] = ([chunks[0], header, *chunks[1:], trailer], "INVALID_ARGUMENT")
    cases["a second header"] = (
        [header, chunks[0], header, *chunks[1:], trailer],
        "INVALID_ARGUMENT",
    )
    cases["chunk out of order"] = (
        [header, chunks[1], chunks[0], *chunks[2:], trailer],
        "INVALID_ARGUMENT",
    )
    cases["chunk repeated"] = ([header, chunks[0], *chunks, trailer], "INVALID_ARGUMENT")
    cases["chunk of an unknown tensor"] = (
        [
            header,
            pb.UpdateMessage(chunk=tpb.TensorChunk(tensor="weights", offset=0, data=b"\0" * 4)),
        ],
        "INVALID_ARGUMENT",
    )
    cases["chunk of a partial element"] = (
        [
            header,
            pb.UpdateMessage(chunk=tpb.TensorChunk(tensor="update", offset=0, data=b"\0" * 6)),
        ],
        "INVALID_ARGUMENT",
    )
    cases["checksum mismatch"] = (
        [header, *chunks, pb.UpdateMessage(trailer=tpb.StreamTrailer(
            crc32c=trailer.trailer.crc32c ^ 0x80, payload_bytes=trailer.trailer.payload_bytes))],
        "DATA_LOSS",
    )  # fmt: skip
    flipped = pb.UpdateMessage()
    flipped.CopyFrom(chunks[1])
    data = bytearray(flipped.chunk.data)
    data[1] ^= 0x01  # a corrupted payload byte (still finite)
    flipped.chunk.data = bytes(data)
    cases["payload byte flipped"] = (
        [header, chunks[0], flipped, *chunks[2:], trailer],
        "DATA_LOSS",
    )
    cases["cut before the trailer"] = ([header, *chunks[:-1]], "DATA_LOSS")
    cases["all chunks, no trailer"] = ([header, *chunks], "DATA_LOSS")
    cases["header only"] = ([header], "DATA_LOSS")
    cases["trailer after half the chunks"] = ([header, *chunks[:2], trailer], "DATA_LOSS")
    cases["oversized chunk (chunk_bytes + 4)"] = (
        [header, pb.UpdateMessage(
            chunk=tpb.TensorChunk(tensor="update", offset=0, data=bytes(chunk_bytes + 4)))],
        "RESOURCE_EXHAUSTED",
    )  # fmt: skip
    cases["message over the receive limit"] = (
        [header, pb.UpdateMessage(
            chunk=tpb.TensorChunk(tensor="update", offset=0, data=bytes(5 << 20)))],
        "RESOURCE_EXHAUSTED",
    )  # fmt: skip
    return cases


def _other_bad_calls(srv: RunningServer, client: Client, layout_other: ModelLayout):
    """(callable, expected code) for bad Register / GetJob / Heartbeat / GetModel calls."""
    channel = grpc.insecure_channel(srv.address)
    stub = pb_grpc.AggregationStub(channel)
    h = client.layout.hash
    v = srv.strategy.version
    cases = {
        "Register: other layout (consistent hash)": (
            lambda: stub.Register(iter(register_with_hash("newcomer", layout_other))),
            "FAILED_PRECONDITION",
        ),
        "Register: known client, other layout": (
            lambda: stub.Register(iter(register_with_hash(client.client_id, layout_other))),
            "FAILED_PRECONDITION",
        ),
        "Register: hash not of the layout sent": (
            lambda: stub.Register(iter(register_with_hash("newcomer", client.layout, "cd" * 32))),
            "INVALID_ARGUMENT",
        ),
        "Register: no header": (lambda: stub.Register(iter([])), "INVALID_ARGUMENT"),
        "GetJob: unknown client": (
            lambda: list(stub.GetJob(pb.GetJobRequest(client_id="nobody", layout_hash=h))),
            "NOT_FOUND",
        ),
        "GetJob: wrong layout hash": (
            lambda: list(
                stub.GetJob(pb.GetJobRequest(client_id=client.client_id, layout_hash="ef" * 32))
            ),
            "FAILED_PRECONDITION",
        ),
        "GetJob: unsupported dtype": (
            lambda: list(
                stub.GetJob(pb.GetJobRequest(client_id=client.client_id, layout_hash=h, dtype=42))
            ),
            "INVALID_ARGUMENT",
        ),
        "Heartbeat: unknown client": (
            lambda: stub.Heartbeat(pb.HeartbeatRequest(client_id="nobody")),
            "NOT_FOUND",
        ),
        "GetModel: future version": (
            lambda: list(stub.GetModel(pb.GetModelRequest(version=v + 1))),
            "OUT_OF_RANGE",
        ),
        "GetModel: unsupported dtype": (
            lambda: list(stub.GetModel(pb.GetModelRequest(dtype=42))),
            "INVALID_ARGUMENT",
        ),
    }
    return channel, cases


@pytest.mark.parametrize("strategy", ["fedasync", "fedbuff"])
def test_every_bad_input_leaves_the_whole_state_bit_identical(servers, strategy: str) -> None:
    """Each bad input gets its table status and a message; the strategy's whole state_dict (model,
    jobs, ledger, RNG, FedBuff's partly filled buffer) is bit-identical afterwards."""
    gen = fresh_gen()
    chunk_bytes = 64
    cfg = (
        {"alpha": 0.5, "staleness": "constant"}
        if strategy == "fedasync"
        else {"buffer_size": 3, "server_lr": 0.8}
    )
    srv = servers(strategy=strategy, strategy_config=cfg, chunk_bytes=chunk_bytes)
    model = tiny_model(20)
    x0 = flat(model)
    a, b, c = registered_clients(srv.address, ["a", "b", "c"], model, chunk_bytes)
    try:
        ja, jb, jc = a.get_job(), b.get_job(), c.get_job()
        good = rand(x0.numel(), gen)
        first = rand(x0.numel(), gen)
        if strategy == "fedbuff":  # the buffer holds one delta while the bad inputs arrive
            assert b.push(jb, first, epochs=1.0).status is Status.BUFFERED
        before = srv.state()
        if strategy == "fedbuff":
            assert len(before["extra"]["weights"]) == 1
            assert_close_to_hand(before["extra"]["sum"].float(), first.double())
        cases = _bad_push_cases(a, ja, jc, good, chunk_bytes)
        for name, (messages, code) in cases.items():
            result = raw_push(srv.address, messages)
            assert isinstance(result, grpc.RpcError), f"{name}: accepted ({result})"
            assert result.code().name == code, f"{name}: {result.code()} {result.details()}"
            assert result.details(), name
            _assert_same(srv.state(), before, name)
        channel, calls = _other_bad_calls(srv, a, ModelLayout.from_module(torch.nn.Linear(3, 2)))
        with channel:
            for name, (fn, code) in calls.items():
                result = call_or_error(fn)
                assert isinstance(result, grpc.RpcError), f"{name}: accepted"
                assert result.code().name == code, f"{name}: {result.code()} {result.details()}"
                assert result.details(), name
                _assert_same(srv.state(), before, name)
        assert "newcomer" not in srv.federation.clients
        status = a.status()
        assert status.uploads_in_progress == 0 and status.updates_accepted == (
            1 if strategy == "fedbuff" else 0
        )
        # The same jobs still work, and the result is the hand value: nothing leaked in.
        ra = a.push(ja, good, epochs=1.0)
        if strategy == "fedasync":
            assert ra.status is Status.APPLIED and ra.version == 1
            assert_close_to_hand(srv.model(), x0.double() + 0.5 * good.double())
        else:
            assert ra.status is Status.BUFFERED and ra.version == 0
            assert torch.equal(srv.model(), x0)
            third = rand(x0.numel(), gen)
            rc = c.push(jc, third, epochs=1.0)
            assert rc.status is Status.APPLIED and rc.version == 1
            mean = (first.double() + good.double() + third.double()) / 3
            assert_close_to_hand(srv.model(), x0.double() + 0.8 * mean)
    finally:
        for cl in (a, b, c):
            cl.close()


def test_rejected_update_id_is_judged_afresh(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedasync", strategy_config={"alpha": 0.5, "staleness": "constant"})
    model = tiny_model(21)
    x0 = flat(model)
    with Client(srv.address, "a") as a:
        a.register(model)
        job = a.get_job()
        good = rand(x0.numel(), gen)
        bad = good.clone()
        bad[0] = float("nan")
        result = raw_push(srv.address, update_messages(a, job, bad, update_id="retry-me"))
        assert result.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = a.push(job, good, update_id="retry-me")
        assert ok.status is Status.APPLIED and ok.original is None
        assert_close_to_hand(srv.model(), x0.double() + 0.5 * good.double())


def test_staleness_beyond_the_bound_is_aborted(servers) -> None:
    """max_staleness=1, polynomial f(s) = (s+1)^-a: s=1 is mixed with alpha/sqrt(2), s=2 ABORTED
    with the state untouched; a fresh job for the same update id then applies."""
    gen = fresh_gen()
    alpha = 0.6
    srv = servers(
        strategy="fedasync",
        strategy_config={"alpha": alpha, "staleness": "polynomial", "a": 0.5, "max_staleness": 1},
    )
    model = tiny_model(22)
    x0 = flat(model).double()
    a, b, c = registered_clients(srv.address, ["a", "b", "c"], model)
    try:
        assert a.status().limits.HasField("max_staleness")
        assert a.status().limits.max_staleness == 1
        ja, jb, jc = a.get_job(), b.get_job(), c.get_job()
        da, db, dc = (rand(x0.numel(), gen) for _ in range(3))
        rb = b.push(jb, db, epochs=1.0)
        assert (rb.status, rb.version, rb.staleness) == (Status.APPLIED, 1, 0)
        x1 = (1 - alpha) * x0 + alpha * (x0 + db.double())
        ra = a.push(ja, da, epochs=1.0)
        assert (ra.status, ra.version, ra.staleness) == (Status.APPLIED, 2, 1)
        w = alpha * 2**-0.5
        x2 = (1 - w) * x1 + w * (x0 + da.double())
        assert_close_to_hand(srv.model(), x2)
        before = srv.state()
        stale = raw_push(srv.address, update_messages(c, jc, dc, update_id="late-1"))
        assert isinstance(stale, grpc.RpcError) and stale.code() == grpc.StatusCode.ABORTED
        assert "max_staleness" in stale.details()
        _assert_same(srv.state(), before)
        jc2 = c.get_job()
        assert jc2.base_version == 2 and jc2.job_id != jc.job_id
        rc = c.push(jc2, dc, epochs=1.0, update_id="late-1")
        assert (rc.status, rc.version, rc.staleness) == (Status.APPLIED, 3, 0)
        assert_close_to_hand(srv.model(), (1 - alpha) * x2 + alpha * (x2 + dc.double()))
    finally:
        for cl in (a, b, c):
            cl.close()


def test_max_staleness_zero_refuses_any_stale_update(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedbuff", strategy_config={"buffer_size": 1, "max_staleness": 0})
    model = tiny_model(23)
    x0 = flat(model)
    a, b = registered_clients(srv.address, ["a", "b"], model)
    try:
        ja, jb = a.get_job(), b.get_job()
        db = rand(x0.numel(), gen)
        assert b.push(jb, db, epochs=1.0).status is Status.APPLIED
        before = srv.state()
        result = raw_push(srv.address, update_messages(a, ja, rand(x0.numel(), gen)))
        assert result.code() == grpc.StatusCode.ABORTED, result.details()
        _assert_same(srv.state(), before)
        assert_close_to_hand(srv.model(), x0.double() + db.double())
    finally:
        a.close()
        b.close()


def test_trailer_with_wrong_payload_bytes_is_data_loss(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedasync")
    with Client(srv.address, "a") as a:
        a.register(tiny_model(29))
        job = a.get_job()
        messages = update_messages(a, job, rand(a.layout.numel, gen))
        messages[-1].trailer.payload_bytes += 4
        before = srv.state()
        result = raw_push(srv.address, messages)
        assert isinstance(result, grpc.RpcError), f"accepted: {result}"
        assert result.code() == grpc.StatusCode.DATA_LOSS
        _assert_same(srv.state(), before)


def test_chunks_after_the_trailer_are_refused(servers) -> None:
    """A chunk after the trailer is an out-of-order message (INVALID_ARGUMENT); nothing applied."""
    gen = fresh_gen()
    srv = servers(strategy="fedasync")
    with Client(srv.address, "a") as a:
        a.register(tiny_model(30))
        job = a.get_job()
        messages = update_messages(a, job, rand(a.layout.numel, gen))
        extra = pb.UpdateMessage(chunk=tpb.TensorChunk(tensor="update", offset=0, data=bytes(8)))
        before = srv.state()
        result = raw_push(srv.address, [*messages, extra])
        assert isinstance(result, grpc.RpcError), f"accepted: {result}"
        assert result.code() == grpc.StatusCode.INVALID_ARGUMENT
        _assert_same(srv.state(), before)


KILLED_CLIENT = r"""
import sys, time, torch
from aggsrv import protocol as P
from aggsrv.client.client import Client
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import tensor_pb2 as tpb

address = sys.argv[1]
torch.manual_seed(32)
model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
client = Client(address, "doomed")
client.register(model)
job = client.get_job()
D = client.layout.numel
header = pb.UpdateHeader(
    client_id="doomed", job_id=job.job_id, base_version=job.base_version, update_id="doomed-1",
    num_samples=5, work=pb.WorkDone(epochs=1.0, complete=True), kind=pb.UPDATE_KIND_DELTA,
    dtype=tpb.WIRE_DTYPE_FLOAT32, layout_hash=client.layout.hash,
    tensors=[tpb.TensorInfo(name="update", numel=D)],
)
chunks = list(P.chunk_stream({"update": torch.randn(D)}, P.WireDtype.FLOAT32,
                             client.chunk_bytes, pb.UpdateMessage))[:-1]

def messages():
    yield pb.UpdateMessage(header=header)
    yield from chunks[: len(chunks) // 2]
    print("HALF", job.job_id, len(chunks), flush=True)
    time.sleep(600)

client._stub.PushUpdate(messages(), timeout=600)
"""


def test_client_killed_mid_stream_leaves_no_trace(servers) -> None:
    gen = fresh_gen()
    srv = servers(
        strategy="fedasync",
        strategy_config={"alpha": 0.5, "staleness": "constant"},
        chunk_bytes=64,
        max_concurrent_uploads=1,
    )
    model = tiny_model(32)
    x0 = flat(model)
    with Client(srv.address, "owner") as owner:
        owner.chunk_bytes = 64
        owner.register(model)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, srv.address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["HALF"], proc.stderr.read() if proc.poll() is not None else line
        job_id, n_chunks = line[1], int(line[2])
        assert n_chunks >= 4  # half of the payload was sent, half was not
        with Client(srv.address, "observer") as observer:
            deadline = time.monotonic() + 10
            while observer.status().uploads_in_progress != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert observer.status().uploads_in_progress == 1
            before = srv.state()
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            deadline = time.monotonic() + 10
            while observer.status().uploads_in_progress != 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            status = observer.status()
            assert status.uploads_in_progress == 0 and status.queue_depth == 0
            assert status.updates_accepted == 0 and status.version == 0
            _assert_same(srv.state(), before)
            assert not srv.federation.in_flight_updates
        # The restarted client (same id) finds its job and the one staging slot free again.
        with Client(srv.address, "doomed") as again:
            assert again.register(model).known_before
            job = again.get_job()
            assert job.job_id == job_id and torch.equal(job.weights, x0)
            delta = rand(x0.numel(), gen)
            result = again.push(job, delta, epochs=1.0, update_id="doomed-1")
            assert result.status is Status.APPLIED and result.version == 1
            assert_close_to_hand(srv.model(), x0.double() + 0.5 * delta.double())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
