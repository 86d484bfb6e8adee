"""Per-update filters (aggsrv/strategies/update_filters.py) against hand-computed traces and a
float64 numpy oracle: the norm filter's refusals, warm-up and sliding window; centered clipping's
u' and centre over a sequence (fixed and adaptive tau); a planted attacker among honest clients;
the four strategies that take the key, whose state a refused update leaves as it was; the
durable state (save mid-sequence, restore, same decisions); parse errors; and a real gRPC round
trip (FILTERED with its reason, DUPLICATE of it, a new job, the metrics and status counters).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from server_helpers import scrape_metrics, tiny_model
from state_helpers import assert_same_state
from strategy_cases import strategy_cases
from strategy_runs import run_layout

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.strategies import Strategy, Update, UpdateKind, make_strategy
from aggsrv.strategies.fedasync import FedAsyncConfig
from aggsrv.strategies.update_filters import UpdateFilters
from aggsrv.values import FilterReason, Outcome, Status

FILTERED_KEYS = ("fedasync", "orthofl", "feddgic", "fedogd")


def small_layout(n_in: int = 6, n_out: int = 5) -> ModelLayout:
    torch.manual_seed(0)
    return ModelLayout.from_module(torch.nn.Linear(n_in, n_out))


def fedasync(layout: ModelLayout, update_filter: str, **config) -> Strategy:
    s = make_strategy(
        "fedasync",
        layout=layout,
        initial=torch.randn(layout.numel, generator=torch.Generator().manual_seed(1)),
        config={"alpha": 0.5, "staleness": "constant", "update_filter": update_filter, **config},
    )
    s.on_register("c", 0.0)
    return s


def push(s: Strategy, delta: torch.Tensor, n: int, client: str = "c") -> Outcome:
    job = s.job_for(client, float(n))
    assert job is not None
    update = Update(client, job.job_id, job.base_version, f"u{n}", 3, 1.0, UpdateKind.DELTA,
                    delta.to(torch.float32))  # fmt: skip
    return s.on_update(update, float(n))


def whole_norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))


# ----------------------------------------------------------------------------- norm filter


def test_norm_filter_follows_a_hand_computed_trace() -> None:
    """factor 2, window 3, warm-up 2; each delta is one element, so its norm is exact.

    norm  history before   bound = 2 x median    verdict
    1     []               warm-up               pass
    2     [1]              warm-up               pass
    10    [1, 2]           2 x 1.5 = 3           refused
    3     [1, 2]           3                     pass (not above)
    7     [1, 2, 3]        2 x 2 = 4             refused
    2.5   [1, 2, 3]        4                     pass
    100   [2, 3, 2.5]      2 x 2.5 = 5           refused (the window slid past 1)
    4     [2, 3, 2.5]      5                     pass
    5.5   [3, 2.5, 4]      2 x 3 = 6             pass (a window that kept every norm,
                                                 [1, 2, 3, 2.5, 4], would give 5: refused)
    6.5   [2.5, 4, 5.5]    2 x 4 = 8             pass
    17    [4, 5.5, 6.5]    2 x 5.5 = 11          refused
    """
    layout = small_layout()
    s = fedasync(layout, "norm:factor=2,window=3,warmup=2")
    trace = [(1, True), (2, True), (10, False), (3, True), (7, False), (2.5, True),
             (100, False), (4, True), (5.5, True), (6.5, True), (17, False)]  # fmt: skip
    for n, (norm, passes) in enumerate(trace):
        delta = torch.zeros(layout.numel)
        delta[(3 * n) % layout.numel] = norm * (-1) ** n
        version = s.version
        out = push(s, delta, n)
        if passes:
            assert out.status is Status.APPLIED and out.version == version + 1, (n, norm)
        else:
            assert (out.status, out.version, out.reason) == (
                Status.FILTERED, version, FilterReason.NORM_OUTLIER,
            ), (n, norm)  # fmt: skip
            assert f"{norm:.6g}" in out.detail and "'norm'" in out.detail
    assert s.update_filters.steps[0].norms == [4.0, 5.5, 6.5]
    assert s.update_filters.filtered == {"NORM_OUTLIER": 4}


def test_norm_filter_measures_weights_updates_as_deltas_in_float64() -> None:
    """A WEIGHTS update is measured as weights minus the job's start weights (float64)."""
    layout = small_layout()
    s = fedasync(layout, "norm:factor=1.5,window=4,warmup=1")
    gen = torch.Generator().manual_seed(5)
    first = torch.randn(layout.numel, generator=gen)
    assert push(s, first, 0).status is Status.APPLIED
    job = s.job_for("c", 1.0)
    delta = torch.randn(layout.numel, generator=gen)
    weights = job.weights + delta
    want = float(np.linalg.norm(weights.double().numpy() - job.weights.double().numpy()))
    ratio = want / float(np.linalg.norm(first.double().numpy()))
    out = s.on_update(
        Update("c", job.job_id, job.base_version, "w", 3, 1.0, UpdateKind.WEIGHTS, weights), 1.0
    )
    assert out.status is (Status.FILTERED if ratio > 1.5 else Status.APPLIED)
    assert s.update_filters.steps[0].norms[-1] == pytest.approx(
        want if ratio <= 1.5 else float(np.linalg.norm(first.double().numpy())), rel=1e-12
    )


# ----------------------------------------------------------------------------- centered clipping


class _Job:
    """What the filters read of a job: its start weights."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights


@pytest.mark.parametrize(
    "spec, tau, factor, window, warmup",
    [
        ("centered_clip:tau=1.1,beta=0.8", 1.1, None, None, 0),
        ("centered_clip:beta=0.7,factor=1.3,window=4,warmup=3", None, 1.3, 4, 3),
    ],
)
def test_centered_clip_matches_the_formula_in_float64(spec, tau, factor, window, warmup) -> None:
    """u' = v + (u - v) min(1, tau / |u - v|), then v <- beta v + (1 - beta) u', over a sequence
    of deltas of varied sizes (some clipped, some not), with tau fixed or adaptive."""
    beta = float(spec.split("beta=")[1].split(",")[0])
    dim = 37
    rng = np.random.default_rng(11)
    filters = UpdateFilters(spec, dim, torch.device("cpu"))
    v = np.zeros(dim)
    distances: list[float] = []
    clipped_seen = unclipped_seen = 0
    for n in range(16):
        u32 = (rng.standard_normal(dim) * rng.choice([0.1, 0.2, 0.5, 2.0])).astype(np.float32)
        u = u32.astype(np.float64)
        update = Update("c", n + 1, 0, f"u{n}", 1, 1.0, UpdateKind.DELTA, torch.from_numpy(u32))
        screening = filters.screen(update, _Job(torch.zeros(dim)), None, whole_norm)
        d = u - v
        dist = float(np.linalg.norm(d))
        t = tau
        if t is None:
            t = factor * float(np.median(distances[-window:])) if len(distances) >= warmup else None
        scale = 1.0 if t is None else min(1.0, t / dist)
        up = v + d * scale
        assert screening.refusal is None
        assert screening.clipped == (scale < 1.0), n
        if scale < 1.0:
            clipped_seen += 1
            assert screening.update.kind is UpdateKind.DELTA
            np.testing.assert_allclose(screening.update.tensor.numpy(), up.astype(np.float32),
                                       rtol=1e-6, atol=1e-7)  # fmt: skip
            assert float(np.linalg.norm(up - v)) == pytest.approx(t, rel=1e-12)
        else:
            unclipped_seen += 1
            assert screening.update is update  # untouched: applied as sent
        filters.commit(screening)
        v = beta * v + (1.0 - beta) * up
        distances.append(dist)
        np.testing.assert_allclose(filters.steps[0].centre.numpy(), v, rtol=1e-12, atol=1e-15)
    assert clipped_seen >= 3 and unclipped_seen >= 3  # the sequence exercised both branches
    assert filters.clipped == clipped_seen


def test_centered_clip_warm_up_clips_nothing() -> None:
    """Adaptive tau: the first `warmup` updates pass unclipped however large they are."""
    layout = small_layout()
    s = fedasync(layout, "centered_clip:warmup=3")
    gen = torch.Generator().manual_seed(2)
    outs = [push(s, torch.randn(layout.numel, generator=gen) * 10.0**n, n) for n in range(4)]
    assert [o.clipped for o in outs] == [False, False, False, True]
    assert all(o.status is Status.APPLIED for o in outs)


# ----------------------------------------------------------------------------- a planted attacker


def _attack_run(update_filter: str, seed: int) -> tuple[list[bool], list[Outcome]]:
    """40 updates of 4 clients in a row; every fifth after the tenth is an attacker's: an honest
    delta sign-flipped and scaled by 100."""
    layout = small_layout(13, 9)
    s = fedasync(layout, update_filter)
    for c in "abc":
        s.on_register(c, 0.0)
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(layout.numel, generator=gen) * 0.05
    attacker, outs = [], []
    for n in range(40):
        honest = mean + torch.randn(layout.numel, generator=gen) * 0.05
        evil = n >= 10 and n % 5 == 0
        attacker.append(evil)
        outs.append(push(s, -100.0 * honest if evil else honest, n, "cabc"[n % 4]))
    return attacker, outs


def test_norm_filter_refuses_a_planted_attacker_and_passes_honest_clients() -> None:
    attacker, outs = _attack_run("norm", seed=3)
    for evil, out in zip(attacker, outs, strict=True):
        assert out.status is (Status.FILTERED if evil else Status.APPLIED), out
    assert sum(attacker) == 6


def test_centered_clip_clips_a_planted_attacker_and_leaves_honest_clients() -> None:
    attacker, outs = _attack_run("centered_clip", seed=4)
    for evil, out in zip(attacker, outs, strict=True):
        assert out.status is Status.APPLIED
        assert out.clipped == evil, out


# ----------------------------------------------------------------------------- the four strategies


def _drive_until_refused(name: str, seed: int) -> None:
    """Honest updates through the warm-up, then a huge one: FILTERED, and the strategy's state
    other than the job it consumed, the ledger entry and the filter's refusal count is bit for
    bit what it was."""
    layout = run_layout()
    gen = torch.Generator().manual_seed(seed)
    config = {**strategy_cases(3)[name], "update_filter": "norm:warmup=2 > centered_clip"}
    s = make_strategy(
        name, layout=layout, initial=torch.randn(layout.numel, generator=gen),
        initial_buffers=torch.rand(layout.buffer_numel, generator=gen) + 0.5, config=config,
    )  # fmt: skip
    clients = ["c0", "c1", "c2"]
    now, accepted, n = 0.0, 0, 0
    for c in clients:
        s.on_register(c, now)
    while True:
        now += 0.1
        n += 1
        c = clients[n % 3]
        job = s.job_for(c, now)
        if job is None:
            deadline = s.next_deadline()
            assert deadline is not None, f"{name}: no job and no deadline"
            now = max(now, deadline)
            s.on_timer(now)
            continue
        huge = accepted >= 3
        delta = torch.randn(layout.numel, generator=gen) * (1e3 if huge else 0.05)
        buffers = job.tensors["buffers"] + torch.rand(layout.buffer_numel, generator=gen)
        update = Update(c, job.job_id, job.base_version, f"u{n}", 4, job.recipe.work_target,
                        UpdateKind.DELTA, delta, buffers)  # fmt: skip
        before = s.state_dict()
        out = s.on_update(update, now)
        if not huge:
            assert out.status in (Status.APPLIED, Status.BUFFERED), (name, out)
            accepted += 1
            continue
        assert (out.status, out.reason, out.version) == (
            Status.FILTERED, FilterReason.NORM_OUTLIER, before["version"]
        ), name  # fmt: skip
        after = s.state_dict()
        # What a refusal may change: the job (consumed), the ledger (the answer), the time.
        changing = ("bases", "jobs", "job_of", "completed_job", "ledger", "now", "update_filter")
        assert_same_state(
            {k: v for k, v in before.items() if k not in changing},
            {k: v for k, v in after.items() if k not in changing},
            name,
        )
        f_before, f_after = before["update_filter"], after["update_filter"]
        assert_same_state(f_before["steps"], f_after["steps"], f"{name} filter statistics")
        assert f_after["filtered"] == {"NORM_OUTLIER": 1} and f_before["filtered"] == {}
        assert job.job_id not in [j["job_id"] for j in after["jobs"]]
        assert s.job_state(c, job.job_id) == "completed"
        again = s.on_update(update, now)
        assert (again.status, again.original, again.reason, again.version) == (
            Status.DUPLICATE, Status.FILTERED, FilterReason.NORM_OUTLIER, out.version
        )  # fmt: skip
        assert_same_state(after, s.state_dict(), f"{name} after the replay")
        return


@pytest.mark.parametrize("name", FILTERED_KEYS)
def test_a_refused_update_changes_only_its_job_and_the_ledger(name: str) -> None:
    _drive_until_refused(name, seed=FILTERED_KEYS.index(name) + 20)


def test_only_the_one_update_at_a_time_strategies_take_the_key() -> None:
    layout = small_layout()
    with pytest.raises(ValueError, match="update_filter"):
        make_strategy("fedbuff", layout=layout, initial=torch.zeros(layout.numel),
                      config={"update_filter": "norm"})  # fmt: skip
    for name in (*FILTERED_KEYS, "fedfg"):
        config = {**strategy_cases(3)[name], "update_filter": "norm"}
        cfg = make_strategy(
            name, layout=layout, initial=torch.zeros(layout.numel), config=config
        ).config
        assert cfg.update_filter == "norm"
        assert "update_filter" in type(cfg).field_help() and type(cfg).field_help()["update_filter"]


# ----------------------------------------------------------------------------- durable state


def test_state_round_trip_mid_sequence_gives_the_same_decisions() -> None:
    layout = small_layout(9, 7)
    spec = "norm:factor=2.5,window=6,warmup=3 > centered_clip:beta=0.8,factor=1.5,window=5,warmup=2"
    gen = torch.Generator().manual_seed(8)
    # Scales the norm filter passes (and the clip clips, 0.2) or refuses (1.0).
    scales = (0.1, 0.12, 0.09, 0.2, 1.0)
    deltas = [torch.randn(layout.numel, generator=gen) * scales[n % 5] for n in range(24)]
    a = fedasync(layout, spec)
    outs_a = [push(a, d, n) for n, d in enumerate(deltas)]
    b = fedasync(layout, spec)
    outs_b = [push(b, d, n) for n, d in enumerate(deltas[:11])]
    saved = b.state_dict()
    c = fedasync(layout, spec)
    c.load_state_dict(saved)
    outs_b += [push(c, d, n + 11) for n, d in enumerate(deltas[11:])]
    assert [(o.status, o.version, o.reason, o.clipped) for o in outs_a] == [
        (o.status, o.version, o.reason, o.clipped) for o in outs_b
    ]
    assert {o.status for o in outs_a} == {Status.APPLIED, Status.FILTERED}
    assert any(o.clipped for o in outs_a)
    assert_same_state(a.state_dict(), c.state_dict())


def test_a_state_for_another_chain_starts_the_filters_afresh() -> None:
    layout = small_layout()
    a = fedasync(layout, "norm:warmup=1")
    push(a, torch.ones(layout.numel), 0)
    b = fedasync(layout, "norm:warmup=2")
    b.load_state_dict(a.state_dict())
    assert b.update_filters.steps[0].norms == [] and b.version == 1


def test_filtered_outcomes_survive_the_ledger_tuple() -> None:
    o = Outcome(Status.FILTERED, 4, staleness=2, reason=FilterReason.NORM_OUTLIER, detail="why")
    back = Outcome.from_tuple(list(o.to_tuple()))
    assert back == o and back.detail == "why" and back.staleness == 2
    plain = Outcome(Status.APPLIED, 3, staleness=1)
    assert len(plain.to_tuple()) == 4 and Outcome.from_tuple(plain.to_tuple()) == plain


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "text, message",
    [
        ("median", "unknown filter 'median'"),
        ("norm:factor=0", "factor must be a finite number > 0"),
        ("norm:factor=inf", "factor must be a finite number > 0"),
        ("norm:window=0", "window must be >= 1"),
        ("norm:window=4,warmup=5", r"warmup must be in \[1, window\]"),
        ("norm:window=2.5", "window must be int"),
        ("norm:tau=1", "has no parameter 'tau'"),
        ("centered_clip:beta=1", r"beta must be in \[0, 1\)"),
        ("centered_clip:tau=-2", "tau must be a finite number > 0"),
        ("norm > ", "must be a non-empty string"),
        ("norm:factor", "expected key=value"),
    ],
)
def test_parse_errors_name_the_key(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedAsyncConfig.from_dict({"update_filter": text})


def test_send_differences_refuses_centered_clip() -> None:
    layout = small_layout()
    with pytest.raises(ValueError, match="send_differences"):
        make_strategy("fedogd", layout=layout, initial=torch.zeros(layout.numel),
                      config={"send_differences": True, "detect": False,
                              "update_filter": "centered_clip"})  # fmt: skip


# ----------------------------------------------------------------------------- over gRPC


def test_grpc_round_trip_filtered_duplicate_new_job_and_metrics(servers) -> None:
    model = tiny_model(3)
    d = ModelLayout.from_module(model).numel
    # Honest deltas have norm ~ 0.1 sqrt(d): clipped at 0.15 sqrt(d), refused past 3x the median.
    tau = 0.15 * math.sqrt(d)
    srv = servers(
        strategy="fedasync",
        strategy_config={"alpha": 0.5, "staleness": "constant",
                         "update_filter": f"norm:warmup=2 > centered_clip:tau={tau}"},
        metrics_port=0,
    )  # fmt: skip
    a = Client(srv.address, "a", retries=0, timeout=15)
    a.register(model)
    gen = torch.Generator().manual_seed(9)

    def honest() -> torch.Tensor:
        return torch.randn(d, generator=gen) * 0.1

    for _ in range(2):
        res = a.push(a.get_job(), honest(), epochs=1.0)
        assert res.status is Status.APPLIED and not res.clipped and res.reason is None
    moderate = a.push(a.get_job(), honest() * 2.0, epochs=1.0)
    assert (moderate.status, moderate.clipped) == (Status.APPLIED, True)
    job = a.get_job()
    huge = honest() * 100.0
    res = a.push(job, huge, epochs=1.0)
    assert (res.status, res.reason, res.version) == (
        Status.FILTERED, FilterReason.NORM_OUTLIER, moderate.version
    )  # fmt: skip
    assert "norm" in res.message and not res.clipped
    again = a.push(job, huge, epochs=1.0, update_id=res.update_id)
    assert (again.status, again.original, again.reason, again.version) == (
        Status.DUPLICATE, Status.FILTERED, FilterReason.NORM_OUTLIER, res.version
    )  # fmt: skip
    fresh = a.get_job()
    assert fresh.job_id != job.job_id and fresh.base_version == job.base_version
    assert a.push(fresh, honest(), epochs=1.0).status is Status.APPLIED

    m = scrape_metrics(srv.server.metrics_port)
    assert m[("aggsrv_updates_total", frozenset({("outcome", "filtered")}))] == 1
    assert m[("aggsrv_updates_total", frozenset({("outcome", "duplicate")}))] == 1
    assert m[("aggsrv_updates_total", frozenset({("outcome", "applied")}))] == 4
    assert m[("aggsrv_updates_filtered_total", frozenset({("reason", "norm_outlier")}))] == 1
    assert m[("aggsrv_updates_clipped_total", frozenset())] == 1
    status = a.status()
    assert dict(status.filtered_by_reason) == {"NORM_OUTLIER": 1}
    assert status.updates_clipped == 1 and status.updates_accepted == 4
    assert status.updates_rejected == 0


def test_a_server_replays_filtered_and_clipped_updates_from_its_log(tmp_path) -> None:
    """Durability on: the log holds the FILTERED update like an accepted one, and a fresh
    federation replaying it reaches the live state bit for bit (replay compares every outcome
    with the logged one, the filter's included)."""
    from server_helpers import RunningServer

    from aggsrv.server.federation import rebuild

    model = tiny_model(4)
    d = ModelLayout.from_module(model).numel
    state_dir = tmp_path / "state"
    srv = RunningServer(
        strategy="fedasync", durability="on", state_dir=str(state_dir),
        strategy_config={"alpha": 0.5,
                         "update_filter": f"norm:warmup=2 > centered_clip:tau={0.15 * d**0.5}"},
    )  # fmt: skip
    gen = torch.Generator().manual_seed(12)
    try:
        a = Client(srv.address, "a", retries=0, timeout=15)
        a.register(model)
        got = [a.push(a.get_job(), torch.randn(d, generator=gen) * s, epochs=1.0)
               for s in (0.1, 0.1, 0.2, 50.0, 0.1)]  # fmt: skip
    finally:
        srv.stop()
    assert [r.status for r in got] == [Status.APPLIED] * 3 + [Status.FILTERED, Status.APPLIED]
    assert [r.clipped for r in got] == [False, False, True, False, False]
    live = srv.strategy.state_dict()
    rebuilt = rebuild(srv.config, state_dir, 1)
    assert_same_state(live, rebuilt.strategy.state_dict(), "replayed")
    assert rebuilt.strategy.update_filters.filtered == {"NORM_OUTLIER": 1}


# ----------------------------------------------------------------------------- sharded


def test_shards_refuse_and_clip_together_as_one_server_does() -> None:
    """Three shards (threads with a summing barrier) take the decisions one server takes: the
    norms are the whole model's, so the refusals and clippings agree, and the joined models
    match the single server's to float32 rounding."""
    from thread_shards import reducers, run_shards

    from aggsrv.sharding import ShardLayout, ShardMap

    whole = ModelLayout.from_named_shapes([("a.weight", (7, 13)), ("a.bias", (7,))])
    D, shards = whole.numel, 3
    gen = torch.Generator().manual_seed(21)
    initial = torch.randn(D, generator=gen)
    scales = [0.1, 0.1, 0.1, 0.25, 100.0, 0.1, 0.3, 0.1, 80.0, 0.1, 0.1, 0.2]
    deltas = [torch.randn(D, generator=gen) * s for s in scales]
    spec = "norm:warmup=3 > centered_clip:factor=1.5,warmup=3"
    config = {"alpha": 0.5, "staleness": "constant", "update_filter": spec}
    shard_map = ShardMap.even(D, shards, align=8)

    def run(strategy, local) -> list[tuple]:
        strategy.on_register("c", 0.0)
        out = []
        for n, d in enumerate(deltas):
            o = push(strategy, local(d).contiguous(), n)
            out.append((o.status, o.version, o.reason, o.clipped))
        return out

    single = make_strategy("fedasync", layout=whole, initial=initial, config=config)
    want = run(single, lambda t: t)
    assert {w[0] for w in want} == {Status.APPLIED, Status.FILTERED} and any(w[3] for w in want)
    results: list = [None] * shards
    strategies = []
    for r, reducer in enumerate(reducers(shards)):
        layout = ShardLayout(whole, shard_map, r)
        strategies.append(make_strategy(
            "fedasync", layout=layout, initial=layout.local(initial).clone(), config=config,
            reducer=reducer,
        ))  # fmt: skip

    def shard(r: int) -> None:
        layout = ShardLayout(whole, shard_map, r)
        results[r] = run(strategies[r], layout.local)

    run_shards(shard, shards)
    assert results == [want] * shards
    joined = shard_map.join([s.global_model() for s in strategies])
    want_model = single.global_model()
    assert float((joined - want_model).abs().max()) <= 1e-6 * (1.0 + float(want_model.abs().max()))


# ----------------------------------------------------------------------------- simulator


def test_inproc_simulation_counts_filtered_updates_apart(tmp_path) -> None:
    """A filter that refuses above 0.9 x the median norm leaves about half the honest updates
    out: the simulator counts them as filtered, not applied and not rejected."""
    from aggsrv.sim import SimConfig, run

    config = SimConfig.from_mapping({
        "strategy": "fedasync", "dataset": "digits", "clients": 3, "model": "mlp",
        "strategy_config": {"alpha": 0.6, "learning_rate": 0.05, "batch_size": 16,
                            "update_filter": "norm:factor=0.9,window=8,warmup=2"},
        "budget": "4v", "eval_every": "4v", "transport": "inproc", "seed": 5,
        "out": str(tmp_path / "run"),
    })  # fmt: skip
    result = run(config, progress=False)
    s = result.summary
    assert s["versions"] == 4 and s["updates_applied"] == 4, s
    assert s["updates_filtered"] >= 1 and s["updates_rejected"] == 0, s
    assert result.metrics[-1]["updates_filtered"] == s["updates_filtered"]


@pytest.mark.parametrize("name", FILTERED_KEYS)
def test_each_strategy_resumes_its_filters_bit_exactly(name: str) -> None:
    """Random calls (registrations, jobs, updates, replays, timers) with a chain tight enough to
    refuse and clip honest updates; a run saved and restored half-way ends in the state of the
    run that never stopped."""
    from strategy_runs import StrategyRun

    chain = "norm:factor=1.02,window=6,warmup=2 > centered_clip:factor=1.0,window=6,warmup=2"
    seed = 40 + FILTERED_KEYS.index(name)
    straight = StrategyRun(name, seed, update_filter=chain)
    half = 35 if name == "feddgic" else 25  # FedDGIC's grouping rounds wait for every client
    for _ in range(2 * half):
        straight.step()
    halted = StrategyRun(name, seed, update_filter=chain)
    for _ in range(half):
        halted.step()
    saved = halted.strategy.state_dict()
    resumed = StrategyRun(name, seed, update_filter=chain).strategy
    resumed.load_state_dict(saved)
    halted.strategy = resumed
    for _ in range(half):
        halted.step()
    final = straight.strategy.state_dict()
    assert_same_state(final, resumed.state_dict(), name)
    counts = final["update_filter"]
    assert counts["filtered"].get("NORM_OUTLIER", 0) >= 1 and counts["clipped"] >= 1, counts
