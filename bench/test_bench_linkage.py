"""aggsrv's average linkage against scipy's ``linkage(method="average")`` on the same distances.

Run with ``pytest bench/test_bench_linkage.py --benchmark-only -s``. Three settings:

* **warm**, one process: ``kernels.average_linkage`` on condensed distances and on the square
  matrix FedDGIC passes (``dynamic_groups``), each against scipy on the condensed distances
  (what scipy takes), timed interleaved (ours, scipy, ours, ...) so drift in machine load hits
  both alike; the ratio is the median of ours over the median of scipy's. Consecutive calls of
  the same n reuse our working matrix, as FedDGIC's grouping rounds do.
* **cold**, a fresh process per call, alternating ours and scipy's: each process makes the
  distances, loads its library with a call on 3 points (numba's compiled cache, scipy's
  extension), then times one call on the square matrix (ours) or the condensed distances
  (scipy): what a program meets the first time it clusters.
* **similarities**, one process: ``kernels.similarity_linkage`` on FedDGIC's input, averaged
  cosine similarities, against making the distances ``max(1 - (S + S^T) / 2, 0)`` with numpy and
  clustering them with scipy (and with our ``average_linkage``), interleaved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

hierarchy = pytest.importorskip("scipy.cluster.hierarchy")
distance = pytest.importorskip("scipy.spatial.distance")

from aggsrv import kernels  # noqa: E402

REPS = 7
COLD_REPS = 5


def _condensed(n: int) -> np.ndarray:
    """1 - cosine of random vectors, the distance FedDGIC clusters on."""
    x = np.random.default_rng(n).standard_normal((n, 64))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    iu = np.triu_indices(n, k=1)
    return np.maximum(1.0 - np.clip(x @ x.T, -1.0, 1.0)[iu], 0.0)


def _scipy(condensed: np.ndarray) -> np.ndarray:
    """The baseline."""
    return hierarchy.linkage(condensed, method="average")


@pytest.mark.parametrize("form", ["condensed", "square"])
@pytest.mark.parametrize("n", [1024, 4096])
def test_bench_average_linkage(benchmark, n: int, form: str) -> None:
    """Interleaved timing of ours and scipy's; pytest-benchmark records ours."""
    condensed = _condensed(n)
    dist = condensed if form == "condensed" else distance.squareform(condensed)
    # Compile (or load the numba cache) and check equality before timing anything.
    np.testing.assert_array_equal(kernels.average_linkage(dist), _scipy(condensed))

    ours: list[float] = []
    theirs: list[float] = []

    def scipy_between() -> None:
        # pytest-benchmark runs setup untimed before every round: scipy goes there, so the
        # recorded stats are ours alone and the two alternate.
        t0 = time.perf_counter()
        _scipy(condensed)
        theirs.append(time.perf_counter() - t0)

    def ours_timed() -> np.ndarray:
        t0 = time.perf_counter()
        z = kernels.average_linkage(dist)
        ours.append(time.perf_counter() - t0)
        return z

    benchmark.pedantic(ours_timed, setup=scipy_between, rounds=REPS, iterations=1, warmup_rounds=1)
    ours, theirs = ours[-REPS:], theirs[-REPS:]
    t_ours, t_scipy = float(np.median(ours)), float(np.median(theirs))
    ratio = t_ours / t_scipy
    benchmark.extra_info.update(
        n=n,
        form=form,
        ours_median_s=t_ours,
        scipy_median_s=t_scipy,
        ratio=ratio,
        merges_per_s=(n - 1) / t_ours,
    )
    print(
        f"\naverage_linkage n={n} {form} (warm): ours {t_ours * 1e3:.1f} ms, scipy "
        f"{t_scipy * 1e3:.1f} ms, ratio {ratio:.2f}, {(n - 1) / t_ours:,.0f} merges/s "
        f"(medians of {REPS}, load {os.getloadavg()[0]:.1f})"
    )


def _similarities(n: int) -> np.ndarray:
    """Averaged cosine similarities as FedDGIC passes them: not exactly symmetric."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 64))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T + rng.normal(0.0, 1e-6, (n, n))


def _numpy_distances(s: np.ndarray) -> np.ndarray:
    """FedDGIC's distances made the numpy way (four [n, n] temporaries)."""
    d = 1.0 - (s + s.T) / 2.0
    np.fill_diagonal(d, 0.0)
    return np.maximum(d, 0.0)


@pytest.mark.parametrize("n", [1024, 4096])
def test_bench_similarity_linkage(benchmark, n: int) -> None:
    """FedDGIC's grouping input, similarities: ``kernels.similarity_linkage`` (the distances
    made in the linkage's own pass) against the same distances made with numpy and then
    clustered by scipy, and by our ``average_linkage``; interleaved, medians of REPS."""
    s = _similarities(n)
    scipy_way = lambda: _scipy(distance.squareform(_numpy_distances(s), checks=False))  # noqa: E731
    numpy_ours = lambda: kernels.average_linkage(_numpy_distances(s))  # noqa: E731
    np.testing.assert_array_equal(kernels.similarity_linkage(s), scipy_way())
    np.testing.assert_array_equal(numpy_ours(), scipy_way())
    times: dict[str, list[float]] = {"ours": [], "numpy+scipy": [], "numpy+ours": []}
    fns = {"ours": lambda: kernels.similarity_linkage(s), "numpy+scipy": scipy_way,
           "numpy+ours": numpy_ours}  # fmt: skip

    def rounds() -> None:
        for k in range(REPS):
            names = list(fns)
            for name in names[k % 3 :] + names[: k % 3]:
                t0 = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - t0)

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    med = {name: float(np.median(v)) for name, v in times.items()}
    benchmark.extra_info.update(n=n, **{f"{k}_median_s": v for k, v in med.items()})
    print(
        f"\nsimilarity_linkage n={n} (FedDGIC's similarities in, warm): ours "
        f"{med['ours'] * 1e3:.1f} ms, numpy distances + scipy {med['numpy+scipy'] * 1e3:.1f} ms "
        f"({med['ours'] / med['numpy+scipy']:.2f}x), numpy distances + our average_linkage "
        f"{med['numpy+ours'] * 1e3:.1f} ms ({med['ours'] / med['numpy+ours']:.2f}x) (medians "
        f"of {REPS}, load {os.getloadavg()[0]:.1f})"
    )


_COLD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    which, n = sys.argv[1], int(sys.argv[2])
    x = np.random.default_rng(n).standard_normal((n, 64))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    iu = np.triu_indices(n, k=1)
    condensed = np.maximum(1.0 - np.clip(x @ x.T, -1.0, 1.0)[iu], 0.0)
    if which == "ours":
        from scipy.spatial.distance import squareform
        from aggsrv import kernels
        square = squareform(condensed)
        kernels.average_linkage(np.array([[0.0, 1.0, 2.0], [1.0, 0.0, 1.5], [2.0, 1.5, 0.0]]))
        t0 = time.perf_counter()
        kernels.average_linkage(square)
    else:
        from scipy.cluster import hierarchy
        hierarchy.linkage(np.array([1.0, 2.0, 1.5]), "average")
        t0 = time.perf_counter()
        hierarchy.linkage(condensed, "average")
    print(json.dumps(time.perf_counter() - t0))
    """
)


def _cold(which: str, n: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _COLD, which, str(n)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("n", [1024, 4096])
def test_bench_average_linkage_cold(benchmark, n: int) -> None:
    """One call in a fresh process, ours (square, FedDGIC's input) and scipy's alternating."""
    ours: list[float] = []
    theirs: list[float] = []

    def rounds() -> None:
        for k in range(COLD_REPS):
            pair = (("ours", ours), ("scipy", theirs))
            for which, times in pair if k % 2 == 0 else pair[::-1]:
                times.append(_cold(which, n))

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    t_ours, t_scipy = float(np.median(ours)), float(np.median(theirs))
    benchmark.extra_info.update(n=n, ours_median_s=t_ours, scipy_median_s=t_scipy)
    print(
        f"\naverage_linkage n={n} square (cold, a process per call): ours {t_ours * 1e3:.1f} ms "
        f"(min {min(ours) * 1e3:.1f}), scipy {t_scipy * 1e3:.1f} ms (min {min(theirs) * 1e3:.1f}),"
        f" ratio {t_ours / t_scipy:.2f} (medians of {COLD_REPS}, load {os.getloadavg()[0]:.1f})"
    )
