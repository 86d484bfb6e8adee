"""FedAvg (sync rounds, k_async), FedAdam and FedProx against float64 hand traces."""

from __future__ import annotations

import pytest
import torch

from aggsrv.layout import ModelLayout
from aggsrv.strategies import (
    FedAvgConfig,
    Job,
    JobSuperseded,
    Outcome,
    Status,
    Strategy,
    Update,
    UpdateKind,
    make_strategy,
)

LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (4, 7)), ("fc.bias", (4,)), ("out.w", (5,))])
D = LAYOUT.numel  # 37


def build(gen: torch.Generator, name: str = "fedavg", **config: object) -> Strategy:
    return make_strategy(name, layout=LAYOUT, initial=torch.randn(D, generator=gen), config=config)


def report(
    s: Strategy,
    job: Job,
    gen: torch.Generator,
    now: float,
    n: int,
    work: float | None = None,
    kind: UpdateKind = UpdateKind.WEIGHTS,
) -> tuple[Outcome, torch.Tensor]:
    """Send a random result for ``job``; return the outcome and the client delta in float64."""
    w = job.weights + 0.1 * torch.randn(D, generator=gen)
    tensor = w.clone() if kind is UpdateKind.WEIGHTS else w - job.weights
    upd = Update(
        client_id=job.client_id,
        job_id=job.job_id,
        base_version=job.base_version,
        update_id=f"u{job.job_id}",
        num_samples=n,
        work_done=job.recipe.work_target if work is None else work,
        kind=kind,
        tensor=tensor,
    )
    return s.on_update(upd, now), w.double() - job.weights.double()


def mean_delta(parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    total = sum(n for n, _ in parts)
    return sum(n * d for n, d in parts) / total


def close(model: torch.Tensor, trace: torch.Tensor) -> None:
    torch.testing.assert_close(model.double(), trace, rtol=1e-5, atol=2e-6)


def test_config_validation() -> None:
    for bad in (
        {"participation": 0},
        {"participation": 1.5},
        {"participation": True},
        {"mode": "async"},
        {"late": "keep"},
        {"partial_work": "half"},
        {"server_opt": "yogi"},
        {"min_clients": 0},
        {"round_timeout": 0.0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FedAvgConfig.from_dict(bad)
    assert FedAvgConfig().effective_server_lr == 1.0
    assert FedAvgConfig(server_opt="adam").effective_server_lr == 0.01


@pytest.mark.parametrize("participation,expected", [(0.6, 3), (2, 2), (1.0, 5)])
def test_sync_round_with_sampled_participation(
    participation: float, expected: int, gen: torch.Generator
) -> None:
    seed = int(torch.randint(0, 1000, (1,), generator=gen))
    s = build(gen, participation=participation, min_available=5, round_timeout=30.0, seed=seed)
    x = s.global_model().double()
    clients = [f"c{i}" for i in range(5)]
    for c in clients[:4]:
        s.on_register(c, 0.0)
        assert s.job_for(c, 0.0) is None  # fewer than min_available registered: no round yet
    assert s.next_deadline() is None
    s.on_register("c4", 5.0)
    picked = s.participants
    assert len(picked) == expected and set(picked) <= set(clients)
    assert s.next_deadline() == 35.0
    twin = make_strategy(
        "fedavg", layout=LAYOUT, initial=torch.zeros(D), config=dict(s.config.to_dict())
    )
    for c in clients:
        twin.on_register(c, 5.0)
    assert twin.participants == picked  # same seed, same sample
    jobs = {}
    for c in clients:
        job = s.job_for(c, 6.0)
        assert (job is not None) == (c in picked)
        if job is not None:
            assert job.deadline == 35.0 and job.base_version == 0
            jobs[c] = job
    parts = []
    for i, c in enumerate(picked):
        n = 3 + 4 * i
        out, delta = report(s, jobs[c], gen, 7.0 + i, n)
        parts.append((n, delta))
        last = i == len(picked) - 1
        assert out == (Outcome(Status.APPLIED, 1) if last else Outcome(Status.BUFFERED, 0))
        if not last:
            assert s.job_for(c, 7.0) is None  # reported: nothing until the next round
    # With every client starting from x, the mean delta step is the sample-weighted mean.
    ws = [(n, x + d) for n, d in parts]
    close(s.global_model(), sum(n * w for n, w in ws) / sum(n for n, _ in ws))
    assert len(s.participants) == expected and s.next_deadline() == 6.0 + len(picked) + 30.0


def test_deadline_closes_with_min_clients_else_extends(gen: torch.Generator) -> None:
    s = build(gen, min_clients=2, min_available=4, round_timeout=10.0)
    x = s.global_model().double()
    for c in "abcd":
        s.on_register(c, 0.0)
    jobs = {c: s.job_for(c, 1.0) for c in "abcd"}
    out, da = report(s, jobs["a"], gen, 2.0, 5)
    assert out == Outcome(Status.BUFFERED, 0)
    s.on_timer(9.0)  # before the deadline: nothing
    assert s.next_deadline() == 10.0
    s.on_timer(10.0)  # one update < min_clients: extend
    assert s.version == 0 and s.next_deadline() == 20.0
    out, dc = report(s, jobs["c"], gen, 12.0, 7)
    assert out == Outcome(Status.BUFFERED, 0)
    s.on_timer(20.5)
    assert s.version == 1
    close(s.global_model(), x + mean_delta([(5, da), (7, dc)]))
    assert s.next_deadline() == 30.5 and len(s.participants) == 4  # the next round is open


@pytest.mark.parametrize("policy", ["drop", "include"])
def test_partial_work_dropped_or_included(policy: str, gen: torch.Generator) -> None:
    s = build(gen, min_available=3, partial_work=policy, local_epochs=2.0)
    x = s.global_model().double()
    for c in "abc":
        s.on_register(c, 0.0)
    jobs = {c: s.job_for(c, 0.0) for c in "abc"}
    _, da = report(s, jobs["a"], gen, 1.0, 4)
    out, db = report(s, jobs["b"], gen, 2.0, 6, work=1.5)  # 1.5 of 2 epochs
    assert out == Outcome(Status.BUFFERED, 0)
    out, dc = report(s, jobs["c"], gen, 3.0, 8)
    assert out == Outcome(Status.APPLIED, 1)  # every sampled client reported
    parts = [(4, da), (8, dc)] + ([(6, db)] if policy == "include" else [])
    close(s.global_model(), x + mean_delta(parts))


@pytest.mark.parametrize("late", ["drop", "next_round"])
def test_late_updates_dropped_or_carried(late: str, gen: torch.Generator) -> None:
    s = build(gen, min_available=3, late=late, round_timeout=10.0, server_lr=0.8)
    x0 = s.global_model().double()
    for c in "abc":
        s.on_register(c, 0.0)
    jobs = {c: s.job_for(c, 0.0) for c in "abc"}
    _, da = report(s, jobs["a"], gen, 1.0, 4)
    _, db = report(s, jobs["b"], gen, 2.0, 6)
    s.on_timer(10.0)  # c is late
    x1 = x0 + 0.8 * mean_delta([(4, da), (6, db)])
    close(s.global_model(), x1)
    assert s.version == 1
    if late == "drop":
        before = s.state_dict()
        with pytest.raises(JobSuperseded, match="no longer open"):
            report(s, jobs["c"], gen, 11.0, 9)
        assert s.state_dict()["version"] == before["version"] == 1
        return
    out, dc_late = report(s, jobs["c"], gen, 11.0, 9)  # staleness 1, counted in round 2
    assert out == Outcome(Status.BUFFERED, 1)
    assert s.job_for("c", 11.0) is not None  # c still owes round 2 its own update
    parts = [(9, dc_late)]
    for i, c in enumerate("abc"):
        out, d = report(s, s.job_for(c, 12.0), gen, 12.0 + i, 2 + i)
        parts.append((2 + i, d))
    assert out == Outcome(Status.APPLIED, 2)
    close(s.global_model(), x1 + 0.8 * mean_delta(parts))


def test_k_async_aggregates_every_k_arrivals(gen: torch.Generator) -> None:
    s = build(gen, mode="k_async", k=3, partial_work="drop")
    x = s.global_model().double()
    clients = [f"c{i}" for i in range(5)]
    for c in clients:
        s.on_register(c, 0.0)
        assert s.next_deadline() is None
    jobs = {c: s.job_for(c, 0.0) for c in clients}
    assert all(j.deadline is None for j in jobs.values())
    parts = []
    arrivals = ["c0", "c1", "c2", "c3", "c4", "c0", "c1"]
    for i, c in enumerate(arrivals):
        work = 0.5 if c == "c4" else None  # c4's partial work does not count towards k
        out, d = report(s, jobs[c], gen, float(i), 1 + i, work=work)
        if work is None:
            parts.append((1 + i, d))
        if len(parts) == 3:
            x = x + mean_delta(parts)
            parts = []
            assert out == Outcome(Status.APPLIED, s.version)
        else:
            assert out == Outcome(Status.BUFFERED, s.version)
        close(s.global_model(), x)
        jobs[c] = s.job_for(c, float(i))
    assert s.version == 2


def test_fedadam_first_two_steps(gen: torch.Generator) -> None:
    b1, b2, tau, lr = 0.9, 0.99, 1e-3, 0.05
    s = build(gen, min_available=2, server_opt="adam", server_lr=lr, beta1=b1, beta2=b2, tau=tau)
    x = s.global_model().double()
    m = torch.zeros(D, dtype=torch.float64)
    v = torch.full((D,), tau**2, dtype=torch.float64)
    for c in "ab":
        s.on_register(c, 0.0)
    for rnd in range(2):
        parts = []
        for i, c in enumerate("ab"):
            kind = UpdateKind.DELTA if (rnd + i) % 2 else UpdateKind.WEIGHTS
            out, d = report(s, s.job_for(c, 0.0), gen, 1.0, 3 + 5 * i, kind=kind)
            parts.append((3 + 5 * i, d))
        assert out == Outcome(Status.APPLIED, rnd + 1)
        d = mean_delta(parts)
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d
        x = x + lr * m / (v.sqrt() + tau)
        close(s.global_model(), x)


def test_fedprox_is_fedavg_with_the_proximal_recipe(gen: torch.Generator) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    initial = torch.randn(D, generator=gen)
    models = []
    for name in ("fedprox", "fedavg"):
        g = torch.Generator().manual_seed(seed)
        cfg = {"min_available": 3, "partial_work": "include"}
        if name == "fedprox":
            cfg = {"min_available": 3, "mu": 0.25}  # includes partial work by default
        s = make_strategy(name, layout=LAYOUT, initial=initial, config=cfg)
        for c in "abc":
            s.on_register(c, 0.0)
        for c in "abc":
            job = s.job_for(c, 0.0)
            assert job.recipe.proximal_mu == (0.25 if name == "fedprox" else 0.0)
            report(s, job, g, 1.0, 5, work=0.5 if c == "b" else None)
        assert s.version == 1
        models.append(s.global_model())
    assert torch.equal(models[0], models[1])
