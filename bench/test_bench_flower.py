"""Flower's built-in Krum (flwr 1.42.0) against the same computation through aggsrv.kernels.

Run with ``pytest bench/test_bench_flower.py --benchmark-only -s`` (full scale: about 1 minute
and under 5 GiB of RAM); ``AGGSRV_BENCH_SCALE=0.01`` shrinks D (K stays) for a smoke run in
seconds. Target: none asserted (the issue asks to report the speed-up); correctness is.

K = 64 reply ``Message``s, each with an ``ArrayRecord`` ("arrays") of D = 4M float32 (2^22) in
62 tensors (the ResNet-18 tensor sizes rescaled to D) and a ``MetricRecord`` ("metrics" with
"num-examples"). Both candidates start from the same prepared replies and return an
``(ArrayRecord, MetricRecord)``:

- **flower**: ``flwr.serverapp.strategy.Krum(num_malicious_nodes=3).aggregate_train``. Its
  ``select_multikrum`` decodes every record (``np.load`` per array), concatenates each into a
  [D] vector, ``np.stack``s them to [K, D], takes squared distances as
  ``|x_i|^2 + |x_j|^2 - 2 X X^T`` (numpy, float32), scores each row by the sum of its
  n - f - 2 smallest distances to the others (the ``argsort`` of its row, self excluded), keeps
  the lowest score and returns its arrays weighted by num-examples / total (= 1: one record).
- **ours**: the same selection with aggsrv.kernels: ``record_to_flat(..., out=X[k])`` per reply
  (zero-copy reads of the NPY bytes, one copy into a [K, D] buffer kept across rounds, as a
  server would keep it; the layout is known beforehand), the squared distances from one Gram
  pass, ``kernels.pairwise_sq_distances(X)`` (d_ij = n_i + n_j - 2 G_ij formed in float64,
  clamped at 0; the norms are the Gram's diagonal), the same scores and argmin, then
  ``flat_to_record`` of the chosen row and Flower's own ``aggregate_metricrecords`` on its reply.
- **stack** (a part of ours, shown for the breakdown): the K ``record_to_flat`` copies alone.

The replies plant the answer: a shared uniform centre plus each client's own uniform noise
scaled by s_k (one client s = 0.25, the others 0.75..1.5) and 3 outliers shifted by +5, fresh
random data every run. Both must select the planted client, with the same output arrays (names,
shapes, values to 1e-5 relative: they are the client's own values).

Timed interleaved (bench/conftest.py ``interleaved``, REPS rounds); the speed-up is the median
over rounds of flower / ours. Ours' effective GB/s counts 2 K D 4 bytes: the records read once
by the stack, X read once by the Gram pass. The peak RSS of one call of each, above the RSS
before it (VmHWM reset through /proc/self/clear_refs), is shown too: what each allocates
beyond the replies and ours' [K, D] buffer.

Measured 2026-11-24 (scale 1, 2 cores, load 0.9-1.0; 44 s): ours 342-352 ms (6.1-6.3 GB/s;
stack 177-213 ms) flower 2.83-2.90 s -> 8.1-8.5x faster; peak per call +2108 MB flower, +0 MB
ours.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

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
    scaled,
)

flwr = pytest.importorskip("flwr")

from flower_replies import (  # noqa: E402
    WEIGHT_KEY,
    flower_quiet_and_identified,  # noqa: F401 - an autouse fixture
    make_replies,
    peak_over_current_mb,
)
from flwr.app import (  # noqa: E402
    ArrayRecord,
    Message,
    MetricRecord,
)
from flwr.serverapp.strategy import Krum  # noqa: E402
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords  # noqa: E402

from aggsrv import kernels  # noqa: E402
from aggsrv.integrations.flower.arrays import (  # noqa: E402
    flat_to_record,
    layout_of,
    record_to_flat,
)
from aggsrv.layout import ModelLayout  # noqa: E402

F32 = 4
K = 64
D_FULL = 4 * 2**20
NUM_MALICIOUS = 3  # Krum's f: the planted outliers
OUTLIER_SHIFT = 5.0
BEST_SCALE = 0.25  # noise scale of the planted Krum choice; the others 0.75..1.5
RTOL = 1e-5


# --------------------------------------------------------------------------------------------
# Replies
# --------------------------------------------------------------------------------------------


def _replies(D: int, seed: int) -> tuple[list[Message], int, list[int]]:
    """K train replies with a planted Krum choice; returns (replies, best, outliers)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(K)
    best, outliers = int(perm[0]), sorted(int(i) for i in perm[1 : 1 + NUM_MALICIOUS])
    noise_scale = rng.uniform(0.75, 1.5, size=K)
    noise_scale[best] = BEST_SCALE
    replies = make_replies(D, noise_scale, outliers, seed, OUTLIER_SHIFT, rng)
    return replies, best, outliers


# --------------------------------------------------------------------------------------------
# Krum through aggsrv.kernels
# --------------------------------------------------------------------------------------------


def krum_scores(X: torch.Tensor, num_malicious: int) -> torch.Tensor:
    """Krum's score per row of X [K, D]: the sum of its n - f - 2 (at least 1) smallest squared
    distances to the other rows (float64 [K]), as Flower's ``select_multikrum``."""
    dist = kernels.pairwise_sq_distances(X).to(torch.float64)  # one Gram pass over X
    dist.fill_diagonal_(math.inf)  # Flower drops each row's smallest entry: itself
    num_closest = max(1, X.shape[0] - num_malicious - 2)
    return dist.topk(num_closest, dim=1, largest=False).values.sum(dim=1)


def krum_ours(
    replies: Iterable[Message], X: torch.Tensor, layout: ModelLayout, num_malicious: int
) -> tuple[ArrayRecord, MetricRecord, int]:
    """Flower's Krum ``aggregate_train`` result (and the chosen index) via aggsrv.kernels."""
    contents = [msg.content for msg in replies if not msg.has_error()]
    if len(contents) != X.shape[0]:
        raise ValueError(f"{len(contents)} valid replies for a buffer of {X.shape[0]} rows")
    for k, content in enumerate(contents):
        record_to_flat(content["arrays"], layout, out=X[k])
    best = int(torch.argmin(krum_scores(X, num_malicious)))
    # One record selected: Flower's weighted average is that record times w / w = 1.
    return (
        flat_to_record(X[best], layout),
        aggregate_metricrecords([contents[best]], WEIGHT_KEY),
        best,
    )


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


def test_bench_flower_krum(benchmark) -> None:
    D = scaled(D_FULL)
    seed = random.randrange(1 << 31)
    replies, planted, outliers = _replies(D, seed)
    layout = layout_of(replies[0].content["arrays"])
    X = torch.zeros(K, D, dtype=torch.float32)  # touched: its page faults are not a call's
    strategy = Krum(num_malicious_nodes=NUM_MALICIOUS)
    krum_scores(X[:, :4096], NUM_MALICIOUS)  # numba compile / cache load outside the peaks

    # One call of each, with its peak memory; then the correctness checks.
    (f_arrays, f_metrics), flower_mb = peak_over_current_mb(
        lambda: strategy.aggregate_train(1, replies)
    )
    (o_arrays, o_metrics, best), ours_mb = peak_over_current_mb(
        lambda: krum_ours(replies, X, layout, NUM_MALICIOUS)
    )
    assert list(o_arrays) == list(f_arrays) == list(layout.names)
    f_flat, o_flat = record_to_flat(f_arrays, layout), record_to_flat(o_arrays, layout)
    matches = [k for k in range(K) if torch.equal(X[k], f_flat)]
    assert matches == [planted], f"Flower chose {matches}, planted {planted} (seed {seed})"
    assert best == planted, f"ours chose {best}, planted {planted} (seed {seed})"
    for name in layout.names:
        assert o_arrays[name].shape == f_arrays[name].shape
    torch.testing.assert_close(o_flat, f_flat, rtol=RTOL, atol=0.0)
    assert dict(o_metrics) == dict(f_metrics)
    del f_arrays, f_metrics, o_arrays, o_metrics, f_flat, o_flat

    fns = {
        "ours": lambda: krum_ours(replies, X, layout, NUM_MALICIOUS),
        "flower": lambda: strategy.aggregate_train(1, replies),
        "stack": lambda: [
            record_to_flat(m.content["arrays"], layout, out=X[k]) for k, m in enumerate(replies)
        ],
    }
    times = interleaved(fns)
    benchmark.pedantic(fns["ours"], rounds=1, iterations=1)

    med = {n: float(np.median(v)) for n, v in times.items()}
    nbytes = 2 * K * D * F32
    speedup = median_ratio(times["flower"], times["ours"])
    gbps = nbytes / med["ours"] / 1e9
    line = (
        f"krum flower K={K} D={fmt_size(D)} L={len(layout.names)} f={NUM_MALICIOUS}: "
        f"ours {fmt_time(med['ours'])} ({gbps:.1f} GB/s; stack {fmt_time(med['stack'])}) "
        f"flower {fmt_time(med['flower'])} -> {speedup:.1f}x faster than Flower's Krum, same "
        f"client ({planted}); peak RSS per call +{flower_mb:.0f} MB flower, "
        f"+{ours_mb:.0f} MB ours (replies {K * D * F32 / 1e6:.0f} MB)"
    )
    emit(
        benchmark,
        line,
        {
            "scale": SCALE,
            "rounds": len(times["ours"]),
            "threads": torch.get_num_threads(),
            "seed": seed,
            **{f"{n}_s": v for n, v in med.items()},
            "speedup_vs_flower": speedup,
            "ours_GBps": gbps,
            "bytes": nbytes,
            "flower_peak_over_MB": flower_mb,
            "ours_peak_over_MB": ours_mb,
        },
    )
