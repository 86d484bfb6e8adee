"""No strategy ever publishes a non-finite model, and an update that would make one is refused
without a trace: every strategy, driven directly (the route the simulator, the Flower adapter and
embedding programs take), with NaN, Inf, huge finite values, oversized sample counts and oversized
norms mixed into ordinary traffic."""

from __future__ import annotations

import copy
import math
import secrets
from typing import Any

import pytest
import torch
from state_helpers import assert_same_state
from strategy_cases import strategy_cases

from aggsrv.layout import ModelLayout
from aggsrv.strategies import (
    STRATEGIES,
    InvalidUpdate,
    Job,
    JobSuperseded,
    NonFiniteResult,
    NonFiniteUpdate,
    Status,
    Strategy,
    StrategyError,
    TooManySamples,
    TooStale,
    Update,
    UpdateKind,
    UpdateNormTooLarge,
    make_strategy,
)

LAYOUT = ModelLayout.from_named_shapes([("conv.w", (3, 2, 5)), ("conv.b", (3,)), ("fc.w", (7,))])
D = LAYOUT.numel  # 40
CLIENTS = [f"c{i}" for i in range(6)]
HOSTILE = ("nan", "inf", "huge", "huge_weights", "samples")


@pytest.fixture
def seed() -> int:
    s = secrets.randbits(31)
    print(f"seed={s}")
    return s


def floats_of(state: Any) -> list[torch.Tensor]:
    """Every floating tensor of a nested state dict."""
    if isinstance(state, torch.Tensor):
        return [state] if state.is_floating_point() else []
    if isinstance(state, dict):
        return [t for v in state.values() for t in floats_of(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in floats_of(v)]
    return []


def assert_all_finite(s: Strategy, when: str) -> None:
    assert bool(torch.isfinite(s.global_model()).all()), f"non-finite model {when}"
    for t in floats_of(s.state_dict()):
        assert bool(torch.isfinite(t).all()), f"non-finite state {when}"


def hostile_update(job: Job, kind: str, g: torch.Generator) -> Update:
    """An update for ``job`` that no strategy may let into its state as is."""
    delta = 0.1 * torch.randn(D, generator=g)
    samples = 10
    upd_kind = UpdateKind.DELTA
    i = int(torch.randint(0, D, (1,), generator=g))
    if kind == "nan":
        delta[i] = math.nan
    elif kind == "inf":
        delta[i] = -math.inf if i % 2 else math.inf
    elif kind == "huge":  # finite, but any sum of two of them overflows float32
        delta = torch.where(torch.rand(D, generator=g) < 0.5, -3e38, 3e38).float()
    elif kind == "huge_weights":
        upd_kind = UpdateKind.WEIGHTS
        delta = torch.full((D,), 3.3e38) * torch.sign(torch.randn(D, generator=g))
    elif kind == "samples":
        samples = 2**64 - 1
    tensor = delta.to(job.weights.device)
    return Update(job.client_id, job.job_id, job.base_version, f"{job.client_id}-{job.job_id}-"
                  f"{kind}", samples, job.recipe.work_target, upd_kind, tensor)  # fmt: skip


def ordinary_update(job: Job, g: torch.Generator) -> Update:
    kind = UpdateKind.DELTA if int(torch.randint(0, 2, (1,), generator=g)) else UpdateKind.WEIGHTS
    delta = (0.1 * torch.randn(D, generator=g)).to(job.weights.device)
    tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
    samples = int(torch.randint(1, 50, (1,), generator=g))
    return Update(job.client_id, job.job_id, job.base_version, f"{job.client_id}-{job.job_id}",
                  samples, job.recipe.work_target, kind, tensor)  # fmt: skip


def submit(s: Strategy, upd: Update, now: float) -> StrategyError | None:
    """on_update; a refusal must leave the state bit-identical and be a StrategyError."""
    before = s.state_dict()  # a point-in-time copy
    model = s.global_model()
    try:
        s.on_update(upd, now)
    except StrategyError as exc:
        assert_same_state(s.state_dict(), before)
        assert s.global_model() is model
        return exc
    return None


# On a machine with a GPU the walk runs on it too (the checks synchronise with the device).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hostile", ["invalid", "huge"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_hostile_updates_never_reach_the_model(
    name: str, hostile: str, device: str, seed: int
) -> None:
    """Invalid updates (NaN, Inf, an absurd num_samples) are refused and the federation goes on;
    huge finite ones are applied while the results stay finite and refused once they would not.
    (An accepted huge update may leave the model near the float32 limit, so that later ordinary
    updates overflow too and are refused: that is what max_update_norm is for.)"""
    g = torch.Generator().manual_seed(seed)
    config = strategy_cases(len(CLIENTS))[name]
    s = make_strategy(
        name, layout=LAYOUT, initial=torch.randn(D, generator=g), config=config, device=device
    )
    for c in CLIENTS:
        s.on_register(c, 0.0)
    kinds = ("nan", "inf", "samples") if hostile == "invalid" else ("huge", "huge_weights")
    refused: dict[str, list[str]] = {k: [] for k in kinds}
    huge_accepted = accepted = 0
    t = 0.0
    for step in range(18):
        t += 0.25
        deadline = s.next_deadline()
        if deadline is not None and t >= deadline:
            s.on_timer(t)
            assert_all_finite(s, f"after the timer at {t}")
        for n, c in enumerate(CLIENTS):
            job = s.outstanding_job(c) or s.job_for(c, t)
            if job is None:
                continue
            # Every client first tries something hostile, then an ordinary update of the job.
            kind = kinds[(step + n) % len(kinds)]
            err = submit(s, hostile_update(job, kind, g), t)
            assert_all_finite(s, f"after a {kind} update")
            if err is None:
                huge_accepted += 1
                continue
            assert isinstance(err, InvalidUpdate), f"{kind}: {err!r}"
            refused[kind].append(type(err).__name__)
            assert s.outstanding_job(c) is job, "a refused update must leave its job open"
            err = submit(s, ordinary_update(job, g), t)
            assert_all_finite(s, "after an ordinary update")
            allowed: tuple[type, ...] = (JobSuperseded, TooStale)
            if huge_accepted:
                allowed += (NonFiniteResult,)
            assert err is None or isinstance(err, allowed), repr(err)
            accepted += err is None
    if hostile == "invalid":
        assert huge_accepted == 0
        assert accepted >= 6 and s.version >= 2, (accepted, s.version)
        assert refused["nan"] and set(refused["nan"]) == {"NonFiniteUpdate"}
        assert refused["inf"] and set(refused["inf"]) == {"NonFiniteUpdate"}
        assert refused["samples"] and set(refused["samples"]) == {"TooManySamples"}
    else:
        assert set(refused["huge"] + refused["huge_weights"]) == {"NonFiniteResult"}


def two_huge_deltas(name: str, **config: Any) -> tuple[Strategy, list[Any]]:
    s = make_strategy(name, layout=LAYOUT, initial=torch.zeros(D), config=config)
    s.on_register("a", 0.0)
    results: list[Any] = []
    for i in range(2):
        job = s.job_for("a", float(i))
        upd = Update("a", job.job_id, job.base_version, f"u{i}", 1, job.recipe.work_target,
                     UpdateKind.DELTA, torch.full((D,), 3e38))  # fmt: skip
        results.append(submit(s, upd, float(i)) or s.version)
    return s, results


def test_fedasync_refuses_the_update_that_would_overflow() -> None:
    s, (first, second) = two_huge_deltas("fedasync", alpha=1.0)
    assert first == 1  # 0 + 1.0 * 3e38 is finite: applied
    assert isinstance(second, NonFiniteResult) and "non-finite" in str(second)
    assert s.version == 1 and bool(torch.isfinite(s.global_model()).all())


def test_buffered_strategy_refuses_the_update_that_would_overflow_its_flush() -> None:
    # FedBuff with M = 3: the second 3e38 delta makes (x + sum / 3 * 3) overflow if flushed now.
    s, (first, second) = two_huge_deltas("fedbuff", buffer_size=3, server_lr=3.0)
    assert first == 0
    assert isinstance(second, NonFiniteResult)
    assert s.state_dict()["extra"]["weights"] == [1.0]  # only the first is in the buffer


def test_num_samples_bound_is_configurable() -> None:
    s = make_strategy("fedavg", layout=LAYOUT, initial=torch.zeros(D),
                      config={"mode": "k_async", "k": 1, "max_num_samples": 100})  # fmt: skip
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    upd = Update("a", job.job_id, 0, "u", 101, 1.0, UpdateKind.DELTA, torch.ones(D))
    with pytest.raises(TooManySamples, match="max_num_samples=100"):
        s.on_update(upd, 0.0)
    assert s.on_update(Update(**{**upd.__dict__, "num_samples": 100}), 0.0).status is Status.APPLIED
    with pytest.raises(ValueError, match="max_num_samples"):
        make_strategy("fedavg", layout=LAYOUT, initial=torch.zeros(D),
                      config={"max_num_samples": 0})  # fmt: skip
    assert make_strategy("fedasync", layout=LAYOUT, initial=torch.zeros(D)).config.max_num_samples


@pytest.mark.parametrize("kind", [UpdateKind.DELTA, UpdateKind.WEIGHTS])
def test_max_update_norm_bounds_the_client_delta(kind: UpdateKind, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    initial = torch.randn(D, generator=g)
    s = make_strategy("fedasync", layout=LAYOUT, initial=initial, config={"max_update_norm": 2.5})
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    delta = torch.randn(D, generator=g)
    delta *= 2.5 * 1.001 / float(delta.double().norm())  # just above the bound
    tensor = delta if kind is UpdateKind.DELTA else initial + delta
    upd = Update("a", job.job_id, 0, "u1", 1, 1.0, kind, tensor)
    before = copy.deepcopy(s.state_dict())
    with pytest.raises(UpdateNormTooLarge, match="max_update_norm=2.5"):
        s.on_update(upd, 0.0)
    assert_same_state(s.state_dict(), before)
    small = delta * 0.99
    tensor = small if kind is UpdateKind.DELTA else initial + small
    out = s.on_update(Update("a", job.job_id, 0, "u2", 1, 1.0, kind, tensor), 0.0)
    assert out.status is Status.APPLIED
    with pytest.raises(ValueError, match="max_update_norm"):
        make_strategy("fedasync", layout=LAYOUT, initial=initial, config={"max_update_norm": -1})


def test_non_finite_update_names_the_tensor_and_element() -> None:
    s = make_strategy("fedasync", layout=LAYOUT, initial=torch.zeros(D))
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    t = torch.zeros(D)
    t[31] = math.nan  # conv.w has 30 elements, conv.b 3: element 1 of conv.b... 30..32
    with pytest.raises(NonFiniteUpdate, match=r"nan at element 1 of 'conv\.b'") as info:
        s.on_update(Update("a", job.job_id, 0, "u", 1, 1.0, UpdateKind.DELTA, t), 0.0)
    assert info.value.code == "INVALID_ARGUMENT" and info.value.reason == "non_finite_update"


# ------------------------------------------------------------------------------ every route


def test_simulator_refuses_a_nan_update_and_keeps_learning(tmp_path, monkeypatch) -> None:
    """The in-process simulator calls on_update directly: a client whose training diverged
    (NaN delta) is refused as NonFiniteUpdate and the model stays finite and learns."""
    from aggsrv.sim import run
    from aggsrv.sim.local import LocalTrainer

    real = LocalTrainer.run

    def diverging(self, client, round_, *args, **kwargs):
        result = real(self, client, round_, *args, **kwargs)
        if client == 0:
            result.delta[3] = math.nan
        return result

    monkeypatch.setattr(LocalTrainer, "run", diverging)
    config = {"strategy": "fedasync", "dataset": "digits", "clients": 4, "model": "mlp",
              "profile": "none", "budget": "4s", "eval_every": "2s", "transport": "inproc",
              "strategy_config": {"learning_rate": 0.05}, "out": str(tmp_path / "run")}  # fmt: skip
    result = run(config, progress=False)
    summary = result.summary
    assert summary["rejected_by"].get("NonFiniteUpdate", 0) >= 2, summary["rejected_by"]
    assert summary["updates_applied"] >= 6
    assert all(math.isfinite(m["test_loss"]) for m in result.metrics)
    assert result.final_accuracy > 0.5


def test_flower_adapter_refuses_bad_replies_and_changes_nothing(flower_identity) -> None:
    """The Flower adapter folds replies with on_update: NaN weights, weights that overflow the
    mix, and a non-finite or absurd sample count are each refused (None, logged); the model is
    untouched; a good reply afterwards is applied."""
    from flower_helpers import initial_record, train_reply
    from flwr.app import MetricRecord

    from aggsrv.integrations.flower.arrays import record_to_flat
    from aggsrv.integrations.flower.strategy import AggsrvStrategy

    adapter = AggsrvStrategy("fedasync", {"alpha": 1.0})
    initial = initial_record(secrets.randbits(30))
    adapter.adopt(initial)
    layout, s = adapter.layout, adapter.strategy
    x0 = record_to_flat(initial, layout)

    def reply(final: torch.Tensor, n: float = 10, refused: bool = True):
        job = adapter.issue_job(7, 0.0)
        msg = adapter.job_message(7, job, server_round=1)
        out = train_reply(msg, final, layout, 10)
        out.content["metrics"] = MetricRecord({"num-examples": n})
        before = s.state_dict()
        outcome = adapter.fold_reply(out, now=0.0)
        assert (outcome is None) == refused, (n, outcome)
        if refused:
            assert_same_state(s.state_dict(), before)

    nan = x0.clone()
    nan[5] = math.nan
    reply(nan)
    reply(torch.full_like(x0, 3e38), refused=False)  # alpha = 1: the model becomes 3e38
    reply(torch.full_like(x0, -3e38))  # 3e38 - (-3e38) overflows: refused
    for n in (math.nan, math.inf, -1.0, 2.0**70):
        reply(x0, n)
    assert s.version == 1 and bool(torch.isfinite(s.global_model()).all())


def test_grpc_route_refuses_overflow_and_keeps_duplicate_staleness(servers) -> None:
    """Over gRPC: a DELTA that would overflow the model is INVALID_ARGUMENT and changes
    nothing; a replayed update id answers DUPLICATE with the staleness it was accepted at."""
    import grpc
    from server_helpers import flat, tiny_model

    from aggsrv.client.client import Client

    srv = servers(strategy="fedasync", strategy_config={"alpha": 1.0})
    model = tiny_model(5)
    d = flat(model).numel()
    with Client(srv.address, "a") as a, Client(srv.address, "b") as b:
        a.register(model)
        b.register(model)
        job_a = a.get_job()
        for _ in range(2):
            b.push(b.get_job(), torch.zeros(d), num_samples=1, epochs=1.0)
        first = a.push(job_a, torch.full((d,), 3e38), update_id="big", num_samples=1, epochs=1.0)
        assert (first.status, first.staleness, first.version) == (Status.APPLIED, 2, 3)
        state = srv.state()
        with pytest.raises(grpc.RpcError) as info:
            b.push(b.get_job(), torch.full((d,), 3e38), num_samples=1, epochs=1.0)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "non-finite" in info.value.details()
        assert bool(torch.isfinite(srv.model()).all())
        b.push(b.get_job(), torch.zeros(d), num_samples=1, epochs=1.0)  # version 4
        again = a.push(job_a, torch.full((d,), 3e38), update_id="big", num_samples=1, epochs=1.0)
        assert again.status is Status.DUPLICATE and again.original is Status.APPLIED
        assert (again.version, again.staleness) == (3, 2)
    assert state["version"] == 3


def test_an_update_proven_finite_is_not_counted_again(monkeypatch) -> None:
    """The server's decoder proves an upload finite in the pass that reads it (Update.finite):
    the strategy does not read the values once more for NaN/Inf; without the proof it does."""
    import aggsrv.strategies.validation as V

    counted: list[int] = []
    real = V.count_non_finite
    monkeypatch.setattr(V, "count_non_finite", lambda t: counted.append(t.numel()) or real(t))
    s = make_strategy("fedasync", layout=LAYOUT, initial=torch.zeros(D))
    s.on_register("a", 0.0)
    for i, finite in enumerate((True, False)):
        job = s.job_for("a", float(i))
        delta = torch.randn(D)
        s.on_update(
            Update("a", job.job_id, job.base_version, f"u{i}", 1, 1.0, UpdateKind.DELTA, delta,
                   finite=finite),
            float(i),
        )  # fmt: skip
    assert counted == [D] and s.version == 2
