"""Straggler and dropout profiles: distributions against scipy oracles, exact tiers, seeding,
ORTHOFL's RPi table, dropouts, FedEN's partial work, spec parsing and errors."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from scipy import optimize, stats

from aggsrv.sim.profiles import (
    PROFILES,
    RASPBERRY_PI_PROFILES,
    RPI_POOLED,
    JobPlan,
    Profile,
    make_profile,
)

SEED = 1234  # fixed: the statistical checks below are deterministic


def durations(profile: Profile, clients: int, rounds: int) -> np.ndarray:
    """All job durations, [client, round]."""
    return np.array([[profile.plan(c, r).duration for r in range(rounds)] for c in range(clients)])


def check_moments(x: np.ndarray, oracle) -> None:
    """Sample mean and std within 5 standard errors of the oracle's (SEs from its moments)."""
    n = x.size
    mean, var, _, kurt = (float(v) for v in oracle.stats(moments="mvsk"))
    std = math.sqrt(var)
    assert abs(x.mean() - mean) < 5 * std / math.sqrt(n), (x.mean(), mean)
    # Var(sample variance) ~ (mu4 - var^2) / n, mu4 = (kurtosis + 3) var^2; delta method for std.
    se_std = math.sqrt((kurt + 2) * var**2 / n) / (2 * std)
    assert abs(x.std() - std) < 5 * se_std, (x.std(), std)


# ---------------------------------------------------------------------------- distributions


@pytest.mark.parametrize(
    ("spec", "oracle"),
    [
        ("exponential", stats.expon(scale=1.0)),
        ("exponential:mean=2.5", stats.expon(scale=2.5)),
        ("exponential:rate=4", stats.expon(scale=0.25)),
        # Parameterised by mean and std (ORTHOFL App. B.4): the oracle is given the same.
        ("lognormal", stats.lognorm(s=math.sqrt(math.log(2)), scale=math.exp(-math.log(2) / 2))),
        ("lognormal:mu=0.5,sigma=0.4", stats.lognorm(s=0.4, scale=math.exp(0.5))),
        ("halfnormal", stats.halfnorm(scale=math.sqrt(math.pi / 2))),
        ("halfnormal:scale=3", stats.halfnorm(scale=3)),
        ("uniform", stats.uniform(loc=0.5, scale=1.0)),
        ("uniform:low=2,high=7", stats.uniform(loc=2, scale=5)),
        ("pareto:shape=6,mean=1.2", stats.pareto(b=6, scale=1.2 * 5 / 6)),
        ("pareto:shape=5,scale=0.5", stats.pareto(b=5, scale=0.5)),
    ],
)
def test_delay_distribution_moments_and_shape(spec: str, oracle) -> None:
    x = durations(make_profile(spec, 100, SEED), 100, 150).ravel()  # 15,000 jobs
    check_moments(x, oracle)
    assert stats.kstest(x, oracle.cdf).pvalue > 1e-3


@pytest.mark.parametrize(
    ("spec", "oracle"),
    [
        ("exponential:rate=4", stats.expon(scale=0.25)),
        (
            "lognormal:mean=3,std=2",
            stats.lognorm(s=math.sqrt(math.log(13 / 9)), scale=3 / math.sqrt(13 / 9)),
        ),
        ("halfnormal:mean=2", stats.halfnorm(scale=2 * math.sqrt(math.pi / 2))),
        ("uniform:low=2,high=7", stats.uniform(loc=2, scale=5)),
        ("pareto:shape=3,mean=1", stats.pareto(b=3, scale=2 / 3)),
        ("pareto:shape=1.5,scale=1", stats.pareto(b=1.5, scale=1)),  # no std: inf, shown as None
    ],
)
def test_described_mean_and_std_are_the_distributions(spec: str, oracle) -> None:
    (component,) = make_profile(spec, 1, SEED).describe()["components"]
    mean, std = float(oracle.mean()), float(oracle.std())
    assert component["mean"] == pytest.approx(mean, rel=1e-12)
    assert component["std"] == (None if math.isinf(std) else pytest.approx(std, rel=1e-12))


def test_zero_spread_is_a_point_mass() -> None:
    for spec, value in (("uniform:low=2,high=2", 2.0), ("lognormal:mean=2,std=0", 2.0)):
        profile = make_profile(spec, 5, SEED, base_time=3)
        assert (durations(profile, 5, 5) == 3 * value).all(), spec
        (component,) = profile.describe()["components"]
        assert (component["mean"], component["std"]) == (pytest.approx(value), 0.0)


def test_shifted_halfnormal_and_speed_follow_their_cdfs() -> None:
    scale = 0.3 / math.sqrt(1 - 2 / math.pi)
    oracle = stats.halfnorm(loc=1 - scale * math.sqrt(2 / math.pi), scale=scale)
    x = durations(make_profile("halfnormal:mean=1,std=0.3", 100, SEED), 100, 150).ravel()
    assert stats.kstest(x, oracle.cdf).pvalue > 1e-3
    speeds = durations(make_profile("speed:dist=pareto,shape=4", 5000, SEED), 5000, 1).ravel()
    assert stats.kstest(speeds, stats.pareto(b=4, scale=0.75).cdf).pvalue > 1e-3


def _preset_spec(name: str, tmp_path) -> str:
    """The preset with the keys it cannot do without: `trace` needs a recorded trace."""
    if name != "trace":
        return name
    path = tmp_path / "trace.jsonl"
    lines = [{"ev": "start", "t": 0.0, "format": 1, "run": "r", "strategy": "fedasync",
              "version": 0}]  # fmt: skip
    for c, (asked, took) in enumerate([(0.0, 1.5), (0.2, 4.0)]):
        lines.append({"ev": "job", "t": asked, "asked": asked, "c": f"c{c}", "job": c,
                      "base": 0, "bytes": 4})  # fmt: skip
        done = asked + took
        lines.append({"ev": "update", "t": done, "start": done, "c": f"c{c}", "job": c,
                      "base": 0, "v": c + 1, "s": 0, "bytes": 4, "out": "applied"})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return f"trace:file={path}"


def test_same_seed_same_trace_for_every_preset(tmp_path) -> None:
    for name in PROFILES:
        spec = _preset_spec(name, tmp_path)
        a, b = make_profile(spec, 6, SEED), make_profile(spec, 6, SEED)
        assert [a.plan(c, r) for c in range(6) for r in range(6)] == [
            b.plan(c, r) for c in range(6) for r in range(6)
        ], name


def test_lognormal_mean_std_mapping_reproduces_the_moments() -> None:
    profile = make_profile("lognormal:mean=3,std=2", 100, SEED)
    (component,) = profile.describe()["components"]
    sigma = math.sqrt(math.log(1 + 4 / 9))
    assert component["sigma"] == pytest.approx(sigma)
    assert component["mu"] == pytest.approx(math.log(3) - sigma**2 / 2)
    assert (component["mean"], component["std"]) == pytest.approx((3, 2))
    check_moments(
        durations(profile, 100, 150).ravel(),
        stats.lognorm(s=sigma, scale=math.exp(math.log(3) - sigma**2 / 2)),
    )


def test_halfnormal_moment_matching_with_a_shift() -> None:
    # docs/algorithms/orthofl.md G11's alternative: scale = std / sqrt(1 - 2/pi), loc =
    # mean - scale sqrt(2/pi).
    scale = 0.3 / math.sqrt(1 - 2 / math.pi)
    oracle = stats.halfnorm(loc=1 - scale * math.sqrt(2 / math.pi), scale=scale)
    x = durations(make_profile("halfnormal:mean=1,std=0.3", 100, SEED), 100, 150).ravel()
    check_moments(x, oracle)
    assert x.min() >= oracle.support()[0]


def test_add_mode_adds_virtual_seconds_and_base_time_scales_mul() -> None:
    added = durations(make_profile("exponential:mode=add,mean=2", 50, SEED, base_time=3), 50, 100)
    check_moments(added.ravel() - 3.0, stats.expon(scale=2))
    scaled = durations(make_profile("exponential", 50, SEED, base_time=3), 50, 100)
    unit = durations(make_profile("exponential", 50, SEED), 50, 100)
    np.testing.assert_allclose(scaled, 3 * unit)


def test_durations_are_positive_and_finite_even_when_draws_hit_zero() -> None:
    # A shifted half-normal with loc < 0 draws many zeros; durations are floored above 0.
    for spec in ("halfnormal:mean=0.1,std=1", "uniform:low=0,high=0", "pareto:shape=0.5,scale=1"):
        x = durations(make_profile(spec, 20, SEED), 20, 50)
        assert np.isfinite(x).all() and (x > 0).all(), spec


# ---------------------------------------------------------------------------- tiers and speed


@pytest.mark.parametrize(
    ("mix", "counts"), [("L1", [30, 10, 10]), ("L2", [20, 15, 15]), ("L3", [10, 20, 20])]
)
@pytest.mark.parametrize("assign", ["shuffled", "contiguous"])
def test_tier_fractions_and_multipliers_are_exact(mix: str, counts: list, assign: str) -> None:
    # docs/algorithms/fedogd.md 2.6: 50 clients, periods 1/3/5, a tier-P job
    # takes exactly P x base_time.
    profile = make_profile(f"tiers:mix={mix},assign={assign}", 50, SEED, base_time=2.0)
    tiers = [profile.tier(c) for c in range(50)]
    assert [tiers.count(p) for p in (1.0, 3.0, 5.0)] == counts
    d = durations(profile, 50, 4)
    assert (d == 2.0 * np.array(tiers)[:, None]).all()
    if assign == "contiguous":  # the authors' select_client: fastest tier first, by index
        assert tiers == sorted(tiers)
    else:
        assert tiers != sorted(tiers)


def test_tier_assignment_is_seeded() -> None:
    a = [make_profile("tiers", 50, 1).tier(c) for c in range(50)]
    b = [make_profile("tiers", 50, 1).tier(c) for c in range(50)]
    c = [make_profile("tiers", 50, 2).tier(c) for c in range(50)]
    assert a == b and a != c


def test_custom_tier_mixes_and_rounding() -> None:
    by_string = make_profile("tiers:mix=1:0.9/2:0.1", 10, SEED)
    by_mapping = make_profile({"name": "tiers", "mix": {"1": 0.9, "2": 0.1}}, 10, SEED)
    assert [by_string.tier(c) for c in range(10)] == [by_mapping.tier(c) for c in range(10)]
    assert sorted(by_string.tier(c) for c in range(10)) == [1.0] * 9 + [2.0]
    # Largest remainder: 0.4/0.3/0.3 of 7 clients is 2.8/2.1/2.1 -> 3/2/2.
    tiers = [make_profile("tiers", 7, SEED).tier(c) for c in range(7)]
    assert [tiers.count(p) for p in (1.0, 3.0, 5.0)] == [3, 2, 2]


def test_speed_factors_are_per_client_and_seeded() -> None:
    profile = make_profile("speed", 4000, SEED)
    d = durations(profile, 4000, 2)
    assert (d[:, 0] == d[:, 1]).all()  # a client's speed does not change between jobs
    check_moments(d[:, 0], stats.lognorm(s=0.5, scale=math.exp(-0.125)))
    uniform = durations(make_profile("speed:dist=uniform", 2000, SEED), 2000, 1)
    assert uniform.min() >= 1.0 and uniform.max() <= 3.0
    check_moments(uniform.ravel(), stats.uniform(loc=1, scale=2))


def test_components_multiply() -> None:
    both = make_profile({"tiers": {"mix": "L1"}, "exponential": {}}, 50, SEED, base_time=2)
    alone = make_profile("exponential", 50, SEED)
    for c in range(50):
        for r in range(3):
            expected = 2 * both.tier(c) * alone.plan(c, r).duration
            assert both.plan(c, r).duration == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------- determinism

EVERYTHING = "tiers+speed+lognormal+pareto:mode=add+raspberry_pi+partial_work:fraction=0.3"


def test_plans_do_not_depend_on_the_profile_object_or_the_call_order() -> None:
    pairs = [(c, r) for c in range(12) for r in range(10)]
    first = make_profile(EVERYTHING, 12, SEED)
    in_order = {key: first.plan(*key) for key in pairs}
    shuffled = pairs[:]
    random.Random(0).shuffle(shuffled)
    second = make_profile(EVERYTHING, 12, SEED)
    assert {key: second.plan(*key) for key in shuffled} == in_order
    assert {key: first.plan(*key) for key in reversed(pairs)} == in_order
    other = make_profile(EVERYTHING, 12, SEED + 1)
    assert sum(other.plan(*key) != in_order[key] for key in pairs) > len(pairs) * 0.9


def test_each_delay_of_a_profile_has_its_own_stream() -> None:
    profile = make_profile("exponential:mode=add+exponential:mode=add", 1, SEED, base_time=1e-9)
    single = make_profile("exponential:mode=add", 1, SEED, base_time=1e-9)
    one = single.plan(0, 0).duration
    assert profile.plan(0, 0).duration != pytest.approx(2 * one)


# ---------------------------------------------------------------------------- Raspberry Pi

# docs/algorithms/orthofl.md 2.3, "Computed from the trace files (seconds, mean ± std)".
SPEC_TABLE = [
    (96.21, 135.58),
    (904.12, 222.23),
    (360.23, 103.47),
    (276.63, 187.24),
    (150.16, 210.27),
    (161.41, 194.38),
    (177.24, 209.79),
    (106.25, 32.71),
    (385.55, 111.89),
]


def rpi_moments(mean: float, std: float, nonpositive: str) -> tuple[float, float]:
    """Mean and std of N(mean, std) with non-positive draws replaced by the mean, or resampled."""
    trunc = stats.truncnorm(-mean / std, np.inf, loc=mean, scale=std)
    if nonpositive == "resample":
        return float(trunc.mean()), float(trunc.std())
    p = stats.norm.cdf(-mean / std)
    m1 = (1 - p) * trunc.mean() + p * mean
    m2 = (1 - p) * (trunc.var() + trunc.mean() ** 2) + p * mean**2
    return float(m1), math.sqrt(m2 - m1 * m1)


def test_raspberry_pi_table_matches_the_spec() -> None:
    assert list(RASPBERRY_PI_PROFILES) == SPEC_TABLE
    described = make_profile("raspberry_pi", 9, SEED).describe()["components"][0]
    assert [(p["mean"], p["std"]) for p in described["profiles"]] == SPEC_TABLE


@pytest.mark.parametrize("nonpositive", ["mean", "resample"])
def test_raspberry_pi_draws_per_profile(nonpositive: str) -> None:
    # round_robin: client c has profile c % 9; 27 clients x 100 jobs = 300 draws per profile.
    spec = f"raspberry_pi:assign=round_robin,nonpositive={nonpositive}"
    d = durations(make_profile(spec, 27, SEED), 27, 100)
    for k, (mean, std) in enumerate(SPEC_TABLE):
        x = d[k::9].ravel()
        m, s = rpi_moments(mean, std, nonpositive)
        assert abs(x.mean() - m) < 5 * s / math.sqrt(x.size), (k, x.mean(), m)
        assert abs(x.std() - s) < 0.2 * s, (k, x.std(), s)
        assert (x > 0).all()
    # The code's effective mean of profile 0 is ~138 s (docs/algorithms/orthofl.md 2.3).
    assert rpi_moments(*SPEC_TABLE[0], "mean")[0] == pytest.approx(138.26, abs=0.01)


def test_raspberry_pi_assignment_follows_the_authors_choice() -> None:
    # np.random.choice(9, M): without replacement below 9 clients, with replacement above.
    few = make_profile("raspberry_pi", 5, SEED).describe()["components"][0]["profiles"]
    assert sorted(p["clients"] for p in few) == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    many = make_profile("raspberry_pi", 200, SEED).describe()["components"][0]["profiles"]
    assert sum(p["clients"] for p in many) == 200
    assert all(p["clients"] > 0 for p in many)


def test_rpi_pooled_statistics() -> None:
    means = np.array([m for m, _ in SPEC_TABLE])
    stds = np.array([s for _, s in SPEC_TABLE])
    assert RPI_POOLED["mean"] == pytest.approx(means.mean())
    assert RPI_POOLED["std"] == pytest.approx(
        math.sqrt((stds**2 + means**2).mean() - means.mean() ** 2)
    )

    def cdf(x: float) -> float:  # the simulated latency mixture, independently with scipy
        p0 = stats.norm.cdf(-means / stds)
        body = np.clip(stats.norm.cdf((x - means) / stds) - p0, 0, None)
        return float(np.mean(body + np.where(x >= means, p0, 0.0)))

    for q, key in ((0.05, "p5"), (0.95, "p95")):
        assert RPI_POOLED[key] == pytest.approx(
            optimize.brentq(lambda x, q=q: cdf(x) - q, 1e-6, 5e3)
        )
    lognormal = make_profile("rpi_lognormal", 1, SEED).describe()["components"][0]
    assert (lognormal["mean"], lognormal["std"]) == pytest.approx(
        (RPI_POOLED["mean"], RPI_POOLED["std"])
    )
    uniform = make_profile("rpi_uniform", 1, SEED).describe()["components"][0]
    assert (uniform["low"], uniform["high"]) == pytest.approx((RPI_POOLED["p5"], RPI_POOLED["p95"]))


# ---------------------------------------------------------------------------- dropout


def test_dropout_at_a_virtual_time_and_back() -> None:
    profile = make_profile(
        {"dropout": {"clients": [1, 3], "at_time": 10, "return_after": 5}}, 4, SEED
    )
    assert profile.dropout_clients == (1, 3)
    for c in (0, 2):  # the others never leave
        assert profile.online(c, 12.0, 0) and profile.next_change(c, 12.0, 0) is None
    assert profile.online(1, 9.99, 7)
    assert profile.next_change(1, 0.0, 0) == 10.0
    assert not profile.online(1, 10.0, 7)
    assert profile.next_change(1, 10.0, 7) == 15.0
    assert not profile.online(1, 14.99, 7)
    assert profile.online(1, 15.0, 7)
    assert profile.next_change(1, 15.0, 7) is None


def test_permanent_dropout_at_a_drawn_time() -> None:
    profile = make_profile("dropout:count=3,at_time=10..20", 10, SEED)
    leaves = profile.describe()["components"][0]["clients"]
    assert len(leaves) == 3
    for item in leaves:
        c, t = item["client"], item["at_time"]
        assert 10 <= t <= 20 and item["return_after"] is None
        assert profile.next_change(c, 0.0, 0) == t
        assert profile.online(c, math.nextafter(t, 0), 0) and not profile.online(c, t, 0)
        assert profile.next_change(c, t, 0) is None  # gone for good


def test_dropout_after_n_updates_and_back() -> None:
    profile = make_profile(
        {"dropout": {"clients": [0], "after_updates": 3, "return_after": 7.5}}, 2, SEED
    )
    # Before its 3rd update only sending can make it leave, so there is no time to wake up at.
    assert profile.online(0, 50.0, 2) and profile.next_change(0, 50.0, 2) is None
    # The simulator asks when the 3rd update arrives (t = 60): away until 67.5.
    assert not profile.online(0, 60.0, 3)
    assert profile.next_change(0, 60.0, 3) == 67.5
    assert not profile.online(0, 67.0, 3)
    assert profile.online(0, 67.5, 3) and profile.next_change(0, 67.5, 3) is None
    assert profile.online(0, 80.0, 4)
    # Or the caller says when the last update arrived.
    fresh = make_profile(
        {"dropout": {"clients": [0], "after_updates": 3, "return_after": 7.5}}, 2, SEED
    )
    assert fresh.next_change(0, 61.0, 3, last_update_at=60.0) == 67.5
    assert not fresh.online(0, 61.0, 3, last_update_at=60.0)


def test_permanent_dropout_after_n_updates_feddgic_defaults() -> None:
    # docs/algorithms/feddgic.md 2.2: 5 of 20 nodes, permanently, after 4..20 of their own updates.
    profile = make_profile("dropout", 20, SEED)
    leaves = profile.describe()["components"][0]["clients"]
    assert len(leaves) == 5
    for item in leaves:
        c, n = item["client"], item["after_updates"]
        assert 4 <= n <= 20
        assert profile.online(c, 1e6, n - 1) and not profile.online(c, 0.0, n)
        assert profile.next_change(c, 0.0, n) is None
    assert make_profile("dropout", 20, SEED).dropout_clients == profile.dropout_clients
    assert make_profile("dropout", 20, SEED + 1).dropout_clients != profile.dropout_clients
    assert len(make_profile("dropout:fraction=0.35", 20, SEED).dropout_clients) == 7


# ---------------------------------------------------------------------------- partial work


def test_partial_work_exact_share_per_round() -> None:
    # docs/algorithms/feden.md 1.8: exactly round(s K) stragglers per round, E_i ~
    # UniformInt{1..E-1} of E.
    profile = make_profile("partial_work:fraction=0.5,units=10", 10, SEED, base_time=2)
    done = []
    for r in range(400):
        plans = [profile.plan(c, r) for c in range(10)]
        fractions = [p.work_fraction for p in plans]
        assert sum(f < 1 for f in fractions) == 5
        assert all(p.duration == 2 for p in plans)  # stragglers stop early, they are not late
        done += [round(f * 10) for f in fractions if f < 1]
    counts = np.bincount(done, minlength=10)[1:]
    assert counts.sum() == 2000 and set(done) == set(range(1, 10))
    assert stats.chisquare(counts).pvalue > 1e-3
    rounds = [
        frozenset(c for c in range(10) if profile.plan(c, r).work_fraction < 1) for r in range(20)
    ]
    assert len(set(rounds)) > 10  # a different set each round


def test_partial_work_bernoulli_and_persistent() -> None:
    bern = make_profile("partial_work:fraction=0.3,selection=bernoulli,units=5", 50, SEED)
    flags = np.array([[bern.plan(c, r).work_fraction < 1 for r in range(200)] for c in range(50)])
    n = flags.size
    assert abs(flags.mean() - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n)
    fractions = {bern.plan(c, r).work_fraction for c in range(50) for r in range(20)}
    assert fractions <= {0.2, 0.4, 0.6, 0.8, 1.0}
    fixed = make_profile("partial_work:fraction=0.2,selection=persistent", 20, SEED)
    slow = [{c for c in range(20) if fixed.plan(c, r).work_fraction < 1} for r in range(10)]
    assert all(s == slow[0] for s in slow) and len(slow[0]) == 4


def test_job_plan_validates() -> None:
    with pytest.raises(ValueError, match="duration must be finite and > 0"):
        JobPlan(0.0, 1.0)
    with pytest.raises(ValueError, match=r"work_fraction must be in \(0, 1\]"):
        JobPlan(1.0, 0.0)


# ---------------------------------------------------------------------------- specs


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_preset_works_with_one_client(name: str, tmp_path) -> None:
    profile = make_profile(_preset_spec(name, tmp_path), 1, SEED)
    for r in range(5):
        plan = profile.plan(0, r)
        assert math.isfinite(plan.duration) and plan.duration > 0
        assert 0 < plan.work_fraction <= 1
    assert profile.online(0, 0.0, 0)
    json.dumps(profile.describe())  # JSON-ready for the run summary


def test_none_is_equal_clients() -> None:
    profile = make_profile("none", 5, SEED, base_time=4)
    assert (durations(profile, 5, 5) == 4).all()
    assert profile.describe()["components"] == []


def test_spec_forms_agree() -> None:
    forms = [
        "tiers:mix=L1+dropout:count=2,at_time=5..9+exponential:mode=add,mean=1e+0",
        {
            "name": "tiers",
            "mix": "L1",
            "dropout": {"count": 2, "at_time": [5, 9]},
            "exponential": {"mode": "add", "mean": 1.0},
        },  # fmt: skip
        {
            "tiers": {"mix": "L1"},
            "dropout": {"count": 2, "at_time": [5, 9]},
            "exponential": {"mode": "add"},
            "speed": False,
        },  # fmt: skip
        [
            "tiers:mix=L1",
            {"name": "dropout", "count": 2, "at_time": [5, 9]},
            "exponential:mode=add",
        ],
    ]
    profiles = [make_profile(form, 20, SEED) for form in forms]
    reference = durations(profiles[0], 20, 5)
    for profile in profiles[1:]:
        assert (durations(profile, 20, 5) == reference).all()
        assert profile.dropout_clients == profiles[0].dropout_clients
    assert make_profile({"name": "none", "base_time": 3}, 1, 0).base_time == 3
    assert make_profile("tiers:base_time=2.5", 1, 0).base_time == 2.5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tires", r"unknown profile 'tires'; known: none, tiers, .*partial_work"),
        ("tiers:speed=3", r"profile 'tiers': unknown keys \['speed'\]; known: mix, assign"),
        ("exponential:sigma=1", r"unknown keys \['sigma'\]; known: mean, mode, rate"),
        ("delay:dist=gamma", r"dist must be one of \['exponential', 'halfnormal'"),
        ("speed:dist=uniform,sigma=1", r"unknown keys \['sigma'\] for uniform; known: \['high'"),
        ({"tires": {}}, r"unknown keys \['tires'\]: use \{'name': preset"),
        ("", "empty profile spec"),
        (42, "a profile spec is a string, a mapping or a list"),
        ("tiers:mix", "expected key=value"),
        ("tiers:mix=L1,mix=L2", "'mix' given twice"),
        ("tiers:mix=L4", "mix must be one of"),
        ("tiers:mix=1:0.5/3:0.4", "tier fractions must sum to 1"),
        ("tiers:assign=random", r"assign must be one of \['shuffled', 'contiguous'\]"),
        ("tiers+tiers", "'tiers' appears twice"),
        ("exponential:mean=0", "mean must be > 0"),
        ("exponential:mean=inf", "mean must be finite"),
        ("exponential:mode=times", r"mode must be one of \['mul', 'add'\]"),
        ("lognormal:mu=0,std=1", "not std with mu"),
        ("lognormal:sigma=9", "overflows"),
        ("uniform:low=2,high=1", "needs low <= high"),
        ("pareto:shape=1", "has no mean; give scale"),
        ("raspberry_pi:nonpositive=drop", "nonpositive must be one of"),
        ({"raspberry_pi": {"profiles": [[1, 2, 3]]}}, r"each profile must be \[mean, std\]"),
        ("dropout:count=2,fraction=0.1", "give one of count, fraction, clients"),
        ("dropout:count=21", "count 21 exceeds the 20 clients"),
        ("dropout:fraction=1.5", r"fraction must be in \[0, 1\]"),
        ("dropout:at_time=5,after_updates=3", "at_time or after_updates, not both"),
        ("dropout:after_updates=0", "after_updates must be >= 1"),
        ("dropout:at_time=9..5", "lo <= hi"),
        ({"dropout": {"clients": [25]}}, "client 25 out of range"),
        ("partial_work:units=1", "units must be an int >= 2"),
        ("partial_work:selection=all", "selection must be one of"),
        ("tiers:base_time=0", "base_time must be > 0"),
        (["tiers:base_time=1", "dropout:base_time=2"], "conflicting base_time"),
    ],
)
def test_bad_specs_raise_helpful_errors(spec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_profile(spec, 20, SEED)


def test_bad_arguments() -> None:
    profile = make_profile("tiers", 3, SEED)
    with pytest.raises(ValueError, match="client 3 out of range for 3 clients"):
        profile.plan(3, 0)
    with pytest.raises(ValueError, match="round must be an int >= 0"):
        profile.plan(0, -1)
    with pytest.raises(ValueError, match="virtual time must be finite"):
        profile.online(0, math.inf, 0)
    with pytest.raises(ValueError, match="num_clients must be >= 1"):
        make_profile("none", 0, SEED)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        make_profile("none", 1, -1)
    with pytest.raises(ValueError, match="base_time must be > 0"):
        make_profile("none", 1, 0, base_time=-1)
