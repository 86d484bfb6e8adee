"""More of the server over real gRPC on loopback: FedBuff, FedAvg (k-async, sample-weighted) and
FedAdam against float64 results computed by hand, WEIGHTS against DELTA, every bad input of the
status table answered with its code while the strategy's whole state dict stays bit-identical,
a client killed mid-stream (a real process, SIGKILL), counters, heartbeats and retained versions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_helpers import (
    RunningServer,
    flat,
    raw_push,
    register_messages,
    tiny_model,
    update_messages,
)
from state_helpers import assert_same_state as _assert_same

from aggsrv import protocol as P
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import Status, UpdateKind

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-6

# ----------------------------------------------------------------------------- helpers


def rand(n: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=gen) * scale


def fresh_gen() -> torch.Generator:
    """Fresh random inputs every run (the seed is printed so a failure can be replayed)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed}")
    return torch.Generator().manual_seed(seed)


def _call(fn: Callable):
    try:
        return fn()
    except grpc.RpcError as exc:
        return exc


def _register_messages(client_id: str, layout: ModelLayout, layout_hash: str | None = None):
    header = pb.RegisterHeader(
        client_id=client_id,
        layout=P.layout_to_pb(layout),
        layout_hash=layout.hash if layout_hash is None else layout_hash,
    )
    return [pb.RegisterRequest(header=header)]


def _close(got: torch.Tensor, want64: torch.Tensor, atol: float = ATOL) -> None:
    """float32 result against the float64 hand value: `atol` per unit of the largest value."""
    tol = atol * max(1.0, want64.abs().max().item())
    err = (got.double() - want64).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


def _clients(
    address: str, names: list[str], model: torch.nn.Module, chunk_bytes: int | None = None
) -> list[Client]:
    """Registered clients; the first one uploads the initial model (`chunk_bytes` overrides the
    chunk size the client learns from GetStatus)."""
    clients = [Client(address, name) for name in names]
    for c in clients:
        if chunk_bytes is not None:
            c.chunk_bytes = chunk_bytes
        c.register(model)
    return clients


# ----------------------------------------------------------------------------- hand results


def test_fedbuff_two_buffered_third_applies_mean(servers) -> None:
    gen = fresh_gen()
    lr = 0.7
    srv = servers(strategy="fedbuff", strategy_config={"buffer_size": 3, "server_lr": lr})
    model = tiny_model(11)
    x0 = flat(model)
    clients = _clients(srv.address, ["a", "b", "c"], model)
    try:
        jobs = [c.get_job() for c in clients]
        assert all(j.base_version == 0 and torch.equal(j.weights, x0) for j in jobs)
        deltas = [rand(x0.numel(), gen) for _ in clients]
        results = [c.push(j, d, epochs=1.0) for c, j, d in zip(clients, jobs, deltas, strict=True)]
        assert [r.status for r in results] == [Status.BUFFERED, Status.BUFFERED, Status.APPLIED]
        assert [r.version for r in results] == [0, 0, 1]
        # Nothing moves before the third delta.
        want = x0.double() + lr * torch.stack([d.double() for d in deltas]).mean(0)
        got = srv.model()
        _close(got, want)
        version, pulled = clients[0].get_model()
        assert version == 1 and torch.equal(pulled, got)
        _, v0 = clients[0].get_model(version=0)
        assert torch.equal(v0, x0)
        # A replayed BUFFERED update: DUPLICATE(BUFFERED, its version 0), applied once.
        again = clients[0].push(jobs[0], deltas[0], epochs=1.0, update_id=results[0].update_id)
        assert again.status is Status.DUPLICATE and again.original is Status.BUFFERED
        assert again.version == 0
        assert torch.equal(srv.model(), got) and srv.strategy.version == 1
    finally:
        for c in clients:
            c.close()


def test_fedavg_k_async_sample_weighted_mean(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedavg", strategy_config={"mode": "k_async", "k": 2})
    model = tiny_model(12)
    x0 = flat(model)
    a, b = _clients(srv.address, ["a", "b"], model)
    try:
        ja, jb = a.get_job(), b.get_job()
        da, db = rand(x0.numel(), gen), rand(x0.numel(), gen)
        na, nb = (int(v) for v in torch.randint(1, 500, (2,), generator=gen))
        ra = a.push(ja, da, num_samples=na, epochs=1.0)
        assert ra.status is Status.BUFFERED and ra.version == 0
        assert torch.equal(srv.model(), x0)
        rb = b.push(jb, db, num_samples=nb, epochs=1.0)
        assert rb.status is Status.APPLIED and rb.version == 1
        want = x0.double() + (na * da.double() + nb * db.double()) / (na + nb)
        _close(srv.model(), want)
    finally:
        a.close()
        b.close()


def test_fedadam_first_two_steps_by_hand(servers) -> None:
    """FedAdam (fedavg.py): m = b1 m + (1-b1) d, v = b2 v + (1-b2) d^2 with m0 = 0, v0 = tau^2,
    x += lr m / (sqrt(v) + tau); defaults b1 = 0.9, b2 = 0.99, tau = 1e-3, lr = 0.01."""
    gen = fresh_gen()
    srv = servers(
        strategy="fedavg", strategy_config={"mode": "k_async", "k": 2, "server_opt": "adam"}
    )
    b1, b2, tau, lr = 0.9, 0.99, 1e-3, 0.01
    model = tiny_model(13)
    x = flat(model).double()
    a, b = _clients(srv.address, ["a", "b"], model)
    m = torch.zeros_like(x)
    v = torch.full_like(x, tau**2)
    try:
        for step in (1, 2):
            ja, jb = a.get_job(), b.get_job()
            assert ja.base_version == jb.base_version == step - 1
            da, db = rand(x.numel(), gen, 0.1), rand(x.numel(), gen, 0.1)
            na, nb = (int(n) for n in torch.randint(1, 100, (2,), generator=gen))
            assert a.push(ja, da, num_samples=na, epochs=1.0).status is Status.BUFFERED
            rb = b.push(jb, db, num_samples=nb, epochs=1.0)
            assert rb.status is Status.APPLIED and rb.version == step
            d = (na * da.double() + nb * db.double()) / (na + nb)
            m = b1 * m + (1 - b1) * d
            v = b2 * v + (1 - b2) * d * d
            x = x + lr * m / (v.sqrt() + tau)
            _close(srv.model(), x, atol=1e-5 * step)
        # The moments are state: m and v match the hand values too.
        extra = srv.state()["extra"]
        _close(extra["m"], m, atol=1e-6)
        _close(extra["v"], v, atol=1e-8)
    finally:
        a.close()
        b.close()


STRATEGY_CASES = {
    "fedasync": ("fedasync", {"alpha": 0.4, "staleness": "constant"}),
    "fedbuff": ("fedbuff", {"buffer_size": 2, "server_lr": 0.5}),
    "fedavg": ("fedavg", {"mode": "k_async", "k": 2}),
}


def _hand(name: str, x0: torch.Tensor, deltas: list[torch.Tensor], ns: list[int]) -> torch.Tensor:
    """The float64 model after the two updates (both from version 0) of STRATEGY_CASES[name]."""
    x = x0.double()
    ds = [d.double() for d in deltas]
    if name == "fedasync":  # x <- (1 - a) x + a (x0 + d), twice (the second one 1 stale)
        for d in ds:
            x = 0.6 * x + 0.4 * (x0.double() + d)
        return x
    if name == "fedbuff":
        return x + 0.5 * (ds[0] + ds[1]) / 2
    return x + (ns[0] * ds[0] + ns[1] * ds[1]) / (ns[0] + ns[1])


@pytest.mark.parametrize("name", list(STRATEGY_CASES))
def test_weights_kind_gives_the_delta_result(servers, name: str) -> None:
    gen = fresh_gen()
    strategy, cfg = STRATEGY_CASES[name]
    model = tiny_model(14)
    x0 = flat(model)
    deltas = [rand(x0.numel(), gen) for _ in range(2)]
    ns = [int(n) for n in torch.randint(1, 50, (2,), generator=gen)]
    results = {}
    for kind in (UpdateKind.DELTA, UpdateKind.WEIGHTS):
        srv = servers(strategy=strategy, strategy_config=cfg)
        clients = _clients(srv.address, ["a", "b"], model)
        jobs = [c.get_job() for c in clients]
        outcomes = []
        for c, j, d, n in zip(clients, jobs, deltas, ns, strict=True):
            payload = d if kind is UpdateKind.DELTA else j.weights + d
            outcomes.append(c.push(j, payload, kind=kind, num_samples=n, epochs=1.0).status)
        for c in clients:
            c.close()
        assert outcomes[-1] is Status.APPLIED, (kind, outcomes)
        results[kind] = srv.model()
        _close(results[kind], _hand(name, x0, deltas, ns))
    # WEIGHTS - start differs from the delta by float32 rounding of x0 + d only.
    _close(results[UpdateKind.WEIGHTS], results[UpdateKind.DELTA].double())


def test_job_stream_waits_while_strategy_returns_none_then_delivers(servers) -> None:
    """FedAvg sync with min_clients=2: the first client's GetJob waits (pending messages) until
    the second registers and the round opens; the round's result is the sample-weighted mean."""
    gen = fresh_gen()
    srv = servers(
        strategy="fedavg",
        strategy_config={"mode": "sync", "min_clients": 2, "participation": 1.0},
        pending_interval_seconds=0.1,
    )
    model = tiny_model(15)
    x0 = flat(model)
    a = Client(srv.address, "a")
    b = Client(srv.address, "b")
    try:
        a.register(model)
        kinds: list[str] = []
        header: list[pb.JobHeader] = []
        errors: list[BaseException] = []

        def wait_for_job() -> None:
            req = pb.GetJobRequest(client_id="a", layout_hash=a.layout.hash)
            try:
                for msg in a._stub.GetJob(req, timeout=20):
                    kinds.append(msg.WhichOneof("kind"))
                    if msg.HasField("header"):
                        header.append(msg.header)
            except BaseException as exc:  # reported below
                errors.append(exc)

        t = threading.Thread(target=wait_for_job)
        t.start()
        deadline = time.monotonic() + 10
        while kinds.count("pending") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert kinds and set(kinds) == {"pending"}, kinds  # waiting, not failing
        assert srv.strategy.outstanding_job("a") is None
        b.register(model)  # the round opens: both sampled
        t.join(timeout=10)
        assert not t.is_alive() and not errors, errors
        assert kinds[-1] == "trailer" and "header" in kinds and kinds[0] == "pending"
        assert header[0].base_version == 0
        ja, jb = a.get_job(), b.get_job()  # the same open jobs again
        assert ja.job_id == header[0].job_id and torch.equal(ja.weights, x0)
        da, db = rand(x0.numel(), gen), rand(x0.numel(), gen)
        na, nb = 17, 41
        assert a.push(ja, da, num_samples=na, epochs=1.0).status is Status.BUFFERED
        rb = b.push(jb, db, num_samples=nb, epochs=1.0)
        assert rb.status is Status.APPLIED and rb.version == 1
        _close(srv.model(), x0.double() + (na * da.double() + nb * db.double()) / (na + nb))
    finally:
        a.close()
        b.close()


def test_empty_server_refuses_until_first_model_then_keeps_it(servers) -> None:
    srv = servers(strategy="fedasync")
    with grpc.insecure_channel(srv.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (
            health.Check(health_pb2.HealthCheckRequest(service="aggsrv.v1.Aggregation")).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        stub = pb_grpc.AggregationStub(channel)
        assert not stub.GetStatus(pb.GetStatusRequest()).has_model
        layout = ModelLayout.from_module(tiny_model(16))
        no_weights = _call(lambda: stub.Register(iter(_register_messages("x", layout))))
        assert no_weights.code() == grpc.StatusCode.FAILED_PRECONDITION
        model = _call(lambda: list(stub.GetModel(pb.GetModelRequest())))
        assert model.code() == grpc.StatusCode.FAILED_PRECONDITION
    first, second = tiny_model(16), tiny_model(17)
    with Client(srv.address, "first") as c1, Client(srv.address, "second") as c2:
        assert c1.register(first).initial_model_adopted
        resp = c2.register(layout=ModelLayout.from_module(second), initial=flat(second))
        assert not resp.initial_model_adopted and resp.known_before is False
        assert torch.equal(srv.model(), flat(first)) and srv.strategy.version == 0


def test_empty_server_with_small_chunks_adopts_the_stock_clients_model(servers) -> None:
    srv = servers(strategy="fedasync", chunk_bytes=64)
    model = tiny_model(33)
    with Client(srv.address, "first") as c:
        resp = c.register(model)  # 232 bytes of weights > 64-byte chunks
        assert resp.initial_model_adopted and resp.limits.chunk_bytes == 64
        assert torch.equal(srv.model(), flat(model))


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
        result = _call(lambda: stub.Register(iter(messages)))
    assert isinstance(result, grpc.RpcError), "accepted"
    assert result.code() == grpc.StatusCode.DATA_LOSS
    _assert_same(srv.state(), before)


# ----------------------------------------------------------------------------- concurrency


def test_eight_concurrent_fedbuff_pushes_each_applied_once(servers) -> None:
    gen = fresh_gen()
    lr, m = 0.9, 4
    srv = servers(
        strategy="fedbuff",
        strategy_config={"buffer_size": m, "server_lr": lr},
        max_concurrent_uploads=2,
    )
    model = tiny_model(18)
    x0 = flat(model)
    clients = _clients(srv.address, [f"c{i}" for i in range(8)], model)
    try:
        jobs = [c.get_job() for c in clients]
        deltas = [rand(x0.numel(), gen) for _ in clients]
        results: list = [None] * 8
        barrier = threading.Barrier(8)

        def push(i: int) -> None:
            barrier.wait()
            results[i] = clients[i].push(jobs[i], deltas[i], epochs=1.0)

        threads = [threading.Thread(target=push, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        statuses = sorted(r.status.value for r in results)
        assert statuses == ["APPLIED"] * 2 + ["BUFFERED"] * 6
        assert sorted(r.version for r in results if r.status is Status.APPLIED) == [1, 2]
        # Every delta is in exactly one buffer flush: x0 + lr/M * sum(all deltas).
        want = x0.double() + lr / m * torch.stack([d.double() for d in deltas]).sum(0)
        _close(srv.model(), want, atol=2e-6)
        status = clients[0].status()
        assert (status.updates_accepted, status.updates_applied) == (8, 2)
        assert status.uploads_in_progress == 0 and status.updates_rejected == 0
    finally:
        for c in clients:
            c.close()


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
        _close(srv.model(), x0.double() + 0.5 * delta.double())
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
            lambda: stub.Register(iter(_register_messages("newcomer", layout_other))),
            "FAILED_PRECONDITION",
        ),
        "Register: known client, other layout": (
            lambda: stub.Register(iter(_register_messages(client.client_id, layout_other))),
            "FAILED_PRECONDITION",
        ),
        "Register: hash not of the layout sent": (
            lambda: stub.Register(iter(_register_messages("newcomer", client.layout, "cd" * 32))),
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
    a, b, c = _clients(srv.address, ["a", "b", "c"], model, chunk_bytes)
    try:
        ja, jb, jc = a.get_job(), b.get_job(), c.get_job()
        good = rand(x0.numel(), gen)
        first = rand(x0.numel(), gen)
        if strategy == "fedbuff":  # the buffer holds one delta while the bad inputs arrive
            assert b.push(jb, first, epochs=1.0).status is Status.BUFFERED
        before = srv.state()
        if strategy == "fedbuff":
            assert len(before["extra"]["weights"]) == 1
            _close(before["extra"]["sum"].float(), first.double())
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
                result = _call(fn)
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
            _close(srv.model(), x0.double() + 0.5 * good.double())
        else:
            assert ra.status is Status.BUFFERED and ra.version == 0
            assert torch.equal(srv.model(), x0)
            third = rand(x0.numel(), gen)
            rc = c.push(jc, third, epochs=1.0)
            assert rc.status is Status.APPLIED and rc.version == 1
            mean = (first.double() + good.double() + third.double()) / 3
            _close(srv.model(), x0.double() + 0.8 * mean)
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
        _close(srv.model(), x0.double() + 0.5 * good.double())


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
    a, b, c = _clients(srv.address, ["a", "b", "c"], model)
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
        _close(srv.model(), x2)
        before = srv.state()
        stale = raw_push(srv.address, update_messages(c, jc, dc, update_id="late-1"))
        assert isinstance(stale, grpc.RpcError) and stale.code() == grpc.StatusCode.ABORTED
        assert "max_staleness" in stale.details()
        _assert_same(srv.state(), before)
        jc2 = c.get_job()
        assert jc2.base_version == 2 and jc2.job_id != jc.job_id
        rc = c.push(jc2, dc, epochs=1.0, update_id="late-1")
        assert (rc.status, rc.version, rc.staleness) == (Status.APPLIED, 3, 0)
        _close(srv.model(), (1 - alpha) * x2 + alpha * (x2 + dc.double()))
    finally:
        for cl in (a, b, c):
            cl.close()


def test_max_staleness_zero_refuses_any_stale_update(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedbuff", strategy_config={"buffer_size": 1, "max_staleness": 0})
    model = tiny_model(23)
    x0 = flat(model)
    a, b = _clients(srv.address, ["a", "b"], model)
    try:
        ja, jb = a.get_job(), b.get_job()
        db = rand(x0.numel(), gen)
        assert b.push(jb, db, epochs=1.0).status is Status.APPLIED
        before = srv.state()
        result = raw_push(srv.address, update_messages(a, ja, rand(x0.numel(), gen)))
        assert result.code() == grpc.StatusCode.ABORTED, result.details()
        _assert_same(srv.state(), before)
        _close(srv.model(), x0.double() + db.double())
    finally:
        a.close()
        b.close()


def test_superseded_job_is_aborted_and_heartbeat_reports_it(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedasync", strategy_config={"alpha": 0.5, "staleness": "constant"})
    model = tiny_model(24)
    x0 = flat(model).double()
    a, b = _clients(srv.address, ["a", "b"], model)
    try:
        j1 = a.get_job()
        assert a.heartbeat(j1.job_id).job_state == pb.JOB_STATE_CURRENT
        assert a.get_job().job_id == j1.job_id  # same version: the same job again
        jb = b.get_job()
        db = rand(x0.numel(), gen)
        assert b.push(jb, db, epochs=1.0).version == 1
        hb = a.heartbeat(j1.job_id)
        assert hb.job_state == pb.JOB_STATE_CURRENT and hb.latest_version == 1
        j2 = a.get_job()  # a newer job supersedes j1
        assert j2.job_id != j1.job_id and j2.base_version == 1
        assert a.heartbeat(j1.job_id).job_state == pb.JOB_STATE_SUPERSEDED
        assert a.heartbeat(j2.job_id).job_state == pb.JOB_STATE_CURRENT
        before = srv.state()
        old = raw_push(srv.address, update_messages(a, j1, rand(x0.numel(), gen)))
        assert isinstance(old, grpc.RpcError) and old.code() == grpc.StatusCode.ABORTED
        _assert_same(srv.state(), before)
        da = rand(x0.numel(), gen)
        assert a.push(j2, da, epochs=1.0).version == 2
        x1 = x0 + 0.5 * db.double()
        _close(srv.model(), x1 + 0.5 * da.double())
    finally:
        a.close()
        b.close()


def test_heartbeat_job_states_unspecified_completed_unknown(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedasync")
    model = tiny_model(25)
    with Client(srv.address, "a") as a:
        a.register(model)
        job = a.get_job()
        a.push(job, rand(flat(model).numel(), gen), epochs=1.0)
        states = (
            a.heartbeat("").job_state,
            a.heartbeat(job.job_id).job_state,
            a.heartbeat("424242").job_state,
        )
        assert states == (
            pb.JOB_STATE_UNSPECIFIED,
            pb.JOB_STATE_COMPLETED,
            pb.JOB_STATE_UNKNOWN,
        ), states


def test_get_model_retained_and_future_versions(servers) -> None:
    gen = fresh_gen()
    srv = servers(
        strategy="fedasync",
        strategy_config={"alpha": 1.0, "staleness": "constant"},
        retained_versions=2,
    )
    model = tiny_model(26)
    x = flat(model).double()
    with Client(srv.address, "a") as a:
        a.register(model)
        history = [x]
        for _ in range(3):
            job = a.get_job()
            d = rand(x.numel(), gen)
            a.push(job, d, epochs=1.0)
            x = history[-1] + d.double()  # alpha = 1: the client's model
            history.append(x)
        status = a.status()
        assert (status.version, status.oldest_retained_version) == (3, 2)
        for v in (2, 3):
            version, weights = a.get_model(version=v)
            assert version == v
            _close(weights, history[v])
        for v, code in ((0, "NOT_FOUND"), (1, "NOT_FOUND"), (4, "OUT_OF_RANGE"), (10**6, None)):
            result = _call(lambda v=v: a.get_model(version=v))
            assert isinstance(result, grpc.RpcError), v
            assert result.code().name == (code or "OUT_OF_RANGE"), (v, result.details())
            assert result.details()


# ----------------------------------------------------------------------------- counters


def test_status_counters_after_accepted_rejected_and_duplicate_updates(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedbuff", strategy_config={"buffer_size": 2})
    model = tiny_model(27)
    x0 = flat(model)
    a, b = _clients(srv.address, ["a", "b"], model)
    try:
        ja, jb = a.get_job(), b.get_job()
        D = x0.numel()
        bad = rand(D, gen)
        bad[1] = float("nan")
        rejected = {
            "INVALID_ARGUMENT": [update_messages(a, ja, bad)],
            "NOT_FOUND": [update_messages(a, ja, rand(D, gen), client_id="ghost")],
            "DATA_LOSS": [
                update_messages(a, ja, rand(D, gen))[:-1],
                update_messages(a, ja, rand(D, gen))[:2],
            ],
            "FAILED_PRECONDITION": [update_messages(a, ja, rand(D, gen), layout_hash="0" * 64)],
        }
        for code, streams in rejected.items():
            for messages in streams:
                assert raw_push(srv.address, messages).code().name == code
        ra = a.push(ja, rand(D, gen), epochs=1.0)
        assert ra.status is Status.BUFFERED
        dup = a.push(ja, rand(D, gen), epochs=1.0, update_id=ra.update_id)
        assert dup.status is Status.DUPLICATE
        rb = b.push(jb, rand(D, gen), epochs=1.0)
        assert rb.status is Status.APPLIED
        for _ in range(2):
            assert b.push(jb, rand(D, gen), epochs=1.0, update_id=rb.update_id).original is (
                Status.APPLIED
            )
        s = a.status()
        assert s.has_model and s.version == 1 and s.strategy == "fedbuff"
        assert (s.updates_accepted, s.updates_applied, s.updates_duplicate) == (2, 1, 3)
        assert s.updates_rejected == 5
        assert dict(s.rejected_by_code) == {
            "INVALID_ARGUMENT": 1,
            "NOT_FOUND": 1,
            "DATA_LOSS": 2,
            "FAILED_PRECONDITION": 1,
        }
        assert (s.clients_known, s.clients_active) == (2, 2)
        assert s.uploads_in_progress == 0 and s.queue_depth == 0
        assert s.numel == D and s.layout_hash == a.layout.hash
    finally:
        a.close()
        b.close()


def test_refused_non_update_calls_are_not_counted_as_rejected_updates(servers) -> None:
    srv = servers(strategy="fedasync")
    with Client(srv.address, "a") as a:
        a.register(tiny_model(28))
        stub = a._stub
        assert _call(lambda: stub.Heartbeat(pb.HeartbeatRequest(client_id="nobody"))).code() == (
            grpc.StatusCode.NOT_FOUND
        )
        req = pb.GetJobRequest(client_id="a", layout_hash="0" * 64)
        assert _call(lambda: list(stub.GetJob(req))).code() == grpc.StatusCode.FAILED_PRECONDITION
        s = a.status()
        assert s.updates_rejected == 0 and dict(s.rejected_by_code) == {}


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


def _slow_upload(
    address: str, messages: list, release: threading.Event, out: list
) -> threading.Thread:
    """Push header + first chunk, then wait for `release` before the rest."""

    def gen() -> Iterator[pb.UpdateMessage]:
        yield messages[0]
        yield messages[1]
        release.wait(20)
        yield from messages[2:]

    t = threading.Thread(target=lambda: out.append(raw_push(address, gen())))
    t.start()
    return t


def test_uploads_in_progress_counts_occupied_slots_only(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedasync", max_concurrent_uploads=1)
    model = tiny_model(31)
    a, b = _clients(srv.address, ["a", "b"], model)
    release = threading.Event()
    out: list = []
    threads = []
    try:
        for c in (a, b):
            job = c.get_job()
            threads.append(
                _slow_upload(srv.address, update_messages(c, job, rand(58, gen)), release, out)
            )
        deadline = time.monotonic() + 5
        while len(srv.federation.in_flight_updates) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        s = a.status()
        # One slot: one upload occupies it, the other waits; no update is validated yet.
        assert (s.uploads_in_progress, s.queue_depth) == (1, 0), s
    finally:
        release.set()
        for t in threads:
            t.join(timeout=20)
        a.close()
        b.close()
    # Backpressure waits, never refuses: both end up applied.
    assert sorted(r.version for r in out) == [1, 2]


# ----------------------------------------------------------------------------- killed client

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
            _close(srv.model(), x0.double() + 0.5 * delta.double())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
