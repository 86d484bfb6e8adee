"""aggsrv's NVIDIA FLARE aggregator against FLARE's own aggregation, one round at a time.

Run with ``pytest bench/test_bench_nvflare.py -s -p no:cacheprovider`` (full sizes: K = 16 and
64 replies of D = 4M and 25M float32; about 9 minutes on 2 cores, one child of up to ~8 GB of
RAM at a time). A quick run, to check it works (under a minute):
``AGGSRV_BENCH_NVFLARE_K=8 AGGSRV_BENCH_NVFLARE_D=1M AGGSRV_BENCH_NVFLARE_REPS=1 pytest
bench/test_bench_nvflare.py -s -p no:cacheprovider``. Skipped when nvflare is not installed.

Both sides run inside FLARE's own ``FedAvg`` controller (nvflare/app_common/workflows/fedavg.py):
a round resets the controller's aggregation state as ``FedAvg.run`` does, hands every reply to
``FedAvg._aggregate_one_result`` (FLARE's in-time callback) and ends with
``FedAvg._get_aggregated_result``. Candidates:

- **flare**: ``FedAvg()`` without an aggregator, i.e. FLARE's built-in weighted mean: a fresh
  ``WeightedAggregationHelper`` per round, ``add(data=result.params, weight=..., ...)`` per reply
  (NumPy arrays: ``total = total + v * weight``, two new float32 arrays per array and reply;
  torch tensors: ``total.add_(v, alpha=weight)`` in place), ``get_result()`` at the end. FLARE's
  ``InTimeAccumulateWeightedAggregator`` (ScatterAndGather's default) is not a separate
  candidate: its ``DXOAggregator.accept`` feeds the same ``WeightedAggregationHelper.add``, so
  its arithmetic and memory are these; it only adds the Shareable/DXO unpacking per reply.
- **mean**: ``FedAvg(aggregator=AggsrvAggregator("mean"))``: each reply checked finite and
  folded into a float64 sum of D values, the aggregate rounded to float32 at the end.
- the robust rules (NumPy replies only: the format only changes the copy into the rows):
  ``AggsrvAggregator(rule, expected_clients=K)``, every reply copied into a [K, D] float32 buffer
  kept across rounds, then the rule. FLARE 2.9 has no robust aggregator to compare with (no
  median, trimmed mean, Krum or geometric median anywhere in the ``nvflare`` package).

Every (format, K, D, candidate, repeat) runs in a process of its own (this file run as a script),
so its peak RSS is its own. The child builds a pool of POOL distinct replies (a ``dict`` of L
float32 arrays of ``skewed_layout`` sizes summing to D: a shared uniform centre plus each reply's
own uniform noise, scaled by 0.75-1.5); the K replies of a round are the pool cycled (``FLModel``s
sharing the pool's arrays, site names ``site-1``..``site-K``, ``NUM_STEPS_CURRENT_ROUND`` 100-999,
which both sides use as the weight), as FLARE would receive them and let them go one at a time.
Then it runs one untimed round of a small model (D_WARM) on throwaway controllers (aggsrv's
constructor already compiles or loads its numba kernels: neither compile time is counted), reads
VmRSS, resets VmHWM (``/proc/self/clear_refs``) and times two rounds of the full model on one
controller: **first** (the robust rules allocate and first-touch their [K, D] buffer here) and
**steady** (the buffer reused, as from the second round of a run on). Each aggregate is dropped
before the next round.

Reported per candidate, medians over REPS repeats (the candidates' order reversed every other
repeat): ms per steady round (all K ``_aggregate_one_result`` calls and the aggregate; in
brackets the fastest and slowest repeat); effective GB/s = K D 4 bytes read / that time; the
first round's ms; **peak +MB** = VmHWM over both rounds minus VmRSS before the first (what
aggregating costs beyond the replies); **held +MB** = RssAnon after both rounds, the last
aggregate dropped, minus RssAnon before (what an aggregator keeps between rounds, with what the
allocator did not hand back). For the means, also the result against a float64 mean of the same
replies (max |x - mean64| relative to max |mean64|) and flare against ours (max |flare - ours|,
from the first repeat's results, saved by the children); for the robust rules, that the result
is finite and inside each coordinate's range over the pool. ``ours/flare`` = median over
repeats of the candidate's steady time / flare's in the same repeat.

Environment (defaults in brackets): ``AGGSRV_BENCH_NVFLARE_K`` [16,64],
``AGGSRV_BENCH_NVFLARE_D`` [4M,25M] (decimal suffixes K, M; times ``AGGSRV_BENCH_SCALE``),
``AGGSRV_BENCH_NVFLARE_REPS`` [3], ``AGGSRV_BENCH_NVFLARE_RULES``
[median,trimmed_mean:trim=0.1,krum:f=1,multi_krum:f=2,geometric_median] (empty: the means
only), ``AGGSRV_BENCH_NVFLARE_FORMATS`` [numpy,torch]. Nothing about speed is asserted; the
results are checked. The children inherit the environment (``OMP_NUM_THREADS=1`` runs torch's
operations on the calling thread). Run nothing else meanwhile: torch's operations split across
its two threads stall on a busy machine (each line ends with the load average over the case).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SCALE, emit, skewed_layout

pytest.importorskip("nvflare")

from nvflare.apis.fl_constant import FLMetaKey  # noqa: E402
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType  # noqa: E402
from nvflare.app_common.aggregators.weighted_aggregation_helper import (  # noqa: E402
    WeightedAggregationHelper,
)
from nvflare.app_common.workflows.fedavg import FedAvg  # noqa: E402

from aggsrv.integrations.nvflare import AggsrvAggregator  # noqa: E402

F32 = 4
MB = 1e6
POOL = 4  # distinct replies, cycled to make K
LAYERS = 16  # arrays per reply
D_WARM = 65_536
FLARE = "flare"
MEAN = "mean"
ROBUST_DEFAULT = "median,trimmed_mean:trim=0.1,krum:f=1,multi_krum:f=2,geometric_median"
REPO = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 3600


def _size(text: str) -> int:
    """'4M' -> 4,000,000; '1.5K' -> 1,500; '123' -> 123 (decimal units, as fmt_size prints)."""
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return round(float(text[:-1] if mult > 1 else text) * mult)


def _list(name: str, default: str) -> list[str]:
    return [s.strip() for s in os.environ.get(name, default).split(",") if s.strip()]


KS = [int(k) for k in _list("AGGSRV_BENCH_NVFLARE_K", "16,64")]
DS = [max(LAYERS, round(_size(d) * SCALE)) for d in _list("AGGSRV_BENCH_NVFLARE_D", "4M,25M")]
REPS = max(1, int(os.environ.get("AGGSRV_BENCH_NVFLARE_REPS", "3")))
RULES = _list("AGGSRV_BENCH_NVFLARE_RULES", ROBUST_DEFAULT)
FORMATS = _list("AGGSRV_BENCH_NVFLARE_FORMATS", "numpy,torch")


def fmt_d(n: int) -> str:
    """25_000_000 -> '25M', 4_194_304 -> '4.19M'."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


# --------------------------------------------------------------------------------------------
# The child: one candidate, one (format, K, D), one repeat
# --------------------------------------------------------------------------------------------


def _status_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(rest.split()[0])
    return out


def _reset_peak() -> bool:
    """VmHWM back to the current RSS; False where /proc refuses (then the peak is the
    process's whole-life peak, ru_maxrss)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _pool(D: int, seed: int) -> tuple[list[str], list[np.ndarray]]:
    """POOL distinct replies as flat float32 rows, and the names of the LAYERS arrays."""
    rng = np.random.default_rng(seed)
    centre = rng.random(D, dtype=np.float32)
    centre *= 2.0
    centre -= 1.0
    rows = []
    for scale in rng.uniform(0.75, 1.5, size=POOL):
        row = rng.random(D, dtype=np.float32)
        row *= np.float32(2.0 * scale)
        row -= np.float32(scale)
        row += centre
        rows.append(row)
    return [f"layer{i:02d}" for i in range(LAYERS)], rows


def _params(names: list[str], row: np.ndarray, fmt: str) -> dict[str, Any]:
    """One reply's parameter dict: the row split at the layout's sizes (views, no copy)."""
    sizes = skewed_layout(row.size, LAYERS)
    parts = np.split(row, np.cumsum(sizes)[:-1])
    if fmt == "torch":
        return {n: torch.from_numpy(p) for n, p in zip(names, parts, strict=True)}
    return dict(zip(names, parts, strict=True))


def _replies(pool: list[dict[str, Any]], K: int) -> list[FLModel]:
    """K replies cycling through the pool, each with its site name and step count."""
    return [
        FLModel(
            params=pool[k % len(pool)],
            params_type=ParamsType.FULL,
            meta={"client_name": f"site-{k + 1}", FLMetaKey.NUM_STEPS_CURRENT_ROUND: _steps(k)},
        )
        for k in range(K)
    ]


def _steps(k: int) -> int:
    return 100 + (389 * k + 17) % 900


def _controller(impl: str, K: int) -> FedAvg:
    aggregator = None if impl == FLARE else AggsrvAggregator(impl, expected_clients=K)
    ctl = FedAvg(num_clients=K, num_rounds=1, aggregator=aggregator)
    ctl.logger.disabled = True  # one INFO line per reply otherwise, on both sides
    return ctl


def _round(ctl: FedAvg, replies: list[FLModel], number: int) -> FLModel:
    """One round as FedAvg.run does it: reset the aggregation state, the in-time callback per
    reply, then the aggregate."""
    ctl.current_round = number
    if ctl.aggregator:
        ctl.aggregator.reset_stats()
    else:
        ctl._aggr_helper = WeightedAggregationHelper(exclude_vars=ctl.exclude_vars)
        ctl._aggr_metrics_helper = WeightedAggregationHelper()
        ctl._all_metrics = True
    ctl._received_count = 0
    ctl._expected_count = len(replies)
    ctl._params_type = None
    ctl._site_metric_weights = {}
    for reply in replies:
        ctl._aggregate_one_result(reply)
    return ctl._get_aggregated_result()


def _flat(model: FLModel, names: list[str]) -> np.ndarray:
    parts = [model.params[n] for n in names]
    return np.concatenate([p.numpy() if isinstance(p, torch.Tensor) else p for p in parts])


def child(impl: str, fmt: str, K: int, D: int, seed: int, save: str) -> dict[str, Any]:
    """Measure one candidate in this process (module docstring); the figures as a dict."""
    names, rows = _pool(D, seed)
    pool = [_params(names, r, fmt) for r in rows]
    replies = _replies(pool, K)
    _, warm_rows = _pool(D_WARM, seed + 1)
    warm = _replies([_params(names, r, fmt) for r in warm_rows], K)
    _round(_controller(impl, K), warm, 0)  # first-call costs, on a throwaway controller
    del warm, warm_rows
    ctl = _controller(impl, K)
    gc.collect()
    start = _status_kb()
    before = start["VmRSS"]
    reset = _reset_peak()
    times = []
    for number in (1, 2):
        t0 = time.perf_counter()
        result = _round(ctl, replies, number)
        times.append(time.perf_counter() - t0)
        if number == 1:
            del result
            gc.collect()
    peak_kb = _status_kb()["VmHWM"] if reset else _maxrss_kb()
    info = (result.meta or {}).get("aggsrv")
    flat = _flat(result, names)  # for the checks, after the measurements
    del result
    gc.collect()
    held_kb = _status_kb()["RssAnon"] - flat.nbytes // 1000
    out: dict[str, Any] = {
        "first_s": times[0],
        "steady_s": times[1],
        "peak_mb": (peak_kb - before) * 1e3 / MB,
        "held_mb": (held_kb - start["RssAnon"]) * 1e3 / MB,
        "pool_mb": sum(r.nbytes for r in rows) / MB,
        "rss_before_mb": before * 1e3 / MB,
        "info": info,
    }
    result = flat
    if impl in (FLARE, MEAN):
        weights = np.zeros(POOL)
        for k in range(K):
            weights[k % POOL] += _steps(k)
        mean64 = np.zeros(D)
        for w, r in zip(weights, rows, strict=True):
            mean64 += (w / weights.sum()) * r
        out["rel_err"] = float(np.abs(result - mean64).max() / np.abs(mean64).max())
        del mean64
        if save:
            np.save(save, result)
    else:
        lo, hi = np.minimum.reduce(rows), np.maximum.reduce(rows)
        out["in_range"] = bool(np.isfinite(result).all() and (lo <= result).all())
        out["in_range"] = out["in_range"] and bool((result <= hi).all())
    return out


def _maxrss_kb() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# --------------------------------------------------------------------------------------------
# The parent
# --------------------------------------------------------------------------------------------


def _run_child(impl: str, fmt: str, K: int, D: int, seed: int, save: str) -> dict[str, Any]:
    args = json.dumps([impl, fmt, K, D, seed, save])
    proc = subprocess.run(
        [sys.executable, __file__, args],
        capture_output=True, text=True, cwd=REPO, timeout=CHILD_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, f"{impl} {fmt} K={K} D={D}: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def _case(fmt: str, K: int, D: int, tmp: Path) -> list[str]:
    """Every candidate of one (format, K, D), REPS repeats interleaved; the table rows."""
    impls = [FLARE, MEAN] + (RULES if fmt == "numpy" else [])
    runs: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
    saved = {i: str(tmp / f"{fmt}-{K}-{D}-{i}.npy") for i in (FLARE, MEAN)}
    load = []
    for rep in range(REPS):
        order = impls if rep % 2 == 0 else impls[::-1]
        for impl in order:
            save = saved.get(impl, "") if rep == 0 else ""
            load.append(os.getloadavg()[0])
            runs[impl].append(_run_child(impl, fmt, K, D, seed=1000 * K + rep, save=save))
    a, b = (np.load(saved[i], mmap_mode="r") for i in (FLARE, MEAN))
    cross = float(np.abs(a - b).max())
    del a, b
    for p in saved.values():
        os.unlink(p)
    steady = {i: [r["steady_s"] for r in runs[i]] for i in impls}
    rows = []
    for impl in impls:
        rs = runs[impl]
        t = float(np.median(steady[impl]))
        ratio = float(np.median(np.asarray(steady[impl]) / np.asarray(steady[FLARE])))
        if impl in (FLARE, MEAN):
            check = f"rel err {max(r['rel_err'] for r in rs):.1e}"
            if impl == MEAN:
                check += f"; vs flare {cross:.1e}"
        else:
            check = "in range" if all(r["in_range"] for r in rs) else "OUT OF RANGE"
            its = [(r["info"] or {}).get("iterations") for r in rs]
            if its[0] is not None:
                check += f", {'/'.join(str(i) for i in its)} iters"
        rows.append(
            f"| {fmt} | {K} | {fmt_d(D)} | {impl} | {_ms(t)} "
            f"({_ms(min(steady[impl]))}-{_ms(max(steady[impl]))}) | {K * D * F32 / t / 1e9:.1f} | "
            f"{ratio:.2f}x | {_ms(float(np.median([r['first_s'] for r in rs])))} | "
            f"{np.median([r['peak_mb'] for r in rs]):.0f} | "
            f"{np.median([r['held_mb'] for r in rs]):.0f} | {check} |"
        )
        assert impl not in (FLARE, MEAN) or max(r["rel_err"] for r in rs) < 1e-4, rows[-1]
        assert impl in (FLARE, MEAN) or all(r["in_range"] for r in rs), rows[-1]
    pool_mb = runs[FLARE][0]["pool_mb"]
    rows.append(
        f"|   | pool {POOL} x {pool_mb / POOL:.0f} MB = {pool_mb:.0f} MB; "
        f"load {min(load):.1f}-{max(load):.1f} |"
    )
    return rows


HEADER = (
    "| format | K | D | candidate | ms/round (range) | GB/s | ours/flare | first round ms "
    "| peak +MB | held +MB | check |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bench_nvflare(benchmark: Any, fmt: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    lines = [HEADER]
    print("\n" + HEADER, flush=True)
    for D in DS:
        for K in KS:
            case = _case(fmt, K, D, tmp_path)
            for line in case:
                print(line, flush=True)
            lines += case
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    title = (
        f"nvflare {fmt}: {REPS} repeats, medians; {time.monotonic() - t0:.0f} s, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    emit(benchmark, title + "\n" + "\n".join(lines), {"scale": SCALE, "fmt": fmt})


if __name__ == "__main__":
    impl_, fmt_, K_, D_, seed_, save_ = json.loads(sys.argv[1])
    print(json.dumps(child(impl_, fmt_, K_, D_, seed_, save_)))
    sys.stdout.flush()
    # Skip the interpreter's teardown of a few GB of arrays (and of FLARE's threads).
    os._exit(0)
