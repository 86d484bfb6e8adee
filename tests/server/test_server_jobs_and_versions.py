"""Jobs, versions and counters over real gRPC: a job stream that waits for the strategy, an empty
server adopting its first model, concurrent pushes each applied once, superseded jobs and
heartbeats, retained and future versions, the status counters and the uploads in progress."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from push_helpers import (
    assert_close_to_hand,
    call_or_error,
    fresh_gen,
    rand,
    register_with_hash,
    registered_clients,
)
from server_helpers import (
    flat,
    raw_push,
    tiny_model,
    update_messages,
)
from state_helpers import assert_same_state as _assert_same

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.values import Status


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
        assert_close_to_hand(
            srv.model(), x0.double() + (na * da.double() + nb * db.double()) / (na + nb)
        )
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
        no_weights = call_or_error(lambda: stub.Register(iter(register_with_hash("x", layout))))
        assert no_weights.code() == grpc.StatusCode.FAILED_PRECONDITION
        model = call_or_error(lambda: list(stub.GetModel(pb.GetModelRequest())))
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
    clients = registered_clients(srv.address, [f"c{i}" for i in range(8)], model)
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
        assert_close_to_hand(srv.model(), want, atol=2e-6)
        status = clients[0].status()
        assert (status.updates_accepted, status.updates_applied) == (8, 2)
        assert status.uploads_in_progress == 0 and status.updates_rejected == 0
    finally:
        for c in clients:
            c.close()


def test_superseded_job_is_aborted_and_heartbeat_reports_it(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedasync", strategy_config={"alpha": 0.5, "staleness": "constant"})
    model = tiny_model(24)
    x0 = flat(model).double()
    a, b = registered_clients(srv.address, ["a", "b"], model)
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
        assert_close_to_hand(srv.model(), x1 + 0.5 * da.double())
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
            assert_close_to_hand(weights, history[v])
        for v, code in ((0, "NOT_FOUND"), (1, "NOT_FOUND"), (4, "OUT_OF_RANGE"), (10**6, None)):
            result = call_or_error(lambda v=v: a.get_model(version=v))
            assert isinstance(result, grpc.RpcError), v
            assert result.code().name == (code or "OUT_OF_RANGE"), (v, result.details())
            assert result.details()


# ----------------------------------------------------------------------------- counters


def test_status_counters_after_accepted_rejected_and_duplicate_updates(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedbuff", strategy_config={"buffer_size": 2})
    model = tiny_model(27)
    x0 = flat(model)
    a, b = registered_clients(srv.address, ["a", "b"], model)
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
        assert call_or_error(
            lambda: stub.Heartbeat(pb.HeartbeatRequest(client_id="nobody"))
        ).code() == (grpc.StatusCode.NOT_FOUND)
        req = pb.GetJobRequest(client_id="a", layout_hash="0" * 64)
        assert (
            call_or_error(lambda: list(stub.GetJob(req))).code()
            == grpc.StatusCode.FAILED_PRECONDITION
        )
        s = a.status()
        assert s.updates_rejected == 0 and dict(s.rejected_by_code) == {}


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
    a, b = registered_clients(srv.address, ["a", "b"], model)
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
