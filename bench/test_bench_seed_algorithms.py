"""The seed algorithms' server work against the per-pair Python loops FL frameworks use today.

Run with ``pytest bench/test_bench_seed_algorithms.py --benchmark-only -s`` (full scale: about
10 minutes and 5 GiB of RAM, most of it the n = 1024 grouping phase); ``AGGSRV_BENCH_SCALE``
shrinks every D (n, K and h stay). See bench/README.md for the figures and how to read a line.

FedDGIC's grouping phase (docs/algorithms/feddgic.md 1.4 and section 4): n_cal =
``similarity_rounds(n)`` rounds of the layer-normalised cosine matrix of an [n, D] float32 update
matrix, accumulated to their mean, then average linkage on ``1 - S`` and the Eq. 5 cut. D = 1M in
the four modules of a 784-997-186-161-10 MLP (782,645 + 185,628 + 30,107 + 1,620 values, one
segment per module: ``ModelLayout.module_offsets``). The clients' updates hold four planted
clusters (40/30/20/10 % of the clients: a shared uniform centre per cluster plus the client's own
uniform noise of the same size, so the within-cluster cosine is about 0.5).

- **ours**: ``kernels.layer_normalized_cosine(U_r, module_offsets)`` per round, summed in float64,
  then ``dynamic_groups(S_mean, 0.8)`` (our average linkage, Eq. 5, the cut);
- **per-pair loop** (what Flower-style code does): for every pair i < j and every layer,
  ``scipy.spatial.distance.cosine(u_i[l], u_j[l])`` (float32 dots, as scipy keeps the input
  dtype), averaged over the layers and the rounds; then
  ``scipy.cluster.hierarchy.linkage(condensed, "average")``;
- **pdist** (vectorised): per layer ``scipy.spatial.distance.pdist(U_l, "cosine")`` (scipy
  converts to float64), averaged over the layers and rounds; then scipy's linkage.

Both baselines cut with the same ``group_count`` (Eq. 5) and ``cut_tree`` as ours, so only the
similarity and the linkage differ. Effective rates count the similarity only: 2 n^2 D flops per
round (the full Gram product per layer that our kernel's ``torch.mm`` computes; n^2 D with
symmetry) and n D 4 bytes read per round, divided by the phase's time.

- n = 64: n_cal = 5 rounds over three distinct matrices (cycled), every candidate runs the whole
  phase, timed interleaved (bench/conftest.py); the labels of all three must be equal, and S
  equal to 1e-5.
- n = 1024: n_cal = 9 rounds over ONE [1024, D] matrix (4 GB at D = 1M; a matrix per round would
  need 37 GB), reused for every round. A round of ours takes tens of seconds there, so the phase
  runs once and its n_cal rounds are the repetitions: in each round, one round of ours, one round
  of each baseline on a sample, round-robin with a rotating start. The per-pair loop times a
  window of 5,000 consecutive pairs of its i < j loop (random start each round: the rows are
  touched as the full loop touches them) and is extrapolated to all n(n-1)/2 pairs; pdist runs on
  a block of 64 consecutive rows (random start, 2,016 pairs) and is extrapolated the same way
  (its O(m D) float64 conversion is scaled with the pairs too: overstated by a few percent).
  Both are labelled "extrapolated". Linkage + cut are timed apart (interleaved, ours against
  scipy on the distances from our S) and added to every total. The sampled similarities must
  equal ours to 1e-5 and scipy's labels on our distances must equal ours. pytest-benchmark
  records ours' last similarity round only.

FedHist's server round (docs/algorithms/fedhist.md 1.4 and section 4) at N = 1024 clients, K = 10,
h = ceil(N / 2K) = 52, D = 1M: the strategy's work after the K-th arrival (ingest not counted).

- **ours**: ``aggregate_round`` (EGS against the 52 valid rows of a 53-slot history ring in a
  rotated ``recency`` order, HAA, INA, written into the free slot), the global step
  ``w - lr * g`` into a recycled buffer and the new row's norm, then the hindsight step as the
  strategy does it: the mean of the |S| = 4 relatively fresh rows (two of round q, one of a later
  round, one of this round) through ``kernels.weighted_sum`` into a [D] buffer,
  ``kernels.cosine_matrix(round_q_rows, other=pred[None])`` and ``hindsight_utility`` /
  ``utility_ema`` per client of round q;
- **numpy loop** (float32 numpy arrays, as a typical framework would write it): for each of the K
  local gradients and each history row, ``np.dot(g, G_j) / (norm(g) * norm(G_j))``, the argmin,
  the fused row ``g + alpha * G_j`` materialised; the weighted sum in a Python loop, the fused
  rows' norms, the rescale, the global step; the hindsight mean in a loop and a cosine per client.

Both must give the same global gradient (rtol 1e-4) and the same utilities. Minimal traffic
(spec section 4, without K0's ingest): ((K + h) + (K + h' + 1) + 4 + (|S| + K)) D 4 bytes, h' the
distinct history rows EGS chose.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    SCALE,
    emit,
    fmt_size,
    fmt_time,
    interleaved,
    median_ratio,
    random_tensor,
    rescale_sizes,
    scaled,
)

from aggsrv import kernels
from aggsrv.layout import ModelLayout
from aggsrv.strategies.fedhist_ops import (
    RoundInputs,
    aggregate_round,
    hindsight_utility,
    temporal_weight,
    utility_ema,
)
from aggsrv.strategies.grouping import cut_tree, dynamic_groups, group_count, similarity_rounds

hierarchy = pytest.importorskip("scipy.cluster.hierarchy")
distance = pytest.importorskip("scipy.spatial.distance")

F32 = 4
P = 0.8  # Eq. 5's threshold
D_FULL = 1_000_000
# A 784-997-186-161-10 MLP: exactly 1,000,000 parameters, fc1 78 % of them.
MLP = [
    ("fc1.weight", (997, 784)),
    ("fc1.bias", (997,)),
    ("fc2.weight", (186, 997)),
    ("fc2.bias", (186,)),
    ("fc3.weight", (161, 186)),
    ("fc3.bias", (161,)),
    ("fc4.weight", (10, 161)),
    ("fc4.bias", (10,)),
]
PLANTED = (0.4, 0.3, 0.2, 0.1)  # cluster shares of the clients
DISTINCT_64 = 3  # distinct update matrices at n = 64, cycled over the rounds
SAMPLE_PAIRS = 5_000  # per-pair loop sample at n = 1024
PDIST_ROWS = 64  # pdist sample at n = 1024
S_TOL = 1e-5


# --------------------------------------------------------------------------------------------
# FedDGIC: data and the three implementations
# --------------------------------------------------------------------------------------------


def _layout(D: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Module offsets of the MLP (tensor sizes rescaled to D, flattened, when D != 1M)."""
    if D == D_FULL:
        shapes = MLP
    else:
        sizes = rescale_sizes([math.prod(s) for _, s in MLP], D)
        shapes = [(name, (int(k),)) for (name, _), k in zip(MLP, sizes, strict=True)]
    offs = ModelLayout.from_named_shapes(shapes).module_offsets
    o = offs.tolist()
    return offs, list(zip(o[:-1], o[1:], strict=True))


def _planted_labels(n: int, seed: int) -> np.ndarray:
    counts = np.floor(np.asarray(PLANTED) * n).astype(int)
    counts[0] += n - counts.sum()
    labels = np.repeat(np.arange(len(PLANTED)), counts)
    return np.random.default_rng(seed).permutation(labels)


def _updates(labels: np.ndarray, D: int, seed: int, centres: torch.Tensor) -> torch.Tensor:
    """[n, D] float32: the client's cluster centre plus its own noise (both uniform(-1, 1))."""
    U = random_tensor(labels.size, D, seed=seed)
    idx = torch.from_numpy(labels)
    for s in range(0, labels.size, 64):  # row blocks: no [n, D] temporary
        U[s : s + 64] += centres[idx[s : s + 64]]
    return U


def _canon(labels: Sequence[int]) -> tuple[int, ...]:
    """Labels renumbered by first occurrence (the convention of cut_tree)."""
    number: dict[int, int] = {}
    return tuple(number.setdefault(int(x), len(number)) for x in labels)


def _scipy_groups(condensed: np.ndarray) -> tuple[int, ...]:
    """scipy's average linkage, then the same Eq. 5 count and cut as ours."""
    Z = hierarchy.linkage(condensed, method="average")
    k, _ = group_count(np.maximum.accumulate(Z[:, 2]), P)
    return cut_tree(Z, k)


def _pair_loop(U: np.ndarray, segs: list[tuple[int, int]], I: np.ndarray, J: np.ndarray):
    """Layer-averaged cosine distances of the pairs (I[t], J[t]), one scipy call per layer."""
    out = np.empty(len(I))
    L = len(segs)
    for t, (i, j) in enumerate(zip(I.tolist(), J.tolist(), strict=True)):
        ui, uj = U[i], U[j]
        out[t] = sum(distance.cosine(ui[s:e], uj[s:e]) for s, e in segs) / L
    return out


def _pdist_layers(U: np.ndarray, segs: list[tuple[int, int]]) -> np.ndarray:
    """Layer-averaged condensed cosine distances of the rows of U (float64, as scipy computes)."""
    return sum(distance.pdist(U[:, s:e], "cosine") for s, e in segs) / len(segs)


def _similarity_rates(n: int, D: int, rounds: int, t: float) -> tuple[float, float]:
    """(GFLOP/s, GB/s) of `rounds` similarity rounds done in t seconds."""
    return rounds * 2.0 * n * n * D / t / 1e9, rounds * n * D * F32 / t / 1e9


def test_feddgic_grouping_64(benchmark) -> None:
    """The whole grouping phase at n = 64, every candidate in full, interleaved."""
    n, D = 64, scaled(D_FULL)
    offs, segs = _layout(D)
    n_cal = similarity_rounds(n)
    planted = _planted_labels(n, seed=64)
    centres = random_tensor(len(PLANTED), D, seed=640)
    mats = [_updates(planted, D, 641 + m, centres) for m in range(DISTINCT_64)]
    mats_np = [m.numpy() for m in mats]
    I, J = np.triu_indices(n, k=1)

    def ours():
        S = torch.zeros(n, n, dtype=torch.float64)
        for r in range(n_cal):
            S += kernels.layer_normalized_cosine(mats[r % DISTINCT_64], offs)
        S /= n_cal
        return dynamic_groups(S, P), S

    def per_pair():
        acc = np.zeros(I.size)
        for r in range(n_cal):
            acc += _pair_loop(mats_np[r % DISTINCT_64], segs, I, J)
        acc /= n_cal
        return _scipy_groups(acc), acc

    def vectorised():
        acc = np.zeros(I.size)
        for r in range(n_cal):
            acc += _pdist_layers(mats_np[r % DISTINCT_64], segs)
        acc /= n_cal
        return _scipy_groups(acc), acc

    # Same grouping and the same similarities before timing anything.
    grouping, S = ours()
    s_ours = S.numpy()[I, J]
    diffs = {}
    for name, fn in (("per-pair", per_pair), ("pdist", vectorised)):
        labels, condensed = fn()
        assert labels == grouping.labels, f"{name} grouping differs from ours"
        diffs[name] = float(np.abs((1.0 - condensed) - s_ours).max())
        assert diffs[name] <= S_TOL, f"{name} similarities differ from ours by {diffs[name]:.2e}"
    assert grouping.k > 1, "the planted clusters should give a non-trivial grouping"
    recovered = grouping.labels == _canon(planted)

    times = interleaved({"ours": ours, "per-pair loop": per_pair, "pdist": vectorised})
    benchmark.pedantic(ours, rounds=1, iterations=1)
    med = {k: float(np.median(v)) for k, v in times.items()}
    sp_loop = median_ratio(times["per-pair loop"], times["ours"])
    sp_pdist = median_ratio(times["pdist"], times["ours"])
    gflops, gbps = _similarity_rates(n, D, n_cal, med["ours"])
    line = (
        f"feddgic grouping n={n} D={fmt_size(D)} L={len(segs)} n_cal={n_cal} "
        f"({DISTINCT_64} distinct matrices): ours {fmt_time(med['ours'])} "
        f"({gflops:.0f} GFLOP/s at 2n^2D per round, {gbps:.1f} GB/s) "
        f"per-pair loop {fmt_time(med['per-pair loop'])} pdist {fmt_time(med['pdist'])} "
        f"-> {sp_loop:.1f}x faster than the per-pair loop, {sp_pdist:.1f}x faster than pdist; "
        f"k={grouping.k} (planted {len(PLANTED)}, {'recovered' if recovered else 'not recovered'}),"
        f" labels equal, S max diff {max(diffs.values()):.1e}"
    )
    emit(
        benchmark,
        line,
        {
            "scale": SCALE,
            "n": n,
            "D": D,
            "n_cal": n_cal,
            "rounds": len(times["ours"]),
            **{f"{k.replace(' ', '_').replace('-', '_')}_s": v for k, v in med.items()},
            "speedup_vs_per_pair_loop": sp_loop,
            "speedup_vs_pdist": sp_pdist,
            "ours_GFLOPps": gflops,
            "ours_GBps": gbps,
            "flops_per_round": 2.0 * n * n * D,
            "bytes_per_round": n * D * F32,
            "groups": grouping.k,
            "planted_recovered": recovered,
            "S_max_diff": diffs,
        },
    )


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def test_feddgic_grouping_1024(benchmark) -> None:
    """n = 1024: ours in full (rounds interleaved with sampled baseline rounds), the baselines
    extrapolated from 5,000 pairs (per-pair loop) and 64 rows (pdist) per round."""
    n, D = 1024, scaled(D_FULL)
    offs, segs = _layout(D)
    n_cal = similarity_rounds(n)
    planted = _planted_labels(n, seed=1024)
    centres = random_tensor(len(PLANTED), D, seed=10240)
    U = _updates(planted, D, 10241, centres)  # ONE matrix, reused by every round
    Unp = U.numpy()
    I, J = np.triu_indices(n, k=1)
    n_pairs = I.size
    m_pairs = PDIST_ROWS * (PDIST_ROWS - 1) // 2
    rng = np.random.default_rng(1024)

    # Warm up untimed on a slice (MKL, scipy, the numba linkage's cache).
    kernels.layer_normalized_cosine(U[:64], offs)
    _pair_loop(Unp, segs, I[:10], J[:10])
    _pdist_layers(Unp[:4], segs)
    dynamic_groups(np.eye(64), P)

    S_sum = torch.zeros(n, n, dtype=torch.float64)
    last: dict[str, Any] = {}

    def ours_round() -> None:
        S_sum.add_(kernels.layer_normalized_cosine(U, offs))

    def pairs_round() -> None:
        start = int(rng.integers(0, n_pairs - SAMPLE_PAIRS + 1))
        w = slice(start, start + SAMPLE_PAIRS)
        last["pairs"] = (I[w], J[w], _pair_loop(Unp, segs, I[w], J[w]))

    def pdist_round() -> None:
        a = int(rng.integers(0, n - PDIST_ROWS + 1))
        last["pdist"] = (a, _pdist_layers(Unp[a : a + PDIST_ROWS], segs))

    names = ["ours", "per-pair sample", "pdist sample"]
    fns = {"ours": ours_round, "per-pair sample": pairs_round, "pdist sample": pdist_round}
    times: dict[str, list[float]] = {k: [] for k in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(n_cal):
            for name in names[r % 3 :] + names[: r % 3]:
                fn = fns[name]
                if name == "ours" and r == n_cal - 1:  # pytest-benchmark records one round
                    dt, _ = _timed(lambda: benchmark.pedantic(ours_round, rounds=1, iterations=1))
                else:
                    dt, _ = _timed(fn)
                times[name].append(dt)
    finally:
        gc.enable()

    S = S_sum / n_cal
    d = np.maximum(1.0 - S.numpy(), 0.0)
    condensed = d[I, J]
    grouping = dynamic_groups(S, P)
    link = interleaved(
        {"ours": lambda: dynamic_groups(S, P), "scipy": lambda: _scipy_groups(condensed)}
    )
    link_med = {k: float(np.median(v)) for k, v in link.items()}

    # Checks (the last round's samples; U is the same every round).
    Ip, Jp, dist_pairs = last["pairs"]
    diff_pairs = float(np.abs((1.0 - dist_pairs) - S.numpy()[Ip, Jp]).max())
    a, dist_block = last["pdist"]
    bi, bj = np.triu_indices(PDIST_ROWS, k=1)
    diff_pdist = float(np.abs((1.0 - dist_block) - S.numpy()[a + bi, a + bj]).max())
    assert diff_pairs <= S_TOL, f"per-pair similarities differ from ours by {diff_pairs:.2e}"
    assert diff_pdist <= S_TOL, f"pdist similarities differ from ours by {diff_pdist:.2e}"
    assert _scipy_groups(condensed) == grouping.labels, "scipy's linkage + cut differ from ours"

    pair_scale = n_pairs / SAMPLE_PAIRS
    pdist_scale = n_pairs / m_pairs
    ours_rounds = np.asarray(times["ours"])
    loop_rounds = np.asarray(times["per-pair sample"]) * pair_scale
    pdist_rounds = np.asarray(times["pdist sample"]) * pdist_scale
    t_ours = float(ours_rounds.sum()) + link_med["ours"]
    t_loop = float(loop_rounds.sum()) + link_med["scipy"]
    t_pdist = float(pdist_rounds.sum()) + link_med["scipy"]
    gflops, gbps = _similarity_rates(n, D, n_cal, t_ours)
    recovered = grouping.labels == _canon(planted)
    line = (
        f"feddgic grouping n={n} D={fmt_size(D)} L={len(segs)} n_cal={n_cal} (one matrix reused "
        f"for every round; the phase once, its {n_cal} rounds interleaved): ours "
        f"{fmt_time(t_ours)} ({gflops:.0f} GFLOP/s at 2n^2D per round, {gbps:.1f} GB/s; "
        f"round median {fmt_time(float(np.median(ours_rounds)))}) "
        f"per-pair loop {fmt_time(t_loop)} (extrapolated from {SAMPLE_PAIRS:,} pairs per round) "
        f"pdist {fmt_time(t_pdist)} (extrapolated from {PDIST_ROWS} rows = {m_pairs:,} pairs per "
        f"round) -> {t_loop / t_ours:.0f}x faster than the per-pair loop, "
        f"{t_pdist / t_ours:.1f}x faster than pdist (extrapolated); linkage+cut ours "
        f"{fmt_time(link_med['ours'])} scipy {fmt_time(link_med['scipy'])}; k={grouping.k} "
        f"(planted {len(PLANTED)}, {'recovered' if recovered else 'not recovered'}), "
        f"S max diff {max(diff_pairs, diff_pdist):.1e}"
    )
    emit(
        benchmark,
        line,
        {
            "scale": SCALE,
            "n": n,
            "D": D,
            "n_cal": n_cal,
            "rounds": n_cal,
            "one_matrix_reused": True,
            "ours_s": t_ours,
            "ours_round_s": times["ours"],
            "per_pair_loop_s": t_loop,
            "per_pair_loop_note": f"extrapolated from {SAMPLE_PAIRS} pairs per round",
            "per_pair_sample_round_s": times["per-pair sample"],
            "pdist_s": t_pdist,
            "pdist_note": f"extrapolated from {PDIST_ROWS} rows ({m_pairs} pairs) per round",
            "pdist_sample_round_s": times["pdist sample"],
            "linkage_cut_ours_s": link_med["ours"],
            "linkage_cut_scipy_s": link_med["scipy"],
            "speedup_vs_per_pair_loop": t_loop / t_ours,
            "speedup_vs_pdist": t_pdist / t_ours,
            "speedup_per_round_median_vs_per_pair_loop": float(
                np.median(loop_rounds / ours_rounds)
            ),
            "speedup_per_round_median_vs_pdist": float(np.median(pdist_rounds / ours_rounds)),
            "ours_GFLOPps": gflops,
            "ours_GBps": gbps,
            "groups": grouping.k,
            "planted_recovered": recovered,
            "S_max_diff": {"per-pair": diff_pairs, "pdist": diff_pdist},
        },
    )


# --------------------------------------------------------------------------------------------
# FedHist: one server round
# --------------------------------------------------------------------------------------------

N_CLIENTS, K_ARRIVALS = 1024, 10
ALPHA, LAM, GAMMA, SIM_T, LR = 0.1, 0.1, 0.2, 0.3, 0.05


def _numpy_round(
    local: np.ndarray,
    hist: np.ndarray,
    recency: list[int],
    taus: list[int],
    clients: list[str],
    w: np.ndarray,
    fresh: list[np.ndarray],
    his: np.ndarray,
    his_clients: list[str],
    his_taus: list[int],
    ubar: dict[str, float],
) -> tuple[np.ndarray, list[int]]:
    """The per-pair numpy code: cosines pair by pair, fused rows materialised, Python loops."""
    raw = [temporal_weight(t) + LAM * ubar.get(c, 0.0) for t, c in zip(taus, clients, strict=True)]
    raw = [max(x, 0.0) for x in raw]
    if sum(raw) <= 0.0:
        raw = [temporal_weight(t - min(taus)) for t in taus]
    weights = [x / sum(raw) for x in raw]
    fused, chosen = [], []
    for g in local:
        best, best_cos = -1, math.inf
        for j in recency:  # oldest first: `<=` keeps the most recent of tied minima
            c = np.dot(g, hist[j]) / (np.linalg.norm(g) * np.linalg.norm(hist[j]))
            if c <= best_cos:
                best, best_cos = j, c
        chosen.append(best)
        fused.append(g + ALPHA * hist[best])
    agg = np.zeros_like(local[0])
    for p, f in zip(weights, fused, strict=True):
        agg += p * f
    m = sum(float(np.linalg.norm(f)) for f in fused) / len(fused)
    agg *= m / np.linalg.norm(agg)
    new_w = w - LR * agg
    _ = np.linalg.norm(agg), new_w  # the new history row's norm, the new model
    pred = np.zeros_like(local[0])
    for row in fresh:
        pred += row
    pred /= len(fresh)
    for g, c, tau in zip(his, his_clients, his_taus, strict=True):
        s = float(np.dot(g, pred) / (np.linalg.norm(g) * np.linalg.norm(pred)))
        ubar[c] = utility_ema(ubar.get(c, 0.0), hindsight_utility(s, tau, SIM_T, len(fresh)), GAMMA)
    return agg, chosen


def test_fedhist_round(benchmark) -> None:
    N, K, D = N_CLIENTS, K_ARRIVALS, scaled(D_FULL)
    h = math.ceil(N / (2 * K))  # 52
    rng = np.random.default_rng(52)
    # History ring of h + 1 slots: the 52 valid ones oldest first from slot 17, the free one last.
    G = random_tensor(h + 1, D, seed=520)
    start = 17
    recency = [(start + t) % (h + 1) for t in range(h)]
    free = (start + h) % (h + 1)
    G_norms = torch.linalg.vector_norm(G, dim=1, dtype=torch.float64)
    # Local gradients: noise minus half of a target history row, so each client's least similar
    # row is clear (cos about -0.45 against about 0 for the rest); 6 distinct targets.
    targets = [recency[t] for t in rng.choice(h, size=6, replace=False)]
    local = random_tensor(K, D, seed=521)
    for i in range(K):
        local[i] -= 0.5 * G[targets[i % len(targets)]]
    local_norms = torch.linalg.vector_norm(local, dim=1, dtype=torch.float64)
    ids = [f"client{i:04d}" for i in range(N)]
    ubar0 = {c: float(u) for c, u in zip(ids, rng.uniform(-0.3, 0.3, N), strict=True)}
    clients = [ids[i] for i in rng.choice(N, K, replace=False)]
    taus = [1, 1, 2, 1, 3, 2, 1, 4, 1, 2]
    # Round q = r - h (its raw gradients and clients) and a later round, for the hindsight step.
    his = random_tensor(K, D, seed=522)
    mid = random_tensor(K, D, seed=523)
    his_clients = [ids[i] for i in rng.choice(N, K, replace=False)]
    his_taus = [1, 2, 1, 1, 3, 1, 2, 1, 5, 2]
    members = [(his, [0, 3]), (mid, [5]), (local, [2])]  # S: tau-fresh rows of rounds q..r
    size = sum(len(rows) for _, rows in members)
    w = random_tensor(D, seed=524)
    new_w = torch.empty(D)
    pred = torch.empty(D)

    def ours(ubar: dict[str, float]) -> tuple[torch.Tensor, Any]:
        g_glob = G[free]
        utilities = [ubar.get(c, 0.0) for c in clients]
        inputs = RoundInputs(
            local, local_norms, G, G_norms, recency, taus, utilities, alpha=ALPHA, lam=LAM
        )
        res = aggregate_round(inputs, out=g_glob)
        torch.add(w, g_glob, alpha=-LR, out=new_w)
        float(torch.linalg.vector_norm(g_glob, dtype=torch.float64))
        first = True
        for grads, rows in members:
            for i in rows:
                kernels.weighted_sum(
                    grads[i : i + 1], [1.0 / size], out=pred, beta=0.0 if first else 1.0
                )
                first = False
        sims = kernels.cosine_matrix(his, other=pred.unsqueeze(0))[:, 0]
        for c, tau, s in zip(his_clients, his_taus, sims.tolist(), strict=True):
            util = hindsight_utility(s, tau, SIM_T, size)
            ubar[c] = utility_ema(ubar.get(c, 0.0), util, GAMMA)
        return g_glob, res

    local_np, G_np, his_np, w_np = local.numpy(), G.numpy(), his.numpy(), w.numpy()
    fresh_np = [grads.numpy()[i] for grads, rows in members for i in rows]

    def baseline(ubar: dict[str, float]) -> tuple[np.ndarray, list[int]]:
        return _numpy_round(
            local_np, G_np, recency, taus, clients, w_np, fresh_np, his_np, his_clients,
            his_taus, ubar,
        )  # fmt: skip

    # Same global gradient, same choices, same utilities before timing.
    u_ours, u_base = dict(ubar0), dict(ubar0)
    g_ours, res = ours(u_ours)
    g_base, chosen_base = baseline(u_base)
    assert res.chosen is not None and res.chosen.tolist() == chosen_base
    g = g_ours.numpy()
    np.testing.assert_allclose(g_base, g, rtol=1e-4, atol=1e-4 * float(np.abs(g).max()))
    for c in his_clients:
        assert abs(u_ours[c] - u_base[c]) <= 1e-5, (c, u_ours[c], u_base[c])
    h_used = len(set(res.chosen.tolist()))

    ub_o, ub_b = dict(ubar0), dict(ubar0)
    fns = {
        "ours": lambda: ours(ub_o),
        "numpy loop": lambda: baseline(ub_b),
        # Where ours' time goes: EGS's [K, h+1] cosine pass alone, and one read of its rows.
        "egs cosines": lambda: kernels.cosine_matrix(local, other=G),
        "read K+h rows": lambda: (local.sum(), G.sum()),
    }
    times = interleaved(fns)
    benchmark.pedantic(lambda: ours(dict(ubar0)), rounds=1, iterations=1)
    med = {k: float(np.median(v)) for k, v in times.items()}
    sp = median_ratio(times["numpy loop"], times["ours"])
    rows = (K + h) + (K + h_used + 1) + 4 + (size + K)
    nbytes = rows * D * F32
    gbps = nbytes / med["ours"] / 1e9
    line = (
        f"fedhist round N={N} K={K} h={h} D={fmt_size(D)} |S|={size} h'={h_used}: ours "
        f"{fmt_time(med['ours'])} ({gbps:.1f} GB/s at {rows} D-rows) numpy per-pair loop "
        f"{fmt_time(med['numpy loop'])} -> {sp:.1f}x faster than the numpy loop, global "
        f"gradient equal (rtol 1e-4); of ours, the EGS cosine pass alone "
        f"{fmt_time(med['egs cosines'])} (one read of its rows {fmt_time(med['read K+h rows'])})"
    )
    emit(
        benchmark,
        line,
        {
            "scale": SCALE,
            "N": N,
            "K": K,
            "h": h,
            "D": D,
            "S": size,
            "h_prime": h_used,
            "rounds": len(times["ours"]),
            "ours_s": med["ours"],
            "numpy_loop_s": med["numpy loop"],
            "speedup_vs_numpy_loop": sp,
            "egs_cosines_s": med["egs cosines"],
            "read_K_h_rows_s": med["read K+h rows"],
            "bytes": nbytes,
            "ours_GBps": gbps,
        },
    )
