"""Differential privacy through a real server on loopback: the decoder's norm clips what the
float64 reference clips, epsilon reaches GetStatus, Prometheus and the status page, the budget
stops the federation with a clear status, and a resumed server (its log replayed) neither
resets epsilon nor draws other noise."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import RunningServer, scrape_metrics

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import durability as D
from aggsrv.strategies.dp_noise import NoiseKey, draw_values
from aggsrv.values import UpdateKind

dpa = pytest.importorskip("dp_accounting", reason="the dp extra (pip install 'aggsrv[dp]')")

LAYOUT = ModelLayout.from_named_shapes([("a.weight", (331, 3)), ("a.bias", (8,))])  # D = 1001
DIM = LAYOUT.numel


def _epsilon(z: float, releases: int, delta: float) -> float:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.GaussianDpEvent(z), releases)
    return acc.get_epsilon(delta)


def _clipped(delta: torch.Tensor, c: float) -> torch.Tensor:
    d = delta.double()
    return d * min(1.0, c / float(torch.linalg.vector_norm(d)))


def test_a_dp_fedbuff_server_clips_noises_and_accounts_over_grpc(tmp_path: Path) -> None:
    C, z, seed, delta = 0.5, 1.2, 77, 1e-5
    # dp_accountant pinned: epsilon is compared with dp-accounting's RDP below.
    keys = {"buffer_size": 2, "dp_clip_norm": C, "dp_noise_multiplier": z, "dp_seed": seed,
            "dp_insecure_seed": True, "dp_delta": delta, "dp_accountant": "rdp"}  # fmt: skip
    srv = RunningServer(strategy="fedbuff", strategy_config=keys, metrics_port=0,
                        dashboard_port=0, rate_limit_per_second=0.0)  # fmt: skip
    rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x0 = torch.randn(DIM, generator=rng)
    key = NoiseKey.insecure(seed)
    expect = x0.double()
    try:
        with Client(srv.address, "a") as a, Client(srv.address, "b") as b:
            a.register(layout=LAYOUT, initial=x0)
            b.register(layout=LAYOUT)
            for i in range(3):
                # DELTA from a (the decoder's norm), WEIGHTS from b (the strategy's).
                da = torch.randn(DIM, generator=rng) * (0.001 if i == 0 else 1.0)
                db = torch.randn(DIM, generator=rng) * 2.0
                a.push(a.get_job(), da, kind=UpdateKind.DELTA)
                job = b.get_job()
                b.push(job, job.weights + db, kind=UpdateKind.WEIGHTS)
                noise = torch.from_numpy(draw_values(key, 0, i, DIM, z * C))
                base = expect
                expect = base + (_clipped(da, C) + _clipped(db, C) + noise) / 2
            torch.testing.assert_close(srv.model().double(), expect, rtol=0, atol=5e-6)
            status = a.status()
        eps = _epsilon(z, 3, delta)
        assert status.HasField("privacy")
        p = status.privacy
        assert p.releases == 3 and p.epsilon == pytest.approx(eps, rel=1e-9)
        assert (p.clip_norm, p.noise_multiplier, p.delta) == (C, z, delta)
        assert not p.HasField("target_epsilon") and not p.budget_spent
        # Without authentication nobody is an admin: the clip count (it depends on the updates'
        # norms) is withheld from GetStatus (tests/server/test_privacy_channels.py), not from the
        # strategy.
        assert status.data_withheld and p.updates_clipped == 0
        assert srv.strategy.privacy.clipped == 5  # all but a's first, tiny update
        m = scrape_metrics(srv.server.metrics_port)
        assert m[("aggsrv_dp_epsilon", frozenset())] == pytest.approx(eps, rel=1e-9)
        assert m[("aggsrv_dp_releases", frozenset())] == 3
        url = f"http://127.0.0.1:{srv.server.dashboard_port}/api/status"
        with urllib.request.urlopen(url, timeout=10) as resp:
            page = json.load(resp)["privacy"]
        assert page["epsilon"] == pytest.approx(eps, rel=1e-9) and page["releases"] == 3
    finally:
        srv.stop()


def test_the_budget_stops_the_server_and_a_resumed_one_charges_what_it_republishes(
    tmp_path,
) -> None:
    """FedAsync (each update a release) with dp_target_epsilon between 3 and 4 releases: the
    4th push is refused FAILED_PRECONDITION naming the budget, GetJob too. A server resumed
    from its log (the later checkpoints removed) draws a fresh noise key, so the versions it
    republishes carry other noise than the ones published before the crash: its model differs,
    each replayed release is charged twice (epsilon of 6 releases), and it knows the budget is
    spent."""
    z, delta = 1.5, 1e-5
    three, four = float(_epsilon(z, 3, delta)), float(_epsilon(z, 4, delta))
    keys = {"dp_clip_norm": 1.0, "dp_noise_multiplier": z, "dp_target_epsilon": (three + four) / 2,
            "dp_accountant": "rdp"}  # fmt: skip
    settings = {"strategy": "fedasync", "strategy_config": keys, "durability": "on",
                "state_dir": str(tmp_path / "state"), "rate_limit_per_second": 0.0}  # fmt: skip
    srv = RunningServer(**settings)
    try:
        with Client(srv.address, "a") as a:
            a.register(layout=LAYOUT, initial=torch.randn(DIM))
            for _ in range(3):
                a.push(a.get_job(), torch.randn(DIM), kind=UpdateKind.DELTA)
            job = a.get_job()
            with pytest.raises(grpc.RpcError) as refused:
                a.push(job, torch.randn(DIM), kind=UpdateKind.DELTA)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "dp_target_epsilon" in refused.value.details()
            with pytest.raises(grpc.RpcError) as no_job:
                a.get_job()
            assert no_job.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "privacy budget is spent" in no_job.value.details()
            status = a.status()
        assert status.version == 3 and status.privacy.budget_spent
        assert status.privacy.epsilon == pytest.approx(three, rel=1e-9)
        live = srv.state()
    finally:
        srv.stop()
    state = Path(srv.config.state_dir)
    for _, path in D.list_checkpoints(state)[1:]:
        path.unlink()  # recovery replays the log from the first checkpoint
    resumed = RunningServer(**settings, resume=True)
    try:
        assert not torch.equal(resumed.model(), live["model"])
        assert resumed.strategy.version == 3
        privacy = resumed.strategy.privacy
        assert privacy.accountant.epsilon() == pytest.approx(_epsilon(z, 6, delta), rel=1e-9)
        assert privacy.accountant.releases == 3
        # The refusal changed no model state, but the log said the budget was spent: the
        # resumed server knows it before any client asks.
        assert privacy.exhausted
        with Client(resumed.address, "a") as a:
            a.register(layout=LAYOUT)
            with pytest.raises(grpc.RpcError) as no_job:
                a.get_job()
            assert no_job.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        resumed.stop()
    assert math.isfinite(three)


def test_client_side_clipping_over_grpc() -> None:
    """dp_clipping = "client": the job's recipe carries clip_norm over the wire, the client
    library clips (the update is accepted and the model moved by at most C), and an update a
    client sends unclipped is not refused (a refusal would reveal its norm) but clipped by the
    server, which tells that client alone (PushUpdateResponse.clipped)."""
    import dataclasses

    C = 0.3
    keys = {"buffer_size": 1, "dp_clip_norm": C, "dp_clipping": "client",
            "dp_noise_multiplier": 0.0}  # fmt: skip
    srv = RunningServer(strategy="fedbuff", strategy_config=keys, rate_limit_per_second=0.0)
    x0 = torch.randn(DIM)
    try:
        with Client(srv.address, "a") as a:
            a.register(layout=LAYOUT, initial=x0)
            job = a.get_job()
            assert job.recipe.clip_norm == C
            delta = torch.randn(DIM)
            a.push(job, job.weights + delta, kind=UpdateKind.WEIGHTS)
            torch.testing.assert_close(srv.model().double(), x0.double() + _clipped(delta, C),
                                       rtol=0, atol=2e-6)  # fmt: skip
            job = a.get_job()
            careless = dataclasses.replace(
                job, recipe=dataclasses.replace(job.recipe, clip_norm=None)
            )
            before = srv.model().double()
            unclipped = torch.randn(DIM) * 2
            answer = a.push(careless, unclipped, kind=UpdateKind.DELTA)
            assert answer.clipped and answer.version == 2 and srv.strategy.version == 2
            torch.testing.assert_close(srv.model().double(), before + _clipped(unclipped, C),
                                       rtol=0, atol=2e-6)  # fmt: skip
    finally:
        srv.stop()


def test_the_client_sends_dense_updates_under_client_side_clipping(monkeypatch) -> None:
    """A sparse upload's size tells how many of its values are zero: with the recipe's
    clip_norm set, encoding "auto" sends a mostly-zero delta dense; without DP it goes sparse."""
    import aggsrv.client.client as client_module

    used = []
    real = client_module.encode_sparse

    def spy(*args, **kwargs):
        used.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(client_module, "encode_sparse", spy)
    for keys, sparse in (({"buffer_size": 1}, True),
                         ({"buffer_size": 1, "dp_clip_norm": 5.0, "dp_clipping": "client"},
                          False)):  # fmt: skip
        used.clear()
        srv = RunningServer(strategy="fedbuff", strategy_config=keys, rate_limit_per_second=0.0)
        try:
            with Client(srv.address, "a") as a:
                a.register(layout=LAYOUT, initial=torch.randn(DIM))
                delta = torch.zeros(DIM)
                delta[::97] = 1e-3
                answer = a.push(a.get_job(), delta, kind=UpdateKind.DELTA)
                assert answer.version == 1
        finally:
            srv.stop()
        assert bool(used) is sparse


def test_recovery_decides_the_budget_as_the_live_server_did() -> None:
    """A sync round that its deadline would close is refused for the budget without a log
    record of its own (the timer's refusal is answered to nobody): the replay of the same calls
    must refuse it too, and publish no version the live server did not. The republished
    releases are then charged a second time (epsilon of twice the releases)."""
    from aggsrv.strategies import Update, make_strategy
    from aggsrv.strategies.privacy import PrivacyBudgetSpent

    layout = ModelLayout.from_named_shapes([("w", (5, 3)), ("b", (7,))])
    d, z = layout.numel, 3.0

    def make():
        keys = {"participation": 1.0, "round_timeout": 10.0, "min_clients": 1,
                "min_available": 2, "dp_clip_norm": 1.0, "dp_noise_multiplier": z,
                "dp_target_epsilon": 4.0, "dp_accountant": "rdp"}  # fmt: skip
        return make_strategy("fedavg", layout=layout, initial=torch.zeros(d), config=keys)

    live, calls = make(), []
    start = live.state_dict()
    for c in "ab":
        live.on_register(c, 0.0)
        calls.append(("register", c, 0.0))
    now = 0.0
    while not live.privacy.exhausted:
        job = live.job_for("a", now + 1)
        calls.append(("job", "a", now + 1))
        update = Update("a", job.job_id, job.base_version, f"a{job.job_id}", 1, 1.0,
                        UpdateKind.DELTA, torch.randn(d))  # fmt: skip
        try:
            live.on_update(update, now + 1)
        except PrivacyBudgetSpent:  # pragma: no cover - the timer refuses first here
            break
        calls.append(("update", update, now + 1))
        now = live.next_deadline()
        live.on_timer(now)
        calls.append(("timer", now, None))
    releases = live.privacy.accountant.releases
    assert live.privacy.exhausted and live.version == releases
    replay = make()
    replay.load_state_dict(start)
    replay.privacy.begin_recovery()
    for kind, a, b in calls:
        if kind == "register":
            replay.on_register(a, b)
        elif kind == "job":
            replay.job_for(a, b)
        elif kind == "update":
            replay.on_update(a, b)
        else:
            replay.on_timer(a)
    replay.privacy.end_recovery()
    assert replay.version == live.version and replay.privacy.exhausted
    assert replay.privacy.accountant.epsilon() == pytest.approx(
        _epsilon(z, 2 * releases, 1e-5), rel=1e-9
    )


def test_a_secretly_sampled_server_recovers_the_same_samples(tmp_path: Path) -> None:
    """Poisson sampling from an OS key: the key is in the first checkpoint (made when the model
    is adopted, before any round), so a server recovering from it samples what the log says."""
    keys = {"sampling": "poisson", "sampling_source": "os", "participation": 0.5,
            "round_timeout": 600.0, "min_available": 8, "late": "drop", "dp_clip_norm": 1.0,
            "dp_noise_multiplier": 1.0, "dp_accountant": "rdp"}  # fmt: skip
    settings = {"strategy": "fedavg", "rate_limit_per_second": 0.0, "durability": "on",
                "state_dir": str(tmp_path / "state"), "strategy_config": keys}  # fmt: skip
    srv = RunningServer(**settings)
    try:
        clients = [Client(srv.address, f"c{i}") for i in range(8)]
        clients[0].register(layout=LAYOUT, initial=torch.zeros(DIM))
        for c in clients[1:]:
            c.register(layout=LAYOUT)
        live = set(srv.strategy.participants)
        for c in clients:
            if c.client_id in live:
                c.push(c.get_job(), torch.randn(DIM), kind=UpdateKind.DELTA)
        for c in clients:
            c.close()
    finally:
        srv.stop()
    for _, path in D.list_checkpoints(Path(settings["state_dir"]))[1:]:
        path.unlink()  # recover from the checkpoint made at adoption
    resumed = RunningServer(**settings, resume=True)
    try:
        assert set(resumed.strategy.participants) == live
    finally:
        resumed.stop()
