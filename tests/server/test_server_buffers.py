"""Models with float buffers (BatchNorm running statistics) over real gRPC on loopback: the
initial statistics travel with the first registration, jobs carry the global ones, updates
must carry the client's, GetModel returns them on request, and bad buffers are refused with
the table's status while the whole state stays bit-identical."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from server_helpers import RunningServer, raw_push, register_messages, update_messages
from state_helpers import assert_same_state

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.values import Status

ALPHA = 0.6


def bn_model(seed: int, track: bool = True) -> torch.nn.Module:
    """Linear, BatchNorm1d (5 running means and variances), LayerNorm, Linear: D = 92, B = 10."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 5),
        torch.nn.BatchNorm1d(5, track_running_stats=track),
        torch.nn.ReLU(),
        torch.nn.LayerNorm(5),
        torch.nn.Linear(5, 3),
    )
    with torch.no_grad():  # fresh statistics, not the 0/1 defaults
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm1d) and track:
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    return model


def random_buffers(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, generator=g)
    b[n // 2 :] = torch.rand(n - n // 2, generator=g) + 0.1  # running_var is the second half
    return b


@pytest.fixture
def server() -> Iterator[RunningServer]:
    srv = RunningServer(
        strategy="fedasync", strategy_config={"alpha": ALPHA, "staleness": "constant"}
    )
    yield srv
    srv.stop()


def test_statistics_travel_and_follow_the_fedasync_average(server: RunningServer) -> None:
    model = bn_model(1)
    layout = ModelLayout.from_module(model)
    w0 = layout.flatten(model, dtype=torch.float32)
    b0 = layout.flatten_buffers(model, dtype=torch.float32)
    assert layout.buffer_numel == 10
    with Client(server.address, "c1") as client:
        assert client.register(model).initial_model_adopted
        assert torch.equal(server.strategy.global_buffers(), b0)
        # The server's layout keeps the norm flags (ORTHOFL skips those segments) and buffers.
        fed_layout = server.federation.layout
        assert torch.equal(fed_layout.is_norm, layout.is_norm) and bool(layout.is_norm.any())
        assert fed_layout.buffer_names == layout.buffer_names
        status = client.status()
        assert status.buffer_numel == 10 and status.numel == layout.numel
        job = client.get_job()
        assert torch.equal(job.weights, w0) and torch.equal(job.buffers, b0)
        delta, xb = torch.randn(layout.numel), random_buffers(10, 3)
        with pytest.raises(ValueError, match="buffers="):
            client.push(job, delta)  # caught locally, nothing sent
        res = client.push(job, delta, num_samples=4, epochs=1.0, buffers=xb)
        assert res.status is Status.APPLIED and res.version == 1
        want_b = ((1 - ALPHA) * b0.double() + ALPHA * xb.double()).float()
        torch.testing.assert_close(server.strategy.global_buffers(), want_b, rtol=0, atol=1e-6)
        version, weights, buffers = client.get_model(include_buffers=True)
        assert version == 1 and torch.equal(buffers, server.strategy.global_buffers())
        assert torch.equal(weights, server.model())
        assert len(client.get_model()) == 2  # weights only unless asked
        _, _, old = client.get_model(0, include_buffers=True)
        assert torch.equal(old, b0)  # retained versions keep their own statistics
        assert torch.equal(client.get_job().buffers, server.strategy.global_buffers())


def test_sparse_update_carries_dense_buffers_in_the_same_stream(server: RunningServer) -> None:
    model = bn_model(2)
    with Client(server.address, "c1") as client:
        client.register(model)
        job = client.get_job()
        D = client.layout.numel
        delta = torch.zeros(D)
        delta[torch.randperm(D)[:5]] = torch.randn(5)  # 5% dense: COO
        xb = random_buffers(10, 4)
        before = server.model()
        res = client.push(job, delta, encoding="coo", buffers=xb)
        assert res.status is Status.APPLIED
        torch.testing.assert_close(server.model(), before + ALPHA * delta, rtol=0, atol=1e-6)
        want_b = ((1 - ALPHA) * job.buffers.double() + ALPHA * xb.double()).float()
        torch.testing.assert_close(server.strategy.global_buffers(), want_b, rtol=0, atol=1e-6)


def test_bad_buffers_are_refused_and_leave_the_state_identical(server: RunningServer) -> None:
    with Client(server.address, "c1") as client:
        client.register(bn_model(3))
        job = client.get_job()
        D = client.layout.numel
        good, xb = torch.randn(D), random_buffers(10, 5)
        nan_b, neg_var = xb.clone(), xb.clone()
        nan_b[2] = float("nan")
        neg_var[7] = -0.25
        cases = {
            "no buffers": ({"update": good}, "INVALID_ARGUMENT"),
            "short buffers": ({"update": good, "buffers": xb[:-1]}, "INVALID_ARGUMENT"),
            "NaN in buffers": ({"update": good, "buffers": nan_b}, "INVALID_ARGUMENT"),
            "negative running_var": ({"update": good, "buffers": neg_var}, "INVALID_ARGUMENT"),
            "unknown tensor": ({"update": good, "stats": xb}, "INVALID_ARGUMENT"),
        }
        before = server.state()
        for name, (tensors, code) in cases.items():
            result = raw_push(server.address, update_messages(client, job, tensors))
            assert isinstance(result, grpc.RpcError), f"{name}: accepted"
            assert result.code().name == code, f"{name}: {result.code()} {result.details()}"
            assert_same_state(before, server.state())
        ok = raw_push(server.address, update_messages(client, job, {"update": good, "buffers": xb}))
        assert not isinstance(ok, grpc.RpcError) and ok.outcome == pb.OUTCOME_APPLIED


def test_registrations_must_agree_on_the_buffers(server: RunningServer) -> None:
    model = bn_model(4)
    layout = ModelLayout.from_module(model)
    with Client(server.address, "c0") as client, pytest.raises(ValueError, match="initial_b"):
        client.register(layout=layout, initial=layout.flatten(model))
    # An empty server refuses an initial model without its statistics.
    messages = register_messages(layout, "raw", {"weights": layout.flatten(model)})
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.AggregationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(iter(messages), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert server.strategy is None
    with Client(server.address, "c1") as client:
        assert client.register(model).initial_model_adopted
    # Same trainable tensors (same hash) but BatchNorm without running statistics.
    other = bn_model(4, track=False)
    assert ModelLayout.from_module(other).hash == layout.hash
    with Client(server.address, "c2") as client, pytest.raises(grpc.RpcError) as err:
        client.register(other)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "float buffers" in err.value.details()
    assert "c2" not in server.federation.clients


def _fresh_bn_model() -> torch.nn.Module:
    return bn_model(int(torch.randint(0, 2**31 - 1, ()).item()))


def test_model_init_state_dict_is_classified_as_the_client_does(tmp_path) -> None:
    """`aggsrv serve --model-init` with a BatchNorm model's state dict: the running statistics
    are buffers (as Client.register lays the model out), so clients of that model register and
    the initial statistics are served with the initial weights."""
    model = _fresh_bn_model()
    path = tmp_path / "init.pt"
    torch.save(model.state_dict(), path)
    want = ModelLayout.from_module(model)
    srv = RunningServer(strategy="fedasync", model_init=str(path))
    try:
        assert srv.federation.layout.hash == want.hash
        with Client(srv.address, "c1") as client:
            resp = client.register(_fresh_bn_model())  # another init: its weights are not taken
            assert not resp.initial_model_adopted and resp.model_version == 0
            job = client.get_job()
            assert torch.equal(job.weights, want.flatten(model, dtype=torch.float32))
            assert torch.equal(job.buffers, want.flatten_buffers(model, dtype=torch.float32))
            version, weights, buffers = client.get_model(include_buffers=True)
            assert version == 0 and torch.equal(weights, job.weights)
            assert torch.equal(buffers, job.buffers)
    finally:
        srv.stop()


def test_model_init_file_keeps_what_a_state_dict_cannot_say(tmp_path) -> None:
    """A frozen parameter (a buffer for the client) and LayerNorm's norm flags survive in the
    file save_model_init writes; the server's layout is the client's in every field."""
    from aggsrv.client.model_init import save_model_init

    model = _fresh_bn_model()
    model[0].bias.requires_grad_(False)
    path = tmp_path / "init.pt"
    want = save_model_init(model, path)
    assert "0.bias" in want.buffer_names and bool(want.is_norm.any())
    srv = RunningServer(strategy="fedasync", model_init=str(path))
    try:
        got = srv.federation.layout
        assert got == want and torch.equal(got.is_norm, want.is_norm)
        with Client(srv.address, "c1") as client:
            frozen = _fresh_bn_model()
            frozen[0].bias.requires_grad_(False)
            client.register(frozen)
            job = client.get_job()
            assert torch.equal(job.buffers, want.flatten_buffers(model, dtype=torch.float32))
    finally:
        srv.stop()
