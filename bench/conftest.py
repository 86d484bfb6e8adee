"""Shared helpers for the aggsrv.kernels CPU benchmarks (see bench/README.md).

- layouts: skewed, deterministic segment sizes summing exactly to D (`skewed_layout`), the real
  CIFAR ResNet-18 layout (`resnet18_sizes`), and `rescale_sizes` to shrink a layout to any D;
- `interleaved`: a round-robin timer, so every candidate sees the same machine state;
- `run_case` / `report`: record our kernel with pytest-benchmark once, then print and store in
  `benchmark.extra_info` the medians, effective GB/s (or GFLOP/s) and the per-round ratios.

`AGGSRV_BENCH_SCALE` (float, default 1.0) multiplies every D: `AGGSRV_BENCH_SCALE=0.01` runs the
whole suite in seconds (to check it works; the figures only mean something at scale 1).
`AGGSRV_BENCH_REPS` (default 7, never fewer) sets the number of interleaved rounds.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

SCALE = float(os.environ.get("AGGSRV_BENCH_SCALE", "1.0"))
REPS = max(7, int(os.environ.get("AGGSRV_BENCH_REPS", "7")))
# A candidate faster than this is called several times per round (small Table-3 models and small
# scales), so timer resolution and per-round noise do not dominate.
MIN_ROUND_S = float(os.environ.get("AGGSRV_BENCH_MIN_ROUND_S", "0.02"))

# One line per benchmark, repeated in the terminal summary (visible without -s).
RESULTS: list[str] = []


def emit(benchmark: Any, line: str, info: dict) -> None:
    """Print a result line with the load average, keep it for the summary and in extra_info."""
    info.setdefault("loadavg_1m", round(os.getloadavg()[0], 2))
    line += f"  (load {info['loadavg_1m']:.1f})"
    print("\n" + line)
    RESULTS.append(line)
    benchmark.extra_info.update(info)
    benchmark.extra_info["line"] = line


def scaled(D: int) -> int:
    """D multiplied by AGGSRV_BENCH_SCALE (at least 1)."""
    return max(1, round(D * SCALE))


def fmt_size(n: float) -> str:
    """4194304 -> '4.2M' (decimal units, like the issue's '4M' and '11.2M')."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def fmt_time(t: float) -> str:
    if t >= 1.0:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


def rescale_sizes(sizes: Sequence[int], D: int) -> np.ndarray:
    """Sizes proportional to `sizes`, each >= 1 (when D >= len(sizes)), summing exactly to D."""
    raw = np.asarray(sizes, dtype=np.float64)
    L = raw.size
    if D < L:
        raise ValueError(f"cannot fit {L} non-empty segments in D={D}")
    ideal = raw * (D / raw.sum())
    out = np.maximum(np.floor(ideal).astype(np.int64), 1)
    diff = D - int(out.sum())
    order = np.argsort(-(ideal - np.floor(ideal)), kind="stable")  # largest remainders first
    i = 0
    while diff > 0:
        out[order[i % L]] += 1
        diff -= 1
        i += 1
    while diff < 0:  # only when the max(., 1) raised tiny segments: take from the largest
        j = int(np.argmax(out))
        take = min(-diff, int(out[j]) - 1)
        out[j] -= take
        diff += take
    assert int(out.sum()) == D and out.min() >= 1
    return out


def skewed_layout(D: int, L: int, seed: int = 0) -> np.ndarray:
    """L segment sizes summing exactly to D with a realistic skew, deterministic from `seed`.

    About a third are norm/bias vectors (16..1024 values, at most 2% of D in all), most are
    conv-like weights (k*k*cin*cout with power-of-two channels, k in {1, 3}: a log-skewed spread)
    and about one in twenty is a big fully-connected layer (several times the largest conv),
    placed last as in a classifier head. Conv and FC sizes are scaled together to fill D.
    """
    if L < 1:
        raise ValueError("L must be >= 1")
    rng = np.random.default_rng(seed)
    n_big = max(1, round(L * 0.05)) if L >= 3 else 0
    n_small = int(L * 0.35) if L >= 3 else 0
    n_conv = L - n_big - n_small
    ch = 2 ** rng.integers(4, 10, size=(n_conv, 2))  # 16..512 channels
    k = rng.choice([1, 3, 3, 3], size=n_conv)
    conv = (ch[:, 0] * ch[:, 1] * k * k).astype(np.float64)
    big = conv.max() * rng.uniform(2.0, 8.0, size=n_big)
    small = (2 ** rng.integers(4, 11, size=n_small)).astype(np.float64)
    if small.sum() > 0.02 * D:
        small = np.maximum(np.floor(small * (0.02 * D / small.sum())), 1.0)
    small = small.astype(np.int64)
    rest = rescale_sizes(np.concatenate([conv, big]), D - int(small.sum()))
    conv_sz, big_sz = rest[:n_conv], rest[n_conv:]
    # Network order: each conv followed by its share of norm/bias vectors, the FC layers last
    # (each with a bias when small vectors are left).
    seq: list[int] = []
    si = 0
    per_conv = n_small / max(n_conv + n_big, 1)
    owed = 0.0
    for c in conv_sz:
        seq.append(int(c))
        owed += per_conv
        while owed >= 1.0 and si < n_small - n_big:
            seq.append(int(small[si]))
            si += 1
            owed -= 1.0
    for b in big_sz:
        seq.append(int(b))
        if si < n_small:
            seq.append(int(small[si]))
            si += 1
    seq.extend(int(s) for s in small[si:])
    sizes = np.asarray(seq, dtype=np.int64)
    assert sizes.size == L and int(sizes.sum()) == D
    return sizes


def resnet18_sizes() -> np.ndarray:
    """The 62 parameter tensors of a CIFAR-10 ResNet-18 (11,173,962 values), in order."""
    sizes = [64 * 3 * 9, 64, 64]  # conv1, bn1
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            c_in = cin if block == 0 else cout
            sizes += [cout * c_in * 9, cout, cout, cout * cout * 9, cout, cout]
            if block == 0 and (stride != 1 or c_in != cout):
                sizes += [cout * c_in, cout, cout]  # shortcut conv + bn
        cin = cout
    sizes += [512 * 10, 10]  # fc
    out = np.asarray(sizes, dtype=np.int64)
    assert out.size == 62 and int(out.sum()) == 11_173_962
    return out


def offsets_of(sizes: Sequence[int]) -> torch.Tensor:
    """int64 offset table [L+1] of a size list."""
    offs = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=offs[1:])
    return torch.from_numpy(offs)


def segments(offsets: torch.Tensor) -> list[tuple[int, int]]:
    o = offsets.tolist()
    return [(o[i], o[i + 1]) for i in range(len(o) - 1)]


def random_tensor(*shape: int, seed: int) -> torch.Tensor:
    """float32 uniform(-1, 1) data, deterministic from `seed` (faster to make than randn)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(*shape, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def _time(fn: Callable[[], Any], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def interleaved(
    fns: dict[str, Callable[[], Any]], reps: int = REPS, min_round_s: float = MIN_ROUND_S
) -> dict[str, list[float]]:
    """Per-call times (seconds) of each candidate over `reps` round-robin rounds.

    Each candidate is called once untimed first (numba compile, page faults, caches), then once
    timed to choose how many calls make one round (>= `min_round_s`). Round r starts at candidate
    r mod n, so no candidate always follows the same one. Index r of every list is round r, so
    per-round ratios compare timings taken seconds apart. The GC is off while timing.
    """
    names = list(fns)
    for n in names:
        fns[n]()
    number = {}
    for n in names:
        t = _time(fns[n], 1)
        number[n] = max(1, min(100_000, math.ceil(min_round_s / max(t, 1e-9))))
    times: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(reps):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                times[n].append(_time(fns[n], number[n]))
    finally:
        if was_enabled:
            gc.enable()
    return times


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over rounds of num[r] / den[r]."""
    return float(np.median(np.asarray(num) / np.asarray(den)))


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def report(
    benchmark: Any,
    title: str,
    times: dict[str, list[float]],
    *,
    nbytes: int | None = None,
    flops: float | None = None,
    floor: str = "floor",
    floor_max: float | None = 1.25,
    naive: str | None = "naive",
    naive_min: float | None = 2.0,
    baseline: str | None = None,
    baseline_max: float | None = None,
) -> dict[str, Any]:
    """Print one line and fill `benchmark.extra_info`; returns the figures.

    `nbytes` (minimal traffic) gives GB/s, `flops` GFLOP/s, both from median times. Ratios are
    medians of per-round ratios: ours/floor, naive/ours (speed-up), ours/baseline. The targets are
    checked and shown, never asserted (timings on a shared 2-core machine are noisy).
    """
    med = {n: float(np.median(v)) for n, v in times.items()}
    ours = times["ours"]
    info: dict[str, Any] = {
        "scale": SCALE,
        "rounds": len(ours),
        "threads": torch.get_num_threads(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        **{f"{n}_s": v for n, v in med.items()},
    }

    def rate(t: float) -> str:
        parts = []
        if nbytes is not None:
            parts.append(f"{nbytes / t / 1e9:.1f} GB/s")
        if flops is not None:
            parts.append(f"{flops / t / 1e9:.0f} GFLOP/s")
        return f" ({', '.join(parts)})" if parts else ""

    if nbytes is not None:
        info["bytes"] = nbytes
        info["ours_GBps"] = nbytes / med["ours"] / 1e9
        info["floor_GBps"] = nbytes / med[floor] / 1e9
    if flops is not None:
        info["flops"] = flops
        info["ours_GFLOPps"] = flops / med["ours"] / 1e9
    line = f"{title}: ours {fmt_time(med['ours'])}{rate(med['ours'])}"
    results, targets = [], []
    met = True
    for n in times:
        if n == "ours":
            continue
        line += f" {n} {fmt_time(med[n])}" + (rate(med[n]) if n == floor else "")
    r_floor = median_ratio(ours, times[floor])
    info[f"ratio_vs_{floor}"] = r_floor
    results.append(f"{r_floor:.2f}x {floor}")
    if floor_max is not None:
        ok = r_floor <= floor_max
        met &= ok
        targets.append(f"<={floor_max}x {floor} {'ok' if ok else 'MISSED'}")
    if naive is not None and naive in times:
        sp = median_ratio(times[naive], ours)
        info["speedup_vs_naive"] = sp
        results.append(f"{sp:.1f}x faster than {naive}")
        if naive_min is not None:
            ok = sp >= naive_min
            met &= ok
            targets.append(f">={naive_min}x vs {naive} {'ok' if ok else 'MISSED'}")
    if baseline is not None:
        rb = median_ratio(ours, times[baseline])
        info[f"ratio_vs_{baseline}"] = rb
        results.append(f"{rb:.2f}x {baseline}")
        if baseline_max is not None:
            ok = rb <= baseline_max
            met &= ok
            targets.append(f"<={baseline_max}x {baseline} {'ok' if ok else 'MISSED'}")
    line += " -> " + ", ".join(results)
    if targets:
        line += f"  [{'; '.join(targets)}]"
        info["targets_met"] = met
    line += f"  (load {info['loadavg_1m']:.1f})"
    print("\n" + line)
    RESULTS.append(line)
    benchmark.extra_info.update(info)
    benchmark.extra_info["line"] = line
    return info


def run_case(
    benchmark: Any, title: str, fns: dict[str, Callable[[], Any]], **report_kw: Any
) -> dict[str, Any]:
    """Time `fns` (must include 'ours') interleaved, record 'ours' once with pytest-benchmark
    (rounds=1: its statistics are not the figures we report), then report."""
    times = interleaved(fns)
    benchmark.pedantic(fns["ours"], rounds=1, iterations=1)
    return report(benchmark, title, times, **report_kw)


# --------------------------------------------------------------------------------------------
# pytest hooks
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _free_memory():
    """Big tensors die with each test; collect so the next one starts with the memory back."""
    yield
    gc.collect()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    tr = terminalreporter
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    tr.section("aggsrv.kernels CPU benchmarks")
    tr.write_line(
        f"scale {SCALE:g}, {REPS} interleaved rounds, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average now {load}"
    )
    for line in RESULTS:
        tr.write_line(line)
