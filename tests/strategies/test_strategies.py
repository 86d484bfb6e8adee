"""Strategy protocol, registry, ledger, FedAsync and FedBuff against float64 hand traces."""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import pytest
import torch
from state_helpers import assert_same_state

from aggsrv.layout import ModelLayout
from aggsrv.strategies import (
    RESERVED,
    STRATEGIES,
    FedAsyncConfig,
    InvalidUpdate,
    Job,
    JobSuperseded,
    NotRegistered,
    Outcome,
    Recipe,
    Status,
    Strategy,
    TooManyClients,
    TooStale,
    Update,
    UpdateKind,
    UpdateLedger,
    make_strategy,
)
from aggsrv.strategies.buffers import Lease
from aggsrv.strategies.fedasync import staleness_weight

LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (4, 7)), ("fc.bias", (4,)), ("out.w", (5,))])
D = LAYOUT.numel  # 37


def build(name: str, gen: torch.Generator, **config: Any) -> Strategy:
    initial = torch.randn(D, generator=gen)
    return make_strategy(name, layout=LAYOUT, initial=initial, config=config)


def result_of(job: Job, gen: torch.Generator, scale: float = 0.1) -> torch.Tensor:
    """A client's final weights for a job: its start weights plus a random step (float32)."""
    return job.weights + scale * torch.randn(D, generator=gen)


def make_update(
    job: Job,
    weights: torch.Tensor,
    kind: UpdateKind = UpdateKind.WEIGHTS,
    uid: str | None = None,
    num_samples: int = 10,
    work_done: float | None = None,
) -> Update:
    tensor = weights.clone() if kind is UpdateKind.WEIGHTS else weights - job.weights
    return Update(
        client_id=job.client_id,
        job_id=job.job_id,
        base_version=job.base_version,
        update_id=uid or f"{job.client_id}-{job.job_id}",
        num_samples=num_samples,
        work_done=job.recipe.work_target if work_done is None else work_done,
        kind=kind,
        tensor=tensor,
    )


def close(model: torch.Tensor, trace: torch.Tensor) -> None:
    torch.testing.assert_close(model.double(), trace, rtol=1e-5, atol=2e-6)


# ------------------------------------------------------------------------------ registry, config


def test_registry_builds_each_strategy_and_names_reserved_issues(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    baselines = {"fedavg", "fedasync", "fedbuff", "fedprox"}
    seeds = {"fedogd", "feden", "orthofl", "fedhist", "feddgic"}
    cheap = {"mifa", "ca2fl", "twafl", "fedfg"}
    assert set(STRATEGIES) >= baselines | seeds | cheap
    assert not set(STRATEGIES) & set(RESERVED)
    for name in sorted(STRATEGIES):
        s = build(name, gen)
        assert s.name == name and s.version == 0 and s.global_model().shape == (D,)
    monkeypatch.setitem(RESERVED, "fedzzz", "the issue after next")
    with pytest.raises(NotImplementedError, match="fedzzz arrives with the issue after next"):
        build("fedzzz", gen)
    for name in RESERVED:
        with pytest.raises(NotImplementedError, match=name):
            build(name, gen)
    with pytest.raises(ValueError, match="unknown strategy 'fedfoo'"):
        build("fedfoo", gen)


def test_config_rejects_unknown_keys_and_bad_values(gen: torch.Generator) -> None:
    with pytest.raises(ValueError, match="'alhpa'"):
        FedAsyncConfig.from_dict({"alhpa": 0.5})
    with pytest.raises(ValueError, match="'bufer_size'"):
        build("fedbuff", gen, bufer_size=3)
    with pytest.raises(ValueError, match="staleness"):
        build("fedasync", gen, staleness="exponential")
    with pytest.raises(ValueError, match="local_epochs or local_steps"):
        build("fedasync", gen, local_epochs=2.0, local_steps=5)
    cfg = FedAsyncConfig.from_dict({"alpha": 0.3, "staleness": "hinge"})
    assert (cfg.alpha, cfg.staleness, cfg.a) == (0.3, "hinge", 0.5)


def test_recipes_carry_the_config(gen: torch.Generator) -> None:
    s = build("fedasync", gen, learning_rate=0.05, local_steps=20, batch_size=8)
    s.on_register("a", 0.0)
    r = s.job_for("a", 0.0).recipe
    assert (r.learning_rate, r.local_steps, r.local_epochs, r.batch_size) == (0.05, 20, None, 8)
    assert r.work_target == 20.0 and r.proximal_mu == 0.0
    p = build("fedprox", gen, mu=0.3, mode="k_async")
    p.on_register("a", 0.0)
    pr = p.job_for("a", 0.0).recipe
    assert pr.proximal_mu == 0.3 and pr.local_epochs == 1.0 and pr.work_target == 1.0
    with pytest.raises(ValueError, match="exactly one"):
        Recipe(local_epochs=1.0, local_steps=3)
    rec = Recipe(extra={"beta": 2})
    with pytest.raises(TypeError):
        rec.extra["beta"] = 3.0  # type: ignore[index]
    assert Recipe.from_dict(rec.to_dict()) == rec


def test_max_clients_and_unregistered_clients(gen: torch.Generator) -> None:
    s = make_strategy(
        "fedasync", layout=LAYOUT, initial=torch.randn(D, generator=gen), max_clients=2
    )
    s.on_register("a", 0.0)
    s.on_register("b", 0.0)
    s.on_register("a", 1.0)  # again: a no-op
    with pytest.raises(TooManyClients, match="max_clients=2"):
        s.on_register("c", 0.0)
    with pytest.raises(NotRegistered, match="'c'"):
        s.job_for("c", 0.0)
    assert NotRegistered.code == "NOT_FOUND" and TooStale.code == "ABORTED"
    assert JobSuperseded.code == "ABORTED" and InvalidUpdate.code == "INVALID_ARGUMENT"


# ------------------------------------------------------------------------------ ledger


def test_update_ledger_keeps_the_last_ids_per_client() -> None:
    ledger = UpdateLedger(size=3)
    for i in range(5):
        ledger.record("a", f"u{i}", Outcome(Status.BUFFERED, i))
    ledger.record("b", "u0", Outcome(Status.APPLIED, 7))
    assert ledger.lookup("a", "u0") is None and ledger.lookup("a", "u1") is None
    assert ledger.lookup("a", "u4") == Outcome(Status.BUFFERED, 4)
    assert ledger.lookup("b", "u0") == Outcome(Status.APPLIED, 7)
    assert ledger.lookup("c", "u0") is None and len(ledger) == 4
    other = UpdateLedger()
    other.load_state_dict(ledger.state_dict())
    assert other.state_dict() == ledger.state_dict() and other.size == 3
    assert UpdateLedger().size == 1024


@pytest.mark.parametrize("name", ["fedasync", "fedbuff", "fedavg"])
def test_replayed_update_id_is_applied_once(name: str, gen: torch.Generator) -> None:
    s = build(name, gen, **({"buffer_size": 2} if name == "fedbuff" else {}))
    s.on_register("a", 0.0)
    s.on_register("b", 0.0)
    job = s.job_for("a", 0.0)
    upd = make_update(job, result_of(job, gen), uid="same")
    first = s.on_update(upd, 1.0)
    assert first.status in (Status.APPLIED, Status.BUFFERED)
    before = copy.deepcopy(s.state_dict())
    again = s.on_update(upd, 2.0)
    assert again == Outcome(Status.DUPLICATE, first.version, original=first.status)
    assert s.ledger.lookup("a", "same") == first
    assert_same_state(s.state_dict(), before)
    # The ledger survives a checkpoint: a replay after resuming is still a duplicate.
    fresh = build(name, gen, **({"buffer_size": 2} if name == "fedbuff" else {}))
    fresh.load_state_dict(s.state_dict())
    assert fresh.on_update(upd, 3.0).status is Status.DUPLICATE


# ------------------------------------------------------------------------------ FedAsync


def test_staleness_functions() -> None:
    assert staleness_weight(7, "constant") == 1.0
    assert staleness_weight(0, "polynomial", a=0.5) == 1.0
    assert staleness_weight(3, "polynomial", a=0.5) == pytest.approx(0.5)
    assert staleness_weight(4, "hinge", hinge_a=10, hinge_b=4) == 1.0
    assert staleness_weight(6, "hinge", hinge_a=10, hinge_b=4) == pytest.approx(1 / 21)


@pytest.mark.parametrize("staleness", ["constant", "polynomial", "hinge"])
@pytest.mark.parametrize("kind", [UpdateKind.WEIGHTS, UpdateKind.DELTA])
def test_fedasync_mixes_with_staleness_from_versions(
    staleness: str, kind: UpdateKind, gen: torch.Generator
) -> None:
    alpha, a, ha, hb = 0.6, 0.7, 2.0, 1
    s = build("fedasync", gen, alpha=alpha, staleness=staleness, a=a, hinge_a=ha, hinge_b=hb)
    x = s.global_model().double()
    clients = [f"c{i}" for i in range(5)]
    for c in clients:
        s.on_register(c, 0.0)
    jobs = {c: s.job_for(c, 0.0) for c in clients}  # all start from version 0
    # Client c2 then restarts from version 2, arriving at version 4: staleness 2 again.
    order = ["c0", "c1", "c2", "c3", "c4"]
    for step, c in enumerate(order):
        job = jobs[c]
        assert job.base_version == 0
        w = result_of(job, gen)
        sval = step  # version at arrival (step) minus base 0
        f = {"constant": 1.0, "polynomial": (sval + 1) ** -a}.get(staleness)
        if f is None:
            f = 1.0 if sval <= hb else 1.0 / (ha * (sval - hb) + 1.0)
        if kind is UpdateKind.WEIGHTS:
            client = w.double()
        else:
            client = job.weights.double() + (w - job.weights).double()
        x = (1 - alpha * f) * x + alpha * f * client
        out = s.on_update(make_update(job, w, kind), float(step))
        assert out == Outcome(Status.APPLIED, step + 1)
        close(s.global_model(), x)
    assert s.version == 5
    # A job taken at version 5 and returned at version 5 has staleness 0: full alpha.
    job = s.job_for("c0", 9.0)
    w = result_of(job, gen)
    x = (1 - alpha) * x + alpha * w.double()
    s.on_update(make_update(job, w, kind), 10.0)
    close(s.global_model(), x)


def test_fedasync_max_staleness_refuses_and_changes_nothing(gen: torch.Generator) -> None:
    s = build("fedasync", gen, max_staleness=1)
    for c in "abc":
        s.on_register(c, 0.0)
    jobs = {c: s.job_for(c, 0.0) for c in "abc"}
    s.on_update(make_update(jobs["a"], result_of(jobs["a"], gen)), 1.0)  # v1
    s.on_update(make_update(jobs["b"], result_of(jobs["b"], gen)), 1.0)  # s=1 ok, v2
    before = copy.deepcopy(s.state_dict())
    model = s.global_model()
    with pytest.raises(TooStale, match="2 versions behind.*max_staleness=1"):
        s.on_update(make_update(jobs["c"], result_of(jobs["c"], gen)), 2.0)
    assert_same_state(s.state_dict(), before)
    assert s.global_model() is model
    # The client asks again and gets a fresh job from version 2.
    assert s.job_for("c", 3.0).base_version == 2


# ------------------------------------------------------------------------------ FedBuff


@pytest.mark.parametrize("weighting", [False, True])
def test_fedbuff_applies_the_mean_of_m_deltas(weighting: bool, gen: torch.Generator) -> None:
    m, lr = 3, 0.7
    s = build("fedbuff", gen, buffer_size=m, server_lr=lr, staleness_weighting=weighting)
    x = s.global_model().double()
    clients = [f"c{i}" for i in range(5)]
    for c in clients:
        s.on_register(c, 0.0)
    jobs = {c: s.job_for(c, 0.0) for c in clients}
    buf: list[tuple[float, torch.Tensor]] = []
    arrivals = ["c0", "c1", "c2", "c3", "c4", "c0"]
    for i, c in enumerate(arrivals):
        job = jobs[c]
        w = result_of(job, gen)
        stale = s.version - job.base_version
        wt = 1 / math.sqrt(1 + stale) if weighting else 1.0
        buf.append((wt, w.double() - job.weights.double()))
        kind = UpdateKind.DELTA if i % 2 else UpdateKind.WEIGHTS
        before = s.global_model()
        out = s.on_update(make_update(job, w, kind), float(i))
        if len(buf) < m:
            assert out == Outcome(Status.BUFFERED, s.version)
            assert s.global_model() is before
        else:
            x = x + lr * sum(wt * d for wt, d in buf) / m
            buf.clear()
            assert out.status is Status.APPLIED and out.version == s.version
            close(s.global_model(), x)
        jobs[c] = s.job_for(c, float(i))  # the client restarts from the current version
    assert s.version == 2
    # Staleness counted from versions: c3 and c4 started at version 0, arrived at version 1.
    assert s.staleness(jobs["c0"]) == 0


# ------------------------------------------------------------------------------ shared behaviour


def two_kinds(name: str, gen: torch.Generator, config: dict[str, Any]) -> list[torch.Tensor]:
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    initial = torch.randn(D, generator=gen)
    finals = []
    for kind in UpdateKind:
        g = torch.Generator().manual_seed(seed)
        s = make_strategy(name, layout=LAYOUT, initial=initial, config=config)
        for c in "abcd":
            s.on_register(c, 0.0)
        for t in range(12):
            c = "abcd"[t % 4]
            job = s.job_for(c, float(t))
            if job is not None:
                s.on_update(make_update(job, result_of(job, g), kind), float(t))
        assert s.version >= 2
        finals.append(s.global_model())
    return finals


@pytest.mark.parametrize(
    "name,config",
    [
        ("fedasync", {"staleness": "hinge"}),
        ("fedbuff", {"buffer_size": 3, "staleness_weighting": True}),
        ("fedavg", {"min_available": 4}),
        ("fedavg", {"mode": "k_async", "k": 3, "server_opt": "adam", "server_lr": 0.05}),
    ],
)
def test_weights_and_delta_kinds_give_the_same_model(
    name: str, config: dict[str, Any], gen: torch.Generator
) -> None:
    a, b = two_kinds(name, gen, config)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_job_for_reissues_until_the_version_moves(gen: torch.Generator) -> None:
    s = build("fedasync", gen)
    for c in "ab":
        s.on_register(c, 0.0)
    ja = s.job_for("a", 0.0)
    assert s.job_for("a", 1.0) is ja  # a reconnect gets the same job
    jb = s.job_for("b", 0.0)
    s.on_update(make_update(jb, result_of(jb, gen)), 1.0)
    ja2 = s.job_for("a", 2.0)
    assert ja2.job_id != ja.job_id and ja2.base_version == 1
    with pytest.raises(JobSuperseded, match=f"job {ja.job_id} is no longer open"):
        s.on_update(make_update(ja, result_of(ja, gen)), 3.0)


def test_only_referenced_base_versions_are_kept(gen: torch.Generator) -> None:
    s = build("fedasync", gen)
    for c in "abc":
        s.on_register(c, 0.0)
    jobs = {c: s.job_for(c, 0.0) for c in "abc"}
    s.on_update(make_update(jobs["a"], result_of(jobs["a"], gen)), 1.0)
    jobs["a"] = s.job_for("a", 1.0)
    assert set(s.state_dict()["bases"]) == {0, 1}
    for c in "bc":
        s.on_update(make_update(jobs[c], result_of(jobs[c], gen)), 2.0)
    assert set(s.state_dict()["bases"]) == {1}  # nobody refers to version 0 any more


# No job leases: the walk below fires the timer at every deadline, and d's job must stay open.
REFUSAL_SETUPS = [
    ("fedasync", {"max_staleness": 1, "job_lease_seconds": None}),
    ("fedbuff", {"buffer_size": 3, "max_staleness": 1, "job_lease_seconds": None}),
    ("fedavg", {"mode": "k_async", "k": 2, "max_staleness": 1, "server_opt": "adam",
                "job_lease_seconds": None}),
    ("fedavg", {"min_available": 4, "max_staleness": 1, "late": "next_round",
                "job_lease_seconds": None}),
]  # fmt: skip


@pytest.mark.parametrize("name,config", REFUSAL_SETUPS)
def test_refused_updates_leave_state_bit_identical(
    name: str, config: dict[str, Any], gen: torch.Generator
) -> None:
    s = build(name, gen, **config)
    for c in "abcd":
        s.on_register(c, 0.0)
    old = {c: s.job_for(c, 0.0) for c in "abcd"}
    # a, b, c move the model on; d keeps its job from version 0 (too stale by then).
    t = 1.0
    while s.version < 2:
        for c in "abc":
            job = s.job_for(c, t)
            if job is not None:
                s.on_update(make_update(job, result_of(job, gen), uid=f"{c}{t}"), t)
            t += 1.0
        deadline = s.next_deadline()
        if deadline is not None:
            s.on_timer(deadline)  # sync: d never reports, the round closes at its deadline
    fresh = s.job_for("a", t)
    assert fresh is not None
    before = copy.deepcopy(s.state_dict())
    model = s.global_model()
    w = result_of(fresh, gen)

    def refuse(err: type[Exception], upd: Update, match: str) -> None:
        with pytest.raises(err, match=match):
            s.on_update(upd, t + 1.0)
        assert_same_state(s.state_dict(), before)
        assert s.global_model() is model

    good = make_update(fresh, w)
    refuse(InvalidUpdate, Update(**{**good.__dict__, "job_id": 10_000}), "never issued")
    refuse(InvalidUpdate, Update(**{**good.__dict__, "base_version": 0}), "started from version")
    refuse(InvalidUpdate, Update(**{**good.__dict__, "client_id": "b"}), "belongs to client 'a'")
    refuse(NotRegistered, Update(**{**good.__dict__, "client_id": "zz"}), "not registered")
    refuse(InvalidUpdate, Update(**{**good.__dict__, "tensor": w[:-1].clone()}), "float32")
    refuse(InvalidUpdate, Update(**{**good.__dict__, "tensor": w.double()}), "float32")
    refuse(JobSuperseded, make_update(old["a"], w), "no longer open")
    assert s.outstanding_job("d") is old["d"]
    refuse(TooStale, make_update(old["d"], w), "max_staleness=1")
    # The good update still goes through afterwards.
    assert s.on_update(good, t + 2.0).status in (Status.APPLIED, Status.BUFFERED)


# ------------------------------------------------------------------------------ checkpoints


class Driver:
    """Deterministic clients: each tick every client either asks for a job or returns its job.

    A client's result depends only on (seed, job id), so two runs with equal strategy state make
    equal updates. Some clients straggle a tick (late or stale by then), some report partial
    work, some replay their update.
    """

    def __init__(self, clients: list[str], seed: int) -> None:
        self.clients = clients
        self.seed = seed
        self.held: dict[str, Job] = {}
        # A client reads its job's weights ticks later: it holds a lease on them meanwhile,
        # as a job stream does (the strategy lets go of a job a round closes or supersedes).
        self.leases: dict[str, Lease] = {}
        self.outcomes: list[Outcome | str] = []

    def hold(self, s: Strategy, c: str, job: Job) -> None:
        self.held[c] = job
        self.leases[c] = s.lease(*job.tensors.values())

    def submit(self, s: Strategy, upd: Update, t: float) -> None:
        try:
            self.outcomes.append(s.on_update(upd, t))
        except (JobSuperseded, TooStale) as e:
            self.outcomes.append(type(e).__name__)

    def tick(self, s: Strategy, t: float) -> None:
        deadline = s.next_deadline()
        if deadline is not None and t >= deadline:
            s.on_timer(t)
        for i, c in enumerate(self.clients):
            job = self.held.get(c)
            if job is None:
                job = s.job_for(c, t)
                if job is not None:
                    self.hold(s, c, job)
                continue
            if (int(t) + i) % 5 == 4:
                continue  # a straggler: returns next tick
            del self.held[c]
            g = torch.Generator().manual_seed(self.seed * 7919 + job.job_id)
            w = job.weights + 0.1 * torch.randn(D, generator=g)
            kind = UpdateKind.DELTA if job.job_id % 2 else UpdateKind.WEIGHTS
            work = job.recipe.work_target * (0.5 if job.job_id % 3 == 0 else 1.0)
            upd = make_update(job, w, kind, num_samples=5 + job.job_id % 7, work_done=work)
            self.leases.pop(c).release()
            self.submit(s, upd, t)
            if (int(t) + i) % 4 == 0:
                self.submit(s, upd, t)  # a replay


CHECKPOINT_SETUPS = [
    ("fedasync", {"staleness": "hinge", "hinge_b": 1, "hinge_a": 3.0}),
    ("fedbuff", {"buffer_size": 3, "staleness_weighting": True, "max_staleness": 3}),
    ("fedavg", {"participation": 0.6, "round_timeout": 3.0, "min_clients": 2}),
    (
        "fedavg",
        {"participation": 2, "late": "next_round", "round_timeout": 2.0, "min_available": 5},
    ),
    ("fedavg", {"mode": "k_async", "k": 3, "server_opt": "adam", "server_lr": 0.03}),
    ("fedprox", {"mu": 0.1, "participation": 0.5, "server_opt": "adam", "round_timeout": 2.0}),
]


def pending(s: Strategy) -> bool:
    """Whether the strategy holds accepted updates not yet in the model (or is FedAsync)."""
    extra = s.state_dict()["extra"]
    return bool(extra.get("weights") or extra.get("acc_count") or s.name == "fedasync")


@pytest.mark.parametrize("name,config", CHECKPOINT_SETUPS)
def test_state_dict_round_trip_continues_bit_identically(
    name: str, config: dict[str, Any], gen: torch.Generator
) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    initial = torch.randn(D, generator=gen)
    config = {**config, "seed": seed % 1000}
    clients = [f"c{i}" for i in range(5)]

    def start() -> Strategy:
        return make_strategy(name, layout=LAYOUT, initial=initial, config=config)

    s = start()
    for c in clients:
        s.on_register(c, 0.0)
    drv = Driver(clients, seed)
    t = 0
    # Checkpoint mid-aggregation (buffered deltas or a partly filled round), after some versions.
    while t < 8 or not pending(s):
        drv.tick(s, float(t))
        t += 1
    assert t < 40
    state_version = s.version
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    r = start()
    r.load_state_dict(torch.load(buf, weights_only=True))
    assert_same_state(r.state_dict(), s.state_dict())
    drv2 = Driver(clients, seed)
    for c, job in drv.held.items():  # the same jobs, as the resumed strategy holds them
        drv2.hold(r, c, r.open_job(c, job.job_id))
    n0 = len(drv.outcomes)
    for t2 in range(t, t + 20):
        drv.tick(s, float(t2))
        drv2.tick(r, float(t2))
    assert drv.outcomes[n0:] == drv2.outcomes
    assert r.version >= int(state_version) + 2  # the resumed run aggregated on
    assert any(isinstance(o, Outcome) and o.status is Status.DUPLICATE for o in drv.outcomes)
    assert s.version >= 3 and torch.equal(s.global_model(), r.global_model())
    assert_same_state(r.state_dict(), s.state_dict())


@pytest.mark.parametrize("name,config", CHECKPOINT_SETUPS)
def test_global_model_snapshots_are_never_mutated(
    name: str, config: dict[str, Any], gen: torch.Generator
) -> None:
    s = make_strategy(name, layout=LAYOUT, initial=torch.randn(D, generator=gen), config=config)
    clients = [f"c{i}" for i in range(5)]
    for c in clients:
        s.on_register(c, 0.0)
    drv = Driver(clients, int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in range(30):
        drv.tick(s, float(t))
        snap = s.global_model()
        if s.version not in kept:  # a reader keeps this version: it holds a lease
            kept[s.version] = (snap, snap.clone(), s.lease(snap))
        for job in drv.held.values():
            if -job.job_id not in kept:
                kept[-job.job_id] = (job.weights, job.weights.clone(), s.lease(job.weights))
    assert s.version >= 3
    for ref, copy_, _ in kept.values():
        assert torch.equal(ref, copy_)
