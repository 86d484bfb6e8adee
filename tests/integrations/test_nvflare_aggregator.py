"""aggsrv's NVIDIA FLARE aggregator (aggsrv.integrations.nvflare.AggsrvAggregator) against
independent oracles: float64 NumPy/SciPy references of every rule, FLARE's own weighted average
(WeightedAggregationHelper), FLARE's FLModel/Shareable conversions and job-config writer.

The replies are fresh random parameter dicts of odd sizes, with a non-float counter in the middle
of the dict, as FLARE's Client API sends them (meta "client_name", NUM_STEPS_CURRENT_ROUND)."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

pytest.importorskip("nvflare")

from nvflare.apis.fl_constant import FLMetaKey, ReservedKey  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402
from nvflare.apis.shareable import Shareable  # noqa: E402
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType  # noqa: E402
from nvflare.app_common.aggregators.weighted_aggregation_helper import (  # noqa: E402
    WeightedAggregationHelper,
)
from nvflare.app_common.app_constant import AppConstants  # noqa: E402
from nvflare.app_common.utils.fl_model_utils import FLModelUtils  # noqa: E402
from scipy import optimize, stats  # noqa: E402

from aggsrv.integrations.nvflare import AggsrvAggregator  # noqa: E402

# Float entries in dict order, with the int64 counter "n" between them (FLARE keeps dict order).
SHAPES = {"a.weight": (7, 13), "a.bias": (13,), "b.weight": (5, 3, 3)}
ORDER = ("a.weight", "a.bias", "n", "b.weight")
D = 7 * 13 + 13 + 5 * 3 * 3
STEPS = FLMetaKey.NUM_STEPS_CURRENT_ROUND


# --------------------------------------------------------------------------------------------
# Replies and references
# --------------------------------------------------------------------------------------------


def _params(row: np.ndarray, counter: int = 0, kind: str = "numpy", dtype=np.float32) -> dict:
    """One reply's parameter dict from a flat float64 row [D], in ORDER."""
    assert row.shape == (D,)
    out, start = {}, 0
    floats = {}
    for name, shape in SHAPES.items():
        size = math.prod(shape)
        floats[name] = row[start : start + size].reshape(shape).astype(dtype)
        start += size
    for name in ORDER:
        value = floats[name] if name in floats else np.array(counter, dtype=np.int64)
        out[name] = torch.from_numpy(value) if kind == "torch" else value
    return out


def _flat(params: dict) -> np.ndarray:
    """The float entries of a parameter dict laid end to end, float64, in SHAPES order."""
    return np.concatenate(
        [np.asarray(params[name], dtype=np.float64).reshape(-1) for name in SHAPES]
    )


def _reply(params, site, steps=None, params_type=ParamsType.FULL, metrics=None) -> FLModel:
    meta = {"client_name": site}
    if steps is not None:
        meta[STEPS] = steps
    return FLModel(params_type=params_type, params=params, metrics=metrics, meta=meta)


def _rows(rng: np.random.Generator, K: int, scale: float = 1.0) -> np.ndarray:
    """K rows rounded to float32 (what the replies carry), held as float64."""
    return (rng.normal(size=(K, D)) * scale).astype(np.float32).astype(np.float64)


def _replies(X: np.ndarray, steps=None, kind: str = "numpy", first_site: int = 1) -> list:
    steps = steps if steps is not None else [None] * len(X)
    return [
        _reply(_params(x, counter=100 + k, kind=kind), f"site-{first_site + k}", steps[k])
        for k, x in enumerate(X)
    ]


def _run(spec: str, replies: list, **kwargs) -> tuple[AggsrvAggregator, FLModel, list[bool]]:
    agg = AggsrvAggregator(spec, **kwargs)
    agg.reset_stats()
    accepted = [agg.accept_model(r) for r in replies]
    return agg, agg.aggregate_model(), accepted


def flare_steps_weight(steps) -> float:
    """FLARE FedAvg's weight of a reply's NUM_STEPS_CURRENT_ROUND, written out independently:
    missing, bool, not a number, not finite or <= 0 -> 1.0."""
    if steps is None or isinstance(steps, bool):
        return 1.0
    try:
        w = float(steps)
    except (TypeError, ValueError, OverflowError):
        return 1.0
    return w if math.isfinite(w) and w > 0 else 1.0


def _assert_same_params(got: dict, want: dict) -> None:
    """Bit-identical parameter dicts: same names in the same order, same dtypes and values."""
    assert list(got) == list(want)
    for name in want:
        g, w = got[name], want[name]
        assert type(g) is type(w), name
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and torch.equal(g, w), name
        else:
            assert g.dtype == w.dtype and np.array_equal(g, w), name


# Odd NUM_STEPS values and FLARE's reading of them.
ODD_STEPS = [3, None, float("nan"), 0, -2, True, "abc", 2.5, float("inf"), "4"]


# --------------------------------------------------------------------------------------------
# 1. The weighted mean
# --------------------------------------------------------------------------------------------


def test_mean_equals_the_float64_weighted_average_with_flares_weights() -> None:
    rng = np.random.default_rng(101)
    K = len(ODD_STEPS)
    X = _rows(rng, K, scale=3.0)
    site_weights = {"site-1": 0.5, "site-2": 3.0, "site-3": 2.0, "site-4": 0.0, "site-6": 1.5}
    site_weights["site-8"] = 7.25
    agg, out, accepted = _run(
        "mean", _replies(X, ODD_STEPS), aggregation_weights=site_weights, expected_clients=3
    )
    assert all(accepted)
    w = np.array(
        [
            flare_steps_weight(s) * site_weights.get(f"site-{k + 1}", 1.0)
            for k, s in enumerate(ODD_STEPS)
        ]
    )
    assert w.tolist() == [1.5, 3.0, 2.0, 0.0, 1.0, 1.5, 1.0, 7.25 * 2.5, 1.0, 4.0]
    ref = (w[:, None] * X).sum(axis=0) / w.sum()
    got = _flat(out.params)
    np.testing.assert_allclose(got, ref, rtol=2.5e-7, atol=1e-12)
    # Not the unweighted mean (the weights matter).
    assert not np.allclose(got, X.mean(axis=0), rtol=1e-3)
    assert out.params_type == ParamsType.FULL
    assert out.meta["sites"] == [f"site-{k + 1}" for k in range(K)]
    assert out.meta["aggsrv"] == {"rule": "mean", "rows": K}


@pytest.mark.parametrize("steps", ODD_STEPS)
def test_reply_weight_reads_num_steps_as_flares_fedavg_does(steps) -> None:
    fedavg = pytest.importorskip("nvflare.app_common.workflows.base_fedavg")
    get = getattr(fedavg, "_get_num_steps_weight", None)
    if get is None:
        pytest.skip("this FLARE has no base_fedavg._get_num_steps_weight")
    from aggsrv.integrations.nvflare import reply_weight

    model = _reply({"x": np.zeros(1, np.float32)}, "site-2", steps)
    assert reply_weight(model, {"site-2": 3.0}) == get(model) * 3.0
    assert reply_weight(model, {"site-9": 3.0}) == get(model) == flare_steps_weight(steps)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_mean_agrees_with_flares_weighted_aggregation_helper(kind: str) -> None:
    rng = np.random.default_rng(102)
    K = 6
    X = _rows(rng, K)
    steps = [17, 3, 250, 1, 64, 9]
    site_weights = {"site-2": 0.25, "site-5": 3.0}
    replies = _replies(X, steps, kind=kind)
    _, out, _ = _run("mean", replies, aggregation_weights=site_weights)

    helper = WeightedAggregationHelper()
    for k, r in enumerate(replies):
        w = steps[k] * site_weights.get(f"site-{k + 1}", 1.0)
        helper.add({n: r.params[n] for n in SHAPES}, w, f"site-{k + 1}", 0)
    flare = helper.get_result()
    for name in SHAPES:
        got = out.params[name]
        want = flare[name]
        if kind == "torch":
            assert isinstance(got, torch.Tensor)
            got, want = got.numpy(), want.numpy()
        else:
            assert isinstance(got, np.ndarray)
        assert got.shape == want.shape == SHAPES[name]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_mean_answers_float32_in_the_replies_kind_and_dict_order(kind: str) -> None:
    rng = np.random.default_rng(103)
    X = _rows(rng, 4)
    # float64 in: float32 out all the same.
    replies = [
        _reply(_params(x, counter=7 + k, kind=kind, dtype=np.float64), f"site-{k}", 5)
        for k, x in enumerate(X)
    ]
    _, out, _ = _run("mean", replies)
    assert list(out.params) == list(ORDER)
    array = torch.Tensor if kind == "torch" else np.ndarray
    for name in SHAPES:
        assert isinstance(out.params[name], array)
        assert str(out.params[name].dtype).endswith("float32")
        assert tuple(out.params[name].shape) == SHAPES[name]
    # The counter is passed through from the first reply, its kind and dtype kept.
    assert isinstance(out.params["n"], array)
    assert int(out.params["n"]) == 7
    assert str(out.params["n"].dtype).endswith("int64")
    np.testing.assert_allclose(_flat(out.params), X.mean(axis=0), rtol=2.5e-7, atol=1e-12)


def test_non_float_entries_come_from_the_first_accepted_reply() -> None:
    rng = np.random.default_rng(104)
    X = _rows(rng, 3)
    replies = _replies(X)
    bad = _params(X[0], counter=999)
    bad["b.weight"][2, 1, 1] = np.nan
    replies.insert(0, _reply(bad, "site-0"))
    for spec in ("mean", "median"):
        agg, out, accepted = _run(spec, replies)
        assert accepted == [False, True, True, True], spec
        assert int(out.params["n"]) == 100, spec  # site-1's counter, not the refused 999


# --------------------------------------------------------------------------------------------
# 2. Robust rules against independent references
# --------------------------------------------------------------------------------------------


def test_median_is_numpys_coordinate_median_and_ignores_weights() -> None:
    rng = np.random.default_rng(201)
    for K in (5, 6):
        X = _rows(rng, K)
        steps = list(rng.integers(1, 50, size=K))
        _, out, _ = _run("median", _replies(X, steps), aggregation_weights={"site-1": 9.0})
        ref = np.median(X, axis=0)
        if K % 2:  # the middle value itself
            assert np.array_equal(_flat(out.params), ref)
        else:  # the mean of the two middle ones, rounded to float32 once
            np.testing.assert_allclose(_flat(out.params), ref, rtol=2.5e-7, atol=1e-12)
        assert out.meta["aggsrv"] == {"rule": "median", "rows": K}


def _trimmed_reference(X: np.ndarray, trim: float) -> tuple[np.ndarray, int]:
    """aggsrv's trimmed mean: cut = floor(trim * K) values at each end of every coordinate, with
    trim * K taken as the decimal it is written as (0.3 * 10 cuts 3)."""
    K = X.shape[0]
    cut = math.floor(Fraction(str(trim)) * K)
    return np.sort(X, axis=0)[cut : K - cut].mean(axis=0), cut


@pytest.mark.parametrize(("trim", "K", "cut"), [(0.2, 7, 1), (0.2, 11, 2), (0.3, 10, 3)])
def test_trimmed_mean_cuts_floor_trim_k_rows_at_each_end(trim: float, K: int, cut: int) -> None:
    rng = np.random.default_rng(202 + K)
    X = _rows(rng, K)
    X[0] += 50.0  # an outlier row the trim has to cut
    _, out, _ = _run(f"trimmed_mean:trim={trim}", _replies(X, list(range(1, K + 1))))
    ref, ref_cut = _trimmed_reference(X, trim)
    assert ref_cut == cut
    got = _flat(out.params)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    if int(trim * K) == cut:  # scipy's int(trim * K) agrees (not for 0.3 * 10 = 2.99...96)
        np.testing.assert_allclose(got, stats.trim_mean(X, trim, axis=0), rtol=1e-6, atol=1e-6)
    assert np.all(np.abs(got) < 10)  # the outlier is gone


def _krum_scores(X: np.ndarray, f: int) -> np.ndarray:
    K = X.shape[0]
    d2 = ((X[:, None, :] - X[None, :, :]) ** 2).sum(axis=-1)
    return np.array([np.sort(np.delete(d2[i], i))[: K - f - 2].sum() for i in range(K)])


def test_krum_picks_the_row_with_the_lowest_krum_score() -> None:
    rng = np.random.default_rng(203)
    K, f = 8, 2
    scale = rng.uniform(0.5, 2.0, size=(K, 1))
    X = (rng.normal(size=(K, D)) * scale).astype(np.float32).astype(np.float64)
    X[[1, 6]] += 40.0  # two Byzantine rows
    scores = _krum_scores(X, f)
    best = int(np.argmin(scores))
    assert np.sort(scores)[1] > scores[best] * (1 + 1e-6)  # no near tie
    _, out, _ = _run(f"krum:f={f}", _replies(X, list(range(K, 0, -1))))
    assert np.array_equal(_flat(out.params), X[best])
    assert list(out.meta["aggsrv"]["selected"]) == [best]
    assert out.meta["sites"][best] == f"site-{best + 1}"


def test_multi_krum_is_the_weighted_mean_of_the_k_minus_f_best_rows() -> None:
    rng = np.random.default_rng(204)
    K, f = 7, 1
    X = _rows(rng, K)
    X[3] *= 30.0
    steps = [4, 9, 1, 6, 2, 8, 5]
    scores = _krum_scores(X, f)
    keep = np.argsort(scores, kind="stable")[: K - f]
    assert 3 not in keep
    w = np.array(steps, dtype=np.float64)[keep]
    ref = (w[:, None] * X[keep]).sum(axis=0) / w.sum()
    _, out, _ = _run(f"multi_krum:f={f}", _replies(X, steps))
    np.testing.assert_allclose(_flat(out.params), ref, rtol=1e-5, atol=1e-6)
    assert sorted(out.meta["aggsrv"]["selected"]) == sorted(keep.tolist())


def test_geometric_median_minimises_the_weighted_distance_sum_as_scipy_does() -> None:
    rng = np.random.default_rng(205)
    K = 7
    X = _rows(rng, K)
    X[0] += 25.0
    w = np.array([1, 3, 2, 5, 1, 4, 2], dtype=np.float64)

    def objective(z: np.ndarray) -> tuple[float, np.ndarray]:
        diff = z[None, :] - X
        dist = np.sqrt((diff**2).sum(axis=1))
        return float(w @ dist), (w / dist) @ diff

    z0 = (w[:, None] * X).sum(axis=0) / w.sum()
    ref = optimize.minimize(objective, z0, jac=True, method="L-BFGS-B", tol=1e-12)
    _, out, _ = _run("geometric_median", _replies(X, w.tolist()))
    got = _flat(out.params)
    assert objective(got)[0] <= ref.fun * (1 + 1e-5)
    assert objective(got)[0] < objective(z0)[0] * (1 - 1e-3)  # moved well off the mean
    assert np.linalg.norm(got - ref.x) < 1e-2 * np.linalg.norm(ref.x)


def test_norm_bound_scales_rows_to_the_bound_before_the_mean() -> None:
    rng = np.random.default_rng(206)
    K, bound = 5, 8.0
    X = _rows(rng, K)
    X[2] *= 10.0  # norm ~120: clipped
    steps = [2, 1, 3, 1, 2]
    norms = np.linalg.norm(X, axis=1)
    assert (norms > bound).sum() >= 2
    clipped = X * np.minimum(1.0, bound / norms)[:, None]
    w = np.array(steps, dtype=np.float64)
    ref = (w[:, None] * clipped).sum(axis=0) / w.sum()
    diffs = [
        _reply(_params(x, counter=100 + k), f"site-{k + 1}", steps[k], ParamsType.DIFF)
        for k, x in enumerate(X)
    ]
    _, out, _ = _run(f"norm_bound:max={bound} > mean", diffs)
    np.testing.assert_allclose(_flat(out.params), ref, rtol=1e-5, atol=1e-6)
    assert out.meta["aggsrv"]["clipped"] == int((norms > bound).sum())


def test_norm_bound_refuses_full_weights_it_would_shrink() -> None:
    """A norm bound bounds updates: on FULL weights it would clip the model itself."""
    X = _rows(np.random.default_rng(), 3)
    agg, out, accepted = _run("norm_bound:max=1 > mean", _replies(X))
    assert accepted == [False] * 3 and all("DIFF" in reason for _, reason in agg.refused)
    assert out.params_type == ParamsType.DIFF and out.params == {}  # the model stays


# --------------------------------------------------------------------------------------------
# 3. Refusals lose nothing
# --------------------------------------------------------------------------------------------


def _bad_reply(kind: str, row: np.ndarray, container: str) -> tuple[FLModel, str]:
    """A reply that must be refused, and a word its reason must hold."""
    params = _params(row, counter=555, kind=container)
    params_type = ParamsType.FULL
    if kind in ("nan_in_a_later_array", "inf_in_a_later_array"):
        # "a.weight" and "a.bias" are fine: only the last float array is bad.
        params["b.weight"][4, 2, 2] = np.nan if kind.startswith("nan") else -np.inf
        word = "NaN or Inf"
    elif kind == "missing_name":
        del params["a.bias"]
        word = "missing"
    elif kind == "extra_name":
        params["c.weight"] = params["a.bias"] * 2
        word = "unknown"
    elif kind == "wrong_shape":
        params["b.weight"] = params["b.weight"].reshape(5, 9)
        word = "shape"
    elif kind == "diff_after_full":
        params_type = ParamsType.DIFF
        word = "params_type"
    elif kind == "integer_weights":
        params["a.bias"] = params["a.bias"].to(torch.int64) if container == "torch" else (
            params["a.bias"].astype(np.int64)
        )  # fmt: skip
        word = "floating point"
    else:
        raise AssertionError(kind)
    return _reply(params, "site-bad", 11, params_type=params_type), word


BAD = [
    "nan_in_a_later_array",
    "inf_in_a_later_array",
    "missing_name",
    "extra_name",
    "wrong_shape",
    "diff_after_full",
    "integer_weights",
]


@pytest.mark.parametrize("spec", ["mean", "median", "trimmed_mean:trim=0.25"])
@pytest.mark.parametrize("bad", BAD)
def test_a_refused_reply_leaves_the_aggregate_bit_identical(spec: str, bad: str) -> None:
    rng = np.random.default_rng(301 + BAD.index(bad))
    X = _rows(rng, 5, scale=2.0)
    steps = [3, 8, 1, 5, 2]
    good = _replies(X, steps)
    bad_reply, word = _bad_reply(bad, X[0] + 100.0, "numpy")
    _, want, _ = _run(spec, good)

    mixed = good[:2] + [bad_reply] + good[2:]  # after the first accepted reply
    agg, got, accepted = _run(spec, mixed)
    assert accepted == [True, True, False, True, True, True]
    assert [site for site, _ in agg.refused] == ["site-bad"]
    assert word in agg.refused[0][1]
    assert got.meta["refused"] == [list(agg.refused[0])]
    assert got.meta["sites"] == want.meta["sites"]
    _assert_same_params(got.params, want.params)


@pytest.mark.parametrize("spec", ["mean", "median"])
def test_a_refused_torch_reply_leaves_the_aggregate_bit_identical(spec: str) -> None:
    rng = np.random.default_rng(310)
    X = _rows(rng, 4)
    good = _replies(X, [2, 7, 1, 4], kind="torch")
    _, want, _ = _run(spec, good)
    for bad in ("nan_in_a_later_array", "wrong_shape"):
        bad_reply, _ = _bad_reply(bad, X[1] * 1e3, "torch")
        agg, got, accepted = _run(spec, [good[0], bad_reply, *good[1:]])
        assert accepted == [True, False, True, True, True]
        assert isinstance(got.params["a.weight"], torch.Tensor)
        _assert_same_params(got.params, want.params)


# --------------------------------------------------------------------------------------------
# 4. Every reply refused
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["mean", "median"])
def test_a_round_of_refused_replies_leaves_flares_global_model_as_it_was(spec: str) -> None:
    rng = np.random.default_rng(401)
    X = _rows(rng, 3)
    replies = []
    for k, x in enumerate(X):
        p = _params(x)
        p["a.bias"][k] = np.inf
        replies.append(_reply(p, f"site-{k}", 4))
    agg, out, accepted = _run(spec, replies)
    assert accepted == [False, False, False]
    assert [s for s, _ in agg.refused] == ["site-0", "site-1", "site-2"]
    assert out.params_type == ParamsType.DIFF and out.params == {}

    start = _params(_rows(rng, 1)[0], counter=3)
    global_model = FLModel(
        params_type=ParamsType.FULL, params={k: v.copy() for k, v in start.items()}
    )
    FLModelUtils.update_model(global_model, out)
    _assert_same_params(global_model.params, start)

    # The next round aggregates as if nothing had happened.
    agg.reset_stats()
    assert agg.refused == []
    assert all(agg.accept_model(r) for r in _replies(X))
    ref = X.mean(axis=0) if spec == "mean" else np.median(X, axis=0)
    np.testing.assert_allclose(_flat(agg.aggregate_model().params), ref, rtol=2.5e-7, atol=1e-12)


# --------------------------------------------------------------------------------------------
# 5. More replies than expected, and the next round
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["median", "trimmed_mean:trim=0.2"])
def test_more_replies_than_expected_keep_every_row_round_after_round(spec: str) -> None:
    rng = np.random.default_rng(501)
    trim = 0.2 if spec.startswith("trimmed") else None

    def reference(X: np.ndarray) -> np.ndarray:
        return np.median(X, axis=0) if trim is None else _trimmed_reference(X, trim)[0]

    agg = AggsrvAggregator(spec, expected_clients=2)
    for K in (7, 5, 11):  # grows, shrinks, grows again past the doubled buffer
        agg.reset_stats()
        X = _rows(rng, K)
        assert all(agg.accept_model(r) for r in _replies(X, list(range(1, K + 1))))
        out = agg.aggregate_model()
        np.testing.assert_allclose(_flat(out.params), reference(X), rtol=1e-6, atol=1e-7)
        assert out.meta["aggsrv"]["rows"] == K
        assert out.meta["sites"] == [f"site-{k + 1}" for k in range(K)]


def test_mean_starts_each_round_from_zero() -> None:
    rng = np.random.default_rng(502)
    agg = AggsrvAggregator("mean")
    for K in (3, 6):
        agg.reset_stats()
        X = _rows(rng, K, scale=5.0)
        steps = list(range(2, K + 2))
        assert all(agg.accept_model(r) for r in _replies(X, steps))
        w = np.array(steps, dtype=np.float64)
        ref = (w[:, None] * X).sum(axis=0) / w.sum()
        np.testing.assert_allclose(
            _flat(agg.aggregate_model().params), ref, rtol=2.5e-7, atol=1e-12
        )


# --------------------------------------------------------------------------------------------
# 6. The ScatterAndGather route (Shareables)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["mean", "median"])
def test_scatter_and_gather_accepts_shareables_and_answers_one(spec: str) -> None:
    rng = np.random.default_rng(601)
    fl_ctx = FLContext()
    X = _rows(rng, 5)
    steps = [6, 2, 9, 1, 4]
    agg = AggsrvAggregator(spec)
    agg.reset(fl_ctx)
    for r in _replies(X, steps):
        assert agg.accept(FLModelUtils.to_shareable(r), fl_ctx) is True
    nan = _params(X[0])
    nan["b.weight"][0, 0, 0] = np.nan
    assert agg.accept(FLModelUtils.to_shareable(_reply(nan, "site-9", 5)), fl_ctx) is False
    assert [s for s, _ in agg.refused] == ["site-9"]

    result = agg.aggregate(fl_ctx)
    assert isinstance(result, Shareable)
    back = FLModelUtils.from_shareable(result)
    assert back.params_type == ParamsType.FULL
    assert list(back.params) == list(ORDER)
    w = np.array(steps, dtype=np.float64)
    ref = (w[:, None] * X).sum(axis=0) / w.sum() if spec == "mean" else np.median(X, axis=0)
    np.testing.assert_allclose(_flat(back.params), ref, rtol=2.5e-7, atol=1e-12)
    assert int(back.params["n"]) == 100
    assert back.meta["sites"] == [f"site-{k + 1}" for k in range(5)]

    # reset: the next round forgets this one.
    agg.reset(fl_ctx)
    assert agg.refused == []
    for r in _replies(X[:3]):
        assert agg.accept(FLModelUtils.to_shareable(r), fl_ctx)
    again = FLModelUtils.from_shareable(agg.aggregate(fl_ctx))
    ref = X[:3].mean(axis=0) if spec == "mean" else np.median(X[:3], axis=0)
    np.testing.assert_allclose(_flat(again.params), ref, rtol=2.5e-7, atol=1e-12)


def test_scatter_and_gather_weighs_replies_by_the_peer_site_name() -> None:
    """ScatterAndGather hands the aggregator the clients' Shareables as they come: the site is
    the Shareable's peer identity (what FLARE's InTimeAccumulateWeightedAggregator reads), not a
    "client_name" meta entry, which only FLARE's ModelController adds. aggregation_weights and
    the refused list must name the site all the same."""
    rng = np.random.default_rng(602)
    fl_ctx = FLContext()
    X = _rows(rng, 3)
    agg = AggsrvAggregator("mean", aggregation_weights={"site-1": 5.0, "site-3": 0.5})
    agg.reset(fl_ctx)
    for k, x in enumerate(X):
        model = FLModel(params_type=ParamsType.FULL, params=_params(x), meta={STEPS: 2})
        shareable = FLModelUtils.to_shareable(model)
        shareable.set_peer_props({ReservedKey.IDENTITY_NAME: f"site-{k + 1}"})
        assert agg.accept(shareable, fl_ctx)
    bad = _params(X[0])
    bad["a.bias"][0] = np.nan
    shareable = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=bad))
    shareable.set_peer_props({ReservedKey.IDENTITY_NAME: "site-4"})
    assert not agg.accept(shareable, fl_ctx)
    assert [s for s, _ in agg.refused] == ["site-4"]
    back = FLModelUtils.from_shareable(agg.aggregate(fl_ctx))
    w = np.array([5.0, 1.0, 0.5]) * 2
    ref = (w[:, None] * X).sum(axis=0) / w.sum()
    np.testing.assert_allclose(_flat(back.params), ref, rtol=2.5e-7, atol=1e-12)


# --------------------------------------------------------------------------------------------
# 7. Constructor errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aggregator": "nonsense"}, "unknown rule 'nonsense'"),
        ({"aggregator": "krum:f=-1"}, "f .* must be >= 0"),
        ({"aggregator": "trimmed_mean:trim=0.5"}, r"trim .* \[0, 0.5\)"),
        ({"aggregation_weights": {"site-1": -1.0}}, r"aggregation_weights\['site-1'\]"),
        ({"aggregation_weights": {"site-2": float("nan")}}, r"aggregation_weights\['site-2'\]"),
        ({"aggregation_weights": {"site-3": float("inf")}}, "finite number >= 0"),
        ({"aggregation_weights": {"site-4": "2"}}, "finite number >= 0"),
        ({"expected_clients": 0}, "expected_clients must be an integer >= 1, got 0"),
        ({"expected_clients": -3}, "expected_clients"),
        ({"expected_clients": 2.0}, "expected_clients"),
    ],
)
def test_bad_constructor_arguments_are_clear_value_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AggsrvAggregator(**kwargs)


# --------------------------------------------------------------------------------------------
# 8. Centered clipping carries its centre from round to round
# --------------------------------------------------------------------------------------------


def _centered_clip_reference(X: np.ndarray, w: np.ndarray, centre: np.ndarray) -> np.ndarray:
    """One step of centered clipping from `centre`, tau the median distance to it (aggsrv's
    default), p the normalised weights: v = c + sum_k p_k (x_k - c) min(1, tau / |x_k - c|)."""
    diff = X - centre[None, :]
    dist = np.sqrt((diff**2).sum(axis=1))
    tau = float(np.median(dist))
    p = w / w.sum()
    return centre + ((p * np.minimum(1.0, tau / dist))[:, None] * diff).sum(axis=0)


def test_centered_clipping_starts_round_two_from_round_ones_aggregate() -> None:
    """Round 1 has no previous aggregate: it starts from the replies' coordinate-wise median.
    Round 2 starts from round 1's aggregate, so it differs from a fresh aggregator's answer."""
    from aggsrv import kernels

    rng = np.random.default_rng(801)
    K = 6
    base = rng.normal(size=D) * 3.0
    X1, X2 = base + rng.normal(size=(2, K, D))
    X1[2] += 60.0
    X2[4] -= 60.0
    X1, X2 = (X.astype(np.float32).astype(np.float64) for X in (X1, X2))
    s1, s2 = [3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]
    w1, w2 = np.array(s1, float), np.array(s2, float)

    agg = AggsrvAggregator("centered_clipping")
    agg.reset_stats()
    assert all(agg.accept_model(r) for r in _replies(X1, s1))
    r1 = _flat(agg.aggregate_model().params)
    want = _centered_clip_reference(X1, w1, np.median(X1, axis=0))
    np.testing.assert_allclose(r1, want, rtol=1e-5, atol=1e-5)

    agg.reset_stats()
    assert all(agg.accept_model(r) for r in _replies(X2, s2))
    out2 = agg.aggregate_model()
    r2 = _flat(out2.params)
    want = _centered_clip_reference(X2, w2, r1)
    np.testing.assert_allclose(r2, want, rtol=1e-5, atol=1e-5)
    tau = float(np.median(np.linalg.norm(X2 - r1, axis=1)))
    assert out2.meta["aggsrv"]["tau"] == pytest.approx(tau, rel=1e-5)

    # aggsrv's own kernel from the same centre agrees; a fresh aggregator (the median of X2 as
    # its centre) does not.
    direct = kernels.centered_clip(
        torch.tensor(X2, dtype=torch.float32),
        torch.tensor(r1, dtype=torch.float32),
        tau,
        weights=torch.tensor(w2),
    )
    np.testing.assert_allclose(r2, direct.numpy(), rtol=1e-5, atol=1e-5)
    _, fresh, _ = _run("centered_clipping", _replies(X2, s2))
    fresh_flat = _flat(fresh.params)
    want = _centered_clip_reference(X2, w2, np.median(X2, axis=0))
    np.testing.assert_allclose(fresh_flat, want, rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(fresh_flat - r2) > 1e-2 * np.linalg.norm(r2)


# --------------------------------------------------------------------------------------------
# 9. Metrics
# --------------------------------------------------------------------------------------------


def test_metrics_are_the_weighted_mean_of_what_every_accepted_reply_reports() -> None:
    rng = np.random.default_rng(901)
    X = _rows(rng, 4)
    steps = [10, 30, 20, 40]
    site_weights = {"site-2": 0.5}
    metrics = [
        {"loss": 0.9, "acc": 1, "note": "a", "only_some": 1.0, "flag": True},
        {"loss": 0.3, "acc": 0, "note": "b", "flag": False},
        {"loss": 0.6, "acc": 1, "note": "c", "flag": True},
        {"loss": 0.1, "acc": 0, "note": "d", "only_some": 2.0, "flag": True},
    ]
    replies = [
        _reply(_params(x), f"site-{k + 1}", steps[k], metrics=metrics[k]) for k, x in enumerate(X)
    ]
    bad = _params(X[0])
    bad["a.weight"][0, 0] = np.nan
    replies.append(_reply(bad, "site-5", 1000, metrics={"loss": 99.0, "acc": 1}))
    _, out, accepted = _run("median", replies, aggregation_weights=site_weights)
    assert accepted == [True, True, True, True, False]
    w = np.array([10, 15, 20, 40], dtype=np.float64)
    assert set(out.metrics) == {"loss", "acc"}
    assert out.metrics["loss"] == pytest.approx(float(w @ [0.9, 0.3, 0.6, 0.1] / w.sum()))
    assert out.metrics["acc"] == pytest.approx(float(w @ [1, 0, 1, 0] / w.sum()))

    # A reply without metrics: no round metrics (FLARE's FedAvg does the same).
    replies[1] = _reply(_params(X[1]), "site-2", 30)
    _, out, _ = _run("mean", replies[:4])
    assert out.metrics is None


def test_numpy_scalar_metrics_are_averaged_as_numbers() -> None:
    """FLARE's FedAvg averages any value that multiplies and adds (filter_aggregatable_metrics),
    NumPy scalars included; they are numeric metrics."""
    rng = np.random.default_rng(902)
    X = _rows(rng, 2)
    metrics = [
        {"loss": np.float32(0.5), "seen": np.int64(100)},
        {"loss": np.float32(0.25), "seen": np.int64(300)},
    ]
    replies = [_reply(_params(x), f"s{k}", [1, 3][k], metrics=metrics[k]) for k, x in enumerate(X)]
    _, out, _ = _run("mean", replies)
    assert out.metrics is not None
    assert out.metrics["loss"] == pytest.approx((0.5 + 3 * 0.25) / 4)
    assert out.metrics["seen"] == pytest.approx((100 + 3 * 300) / 4)


# --------------------------------------------------------------------------------------------
# 10. FLARE's job configuration
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"aggregator": "norm_bound:max=5 > krum:f=1", "aggregation_weights": {"site-1": 2.5}},
        {"aggregator": "median", "expected_clients": 3},
        {},
    ],
)
def test_flare_job_config_round_trips_the_constructor_arguments(kwargs: dict, tmp_path) -> None:
    from nvflare.job_config.fed_job_config import FedJobConfig

    agg = AggsrvAggregator(**kwargs)
    assert agg.aggregator == kwargs.get("aggregator", "mean")
    assert agg.aggregation_weights == kwargs.get("aggregation_weights", {})
    assert agg.expected_clients == kwargs.get("expected_clients", 8)

    job = FedJobConfig(job_name="aggsrv", min_clients=1)
    path = job._get_class_path(agg, str(tmp_path))
    assert path == "aggsrv.integrations.nvflare.aggregator.AggsrvAggregator"
    args = json.loads(json.dumps(job._get_args(agg, str(tmp_path))))  # as the job file has it
    # Only the arguments that differ from the defaults are written ({} for no weights).
    assert kwargs == {k: v for k, v in args.items() if k != "aggregation_weights" or v}
    again = AggsrvAggregator(**args)
    assert job._get_args(again, str(tmp_path)) == args
    assert again.spec == agg.spec
    assert (again.aggregator, again.aggregation_weights, again.expected_clients) == (
        agg.aggregator,
        agg.aggregation_weights,
        agg.expected_clients,
    )


# --------------------------------------------------------------------------------------------
# Parameter kinds
# --------------------------------------------------------------------------------------------


def test_mean_accepts_half_precision_params_whose_sum_exceeds_float16_range() -> None:
    """Finite float16 weights are finite: a sum over 65504 (float16's largest) is no NaN/Inf."""
    rng = np.random.default_rng(1001)
    big = {"w": np.abs(rng.normal(size=(300, 300))).astype(np.float16) + np.float16(1)}
    assert np.isfinite(big["w"]).all()
    small = {"w": big["w"] * np.float16(0.5)}
    for spec in ("median", "mean"):
        agg, out, accepted = _run(spec, [_reply(big, "a"), _reply(small, "b")])
        assert accepted == [True, True], (spec, agg.refused)
        want = (big["w"].astype(np.float64) + small["w"].astype(np.float64)) / 2
        np.testing.assert_allclose(out.params["w"], want, rtol=1e-6)


def test_numpy_params_with_a_numpy_scalar_counter_come_back_as_numpy() -> None:
    """A NumPy model is answered in NumPy (FLARE's NumPy exchange format), whatever kind of
    number its non-float counter is."""
    rng = np.random.default_rng(1002)
    X = _rows(rng, 2)
    for counter in (np.int64(4), 4):
        replies = []
        for k, x in enumerate(X):
            p = _params(x)
            p["n"] = counter
            replies.append(_reply(p, f"site-{k}"))
        _, out, _ = _run("mean", replies)
        for name in SHAPES:
            assert isinstance(out.params[name], np.ndarray), (type(counter), name)
        assert out.params["n"] == 4


# --------------------------------------------------------------------------------------------
# A first reply of another model does not lock the run out
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["mean", "median"])
def test_a_first_reply_of_another_model_costs_one_round_not_the_run(spec) -> None:
    rng = np.random.default_rng()
    X = _rows(rng, 5)
    odd = _params(_rows(rng, 1)[0])
    odd["extra"] = np.ones(3, dtype=np.float32)  # sent first: it sets the run's names
    agg = AggsrvAggregator(spec)
    agg.reset_stats()
    assert agg.accept_model(_reply(odd, "byzantine"))
    assert not any(agg.accept_model(r) for r in _replies(X))  # the honest majority disagrees
    dropped = agg.aggregate_model()
    assert dropped.params_type == ParamsType.DIFF and dropped.params == {}  # model kept
    # The next round's first reply sets the model again, and the odd one is refused.
    agg.reset_stats()
    assert [agg.accept_model(r) for r in _replies(X)] == [True] * 5
    assert not agg.accept_model(_reply(odd, "byzantine"))
    result = agg.aggregate_model()
    _, reference, _ = _run(spec, _replies(X))
    _assert_same_params(result.params, reference.params)


def test_a_reply_that_is_not_a_model_is_refused_on_the_scatter_and_gather_route() -> None:
    agg = AggsrvAggregator("mean")
    agg.reset(FLContext())
    junk = Shareable()
    junk["something"] = 1
    junk.set_peer_props({ReservedKey.IDENTITY_NAME: "site-9"})
    assert agg.accept(junk, FLContext()) is False
    assert agg.refused and agg.refused[0][0] == "site-9"


def test_a_boolean_aggregation_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="aggregation_weights"):
        AggsrvAggregator("mean", aggregation_weights={"site-1": True})


def _shareable(row: np.ndarray, site: str, round_: int, meta_site: str | None = None) -> Shareable:
    reply = _reply(_params(row), meta_site or site, 1)
    shareable = FLModelUtils.to_shareable(reply)
    shareable.set_peer_props({ReservedKey.IDENTITY_NAME: site})
    shareable.add_cookie(AppConstants.CONTRIBUTION_ROUND, round_)
    return shareable


def _context(round_: int) -> FLContext:
    ctx = FLContext()
    ctx.set_prop(AppConstants.CURRENT_ROUND, round_, private=True, sticky=False)
    return ctx


def test_scatter_and_gather_refuses_a_late_reply_and_a_second_one_from_a_site() -> None:
    X = _rows(np.random.default_rng(), 4)
    agg = AggsrvAggregator("median")
    ctx = _context(5)
    agg.reset(ctx)
    assert agg.accept(_shareable(X[0], "site-1", 5), ctx)
    assert not agg.accept(_shareable(X[1], "site-2", 4), ctx)  # round 4's task, late
    assert not agg.accept(_shareable(X[2], "site-1", 5), ctx)  # site-1 again
    assert agg.accept(_shareable(X[3], "site-3", 5), ctx)
    reasons = dict(agg.refused)
    assert "round 4" in reasons["site-2"] and "second reply" in reasons["site-1"]
    result = FLModelUtils.from_shareable(agg.aggregate(ctx))
    np.testing.assert_array_equal(
        _flat(result.params), np.median(X[[0, 3]], axis=0).astype(np.float32)
    )


def test_scatter_and_gather_weighs_by_the_peer_identity_not_the_sites_own_word() -> None:
    X = _rows(np.random.default_rng(), 2)
    agg = AggsrvAggregator("mean", aggregation_weights={"site-1": 1.0, "site-2": 0.0})
    ctx = _context(1)
    agg.reset(ctx)
    # site-2 (weight 0) claims to be site-1 in its meta: FLARE's peer identity decides.
    assert agg.accept(_shareable(X[0], "site-1", 1), ctx)
    assert agg.accept(_shareable(X[1], "site-2", 1, meta_site="site-1"), ctx)
    result = FLModelUtils.from_shareable(agg.aggregate(ctx))
    np.testing.assert_allclose(_flat(result.params), X[0].astype(np.float32), rtol=0, atol=0)


@pytest.mark.parametrize("spec", ["mean", "median"])
def test_a_round_whose_weights_are_all_zero_keeps_the_model(spec) -> None:
    X = _rows(np.random.default_rng(), 3)
    agg = AggsrvAggregator(spec, aggregation_weights={f"site-{k}": 0.0 for k in range(1, 4)})
    agg.reset_stats()
    assert all(agg.accept_model(r) for r in _replies(X))
    out = agg.aggregate_model()
    assert out.params_type == ParamsType.DIFF and out.params == {}
