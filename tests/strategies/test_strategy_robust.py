"""The ``aggregator`` key of every strategy that combines rows (docs/robust.md): planted rows
against hand-computed float64 oracles (the robust rules give the honest value, the mean the
poisoned one), FedAdam and FedEN's weights with a robust rule, checkpoints mid-aggregation,
refused updates, restores across aggregators, and the mean path unchanged."""

from __future__ import annotations

import random
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import scipy.stats
import torch
from state_helpers import assert_same_state
from strategy_runs import StrategyRun

from aggsrv.layout import ModelLayout
from aggsrv.sharding import ShardLayout, ShardMap
from aggsrv.strategies import Strategy, make_strategy
from aggsrv.strategies.ca2fl import CA2FLConfig
from aggsrv.strategies.errors import NonFiniteResult
from aggsrv.strategies.fedavg import FedAvgConfig
from aggsrv.strategies.fedbuff import FedBuffConfig
from aggsrv.strategies.fedhist import FedHistConfig
from aggsrv.strategies.mifa import MIFAConfig
from aggsrv.values import Status, Update, UpdateKind

LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (4, 7)), ("fc.bias", (4,)), ("out", (5,))])
D = LAYOUT.numel  # 37
N = 7  # clients per aggregation, 2 of them Byzantine


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(31)
    print(f"seed={seed}")  # shown with a failure
    return torch.Generator().manual_seed(seed)


def deltas(gen: torch.Generator, n: int = N) -> torch.Tensor:
    """n rows: clients 2.. honest (around 0.1), clients 0 and 1 huge and opposite-ish."""
    rows = 0.1 + 0.02 * torch.randn(n, D, generator=gen)
    rows[0] = 500.0
    rows[1] = 300.0 + torch.randn(D, generator=gen)
    return rows


def make(name: str, clients: int = N, initial: torch.Tensor | None = None, **config: Any):
    x0 = torch.linspace(-1, 1, D) if initial is None else initial
    s = make_strategy(name, layout=LAYOUT, initial=x0.clone(), config=config)
    for i in range(clients):
        s.on_register(f"c{i}", 0.0)
    return s


_uid = iter(range(10**9))


def update(
    s: Strategy, cid: str, delta: torch.Tensor, samples: int = 10, job=None, kind=None, uid=None
):
    job = job or s.job_for(cid, 0.0)
    assert job is not None, cid
    kind = kind or UpdateKind.DELTA
    tensor = delta.clone() if kind is UpdateKind.DELTA else job.weights + delta
    return Update(
        client_id=cid, job_id=job.job_id, base_version=job.base_version,
        update_id=uid or f"u{next(_uid)}", num_samples=samples, work_done=job.recipe.work_target,
        kind=kind, tensor=tensor,
    )  # fmt: skip


def send_round(s: Strategy, rows: torch.Tensor, samples=None, kinds=True):
    out = None
    for i in range(rows.shape[0]):
        kind = UpdateKind.WEIGHTS if kinds and i % 3 == 2 else UpdateKind.DELTA
        n = 10 if samples is None else samples[i]
        out = s.on_update(update(s, f"c{i}", rows[i], n, kind=kind), 0.0)
    return out


def f64(t: torch.Tensor) -> np.ndarray:
    return t.double().numpy()


def krum_pick(X: np.ndarray, f: int, m: int) -> np.ndarray:
    K = X.shape[0]
    d2 = ((X[:, None] - X[None]) ** 2).sum(-1)
    scores = [np.sort(np.delete(d2[i], i))[: K - f - 2].sum() for i in range(K)]
    return np.argsort(scores, kind="stable")[:m]


def honest_close(model: torch.Tensor, want: np.ndarray, atol: float = 2e-6) -> None:
    np.testing.assert_allclose(f64(model), want, rtol=1e-6, atol=atol)


# ----------------------------------------------------------------------------- FedAvg family


RULES_FEDAVG = {
    "median": lambda X: np.median(X, 0),
    "trimmed_mean:trim=0.3": lambda X: scipy.stats.trim_mean(X, 0.3, axis=0),
    "krum:f=2": lambda X: X[krum_pick(X, 2, 1)[0]],
}


@pytest.mark.parametrize("rule", sorted(RULES_FEDAVG))
@pytest.mark.parametrize("mode", ["sync", "k_async"])
def test_fedavg_robust_rules_give_the_honest_value_and_the_mean_the_poisoned(gen, rule, mode):
    rows = deltas(gen)
    cfg = {"mode": mode, "k": N, "min_clients": N, "round_timeout": None}
    robust, mean = make("fedavg", aggregator=rule, **cfg), make("fedavg", **cfg)
    x0 = f64(robust.global_model())
    out = send_round(robust, rows)
    assert (out.status, out.version) == (Status.APPLIED, 1)
    send_round(mean, rows)
    X = f64(rows)
    honest_close(robust.global_model(), x0 + RULES_FEDAVG[rule](X))
    honest_close(mean.global_model(), x0 + X.mean(0), atol=1e-4)
    assert float(mean.global_model().max()) > 100.0
    assert float((robust.global_model().double() - torch.tensor(x0)).abs().max()) < 0.2
    assert robust._robust.last_info.rule == rule.partition(":")[0]


def test_fedadam_with_a_robust_rule_steps_on_the_rules_aggregate(gen) -> None:
    rows = deltas(gen)
    beta1, beta2, tau, lr = 0.9, 0.99, 1e-3, 0.01
    s = make(
        "fedavg", aggregator="trimmed_mean:trim=0.3", server_opt="adam", min_clients=N,
        round_timeout=None,
    )  # fmt: skip
    x0 = f64(s.global_model())
    send_round(s, rows)
    d = scipy.stats.trim_mean(f64(rows), 0.3, axis=0)
    m = (1 - beta1) * d
    v = beta2 * tau**2 + (1 - beta2) * d * d
    np.testing.assert_allclose(f64(s.global_model()), x0 + lr * m / (np.sqrt(v) + tau), atol=1e-6)
    np.testing.assert_allclose(f64(s._m), m, rtol=1e-5)


def test_feden_weights_the_selected_rows_of_multi_krum(gen) -> None:
    rows = deltas(gen)
    samples = [5, 7, 11, 13, 0, 17, 19]  # client 4 weighs 0: in no rule
    s = make(
        "feden", aggregator="multi_krum:f=2,m=3", weighting="samples", participation=1.0,
        min_clients=N, round_timeout=None,
    )  # fmt: skip
    x0 = f64(s.global_model())
    send_round(s, rows, samples)
    kept = [i for i in range(N) if samples[i]]
    X = f64(rows)[kept]
    sel = krum_pick(X, 2, 3)
    w = np.array([samples[kept[i]] for i in sel], dtype=float)
    want = x0 + (w[:, None] * X[sel]).sum(0) / w.sum()
    honest_close(s.global_model(), want)
    assert set(s._robust.last_info.selected) == {kept[i] for i in sel}
    assert not {0, 1} & set(s._robust.last_info.selected)


# ----------------------------------------------------------------------------- buffered


def test_fedbuff_robust_rule_replaces_sum_over_m(gen) -> None:
    rows = deltas(gen)
    robust = make("fedbuff", buffer_size=N, server_lr=0.5, aggregator="median")
    clipped = make("fedbuff", buffer_size=N, server_lr=0.5, aggregator="norm_bound:max=1 > mean")
    mean = make("fedbuff", buffer_size=N, server_lr=0.5)
    x0 = f64(robust.global_model())
    for s in (robust, clipped, mean):
        assert send_round(s, rows).status is Status.APPLIED
    X = f64(rows)
    honest_close(robust.global_model(), x0 + 0.5 * np.median(X, 0))
    norms = np.linalg.norm(X, axis=1)
    honest_close(clipped.global_model(), x0 + 0.5 * (X * np.minimum(1, 1 / norms)[:, None]).mean(0))
    honest_close(mean.global_model(), x0 + 0.5 * X.mean(0), atol=1e-4)
    assert clipped._robust.last_info.clipped == 2


def test_fedbuff_rows_carry_the_staleness_weight(gen) -> None:
    s = make("fedbuff", buffer_size=3, staleness_weighting=True, aggregator="median")
    x0 = f64(s.global_model())
    stale = s.job_for("c6", 0.0)  # from version 0
    first = deltas(gen)[2:5]
    send_round_named = [update(s, f"c{i}", first[i]) for i in range(3)]
    for u in send_round_named:
        s.on_update(u, 0.0)
    x1 = f64(s.global_model())
    np.testing.assert_allclose(x1, x0 + np.median(f64(first), 0), atol=1e-6)
    rows = deltas(gen)[2:5]
    s.on_update(update(s, "c6", rows[0], job=stale), 0.0)  # staleness 1: weight 1/sqrt(2)
    s.on_update(update(s, "c3", rows[1]), 0.0)
    s.on_update(update(s, "c4", rows[2]), 0.0)
    X = f64(rows) * np.array([1 / np.sqrt(2), 1, 1])[:, None]
    np.testing.assert_allclose(f64(s.global_model()), x1 + np.median(X, 0), atol=1e-6)


def test_ca2fl_robust_cache_estimate_and_correction(gen) -> None:
    s = make("ca2fl", buffer_size=N, aggregator="median")
    x0 = f64(s.global_model())
    first, second = deltas(gen), deltas(gen)
    send_round(s, first)
    # First buffer: no client has reported, h_bar = 0; the correction is the median of deltas.
    x1 = x0 + np.median(f64(first), 0)
    honest_close(s.global_model(), x1)
    order = [3, 0, 6, 1, 2, 5, 4]  # the cache is read at the buffer's first arrival
    for i in order:
        s.on_update(update(s, f"c{i}", second[i]), 0.0)
    hbar = np.median(f64(first), 0)
    calibrated = f64(second) - f64(first)
    honest_close(s.global_model(), x1 + hbar + np.median(calibrated, 0))
    assert torch.equal(s.cached_update("c4"), second[4])


# ----------------------------------------------------------------------------- MIFA, FedHist


def test_mifa_rule_over_the_clients_that_uploaded(gen) -> None:
    rows = deltas(gen)
    # c7 is a straggler that never uploads: the mean counts its zero row (count_empty_rows),
    # a robust rule only the rows of clients that uploaded.
    cfg = {"learning_rate": 0.5, "min_available": N + 1, "tiers": {"c7": 3}}
    robust = make("mifa", N + 1, aggregator="geometric_median:iters=300,tol=0", **cfg)
    mean = make("mifa", N + 1, **cfg)
    x0 = f64(robust.global_model())
    for s in (robust, mean):
        assert send_round(s, rows, kinds=False).status is Status.APPLIED
    X = f64(rows)  # pseudo-gradients -delta / lr, stepped by -lr: the deltas themselves
    z = f64(robust.global_model()) - x0
    d = np.linalg.norm(X - z, axis=1)
    grad = ((z - X) / d[:, None]).sum(0)  # the geometric median's optimality condition
    assert np.linalg.norm(grad) < 1e-2
    assert np.abs(z - 0.1).max() < 0.1
    honest_close(mean.global_model(), x0 + X.sum(0) / (N + 1), atol=1e-4)


def test_twafl_and_fedhist_combine_the_rounds_rows(gen) -> None:
    rows = deltas(gen)
    lr = 0.1
    twafl = make("twafl", buffer_size=N, aggregator="median")
    fedhist = make("fedhist", buffer_size=N, aggregator="median")
    x0 = f64(twafl.global_model())
    for s in (twafl, fedhist):
        assert send_round(s, rows, kinds=False).status is Status.APPLIED
    g = -f64(rows) / lr  # one local step: g = -delta / (lr * 1)
    a = np.median(g, 0)  # fresh updates: equal HAA weights summing to 1
    honest_close(twafl.global_model(), x0 - lr * a)
    # FedHist: INA rescales to the median row norm (no history to fuse in round 1).
    ina = a * np.median(np.linalg.norm(g, axis=1)) / np.linalg.norm(a)
    honest_close(fedhist.global_model(), x0 - lr * ina, atol=1e-5)


# ----------------------------------------------------------------------------- state


CASES = {
    "fedavg": {"min_clients": N, "round_timeout": None},
    "fedbuff": {"buffer_size": N},
    "ca2fl": {"buffer_size": N},
    "fedhist": {"buffer_size": N},
    "mifa": {"min_available": N},
}


def rounds(s: Strategy, gen: torch.Generator, count: int, stop_after: int | None = None):
    """``count`` aggregations of N updates each (the last one's jobs issued first); returns the
    updates not yet sent when ``stop_after`` of the last round's were."""
    for r in range(count):
        jobs = {f"c{i}": s.job_for(f"c{i}", 0.0) for i in range(N)}
        ups = [
            update(s, c, d, job=j, uid=f"r{r}{c}")
            for (c, j), d in zip(jobs.items(), deltas(gen), strict=True)
        ]
        last = r == count - 1
        for k, u in enumerate(ups):
            if last and stop_after is not None and k == stop_after:
                return ups[k:]
            s.on_update(u, 0.0)
    return []


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_state_saved_mid_aggregation_resumes_bitwise(gen, name) -> None:
    cfg = {**CASES[name], "aggregator": "centered_clipping"}  # a centre to carry too
    s = make(name, **cfg)
    rest = rounds(s, gen, 2, stop_after=3)
    assert s.version == 1 and len(rest) == N - 3
    saved = s.state_dict()
    other = make(name, **cfg)
    other.load_state_dict(saved)
    assert_same_state(other.state_dict(), saved)
    for u in rest:
        a, b = s.on_update(u, 0.0), other.on_update(u, 0.0)
        assert a == b
    assert s.version == 2
    assert torch.equal(s.global_model(), other.global_model())
    assert_same_state(s.state_dict(), other.state_dict())


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_refused_update_leaves_the_kept_rows_unchanged(gen, name) -> None:
    s = make(name, **CASES[name], aggregator="median")
    rest = rounds(s, gen, 2, stop_after=2)
    before = s.state_dict()
    u = rest[0]
    big = torch.finfo(torch.float32).max  # finite, past what a step may reach
    huge = update(s, u.client_id, torch.full((D,), big), job=s.outstanding_job(u.client_id))
    with pytest.raises(NonFiniteResult):
        s.on_update(huge, 0.0)
    assert_same_state(s.state_dict(), before)
    for u in rest:  # the round goes on as if nothing happened
        s.on_update(u, 0.0)
    assert s.version == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_default_and_an_explicit_mean_are_the_same_path(gen, name) -> None:
    seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
    a = make(name, **CASES[name])
    b = make(name, **CASES[name], aggregator="mean")
    rounds(a, torch.Generator().manual_seed(seed), 2, stop_after=4)
    rounds(b, torch.Generator().manual_seed(seed), 2, stop_after=4)
    assert a._robust is None and b._robust is None  # the running sums, as before the key
    assert_same_state(a.state_dict(), b.state_dict())


def test_fedavg_mean_path_matches_todays_arithmetic_in_float64(gen) -> None:
    rows = deltas(gen)
    samples = [3, 5, 7, 11, 13, 17, 19]
    s = make("fedavg", aggregator="mean", min_clients=N, round_timeout=None)
    x0 = f64(s.global_model())
    send_round(s, rows, samples)
    w = np.array(samples, dtype=float)
    np.testing.assert_allclose(
        f64(s.global_model()), x0 + (w[:, None] * f64(rows)).sum(0) / w.sum(), rtol=1e-6,
        atol=1e-4,
    )  # fmt: skip


def test_restoring_across_aggregators(gen) -> None:
    cfg = CASES["fedavg"]
    s = make("fedavg", **cfg, aggregator="median")
    rest = rounds(s, gen, 1, stop_after=4)
    mid = s.state_dict()
    mean = make("fedavg", **cfg)
    before = mean.state_dict()
    with pytest.raises(ValueError, match="saved with aggregator 'median' part-way"):
        mean.load_state_dict(mid)
    assert_same_state(mean.state_dict(), before)
    # Rows serve any robust rule: Krum on the saved rows.
    krum = make("fedavg", **cfg, aggregator="krum:f=2")
    krum.load_state_dict(mid)
    x0 = f64(krum.global_model())
    for u in rest:
        krum.on_update(u, 0.0)
    saved_rows = [f64(r) for r in mid["extra"]["robust"]["rows"]]
    rows = np.stack(saved_rows + [f64(u.tensor) for u in rest])
    honest_close(krum.global_model(), x0 + rows[krum_pick(rows, 2, 1)[0]])
    # Between aggregations any aggregator resumes, the mean's state into a robust one too.
    between = mean.state_dict()
    make("fedavg", **cfg, aggregator="median").load_state_dict(between)
    mean.load_state_dict(krum.state_dict())
    robust_mid = make("fedavg", **cfg)
    rounds(robust_mid, gen, 1, stop_after=2)
    with pytest.raises(ValueError, match="saved with aggregator 'mean' part-way"):
        make("fedavg", **cfg, aggregator="median").load_state_dict(robust_mid.state_dict())


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("config", "values", "message"),
    [
        (FedBuffConfig, {"buffer_size": 4, "aggregator": "krum:f=2"}, "buffer_size = 4"),
        (CA2FLConfig, {"buffer_size": 5, "aggregator": "bulyan"}, r"K >= 4f \+ 3"),
        (FedHistConfig, {"buffer_size": 3, "aggregator": "krum:f=1"}, "buffer_size = 3"),
        (FedAvgConfig, {"mode": "k_async", "k": 6, "aggregator": "bulyan:f=1"}, "k = 6"),
        (FedAvgConfig, {"aggregator": "avg"}, "unknown rule 'avg'; the rules: mean"),
        (MIFAConfig, {"aggregator": "median:f=1"}, "no parameter 'f'"),
        (FedAvgConfig, {"aggregator": 3}, "aggregator"),
    ],
)
def test_config_refuses_an_aggregator_it_cannot_run(config, values, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        config.from_dict(values)


def test_sync_rounds_and_a_too_small_round_fall_back_to_the_median(gen, caplog) -> None:
    # A sync round's size is not known in advance: Krum with too few rows takes the median.
    s = make("fedavg", 3, aggregator="krum:f=1", min_clients=3, round_timeout=None)
    x0 = f64(s.global_model())
    rows = deltas(gen, 3)
    rows[1] = 0.1  # one bad row of three: the median stays honest
    send_round(s, rows)
    honest_close(s.global_model(), x0 + np.median(f64(rows), 0))
    assert s._robust.fallbacks == 1 and "median" in s._robust.last_info.fallback
    FedAvgConfig.from_dict({"aggregator": "krum:f=1"})  # sync: accepted when built


def test_every_strategy_with_the_key_describes_it() -> None:
    for config in (FedAvgConfig, FedBuffConfig, CA2FLConfig, FedHistConfig, MIFAConfig):
        assert "median" in config.field_help()["aggregator"]
        assert config().aggregator == "mean"


# ----------------------------------------------------------------------------- random runs


ROBUST_NAMES = ["fedavg", "fedprox", "feden", "fedbuff", "ca2fl", "fedhist", "twafl", "mifa"]


@pytest.mark.parametrize("name", ROBUST_NAMES)
def test_random_runs_resume_from_a_state_loaded_anywhere(name: str) -> None:
    """Registrations, job requests, DELTA and WEIGHTS updates with float buffers, replays and
    deadlines in a random order: two runs of one seed agree bitwise, and one that loads the
    other's state at a random step goes on identically (the rows, weights and centre are the
    whole robust state)."""
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    spec = "norm_bound:max=0.4 > centered_clipping"  # clips some rows, carries a centre
    a = StrategyRun(name, seed, aggregator=spec)
    b = StrategyRun(name, seed, aggregator=spec)
    cut = random.Random(seed).randrange(20, 80)
    for _ in range(cut):
        a.step()
        b.step()
    fresh = make_strategy(
        name, layout=b.layout, initial=torch.zeros(b.layout.numel),
        initial_buffers=torch.ones(b.layout.buffer_numel), config=b.strategy.config,
    )  # fmt: skip
    fresh.load_state_dict(b.strategy.state_dict())
    b.strategy = fresh
    for _ in range(60):
        a.step()
        b.step()
    assert a.strategy.version > 0
    assert_same_state(a.strategy.state_dict(), b.strategy.state_dict())


# ----------------------------------------------------------------------------- sharded


class _Token:
    """Two shards in two threads that take turns: a shard computes only while it holds the
    lock (numba's threading layer is not thread-safe) and lets go of it inside a collective."""

    def __init__(self, world: int) -> None:
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(world)
        self.parts: list[torch.Tensor | None] = [None] * world


class _ThreadReducer:
    def __init__(self, token: _Token, rank: int) -> None:
        self.token, self.rank, self.world_size = token, rank, len(token.parts)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        tok = self.token
        tok.parts[self.rank] = t.double().clone()
        tok.lock.release()
        tok.barrier.wait()
        total = sum(tok.parts[1:], tok.parts[0])  # rank order, float64
        tok.barrier.wait()  # every shard read the parts before the next collective
        tok.lock.acquire()
        return total.to(t.dtype)


SHARDED = {
    "fedavg": ({"min_clients": N, "round_timeout": None}, "krum:f=2"),
    "fedbuff": ({"buffer_size": N}, "geometric_median:iters=20,tol=0"),
    "ca2fl": ({"buffer_size": N}, "norm_bound:max=50 > centered_clipping:iters=2"),
    "fedhist": ({"buffer_size": N}, "bulyan:f=1"),
    "mifa": ({"min_available": N}, "multi_krum:f=2"),
}


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_sharded_strategies_select_alike_and_join_to_the_whole_model(gen, name) -> None:
    config, spec = SHARDED[name]
    config = {**config, "aggregator": spec}
    x0 = torch.linspace(-1, 1, D)
    smap = ShardMap.even(D, 2, align=8)
    token = _Token(2)
    shards = []
    for r in range(2):
        lo, hi = smap.slice(r)
        s = make_strategy(
            name, layout=ShardLayout(LAYOUT, smap, r), initial=x0[lo:hi].clone(), config=config,
            reducer=_ThreadReducer(token, r),
        )  # fmt: skip
        shards.append((s, lo, hi))
    whole = make(name, initial=x0, **config)

    def on_every_shard(call) -> list[Any]:  # noqa: ANN001
        def run(r: int) -> Any:
            with token.lock:
                return call(r, *shards[r])

        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(run, range(2)))

    for i in range(N):
        on_every_shard(lambda r, s, lo, hi, i=i: s.on_register(f"c{i}", 0.0))
    for _ in range(2):
        rows = deltas(gen)
        for i in range(N):
            u = update(whole, f"c{i}", rows[i])
            whole.on_update(u, 0.0)

            def send(r, s, lo, hi, u=u):  # noqa: ANN001, ANN202
                job = s.job_for(u.client_id, 0.0)
                part = update(s, u.client_id, u.tensor[lo:hi], job=job, uid=u.update_id)
                return s.on_update(part, 0.0)

            outcomes = on_every_shard(send)
            assert outcomes[0] == outcomes[1]
    infos = [s._robust.last_info for s, _, _ in shards]
    assert infos[0].selected == infos[1].selected == whole._robust.last_info.selected
    joined = torch.cat([s.global_model() for s, _, _ in shards])
    assert shards[0][0].version == whole.version == 2
    torch.testing.assert_close(joined, whole.global_model(), rtol=1e-5, atol=1e-5)
