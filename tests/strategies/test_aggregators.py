"""aggsrv.aggregators: every rule against its definition (float64 numpy/scipy oracles written
here), planted Byzantine rows, weights, norm_bound, the small-K fallback, parsing errors and the
sharded ``reduce`` path (shards simulated in one process, as tests/kernels/test_kernels_reduce.py
does)."""

from __future__ import annotations

import logging
import os
import random
from collections import defaultdict

import numpy as np
import pytest
import scipy.stats
import torch

from aggsrv.aggregators import RULES, Aggregator, RowBuffer, parse_aggregator
from aggsrv.sharding import LocalReducer, ShardMap

D = 37  # odd, no multiple of anything
HONEST, BAD = 11, 2


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(os.environ.get("AGGSRV_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (AGGSRV_TEST_SEED replays it)")  # shown with a failure
    return np.random.default_rng(seed)


def planted(rng: np.random.Generator, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """11 honest rows around 1.0 and 2 crafted ones far away (one in a shared direction, one
    that flips the sign), shuffled."""
    honest = 1.0 + 0.1 * rng.standard_normal((HONEST, D))
    bad = np.stack([np.full(D, 1e3), -50.0 * np.ones(D) + rng.standard_normal(D)])
    X = np.concatenate([honest, bad])[rng.permutation(HONEST + BAD)]
    return torch.tensor(X, dtype=dtype)


def combine(text: str, X: torch.Tensor, w=None, **kw):
    w = torch.ones(X.shape[0], dtype=torch.float64) if w is None else w
    return Aggregator.parse(text).combine(X, w, **kw)


# ----------------------------------------------------------------------------- oracles


def krum_scores_np(X: np.ndarray, f: int) -> np.ndarray:
    K = X.shape[0]
    d2 = ((X[:, None, :] - X[None, :, :]) ** 2).sum(-1)
    return np.array([np.sort(np.delete(d2[i], i))[: K - f - 2].sum() for i in range(K)])


def bulyan_np(X: np.ndarray, f: int) -> np.ndarray:
    """El Mhamdi et al.: theta = K - 2f rows, each the Krum choice among those left (once fewer
    than f + 3 are left, Krum has no neighbours: the row with the least summed squared distance
    to the others), then per coordinate the mean of the beta = theta - 2f selected values
    closest to the coordinate's median (a tie between two equally close values: the lower)."""
    left = list(range(X.shape[0]))
    chosen = []
    for _ in range(X.shape[0] - 2 * f):
        if len(left) >= f + 3:
            scores = krum_scores_np(X[left], f)
        else:
            scores = ((X[left][:, None] - X[left][None]) ** 2).sum((1, 2))
        chosen.append(left.pop(int(np.argmin(scores))))
    S = X[chosen]
    beta = len(chosen) - 2 * f
    med = np.median(S, axis=0)
    out = np.empty(S.shape[1])
    for d in range(S.shape[1]):
        order = np.lexsort((S[:, d], np.abs(S[:, d] - med[d])))  # by distance, then value
        out[d] = S[order[:beta], d].mean()
    return out


def centered_clip_np(X, w, center, tau, iters):
    p = w / w.sum()
    v = center.copy()
    for _ in range(iters):
        d = np.linalg.norm(X - v, axis=1)
        scale = np.minimum(1.0, tau / np.maximum(d, 1e-300))
        v = v + (p[:, None] * (X - v) * scale[:, None]).sum(0)
    return v


# ----------------------------------------------------------------------------- definitions


def test_mean_median_trimmed_mean_match_numpy_and_scipy(rng) -> None:
    X = planted(rng)
    w = torch.tensor(rng.uniform(0.5, 3.0, X.shape[0]))
    Xn, wn = X.numpy(), w.numpy()
    out, info = combine("mean", X, w)
    np.testing.assert_allclose(out.numpy(), (wn[:, None] * Xn).sum(0) / wn.sum(), rtol=1e-12)
    assert info.rule == "mean" and info.rows == 13
    out, _ = combine("median", X, w)  # unweighted
    np.testing.assert_allclose(out.numpy(), np.median(Xn, axis=0), rtol=1e-12)
    for trim in (0.1, 0.2, 0.3):
        out, _ = combine(f"trimmed_mean:trim={trim}", X, w)
        want = scipy.stats.trim_mean(Xn, trim, axis=0)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("f", [1, 2, 3])
def test_krum_and_multi_krum_pick_the_brute_force_lowest_scores(rng, f) -> None:
    X = planted(rng)
    w = torch.tensor(rng.uniform(0.5, 3.0, X.shape[0]))
    scores = krum_scores_np(X.numpy(), f)
    order = np.argsort(scores, kind="stable")
    out, info = combine(f"krum:f={f}", X, w)
    assert info.selected == (int(order[0]),)
    np.testing.assert_array_equal(out.numpy(), X.numpy()[order[0]])
    for m in (None, 4):
        text = f"multi_krum:f={f}" + ("" if m is None else f",m={m}")
        out, info = combine(text, X, w)
        k = X.shape[0] - f if m is None else m
        sel = order[:k]
        assert info.selected == tuple(int(i) for i in sel)
        wn = w.numpy()[sel]
        want = (wn[:, None] * X.numpy()[sel]).sum(0) / wn.sum()
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-12)
        if f >= BAD:  # with f below the bad rows' count, K - f rows must take some in
            assert not set(info.selected) & set(np.argsort(-np.abs(X.numpy()).max(1))[:BAD])


def test_bulyan_matches_the_iterative_definition(rng) -> None:
    X = torch.tensor(rng.standard_normal((15, D)))
    X[3] += 40.0
    X[9] -= 25.0
    for f in (1, 2, 3):
        out, info = combine(f"bulyan:f={f}", X)
        np.testing.assert_allclose(out.numpy(), bulyan_np(X.numpy(), f), rtol=1e-10, atol=1e-12)
        assert len(info.selected) == 15 - 2 * f


def test_geometric_median_is_optimal(rng) -> None:
    X = planted(rng)
    w = torch.tensor(rng.uniform(0.5, 3.0, X.shape[0]))
    out, info = combine("geometric_median:iters=500,tol=1e-14", X, w)
    z, Xn, wn = out.numpy(), X.numpy(), w.numpy()

    def objective(p: np.ndarray) -> float:
        return float((wn * np.linalg.norm(Xn - p, axis=1)).sum())

    # Optimality: the weighted unit vectors towards the rows cancel (the subgradient at z).
    d = np.linalg.norm(Xn - z, axis=1)
    grad = (wn[:, None] * (z - Xn) / d[:, None]).sum(0)
    assert np.linalg.norm(grad) < 1e-6 * wn.sum(), np.linalg.norm(grad)
    # ... and no nearby point, nor the mean or the coordinate median, does better.
    for p in (Xn.mean(0), np.median(Xn, 0), z + 1e-3 * rng.standard_normal(D)):
        assert objective(z) <= objective(p) + 1e-9
    assert info.iterations >= 1 and info.converged is True


@pytest.mark.parametrize("iters", [1, 3])
def test_centered_clipping_matches_the_formula(rng, iters) -> None:
    X = planted(rng)
    w = torch.tensor(rng.uniform(0.5, 3.0, X.shape[0]))
    center = torch.tensor(1.0 + 0.05 * rng.standard_normal(D))
    Xn, c = X.numpy(), center.numpy()
    out, info = combine(f"centered_clipping:iters={iters}", X, w, center=center)
    tau = float(np.median(np.linalg.norm(Xn - c, axis=1)))  # adaptive: the median distance
    assert info.tau == pytest.approx(tau, rel=1e-12)
    want = centered_clip_np(Xn, w.numpy(), c, tau, iters)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-10)
    out, info = combine(f"centered_clipping:tau=0.5,iters={iters}", X, w, center=center)
    assert info.tau == 0.5
    np.testing.assert_allclose(out.numpy(), centered_clip_np(Xn, w.numpy(), c, 0.5, iters))
    # No centre: zero.
    out, _ = combine("centered_clipping:tau=0.5", X, w)
    np.testing.assert_allclose(out.numpy(), centered_clip_np(Xn, w.numpy(), 0 * c, 0.5, 1))


# ----------------------------------------------------------------------------- robustness


ROBUST = [
    "median",
    "trimmed_mean:trim=0.2",
    "krum:f=2",
    "multi_krum:f=2",
    "bulyan:f=2",
    "geometric_median",
    "centered_clipping",
    "norm_bound:max=10 > mean",
]


@pytest.mark.parametrize("text", ROBUST)
def test_planted_rows_move_the_mean_but_not_the_robust_rules(rng, text) -> None:
    X = planted(rng, torch.float32)
    honest = X[(X - 1.0).abs().max(1).values < 1.0].double().mean(0)
    assert honest.shape == (D,)
    mean, _ = combine("mean", X)
    assert float((mean.double() - honest).abs().max()) > 50.0
    center = torch.ones(D)  # a strategy's previous aggregate
    out, info = combine(text, X, center=center)
    assert out.dtype == torch.float32 and info.fallback is None
    assert float((out.double() - honest).abs().max()) < 0.5, (text, out[:4], honest[:4])


def test_weights_of_zero_leave_a_row_out_and_indices_stay_the_callers(rng) -> None:
    X = torch.tensor(rng.standard_normal((9, D)))
    X[4] = 1e6  # weight 0: in no rule
    w = torch.ones(9, dtype=torch.float64)
    w[4] = 0.0
    out, info = combine("median", X, w)
    np.testing.assert_allclose(out.numpy(), np.median(np.delete(X.numpy(), 4, 0), 0))
    assert info.rows == 8
    out, info = combine("multi_krum:f=1", X, w)
    scores = krum_scores_np(np.delete(X.numpy(), 4, 0), 1)
    kept = [i for i in range(9) if i != 4]
    assert info.selected == tuple(kept[i] for i in np.argsort(scores, kind="stable")[:7])
    with pytest.raises(ValueError, match="must not all be 0"):
        combine("median", X, torch.zeros(9, dtype=torch.float64))
    with pytest.raises(ValueError, match="finite and >= 0"):
        combine("median", X, -w)


def test_norm_bound_clips_rows_before_the_rule_and_leaves_the_callers_rows(rng) -> None:
    X = torch.tensor(rng.standard_normal((7, D))) * torch.tensor([1, 1, 9, 1, 1, 20, 1.0])[:, None]
    before = X.clone()
    w = torch.tensor(rng.uniform(0.5, 2.0, 7))
    out, info = combine("norm_bound:max=8 > mean", X, w)
    norms = np.linalg.norm(X.numpy(), axis=1)
    clipped = X.numpy() * np.minimum(1.0, 8.0 / norms)[:, None]
    wn = w.numpy()
    np.testing.assert_allclose(out.numpy(), (wn[:, None] * clipped).sum(0) / wn.sum())
    assert info.clipped == int((norms > 8).sum()) >= 2
    assert torch.equal(X, before)
    out, _ = combine("norm_bound:max=8 > median", X, w)
    np.testing.assert_allclose(out.numpy(), np.median(clipped, 0))


# ----------------------------------------------------------------------------- fallbacks


@pytest.mark.parametrize(
    ("text", "K"),
    [("krum:f=1", 3), ("multi_krum:f=2", 4), ("bulyan:f=1", 6), ("trimmed_mean:trim=0.1", 9)],
)
def test_too_few_rows_fall_back_to_the_median_with_a_warning(rng, caplog, text, K) -> None:
    X = torch.tensor(rng.standard_normal((K, D)))
    X[0] += 1e3  # one bad row of K: the median stays with the others
    with caplog.at_level(logging.WARNING, logger="aggsrv.aggregators.combine"):
        out, info = combine(text, X)
    np.testing.assert_allclose(out.numpy(), np.median(X.numpy(), 0))
    assert info.fallback and "median" in info.fallback and str(K) in info.fallback
    assert any("median" in r.getMessage() for r in caplog.records)
    need = Aggregator.parse(text).min_rows()
    assert need == K + 1
    out, info = combine(text, torch.tensor(rng.standard_normal((need, D))))
    assert info.fallback is None


def test_multi_krum_lowers_m_when_fewer_rows_came(rng) -> None:
    X = torch.tensor(rng.standard_normal((6, D)))
    _, info = combine("multi_krum:f=1,m=5", X)  # K - f = 5: as asked
    assert len(info.selected) == 5
    _, info = combine("multi_krum:f=1,m=5", X[:5])  # K - f = 4
    assert len(info.selected) == 4


# ----------------------------------------------------------------------------- parsing


def test_parse_fills_defaults_and_prints_back() -> None:
    a = Aggregator.parse("norm_bound:max=10 > multi_krum:f=2,m=5")
    assert (a.rule, dict(a.params), a.norm_bound) == ("multi_krum", {"f": 2, "m": 5}, 10.0)
    assert Aggregator.parse(str(a)) == a
    assert Aggregator.parse("mean").is_mean and not Aggregator.parse("norm_bound:max=1").is_mean
    assert Aggregator.parse("norm_bound:max=1").rule == "mean"
    assert dict(Aggregator.parse("geometric_median").params) == {
        "iters": 100, "tol": 1e-6, "eps": 1e-8,
    }  # fmt: skip
    assert dict(Aggregator.parse("centered_clipping").params) == {"tau": None, "iters": 1}
    assert Aggregator.parse("centered_clipping:tau=auto") == Aggregator.parse("centered_clipping")
    assert Aggregator.parse("multi_krum:m=auto").params["m"] is None
    assert dict(Aggregator.parse("trimmed_mean").params) == {"trim": 0.1}
    for rule in RULES:
        assert parse_aggregator(rule).rule == rule
    assert Aggregator.parse("krum:f=2").weighted is False
    assert Aggregator.parse("multi_krum").weighted is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("krumm:f=1", "unknown rule 'krumm'; the rules: mean, median, trimmed_mean, krum"),
        ("krum:g=1", r"no parameter 'g' \(its parameters: f\)"),
        ("geometric_median:tau=1", "its parameters: eps, iters, tol"),
        ("trimmed_mean:trim=0.5", r"trim .* must be in \[0, 0.5\)"),
        ("krum:f=-1", "f .* must be >= 0"),
        ("krum:f=1.5", "f must be int"),
        ("krum:f=none", "f must be a number"),
        ("krum:f=auto", "f must be int"),
        ("multi_krum:m=0", "m .* must be >= 1"),
        ("centered_clipping:tau=0", "tau must be finite and > 0"),
        ("centered_clipping:iters=0", "iters must be >= 1"),
        ("geometric_median:eps=0", "eps must be finite and > 0"),
        ("median > norm_bound:max=3", "norm_bound may only come first"),
        ("median > krum", "at most one rule"),
        ("norm_bound:max=0 > median", "max must be finite and > 0"),
        ("norm_bound > median", "norm_bound needs max="),
        ("", "non-empty string"),
    ],
)
def test_parse_errors_name_what_is_wrong(text, message) -> None:
    with pytest.raises(ValueError, match=message):
        Aggregator.parse(text)


def test_check_rows_refuses_a_known_count_too_small() -> None:
    Aggregator.parse("krum:f=2").check_rows(5, "buffer_size")
    with pytest.raises(ValueError, match=r"at least 5 rows .*K >= f \+ 3.* buffer_size = 4"):
        Aggregator.parse("krum:f=2").check_rows(4, "buffer_size")
    with pytest.raises(ValueError, match=r"4f \+ 3.* k = 10"):
        Aggregator.parse("bulyan:f=2").check_rows(10, "k")
    with pytest.raises(ValueError, match="m = 9 must be <= K - f = 8"):
        Aggregator.parse("multi_krum:f=2,m=9").check_rows(10, "buffer_size")
    with pytest.raises(ValueError, match="cuts no row"):
        Aggregator.parse("trimmed_mean:trim=0.1").check_rows(9, "buffer_size")
    Aggregator.parse("trimmed_mean:trim=0.1").check_rows(10, "buffer_size")


# ----------------------------------------------------------------------------- rows


def test_row_buffer_counts_only_committed_rows_and_round_trips() -> None:
    rows = RowBuffer(5, torch.device("cpu"))
    for i in range(11):  # grows past a block
        rows.slot().fill_(float(i))
        rows.commit(0.5 * i)
    rows.slot().fill_(99.0)  # staged, not counted
    assert len(rows) == 11 and rows.rows[:, 0].tolist() == [float(i) for i in range(11)]
    staged, weights = rows.with_slot(7.0)
    assert staged.shape == (12, 5) and float(staged[11, 0]) == 99.0 and weights[-1] == 7.0
    other = RowBuffer(5, torch.device("cpu"))
    other.load({k: (v.clone() if torch.is_tensor(v) else v) for k, v in rows.state().items()},
               "rows")  # fmt: skip
    assert torch.equal(other.rows, rows.rows) and other.weights == rows.weights
    with pytest.raises(ValueError, match="shape"):
        other.load({"rows": torch.zeros(2, 4), "weights": [1.0, 1.0]}, "rows")


# ----------------------------------------------------------------------------- sharded


def sharded_combine(text: str, X: torch.Tensor, w: torch.Tensor, center: torch.Tensor, n: int):
    """combine on n shards' column slices, each reduce a collective: simulated by replays, the
    first p collectives answered with the float64 sums (in rank order) found so far."""
    smap = ShardMap.even(X.shape[1], n, align=8)
    known: list[torch.Tensor] = []
    while True:
        partials: dict[int, list[torch.Tensor]] = defaultdict(list)
        results, counts = [], []
        for rank in range(n):
            lo, hi = smap.slice(rank)
            calls = 0

            def reduce(t: torch.Tensor, partials=partials) -> torch.Tensor:
                nonlocal calls
                i, calls = calls, calls + 1
                if i < len(known):
                    return known[i].clone().to(t.dtype)
                partials[i].append(t.double().clone())
                return t

            results.append(combine(text, X[:, lo:hi], w, center=center[lo:hi], reduce=reduce))
            counts.append(calls)
        if all(c == len(known) for c in counts):
            return results
        known.append(sum(partials[len(known)][1:], partials[len(known)][0]))


@pytest.mark.parametrize(
    "text",
    [
        "krum:f=2",
        "multi_krum:f=2",
        "bulyan:f=2",
        "geometric_median:iters=4,tol=0",
        "centered_clipping:iters=2",
        "norm_bound:max=20 > median",
    ],
)
def test_every_shard_selects_alike_and_the_joined_result_is_the_whole_ones(rng, text) -> None:
    X = planted(rng, torch.float32)
    w = torch.tensor(rng.uniform(0.5, 2.0, X.shape[0]))
    center = torch.ones(D)
    whole, info = combine(text, X, w, center=center)
    one, _ = combine(text, X, w, center=center, reduce=LocalReducer().sum_)
    assert torch.equal(one, whole)
    results = sharded_combine(text, X, w, center, 3)
    joined = torch.cat([out for out, _ in results])
    torch.testing.assert_close(joined, whole, rtol=1e-4, atol=1e-4)
    for _, shard_info in results:
        assert shard_info.selected == info.selected
        assert shard_info.clipped == info.clipped
        if info.tau is not None:
            assert shard_info.tau == pytest.approx(info.tau, rel=1e-5)
