"""docs/wire.md's statements a client in another language relies on, recomputed from the code:
the baselines' arithmetic (each worked example against the real strategy, each stated default
against the strategy's config), who is in a synchronous round (a strategy and a real server),
which chunk size Register's chunks may use, and the token expiry allowance."""

from __future__ import annotations

import math
import re
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import register_messages

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server.auth import AuthError, HmacAuthenticator, issue_token, new_secret
from aggsrv.server.config import ServerConfig
from aggsrv.strategies import Status, Strategy, Update, UpdateKind, make_strategy
from aggsrv.strategies.fedasync import FedAsyncConfig
from aggsrv.strategies.fedavg import FedAvgConfig
from aggsrv.strategies.fedbuff import FedBuffConfig
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "wire.md").read_text()
FLAT = " ".join(DOC.split())  # the doc with its line breaks as spaces, for phrases
LAYOUT = ModelLayout.from_named_shapes([("w", (2,))])
CALL_S = 20.0


def documented(label: str) -> list[float]:
    """The result ``x'`` of the doc's example line ``<label>: x' = [a, b]``."""
    found = re.findall(rf"^{re.escape(label)}: x' = \[([^\]]*)\]", DOC, flags=re.M)
    assert len(found) == 1, f"docs/wire.md has {len(found)} example lines {label!r}"
    return [float(v) for v in found[0].split(",")]


def build(name: str, initial: list[float], **config: object) -> Strategy:
    return make_strategy(name, layout=LAYOUT, initial=torch.tensor(initial), config=config)


def push(s: Strategy, client: str, values: list[float], kind: UpdateKind, n: int = 1, now=0.0):
    job = s.job_for(client, now)
    assert job is not None, client
    update = Update(
        client_id=client,
        job_id=job.job_id,
        base_version=job.base_version,
        update_id=f"{client}-{job.job_id}",
        num_samples=n,
        work_done=job.recipe.work_target,
        kind=kind,
        tensor=torch.tensor(values, dtype=torch.float32),
    )
    return s.on_update(update, now)


def assert_model(s: Strategy, label: str) -> None:
    expected = torch.tensor(documented(label), dtype=torch.float64)
    torch.testing.assert_close(s.global_model().double(), expected, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- arithmetic


def test_fedasync_example() -> None:
    """alpha_s = alpha (s + 1)^-a; a DELTA's client model is the job's weights plus the delta."""
    s = build("fedasync", [0.5, 0.5], alpha=0.6, a=0.5)
    for c in ("a", "b"):
        s.on_register(c, 0.0)
    job = s.job_for("a", 0.0)  # issued at version 0, x_base = [0.5, 0.5]
    assert job.base_version == 0
    # b moves the model to [1.0, -2.0] at version 3: two updates equal to x, then one solved for.
    for _ in range(2):
        assert push(s, "b", [0.5, 0.5], UpdateKind.WEIGHTS).status is Status.APPLIED
    target = torch.tensor([1.0, -2.0], dtype=torch.float64)
    u = ((target - 0.4 * s.global_model().double()) / 0.6).tolist()
    push(s, "b", u, UpdateKind.WEIGHTS)
    torch.testing.assert_close(s.global_model().double(), target, rtol=0, atol=1e-6)
    assert s.version == 3 and s.mixing_weight(3) == pytest.approx(0.3)
    update = Update("a", job.job_id, 0, "a-1", 1, 1.0, UpdateKind.DELTA, torch.tensor([0.5, -1.0]))
    outcome = s.on_update(update, 0.0)
    assert (outcome.status, outcome.version) == (Status.APPLIED, 4)
    assert_model(s, "fedasync")


@pytest.mark.parametrize(("server_lr", "label"), [(1.0, "1.0"), (0.5, "0.5")])
def test_fedavg_example(server_lr: float, label: str) -> None:
    s = build("fedavg", [1.0, 2.0], server_lr=server_lr, min_available=2)
    for c in ("a", "b"):
        s.on_register(c, 0.0)
    assert set(s.participants) == {"a", "b"}  # both registered before round 0 opened
    first = push(s, "a", [0.4, -0.8], UpdateKind.DELTA, n=100)
    assert (first.status, first.version) == (Status.BUFFERED, 0)
    # WEIGHTS give the same delta: u - x_base.
    last = push(s, "b", [1.8, 2.4], UpdateKind.WEIGHTS, n=300)
    assert (last.status, last.version) == (Status.APPLIED, 1)
    assert_model(s, f"fedavg (server_lr = {label})")


def test_fedadam_example() -> None:
    s = build("fedavg", [1.0, 2.0], server_opt="adam", min_available=2)
    for c in ("a", "b"):
        s.on_register(c, 0.0)
    push(s, "a", [0.4, -0.8], UpdateKind.DELTA, n=100)
    push(s, "b", [0.8, 0.4], UpdateKind.DELTA, n=300)
    assert_model(s, "fedadam")
    # The moments the doc names, in float64 from the equations.
    d = torch.tensor([0.7, 0.1], dtype=torch.float64)
    torch.testing.assert_close(s._m.double(), 0.1 * d, rtol=1e-6, atol=0)
    torch.testing.assert_close(s._v.double(), 0.99e-6 + 0.01 * d * d, rtol=1e-6, atol=0)
    assert "m' = [0.07, 0.01], v' = [0.00490099, 0.00010099]" in FLAT


def test_fedbuff_example() -> None:
    s = build("fedbuff", [1.0, 2.0], buffer_size=2)
    for c in ("a", "b"):
        s.on_register(c, 0.0)
    first = push(s, "a", [0.4, -0.8], UpdateKind.DELTA)
    assert (first.status, first.version) == (Status.BUFFERED, 0)
    last = push(s, "b", [0.8, 0.4], UpdateKind.DELTA)
    assert (last.status, last.version) == (Status.APPLIED, 1)
    assert_model(s, "fedbuff")


def test_fedbuff_divides_by_m_and_weights_stale_deltas() -> None:
    """x' = x + lr sum w_i delta_i / M with w = 1/sqrt(1 + s): a stale delta moves x less."""
    s = build("fedbuff", [1.0, 2.0], buffer_size=2, staleness_weighting=True, server_lr=2.0)
    for c in ("a", "b", "c"):
        s.on_register(c, 0.0)
    stale = s.job_for("a", 0.0)
    push(s, "b", [0.0, 0.0], UpdateKind.DELTA)
    push(s, "c", [0.0, 0.0], UpdateKind.DELTA)  # version 1; a's job is now 1 version old
    push(s, "b", [0.8, 0.4], UpdateKind.DELTA)  # fresh (s = 0), w = 1
    x = s.global_model().double().clone()
    delta = torch.tensor([0.4, -0.8])
    update = Update("a", stale.job_id, 0, "a-1", 1, 1.0, UpdateKind.DELTA, delta)
    assert s.on_update(update, 0.0).status is Status.APPLIED
    w = 1 / math.sqrt(2)
    expected = x + 2.0 * (torch.tensor([0.8, 0.4]).double() + w * delta.double()) / 2
    torch.testing.assert_close(s.global_model().double(), expected, rtol=0, atol=1e-6)


def test_the_documented_defaults_are_the_strategies() -> None:
    fa, avg, buf = FedAsyncConfig(), FedAvgConfig(), FedBuffConfig()
    adam = FedAvgConfig(server_opt="adam")
    phrases = [
        f"defaults: alpha = {fa.alpha:g}, a = {fa.a:g}, hinge_a = {fa.hinge_a:g}, "
        f"hinge_b = {fa.hinge_b}",
        f'staleness = "{fa.staleness}" (default)',
        f'server_opt = "{avg.server_opt}" (default)',
        f"defaults: server_lr = {avg.effective_server_lr:.1f} (then",
        f'mode = "{avg.mode}", k = {avg.k}',
        f"defaults: server_lr = {adam.effective_server_lr:g} (with adam), beta1 = "
        f"{adam.beta1:g}, beta2 = {adam.beta2:g}, tau = {adam.tau:g}",
        f"defaults: buffer_size M = {buf.buffer_size}, server_lr = {buf.server_lr:.1f}, "
        f"staleness_weighting = {str(buf.staleness_weighting).lower()}",
        f"`round_timeout` ({avg.round_timeout:g} s by default)",
        "`max(min_clients, min_available)` (both "
        f"{avg.min_clients if avg.min_clients == avg.min_available else '?'} by default)",
        f"at least every {ServerConfig().pending_interval_seconds:g} s "
        "(`pending_interval_seconds`)",
    ]
    for phrase in phrases:
        assert phrase in FLAT, phrase
    # The FedAsync example's alpha_s.
    assert FedAsyncConfig(alpha=0.6, a=0.5).alpha * 4**-0.5 == pytest.approx(0.3)


# ----------------------------------------------------------------------------- sync rounds


def test_a_sync_round_holds_the_clients_registered_when_it_opened() -> None:
    s = build("fedavg", [1.0, 2.0])  # the defaults: participation 1.0, min_clients 1
    s.on_register("a", 0.0)  # round 0 opens here, with a alone
    assert s.participants == ("a",)
    s.on_register("b", 0.1)  # a moment later: not in round 0
    assert s.job_for("b", 0.1) is None and s.participants == ("a",)
    job = s.job_for("a", 0.2)
    assert job.deadline == pytest.approx(0.0 + FedAvgConfig().round_timeout)
    # The deadline passes without an update: the round stays open, its deadline moves on.
    s.on_timer(job.deadline)
    assert s.participants == ("a",) and s.version == 0 and s.job_for("b", 61.0) is None
    assert s.next_deadline() == pytest.approx(job.deadline + FedAvgConfig().round_timeout)
    # a pushes: round 0 closes at once and round 1 opens with both.
    assert push(s, "a", [0.1, 0.1], UpdateKind.DELTA, now=70.0).status is Status.APPLIED
    assert set(s.participants) == {"a", "b"} and s.job_for("b", 70.0) is not None


def test_min_available_makes_round_0_wait_for_the_group() -> None:
    s = build("fedavg", [1.0, 2.0], min_available=2)
    s.on_register("a", 0.0)
    assert s.job_for("a", 0.0) is None and s.participants == ()
    s.on_register("b", 5.0)
    assert set(s.participants) == {"a", "b"}


def test_a_client_outside_the_round_waits_on_its_open_stream(servers) -> None:
    """Over gRPC: b's GetJob gets pending messages, then its job on the same stream once a's
    push closed round 0."""
    srv = servers(strategy="fedavg", pending_interval_seconds=0.2)
    model = torch.nn.Linear(3, 2)
    messages: list = []
    with Client(srv.address, "a") as a:
        a.register(model)
        job_a = a.get_job()
        with Client(srv.address, "b") as b:
            b.register(model)
        layout = ModelLayout.from_module(model)

        def listen() -> None:
            with grpc.insecure_channel(srv.address) as channel:
                stub = pb_grpc.AggregationStub(channel)
                request = pb.GetJobRequest(client_id="b", layout_hash=layout.hash)
                messages.extend(stub.GetJob(request, timeout=CALL_S))

        listener = threading.Thread(target=listen)
        listener.start()
        deadline = time.monotonic() + CALL_S
        while sum(m.WhichOneof("kind") == "pending" for m in messages) < 2:
            assert time.monotonic() < deadline and listener.is_alive()
            time.sleep(0.05)
        delta = torch.zeros(layout.numel)
        result = a.push(job_a, delta, kind=UpdateKind.DELTA, num_samples=10, epochs=1.0)
        assert result.version == 1
        listener.join(CALL_S)
    kinds = [m.WhichOneof("kind") for m in messages]
    assert kinds[:2] == ["pending", "pending"] and "header" in kinds and kinds[-1] == "trailer"
    header = next(m.header for m in messages if m.WhichOneof("kind") == "header")
    assert header.base_version == 1


# ----------------------------------------------------------------------------- Register chunks


def test_register_chunks_are_bounded_by_the_servers_chunk_size_not_the_negotiated_one(
    servers,
) -> None:
    """Register's chunks may be as large as GetStatus's limits.chunk_bytes, even when the
    receive limit the client states in the same header negotiates a smaller chunk_bytes."""
    server_chunk = 2048
    srv = servers(strategy="fedasync", chunk_bytes=server_chunk)
    layout = ModelLayout.from_named_shapes([("w", (1024,))])
    weights = {"weights": torch.arange(1024, dtype=torch.float32)}
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.AggregationStub(channel)
        limits = stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_S).limits
        assert limits.chunk_bytes == server_chunk
        over = register_messages(layout, "c1", weights, chunk_bytes=server_chunk + 4)
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(iter(over), timeout=CALL_S)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert srv.federation.strategy is None
        msgs = register_messages(layout, "c1", weights, chunk_bytes=server_chunk)
        msgs[0].header.capabilities.max_receive_message_bytes = 1024  # negotiates 960
        assert max(len(m.chunk.data) for m in msgs[1:-1]) == server_chunk
        response = stub.Register(iter(msgs), timeout=CALL_S)
    assert response.initial_model_adopted and response.limits.chunk_bytes == 960
    assert torch.equal(srv.model(), weights["weights"])


# ----------------------------------------------------------------------------- token expiry


def test_token_expiry_allowance_is_as_documented() -> None:
    (allowance,) = {int(v) for v in re.findall(r"`exp >= now - (\d+)`", DOC)}
    assert f"a fixed allowance of {allowance} s" in FLAT

    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    secret = new_secret()
    auth = HmacAuthenticator(secret, clock=clock)  # the server's: default leeway
    token = issue_token(secret, "c1", ttl_seconds=60.5, now=1000.0)  # exp = int(1060.5) = 1060
    for now in (1060.0, 1060.0 + allowance):
        clock.now = now
        assert auth.authenticate(token).expires == 1060.0
    clock.now = 1060.0 + allowance + 1e-3
    with pytest.raises(AuthError, match="token expired"):
        auth.authenticate(token)
    # No allowance the other way: a token issued an hour in the server's future is accepted.
    clock.now = 1000.0
    ahead = issue_token(secret, "c1", ttl_seconds=60, now=1000.0 + 3600)
    assert auth.authenticate(ahead).subject == "c1"
