"""FedDGIC and FedFG as strategies (docs/algorithms/feddgic.md 1.4-1.5): the grouping phase against
a float64 numpy oracle and scipy's linkage, Algorithm 2 with dropouts against a direct float64
implementation of Eqs. 8-10, FedFG's reduction, timeouts, late joiners, regrouping, events,
float buffers and state_dict round trips. (Eq. 5, the cut and the spec's Algorithm 2 trace are
in test_grouping.py and test_compensation.py.)"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from state_helpers import assert_same_state

from aggsrv.layout import ModelLayout
from aggsrv.strategies import JobSuperseded, Update, UpdateKind, make_strategy
from aggsrv.strategies.grouping import group_count

hierarchy = pytest.importorskip("scipy.cluster.hierarchy")
distance = pytest.importorskip("scipy.spatial.distance")

# Three modules of unequal size (fc1 dominates, as in the paper's MLP): D = 49.
LAYOUT = ModelLayout.from_named_shapes(
    [
        ("fc1.weight", (4, 6)),
        ("fc1.bias", (4,)),
        ("fc2.weight", (3, 4)),
        ("fc2.bias", (3,)),
        ("out.weight", (2, 3)),
    ]  # fmt: skip
)
D = LAYOUT.numel
MODULES = [(0, 28), (28, 43), (43, 49)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Driver:
    """Submits updates for the strategy's outstanding jobs and records the events."""

    def __init__(self, name: str, seed: int = 0, n: int = 9, **config) -> None:
        g = _gen(seed)
        self.s = make_strategy(name, layout=LAYOUT, initial=torch.randn(D, generator=g),
                               config=config)  # fmt: skip
        self.events: list[dict] = []
        self.s.event_sink = self.events.append
        self.ids = [f"c{i}" for i in range(n)]
        for c in self.ids:
            self.s.on_register(c, 0.0)
        self.n = 0

    def job(self, cid: str, now: float = 0.0):
        return self.s.outstanding_job(cid) or self.s.job_for(cid, now)

    def submit(self, cid, delta, *, kind=UpdateKind.DELTA, samples=10, now=0.0, buffers=None):
        job = self.job(cid, now)
        assert job is not None, cid
        self.n += 1
        tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
        upd = Update(cid, job.job_id, job.base_version, f"u{self.n}", samples, 1.0, kind,
                     tensor.float(), buffers)  # fmt: skip
        return self.s.on_update(upd, now), job


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


def _similarity(rows: np.ndarray, mode: str) -> np.ndarray:
    """The spec's 1.4.2 similarity, pair by pair in float64 (independent of the kernels)."""
    m = rows.shape[0]
    s = np.zeros((m, m))
    sizes = np.array([e - b for b, e in MODULES], dtype=np.float64)
    for i in range(m):
        for j in range(m):
            if mode == "none":
                s[i, j] = _cos(rows[i], rows[j])
                continue
            per = np.array([_cos(rows[i, b:e], rows[j, b:e]) for b, e in MODULES])
            s[i, j] = per.mean() if mode == "per_layer_mean" else per @ sizes / sizes.sum()
    return s


def _scipy_partition(s_avg: np.ndarray, ids: list[str], p: float = 0.8):
    d = 1.0 - (s_avg + s_avg.T) / 2
    np.fill_diagonal(d, 0.0)
    Z = hierarchy.linkage(distance.squareform(np.maximum(d, 0.0), checks=False), "average")
    k, _ = group_count(Z[:, 2], p)
    labels = hierarchy.fcluster(Z, k, "maxclust")
    return _partition(labels, ids), Z


def _partition(labels, ids) -> set[frozenset[str]]:
    groups: dict[int, set[str]] = {}
    for cid, g in zip(ids, labels, strict=True):
        groups.setdefault(int(g), set()).add(cid)
    return {frozenset(v) for v in groups.values()}


def _planted(g: torch.Generator, n: int, clusters: int) -> list[torch.Tensor]:
    """Cluster directions with a different scale per module (the layer-scale problem)."""
    scale = torch.ones(D)
    scale[28:43] = 20.0
    scale[43:] = 0.05
    return [torch.randn(D, generator=g) * scale for _ in range(clusters)]


# ----------------------------------------------------------------------------- grouping phase


@pytest.mark.parametrize("layer_norm", ["per_layer_mean", "none", "param_weighted"])
@pytest.mark.parametrize("sim_input", ["update", "weights"])
def test_grouping_phase_against_float64_oracle_and_scipy(layer_norm: str, sim_input: str) -> None:
    n = 9
    drv = Driver("feddgic", seed=1, n=n, min_available=n, layer_norm=layer_norm,
                 sim_input=sim_input)  # fmt: skip
    s = drv.s
    assert s.n_cal == 2 and s.phase == "grouping"  # Eq. 6: n = 9 -> 2
    g = _gen(2)
    centers = _planted(g, n, 3)
    rng = random.Random(3)
    s_sum = np.zeros((n, n))
    order_seen: list[str] = []
    for rnd in range(2):
        base = s.global_model().double().clone()
        acc, total = torch.zeros(D, dtype=torch.float64), 0
        rows = {}
        for cid in rng.sample(drv.ids, n):
            delta = 0.1 * centers[int(cid[1:]) % 3] + 0.02 * torch.randn(D, generator=g)
            samples = rng.randint(3, 30)
            kind = UpdateKind.WEIGHTS if rng.random() < 0.5 else UpdateKind.DELTA
            outcome, job = drv.submit(cid, delta, kind=kind, samples=samples)
            assert torch.equal(job.weights.double(), base)
            w_new = (job.weights + delta.float()).double()
            rows[cid] = (w_new - base if sim_input == "update" else w_new).numpy()
            acc += samples * w_new
            total += samples
            if cid not in order_seen:
                order_seen.append(cid)
        assert outcome.status.value == "APPLIED" and outcome.version == rnd + 1
        torch.testing.assert_close(s.global_model().double(), acc / total, rtol=1e-6, atol=1e-6)
        mat = np.stack([rows[c] for c in drv.ids])
        s_sum += _similarity(mat, layer_norm)
    assert s.phase == "async" and s.grouping is not None
    expected, Z = _scipy_partition(s_sum / 2, drv.ids)
    got = _partition([s.grouping.labels[order_seen.index(c)] for c in drv.ids], drv.ids)
    assert got == expected
    np.testing.assert_allclose(s.grouping.heights, Z[:, 2], rtol=1e-5, atol=1e-6)
    if layer_norm == "per_layer_mean" and sim_input == "update":
        planted = {frozenset(c for c in drv.ids if int(c[1:]) % 3 == k) for k in range(3)}
        assert got == planted
    (event,) = drv.events
    assert event["event"] == "grouping" and event["reason"] == "initial"
    assert event["version"] == 2 and event["k"] == s.grouping.k and event["n_cal"] == 2
    assert event["clients"] == order_seen and event["labels"] == list(s.grouping.labels)
    assert len(event["linkage"]) == n - 1 and len(event["heights"]) == n - 1


def test_grouping_round_timeout_late_updates_and_per_pair_averaging() -> None:
    """A client missing from round 1 is averaged over round 2 only; its late job is refused."""
    n = 5
    drv = Driver("feddgic", seed=4, n=n, min_available=n, grouping_round_timeout=5.0)
    s = drv.s
    g = _gen(5)
    deltas = {c: [torch.randn(D, generator=g) for _ in range(2)] for c in drv.ids}
    for cid in drv.ids[:-1]:
        drv.submit(cid, deltas[cid][0])
    late_job = drv.job("c4")
    assert s.version == 0 and s.next_deadline() == 5.0
    s.on_timer(4.9)
    assert s.version == 0
    s.on_timer(5.0)
    assert s.version == 1
    before = s.state_dict()
    with pytest.raises(JobSuperseded):
        s.on_update(Update("c4", late_job.job_id, 0, "late", 10, 1.0, UpdateKind.DELTA,
                           deltas["c4"][0]), 6.0)  # fmt: skip
    assert_same_state(before, s.state_dict())
    for cid in drv.ids:
        drv.submit(cid, deltas[cid][1], now=6.0)
    assert s.phase == "async"
    r1 = _similarity(np.stack([deltas[c][0].double().numpy() for c in drv.ids[:-1]]),
                     "per_layer_mean")  # fmt: skip
    r2 = _similarity(np.stack([deltas[c][1].double().numpy() for c in drv.ids]),
                     "per_layer_mean")  # fmt: skip
    avg = r2.copy()
    avg[:4, :4] = (r1 + r2[:4, :4]) / 2  # c4 took part in round 2 only
    _, Z = _scipy_partition(avg, drv.ids)
    np.testing.assert_allclose(s.grouping.heights, Z[:, 2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("outside", ["not_a_participant", "round_closed"])
def test_an_update_outside_the_open_grouping_round_is_refused_not_dropped(outside: str) -> None:
    """Refuse or apply, never both: an update whose job is not part of the open grouping round
    is refused (ABORTED, a message naming the round) and changes nothing; it used to answer
    BUFFERED while leaving the update out of the round's average. A closed round retires its
    jobs, so the API alone cannot hold such a job: the state here is built by hand."""
    n = 4
    drv = Driver("feddgic", seed=6, n=n, min_available=n, grouping_round_timeout=5.0)
    g = _gen(7)
    drv.submit("c0", torch.randn(D, generator=g))
    job = drv.job("c1")
    state = drv.s.state_dict()
    if outside == "not_a_participant":
        del state["extra"]["participants"]["c1"]
    else:
        state["extra"]["round_open"] = False
    drv.s.load_state_dict(state)
    before = drv.s.state_dict()
    upd = Update("c1", job.job_id, job.base_version, "x", 10, 1.0, UpdateKind.DELTA,
                 torch.randn(D, generator=g))  # fmt: skip
    with pytest.raises(JobSuperseded, match="grouping round") as err:
        drv.s.on_update(upd, 1.0)
    assert err.value.code == "ABORTED"
    assert_same_state(before, drv.s.state_dict())


def test_a_round_without_any_update_is_extended() -> None:
    drv = Driver("feddgic", n=3, min_available=3, grouping_round_timeout=2.0)
    drv.s.on_timer(2.0)
    assert drv.s.version == 0 and drv.s.next_deadline() == 4.0


@pytest.mark.parametrize("n", [1, 2])
def test_one_or_two_clients_form_one_group(n: int) -> None:
    drv = Driver("feddgic", n=n, min_available=n, similarity_rounds=1)
    g = _gen(6)
    for cid in drv.ids:
        drv.submit(cid, torch.randn(D, generator=g))
    assert drv.s.phase == "async" and drv.s.grouping.k == 1
    outcome, _ = drv.submit("c0", torch.randn(D, generator=g))
    assert outcome.version == 2


# ----------------------------------------------------------------------------- Algorithm 2


def _grouped(name: str, n: int = 6, seed: int = 7, **config) -> tuple[Driver, torch.Generator]:
    """A strategy past its grouping phase with groups {c0,c1,c2}, {c3,c4,c5}."""
    drv = Driver(name, seed=seed, n=n, min_available=n, similarity_rounds=1, **config)
    g = _gen(seed + 100)
    centers = _planted(g, n, 2)
    for cid in drv.ids:
        drv.submit(cid, 0.1 * centers[int(cid[1:]) // 3] + 0.01 * torch.randn(D, generator=g))
    groups = drv.s.grouping.groups()
    ids = drv.events[0]["clients"]
    assert {frozenset(ids[i] for i in grp) for grp in groups} == {
        frozenset({"c0", "c1", "c2"}),
        frozenset({"c3", "c4", "c5"}),
    }
    return drv, g


class Algorithm2:
    """Eqs. 8-10 and the dropout scan, directly in float64 (spec 1.5.6 order)."""

    def __init__(self, groups, w0, a_glob=0.5, a_max=0.8, beta=1.0, t_factor=2, compensate=True):
        self.group_of = {c: gi for gi, grp in enumerate(groups) for c in grp}
        self.groups = groups
        self.w = w0.double().clone()
        self.wg = [w0.double().clone() for _ in groups]
        self.vg = [0] * len(groups)
        self.vi = dict.fromkeys(self.group_of, 0)
        self.dropped = dict.fromkeys(self.group_of, False)
        self.a_glob, self.a_max, self.beta, self.tf, self.comp = (
            a_glob, a_max, beta, t_factor, compensate,
        )  # fmt: skip

    def submit(self, c: str, w_new: torch.Tensor) -> None:
        gi = self.group_of[c]
        n_g = len(self.groups[gi])
        stale = max(self.vg[gi] - self.vi[c] - n_g, 0)
        a = self.a_max / (1 + self.beta * stale)
        self.wg[gi] = a * w_new.double() + (1 - a) * self.wg[gi]
        self.vg[gi] += 1
        t = max(2, self.tf * n_g)
        for j in self.groups[gi]:
            self.dropped[j] = j != c and self.vg[gi] - self.vi[j] >= t
        d_g = sum(self.dropped[j] for j in self.groups[gi]) if self.comp else 0
        a_comp = 1 - (1 - self.a_glob) ** (n_g / (n_g - d_g))
        self.w = a_comp * self.wg[gi] + (1 - a_comp) * self.w
        self.vi[c] = self.vg[gi]


def test_async_phase_with_a_dropout_matches_algorithm_2_in_float64() -> None:
    drv, g = _grouped("feddgic")
    s = drv.s
    oracle = Algorithm2([["c0", "c1", "c2"], ["c3", "c4", "c5"]], s.global_model())
    drv.events.clear()
    order = ["c0", "c1", "c2", "c3", "c4", "c5"] * 2 + ["c0", "c1", "c3", "c4", "c5"] * 4
    rng = random.Random(8)
    for step, cid in enumerate(order):
        delta = torch.randn(D, generator=g) * 0.1
        kind = UpdateKind.WEIGHTS if rng.random() < 0.5 else UpdateKind.DELTA
        outcome, job = drv.submit(cid, delta, kind=kind, now=float(step))
        oracle.submit(cid, job.weights + delta)
        assert outcome.status.value == "APPLIED"
        torch.testing.assert_close(s.global_model().double(), oracle.w, rtol=1e-5, atol=1e-6)
    # c2 went silent after V_c2 = 3 in its group; with T = 6 it is flagged at V_g = 9.
    assert s.dropped() == ["c2"]
    assert [(e["client"], e["dropped"]) for e in drv.events] == [("c2", True)]
    # It comes back: un-flagged, and Eq. 8 damps its stale model.
    drv.submit("c2", torch.randn(D, generator=g))
    assert s.dropped() == [] and drv.events[-1]["dropped"] is False


def test_fedfg_equals_feddgic_without_dropouts_and_does_not_compensate() -> None:
    a, g = _grouped("feddgic", fixed_groups=2)
    b, _ = _grouped("fedfg", fixed_groups=2)
    assert torch.equal(a.s.global_model(), b.s.global_model())
    for _ in range(3):
        for cid in a.ids:
            delta = torch.randn(D, generator=g)
            a.submit(cid, delta)
            b.submit(cid, delta)
            assert torch.equal(a.s.global_model(), b.s.global_model())
    oracle = Algorithm2([["c0", "c1", "c2"], ["c3", "c4", "c5"]], b.s.global_model(),
                        compensate=False)  # fmt: skip
    # Counters restart only in the oracle, so from here on compare FedFG with a fresh replay.
    oracle.vg = [9, 9]
    oracle.vi = {c: 7 + int(c[1:]) % 3 for c in oracle.vi}
    oracle.wg = [w.double().clone() for w in b.s._comp.group_models]
    for cid in ["c0", "c1"] * 5:  # c2 silent: dropped, yet FedFG merges with alpha_global
        delta = torch.randn(D, generator=g)
        _, job = b.submit(cid, delta)
        oracle.submit(cid, job.weights + delta)
        torch.testing.assert_close(b.s.global_model().double(), oracle.w, rtol=1e-5, atol=1e-6)
    assert b.s.dropped() == ["c2"]


def test_late_joiner_gets_its_own_group_or_a_regroup() -> None:
    drv, g = _grouped("feddgic")
    drv.s.on_register("late", 1.0)
    drv.submit("late", torch.randn(D, generator=g))
    assert drv.s.group_of("late") == drv.s.grouping.k  # a new singleton group
    assert [e["event"] for e in drv.events] == ["grouping"]

    drv2, g2 = _grouped("feddgic", regroup_on_join=True)
    drv2.s.on_register("late", 1.0)
    # Like group 1's members: the regroup puts it there.
    like = drv2.s._rows.read(drv2.s._index["c4"]).clone()
    drv2.submit("late", like + 0.001 * torch.randn(D, generator=g2))
    event = drv2.events[-1]
    assert event["event"] == "grouping" and event["reason"] == "join"
    assert "late" in event["clients"]
    assert drv2.s.group_of("late") == drv2.s.group_of("c4")
    assert drv2.s.group_of("late") != drv2.s.group_of("c0")


def test_regroup_every_restarts_the_counters_on_schedule() -> None:
    drv, g = _grouped("feddgic", regroup_every=4)
    for i in range(9):
        drv.submit(drv.ids[i % 6], torch.randn(D, generator=g))
    reasons = [e["reason"] for e in drv.events if e["event"] == "grouping"]
    assert reasons == ["initial", "schedule", "schedule"]
    assert sum(drv.s._comp.group_version) == 1  # one submission since the last regroup


def test_config_errors() -> None:
    for bad in ({"t_mode": "constant"}, {"layer_norm": "zscore"}, {"alpha_global": 1.0},
                {"fixed_groups": 0}, {"sim_input": "gradients"}):  # fmt: skip
        with pytest.raises(ValueError):
            make_strategy("feddgic", layout=LAYOUT, initial=torch.zeros(D), config=bad)
    with pytest.raises(ValueError, match="fedfg has a fixed number of groups"):
        make_strategy("fedfg", layout=LAYOUT, initial=torch.zeros(D), config={"compensate": True})


# ----------------------------------------------------------------------------- state


@pytest.mark.parametrize("stop_after", [3, 9, 20])
def test_state_dict_round_trip_in_each_phase(stop_after: int) -> None:
    """Saved mid grouping round (3 updates), right after the grouping (9) and in the
    asynchronous phase with a dropout flagged (20); both continue bit-identically."""
    cfg = {"min_available": 6, "similarity_rounds": 1, "regroup_every": 7}
    a = Driver("feddgic", seed=9, n=6, **cfg)
    g = _gen(10)
    schedule = [(f"c{i % 6}", torch.randn(D, generator=g)) for i in range(6)]
    schedule += [(f"c{i % 5}", torch.randn(D, generator=g)) for i in range(30)]
    for cid, delta in schedule[:stop_after]:
        a.submit(cid, delta)
    b = Driver("feddgic", seed=99, n=6, **cfg)
    b.s.load_state_dict(a.s.state_dict())
    b.n = a.n  # the same update ids from here on (the ledger travels with the state)
    assert_same_state(a.s.state_dict(), b.s.state_dict())
    a.events.clear()
    for cid, delta in schedule[stop_after:]:
        a.submit(cid, delta)
        b.submit(cid, delta)
        assert torch.equal(a.s.global_model(), b.s.global_model())
    assert a.events == b.events and a.s.dropped() == b.s.dropped()


# ----------------------------------------------------------------------------- float buffers

BN_LAYOUT = ModelLayout(
    [("fc.weight", (3, 5)), ("bn.weight", (3,)), ("bn.bias", (3,))],
    [("bn.running_mean", (3,)), ("bn.running_var", (3,))],
    norm_flags=[False, True, True],
)


def test_float_buffers_follow_the_weights() -> None:
    g = _gen(11)
    d, b = BN_LAYOUT.numel, BN_LAYOUT.buffer_numel
    b0 = torch.rand(b, generator=g) + 0.1
    s = make_strategy("feddgic", layout=BN_LAYOUT, initial=torch.randn(d, generator=g),
                      initial_buffers=b0, config={"min_available": 3, "similarity_rounds": 1,
                                                  "fixed_groups": 1})  # fmt: skip
    for c in ("a", "b", "c"):
        s.on_register(c, 0.0)
    bufs, samples = [], [5, 10, 20]
    for i, c in enumerate(("a", "b", "c")):
        job = s.job_for(c, 0.0)
        bufs.append(torch.rand(b, generator=g) + 0.1)
        s.on_update(Update(c, job.job_id, 0, f"{c}0", samples[i], 1.0, UpdateKind.DELTA,
                           torch.randn(d, generator=g), bufs[-1]), 0.0)  # fmt: skip
    mean = sum(n * x.double() for n, x in zip(samples, bufs, strict=True)) / sum(samples)
    torch.testing.assert_close(s.global_buffers().double(), mean, rtol=1e-6, atol=1e-7)
    job = s.job_for("a", 1.0)
    new = torch.rand(b, generator=g) + 0.1
    s.on_update(Update("a", job.job_id, job.base_version, "a1", 5, 1.0, UpdateKind.DELTA,
                       torch.randn(d, generator=g), new), 1.0)  # fmt: skip
    group = 0.8 * new.double() + 0.2 * mean.float().double()  # Eq. 8, staleness 0
    expected = 0.5 * group + 0.5 * mean  # Eq. 10 with alpha_global, no dropout
    torch.testing.assert_close(s.global_buffers().double(), expected, rtol=1e-5, atol=1e-6)
    assert math.isclose(float(s.global_buffers().sum()), float(expected.sum()), rel_tol=1e-5)
