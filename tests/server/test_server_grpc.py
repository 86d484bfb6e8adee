"""The server over real gRPC on loopback: registration, jobs, updates, models, and bad input
answered with the table's status while the global model stays bit-identical."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_helpers import RunningServer, raw_push, tiny_model, update_messages

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import Status, UpdateKind


@pytest.fixture
def fedasync_server() -> Iterator[RunningServer]:
    srv = RunningServer(
        strategy="fedasync", strategy_config={"alpha": 0.5, "staleness": "constant"}
    )
    yield srv
    srv.stop()


def test_empty_server_adopts_first_model_and_fedasync_mixes(fedasync_server: RunningServer) -> None:
    model = tiny_model(1)
    start = ModelLayout.from_module(model).flatten(model, dtype=torch.float32)
    with Client(fedasync_server.address, "c1") as client:
        resp = client.register(model)
        assert resp.initial_model_adopted and resp.model_version == 0
        assert resp.strategy == "fedasync"
        assert torch.equal(fedasync_server.model(), start)
        job = client.get_job()
        assert job.base_version == 0 and torch.equal(job.weights, start)
        delta = torch.randn(start.numel())
        result = client.push(job, delta, kind=UpdateKind.DELTA, num_samples=10, epochs=1.0)
        assert result.status is Status.APPLIED and result.version == 1 and result.staleness == 0
        # FedAsync, constant staleness: x <- (1 - a) x + a (x + delta) = x + a delta.
        want = (start.double() + 0.5 * delta.double()).float()
        got = fedasync_server.model()
        assert torch.allclose(got, want, rtol=0, atol=1e-6)
        version, pulled = client.get_model()
        assert version == 1 and torch.equal(pulled, got)
        old_version, old = client.get_model(version=0)
        assert old_version == 0 and torch.equal(old, start)


def test_replayed_update_id_is_applied_once(fedasync_server: RunningServer) -> None:
    with Client(fedasync_server.address, "c1") as client:
        client.register(tiny_model(2))
        job = client.get_job()
        delta = torch.randn(job.weights.numel())
        first = client.push(job, delta, update_id="u-1")
        after_first = fedasync_server.model()
        again = client.push(job, delta, update_id="u-1")
        assert again.status is Status.DUPLICATE and again.original is Status.APPLIED
        assert again.version == first.version
        assert torch.equal(fedasync_server.model(), after_first)


def test_bad_updates_get_their_status_and_change_nothing(fedasync_server: RunningServer) -> None:
    with Client(fedasync_server.address, "c1") as client:
        client.register(tiny_model(3))
        job = client.get_job()
        D = client.layout.numel
        good = torch.randn(D)
        state_before = fedasync_server.model()
        nan = good.clone()
        nan[D // 2] = float("nan")
        inf = good.clone()
        inf[3] = float("inf")
        cases = {
            "unknown client": (
                update_messages(client, job, good, client_id="nobody"),
                "NOT_FOUND",
            ),
            "wrong hash": (
                update_messages(client, job, good, layout_hash="0" * 64),
                "FAILED_PRECONDITION",
            ),
            "NaN": (update_messages(client, job, nan), "INVALID_ARGUMENT"),
            "Inf": (update_messages(client, job, inf), "INVALID_ARGUMENT"),
            "wrong length": (
                update_messages(
                    client, job, good[:-1], tensors=[tpb.TensorInfo(name="update", numel=D - 1)]
                ),
                "INVALID_ARGUMENT",
            ),
            "bad dtype": (update_messages(client, job, good, dtype=7), "INVALID_ARGUMENT"),
            "header not matching the job": (
                update_messages(client, job, good, base_version=job.base_version + 5),
                "INVALID_ARGUMENT",
            ),
            "unknown job": (update_messages(client, job, good, job_id="999"), "INVALID_ARGUMENT"),
        }
        truncated = update_messages(client, job, good)[:-2]  # no last chunk, no trailer
        cases["cut before trailer"] = (truncated, "DATA_LOSS")
        corrupt = update_messages(client, job, good)
        corrupt[-1] = pb.UpdateMessage(
            trailer=tpb.StreamTrailer(crc32c=corrupt[-1].trailer.crc32c ^ 1)
        )
        cases["checksum"] = (corrupt, "DATA_LOSS")
        oversized = update_messages(client, job, good)
        oversized[1] = pb.UpdateMessage(
            chunk=tpb.TensorChunk(tensor="update", offset=0, data=bytes(4 * (D + 400_000)))
        )
        cases["oversized chunk"] = (oversized, "RESOURCE_EXHAUSTED")
        for name, (messages, code) in cases.items():
            result = raw_push(fedasync_server.address, messages)
            assert isinstance(result, grpc.RpcError), f"{name}: accepted"
            assert result.code().name == code, f"{name}: {result.code()} {result.details()}"
            assert result.details(), name
            assert torch.equal(fedasync_server.model(), state_before), name
        assert fedasync_server.strategy.version == 0
        # The same job still works afterwards.
        ok = client.push(job, good)
        assert ok.status is Status.APPLIED


def test_job_stream_waits_while_strategy_has_nothing() -> None:
    """FedBuff-like waiting is strategy-driven; FedAvg sync hands jobs only to sampled clients."""
    srv = RunningServer(
        strategy="fedavg",
        strategy_config={
            "mode": "sync",
            "participation": 1,
            "min_clients": 1,
            "round_timeout": 30.0,
        },
        pending_interval_seconds=0.2,
    )
    try:
        with Client(srv.address, "a") as a, Client(srv.address, "b") as b:
            a.register(tiny_model(4))
            b.register(tiny_model(4))
            jobs = {}
            waiting = {}

            def fetch(name: str, client: Client) -> None:
                try:
                    jobs[name] = client.get_job(timeout=1.5)
                except grpc.RpcError as exc:
                    waiting[name] = exc.code()

            threads = [threading.Thread(target=fetch, args=(n, c)) for n, c in (("a", a), ("b", b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # One participant per round: one client gets a job, the other waits until its deadline.
            assert len(jobs) == 1 and waiting == {
                next(iter({"a", "b"} - set(jobs))): grpc.StatusCode.DEADLINE_EXCEEDED
            }
    finally:
        srv.stop()


def test_health_and_reflection(fedasync_server: RunningServer) -> None:
    with grpc.insecure_channel(fedasync_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert "aggsrv.v1.Aggregation" in names


def test_concurrent_clients_each_update_applied_once() -> None:
    srv = RunningServer(
        strategy="fedasync",
        strategy_config={"alpha": 0.25, "staleness": "constant"},
        max_concurrent_uploads=2,
    )
    try:
        n = 8
        clients = [Client(srv.address, f"c{i}") for i in range(n)]
        clients[0].register(tiny_model(5))
        for c in clients[1:]:
            c.register(tiny_model(5))
        jobs = [c.get_job() for c in clients]
        deltas = [torch.randn(clients[0].layout.numel) for _ in range(n)]
        results: list = [None] * n

        def push(i: int) -> None:
            results[i] = clients[i].push(jobs[i], deltas[i])

        threads = [threading.Thread(target=push, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.status is Status.APPLIED for r in results)
        assert sorted(r.version for r in results) == list(range(1, n + 1))
        assert srv.strategy.version == n
        status = clients[0].status()
        assert status.updates_applied == n and status.clients_known == n
        for c in clients:
            c.close()
    finally:
        srv.stop()


def test_cli_pull_writes_state_dict(fedasync_server: RunningServer, tmp_path) -> None:
    import subprocess
    import sys

    model = tiny_model(6)
    with Client(fedasync_server.address, "c1") as client:
        client.register(model)
    out = tmp_path / "model.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "pull", fedasync_server.address, "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    state = torch.load(out, weights_only=True)
    assert set(state) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach()), name


def test_serve_print_config_and_unknown_key(tmp_path) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "server.toml"
    cfg.write_text('strategy = "fedbuff"\nport = 6000\n[strategy_config]\nbuffer_size = 3\n')
    proc = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "serve", "--config", str(cfg), "--port", "6001",
         "--print-config"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert 'strategy = "fedbuff"' in proc.stdout and "port = 6001" in proc.stdout
    assert "buffer_size = 3" in proc.stdout
    cfg.write_text("prot = 6000\n")
    proc = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "serve", "--config", str(cfg)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "prot" in proc.stderr


def test_clients_train_and_federated_model_improves() -> None:
    """Three clients run `aggsrv.client.train` on their shard and push deltas to FedAvg
    (k_async, k=3): the aggregated model classifies held-out data better than the initial one."""
    from aggsrv.client import train

    gen = torch.Generator().manual_seed(7)
    true_w = torch.randn(7, 3, generator=gen)
    X = torch.randn(600, 7, generator=gen)
    y = (X @ true_w).argmax(1)
    shards = [(X[i::4], y[i::4]) for i in range(3)]
    X_test, y_test = X[3::4], y[3::4]
    srv = RunningServer(
        strategy="fedavg",
        strategy_config={"mode": "k_async", "k": 3, "learning_rate": 0.5, "local_epochs": 2.0,
                         "batch_size": 25},
    )  # fmt: skip

    def accuracy(flat: torch.Tensor) -> float:
        model = tiny_model(0)
        ModelLayout.from_module(model).unflatten(flat, model)
        return (model(X_test).argmax(1) == y_test).float().mean().item()

    try:
        clients = [Client(srv.address, f"site{i}") for i in range(3)]
        for c in clients:
            c.register(tiny_model(8))
        before = accuracy(srv.model())
        for _ in range(3):
            for c, (xs, ys) in zip(clients, shards, strict=True):
                job = c.get_job()
                batches = list(
                    zip(
                        xs.split(job.recipe.batch_size),
                        ys.split(job.recipe.batch_size),
                        strict=True,
                    )
                )
                model = tiny_model(0)
                res = train(model, batches, job.recipe, job.weights)
                c.push(job, res.delta, num_samples=len(xs), epochs=res.work_done(job.recipe))
        after = accuracy(srv.model())
        assert srv.strategy.version == 3
        assert after > before + 0.2, (before, after)
        for c in clients:
            c.close()
    finally:
        srv.stop()
