"""The per-shard overhead of the sharded strategies (issue 9, docs/sharding.md "Scaling model"):
1 shard against 2 shards as separate processes on loopback (gloo), on this 2-core machine.

Run: `pytest bench/test_bench_sharding.py --benchmark-only -s` (about 1.5 minutes at scale 1,
about 3.5 GiB of RAM over the four processes); `AGGSRV_BENCH_SCALE=0.01` for a smoke run (about
25 s, mostly process start-up). bench/README.md has the figures and how to read a line.
The file's other benchmark, `test_bench_sharding_grpc` (at its end, described there), times a
client's updates over gRPC against `aggsrv serve` processes: about 30 s more at scale 1; `-k
sharding_grpc` runs it alone, `-k "not grpc"` the others.

For fedasync (elementwise: no collective) and the three reducing families, orthofl, fedhist and
feddgic: D = 4M (2^22) float32 in a ResNet-18-shaped layout (the 62 tensors of
`resnet18_sizes` rescaled to D, named as in a CIFAR ResNet-18, BatchNorm modules flagged as
normalisation), K = 16 clients. The same update sequence drives three candidates (the `_drive`
of tests/sharding/test_sharding.py: every step each client asks for a job in a seeded order, and an
update is the job's weights plus a per-client noise row times 0.1 / (1 + step mod 3)):

- **1 shard**: one process with the whole model and a LocalReducer (the kernels' single-pass
  paths), torch and numba threads = 1;
- **sharded path**: the same in a process of its own, with a reducer that claims 2 shards and
  returns its input: the strategies' and kernels' sharded code (partial sums, one reduce, then
  the apply pass) without communication: what sharding adds in arithmetic, apart from the
  collectives;
- **2 shards**: two spawned processes in one gloo group (file:// rendezvous in a tmp dir), each
  with its `ShardLayout` slice and a TorchReducer (threads = 1 each) whose `sum_` a subclass here
  times and counts.

Interleaving: the sequence runs in chunks of CHUNK_STEPS steps; a multiprocessing barrier lets
one candidate at a time run its chunk, so the three see the same machine state and never run
together (the waiting processes sleep). The chunks take the six orders of the three in turn, so
each candidate follows each other equally often: with three rotations only, the sharded-path
candidate, which then mostly ran right after the 1-shard one, was 20-30% slower on FedDGIC's
round close in every run (page faults of a 256 MB copy; alone, the two take the same time).
Each candidate runs the sequence on a small model first (numba's cached kernels load, gloo
connects). Before each update the two shards vote, one 8 B `all_reduce(MAX)` as the design's
all-or-none check would; it is timed apart, and it lines the shards up so that their per-call
times compare.

Measured per `on_update` call, grouped by what the call did (fedasync, orthofl: every update
makes a version; fedhist: the buffered updates, and the K-th update that runs the round;
feddgic: the grouping-phase updates, the update that closes a grouping round, the asynchronous
updates):

- **time**, median over calls; for 2 shards of the per-call maximum over the ranks (an update is
  done when both shards are);
- **collectives**: the time inside the reducer's all_reduce calls (per-call maximum over the
  ranks, which includes waiting for the other shard: the part sharding adds to a call; the
  per-call minimum, with one collective per call, is the shard that arrived last: about the
  collective's own latency), their count and bytes (the reduced float64 tensors). Count and
  bytes must be equal on both shards and equal to the sharded-path candidate's: the volume
  depends on K and L only, not on the number of shards;
- per round (fedhist, feddgic's grouping rounds: the calls from one aggregation to the next),
  the all_reduce count and bytes, beside docs/sharding.md's model of them;
- **vote**: the median time of the 8 B vote before each update (it also waits for the other
  shard to finish the previous call and to prepare this one);
- **t_c**: the median of 200 back-to-back 8 B all_reduces between the two shards, and of 100
  where the shard timed arrives last, 2 ms after the other (which then sleeps in gloo).

`2/1` = median over calls of the 2-shard time over the 1-shard time of the same call. It is NOT
a speed-up claim: the 1-shard baseline runs one thread while the two shards run on both cores
and share the memory bandwidth, and the machine has only those two cores. Effective GB/s =
the model's 4D bytes per update / the time (the rate at which updates are applied).
"""

from __future__ import annotations

import gc
import itertools
import math
import multiprocessing as mp
import random
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    SCALE,
    emit,
    fmt_size,
    fmt_time,
    random_tensor,
    rescale_sizes,
    resnet18_sizes,
    scaled,
)

from aggsrv.sharding import LocalReducer, ShardLayout, ShardMap, TorchReducer

D_FULL = 2**22
D = scaled(D_FULL)
D_WARMUP = 64 * 62 * 4  # numba's cached kernels load and gloo connects on a small model first
CLIENTS = 16
CHUNK_STEPS = 1
SEED = 20261124
# One process per candidate: 'one' (1 shard), 'split' (the sharded path on 1 shard), and the
# two gloo ranks of 'two'.
ROLES = ("one", "split", "0", "1")
TIMEOUT_S = 900.0

# name -> (config, steps, labels: what each outcome of on_update means, the label that closes a
# round, or None when every update is one). A label is the strategy's phase (FedDGIC) followed
# by the outcome's status.
CASES: dict[str, tuple[dict[str, Any], int, dict[str, str], str | None]] = {
    "fedasync": ({"alpha": 0.6}, 12, {"APPLIED": "update"}, None),
    "orthofl": ({}, 12, {"APPLIED": "update"}, None),
    "fedhist": (
        {"buffer_size": 4, "history": 2, "learning_rate": 0.1},
        12,
        {"BUFFERED": "buffered update", "APPLIED": "aggregating update"},
        "APPLIED",
    ),
    "feddgic": (
        {"min_available": CLIENTS, "similarity_rounds": 12, "grouping_round_timeout": None},
        18,
        {
            "groupingBUFFERED": "grouping update",
            "groupingAPPLIED": "round-closing update",
            "asyncAPPLIED": "async update",
        },
        "groupingAPPLIED",
    ),
}


# ------------------------------------------------------------------------------ the layout


def resnet18_names() -> tuple[list[str], list[str]]:
    """The names of `resnet18_sizes`' 62 tensors (same order) and the BatchNorm modules."""
    names = ["conv1.weight", "bn1.weight", "bn1.bias"]
    norms = ["bn1"]
    cin = 64
    for stage, (cout, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), start=1):
        for block in range(2):
            c_in = cin if block == 0 else cout
            p = f"layer{stage}.{block}"
            names += [f"{p}.conv1.weight", f"{p}.bn1.weight", f"{p}.bn1.bias"]
            names += [f"{p}.conv2.weight", f"{p}.bn2.weight", f"{p}.bn2.bias"]
            norms += [f"{p}.bn1", f"{p}.bn2"]
            if block == 0 and (stride != 1 or c_in != cout):
                names += [f"{p}.shortcut.0.weight", f"{p}.shortcut.1.weight"]
                names += [f"{p}.shortcut.1.bias"]
                norms.append(f"{p}.shortcut.1")
        cin = cout
    names += ["fc.weight", "fc.bias"]
    assert len(names) == 62
    return names, norms


def resnet18_layout(numel: int):
    """A ModelLayout of the ResNet-18's 62 tensors rescaled to `numel` values (1-D shapes)."""
    from aggsrv.layout import ModelLayout

    names, norms = resnet18_names()
    sizes = rescale_sizes(resnet18_sizes(), numel)
    pairs = [(n, (int(s),)) for n, s in zip(names, sizes, strict=True)]
    return ModelLayout.from_named_shapes(pairs, norm_names=norms)


# ------------------------------------------------------------------------------ reducers


class _Meter:
    """Count, bytes and seconds of the reduce calls since `reset`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.nbytes = 0
        self.seconds = 0.0

    def add(self, t: torch.Tensor, seconds: float) -> None:
        self.calls += 1
        # TorchReducer reduces floats in float64 (a copy for float32) and others as they are.
        self.nbytes += t.numel() * (8 if t.is_floating_point() else t.element_size())
        self.seconds += seconds


class _TimedReducer(TorchReducer):
    """TorchReducer whose all_reduce calls are timed and counted."""

    def __init__(self, group: Any = None) -> None:
        super().__init__(group)
        self.meter = _Meter()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = super().sum_(t)
        self.meter.add(t, time.perf_counter() - t0)
        return out


class _SplitPathReducer:
    """The whole model in one process, but 2 shards claimed: the strategies and kernels take
    their sharded code path; the sum over the "shards" is the tensor itself (counted)."""

    rank = 0
    world_size = 2

    def __init__(self) -> None:
        self.meter = _Meter()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        self.meter.add(t, 0.0)
        return t


class _LocalMeteredReducer(LocalReducer):
    """LocalReducer (world_size 1: strategies pass no reduce= at all) with an idle meter."""

    def __init__(self) -> None:
        self.meter = _Meter()


# ------------------------------------------------------------------------------ the driver


class _Driver:
    """One candidate: a strategy driven step by step through the shared update sequence."""

    def __init__(self, strategy: Any, noise: torch.Tensor, meter: _Meter, vote: Any) -> None:
        self.strategy = strategy
        self.noise = noise  # [CLIENTS, local D]
        self.meter = meter
        self.vote = vote
        self.staging = torch.empty(strategy.dim, dtype=torch.float32)  # the server's slot
        self.rng = random.Random(SEED)
        self.now = 0.0
        self.step = 0
        self.timers = 0
        # (label, seconds, collective seconds, all_reduce calls, all_reduce bytes, vote seconds)
        self.records: list[tuple[str, float, float, int, int, float]] = []
        for k in range(CLIENTS):
            strategy.on_register(f"c{k}", self.now)

    def run(self, steps: int) -> None:
        from aggsrv.strategies import Update, UpdateKind

        s = self.strategy
        for _ in range(steps):
            self.step += 1
            self.now += 0.1
            order = list(range(CLIENTS))
            self.rng.shuffle(order)
            for k in order:
                c = f"c{k}"
                deadline = s.next_deadline()
                if deadline is not None and self.now >= deadline:
                    s.on_timer(self.now)  # none of CASES sets a timer; counted, not timed
                    self.timers += 1
                job = s.job_for(c, self.now)
                if job is None:
                    continue
                scale = 0.1 / (1 + self.step % 3)
                torch.add(job.weights, self.noise[k], alpha=scale, out=self.staging)
                update = Update(
                    c, job.job_id, job.base_version, f"{c}-{self.step}", 10 + k,
                    job.recipe.work_target, UpdateKind.WEIGHTS, self.staging,
                )  # fmt: skip
                phase = str(getattr(s, "phase", ""))
                vote_s = self.vote() if self.vote is not None else 0.0
                self.meter.reset()
                t0 = time.perf_counter()
                outcome = s.on_update(update, self.now)
                t = time.perf_counter() - t0
                m = self.meter
                label = phase + outcome.status.name
                self.records.append((label, t, m.seconds, m.calls, m.nbytes, vote_s))


def _make(name: str, layout: Any, initial: torch.Tensor, reducer: Any) -> Any:
    from aggsrv.strategies import make_strategy

    config = CASES[name][0]
    return make_strategy(name, layout=layout, initial=initial, config=config, device="cpu",
                         reducer=reducer)  # fmt: skip


def _candidate(name: str, numel: int, role: str, vote: Any) -> _Driver:
    """This process's candidate on a `numel` model: roles 'one' and 'split' (the whole model),
    '0' and '1' (the gloo ranks of 'two')."""
    whole = resnet18_layout(numel)
    initial = random_tensor(numel, seed=SEED)
    noise = random_tensor(CLIENTS, numel, seed=SEED + 1)
    if role in ("one", "split"):
        reducer = _LocalMeteredReducer() if role == "one" else _SplitPathReducer()
        return _Driver(_make(name, whole, initial, reducer), noise, reducer.meter, None)
    layout = ShardLayout(whole, ShardMap.even(numel, 2), int(role))
    shard_reducer = _TimedReducer()
    local_noise = layout.local(noise).contiguous()
    del noise
    strategy = _make(name, layout, layout.local(initial).clone(), shard_reducer)
    return _Driver(strategy, local_noise, shard_reducer.meter, vote)


def _late_latency(rank: int, vote: Any, reps: int = 100, wait_s: float = 0.002) -> float:
    """Median time of an 8 B all_reduce for the shard that arrives last, the other one having
    waited in it for `wait_s` (the late shard spins meanwhile; the shards take turns): the
    latency a collective has between two computations, as in a strategy's call."""
    times = []
    for i in range(reps):
        vote()  # line up
        if rank == i % 2:
            end = time.perf_counter() + wait_s
            while time.perf_counter() < end:
                pass
            times.append(vote())
        else:
            vote()
    return float(np.median(times))


def _process_main(name: str, role: str, init: str, barrier: Any, queue: Any) -> None:
    """One process: the candidate 'one' or 'split', or gloo rank '0' or '1' of 'two'."""
    try:
        import numba
        import torch.distributed as dist

        torch.set_num_threads(1)
        numba.set_num_threads(1)
        vote = None
        t_c = t_late = math.nan
        if role in ("0", "1"):
            dist.init_process_group("gloo", init_method=init, rank=int(role), world_size=2,
                                    timeout=timedelta(seconds=TIMEOUT_S))  # fmt: skip
            flag = torch.zeros(1, dtype=torch.int64)

            def vote() -> float:
                t0 = time.perf_counter()
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                return time.perf_counter() - t0

        steps = CASES[name][1]
        _candidate(name, D_WARMUP, role, vote).run(steps)
        driver = _candidate(name, D, role, vote)
        mine = "two" if role in ("0", "1") else role
        orders = list(itertools.permutations(("one", "split", "two")))
        gc.collect()
        gc.disable()
        for chunk in range(math.ceil(steps / CHUNK_STEPS)):
            n = min(CHUNK_STEPS, steps - chunk * CHUNK_STEPS)
            for cand in orders[chunk % len(orders)]:
                barrier.wait(TIMEOUT_S)
                if cand == mine:
                    driver.run(n)
        gc.enable()
        barrier.wait(TIMEOUT_S)
        if vote is not None:  # t_c while the other candidates' processes wait
            for _ in range(20):
                vote()
            t_c = float(np.median([vote() for _ in range(200)]))
            t_late = _late_latency(int(role), vote)
        barrier.wait(TIMEOUT_S)
        queue.put((role, driver.records, driver.timers, (t_c, t_late), None))
        if role in ("0", "1"):
            dist.destroy_process_group()
    except Exception:
        barrier.abort()
        queue.put((role, None, None, None, traceback.format_exc()))


def _run_processes(name: str, tmp: Path) -> dict[str, tuple]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    barrier = ctx.Barrier(len(ROLES))
    init = f"file://{tmp / 'rendezvous'}"
    procs = [
        ctx.Process(target=_process_main, args=(name, role, init, barrier, queue)) for role in ROLES
    ]
    for p in procs:
        p.start()
    got: dict[str, tuple] = {}
    try:
        for _ in procs:
            role, records, timers, t_c, error = queue.get(timeout=TIMEOUT_S)
            assert error is None, f"{name}, process {role}:\n{error}"
            got[role] = (records, timers, t_c)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


# ------------------------------------------------------------------------------ the model


def doc_model_bytes(name: str, layout: Any) -> tuple[str, int]:
    """docs/sharding.md's all_reduce bytes per update (per round for fedhist and feddgic's
    grouping rounds), with what it counts."""
    config = CASES[name][0]
    L = len(layout.names)
    if name == "fedasync":
        return "0 per update", 0
    if name == "orthofl":
        return f"16L per update, L = {L}", 16 * L
    if name == "fedhist":
        K, h = config["buffer_size"], config["history"]
        return f"8(Kh + K + h + 2) per round, K = {K}, h = {h}", 8 * (K * h + K + h + 2)
    M = layout.module_offsets.numel() - 1  # FedDGIC's "layers" are the layout's modules
    K = CLIENTS
    return f"8L(K^2 + K + 1) per grouping round, L = {M} modules, K = {K}", 8 * M * (K * K + K + 1)


# ------------------------------------------------------------------------------ reporting


def _med(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else math.nan


def _span(xs: list[int]) -> str:
    lo, hi, mid = min(xs), max(xs), int(np.median(xs))
    return f"{mid}" if lo == hi else f"{mid} (range {lo}-{hi})"


def _rounds(records: list[tuple], closing: str | None) -> list[tuple[int, int, float]]:
    """(all_reduce calls, bytes, collective seconds) per round: the calls after one aggregation
    up to the next (every call when `closing` is None)."""
    out = []
    calls = nbytes = 0
    secs = 0.0
    for label, _, c_s, n, b, _ in records:
        calls, nbytes, secs = calls + n, nbytes + b, secs + c_s
        if closing is None or label == closing:
            out.append((calls, nbytes, secs))
            calls = nbytes = 0
            secs = 0.0
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_bench_sharding(benchmark: Any, name: str, tmp_path: Path) -> None:
    config, steps, labels, closing = CASES[name]
    got = benchmark.pedantic(_run_processes, args=(name, tmp_path), rounds=1, iterations=1)
    one, split, two0, two1 = (got[role][0] for role in ROLES)
    assert not any(got[role][1] for role in ROLES), "no timer expected"
    t_c0, t_c1 = got["0"][2], got["1"][2]
    # The shards made the same calls, and the same collectives in each.
    assert [r[0] for r in two0] == [r[0] for r in two1], f"{name}: the shards diverged"
    assert [r[3:5] for r in two0] == [r[3:5] for r in two1], f"{name}: unequal collectives"
    # One server took the same decisions, and the reduced volume does not depend on the shards.
    same = [r[0] for r in one] == [r[0] for r in two0] == [r[0] for r in split]
    assert same, f"{name}: one shard and two shards took other decisions"
    assert [r[3:5] for r in split] == [r[3:5] for r in two0], f"{name}: other reduce volume"
    assert {r[0] for r in one} <= set(labels), {r[0] for r in one}

    layout = resnet18_layout(D)
    L = len(layout.names)
    head = (
        f"sharding {name} D={fmt_size(D)} L={L} K={CLIENTS} clients, 1 vs 2 gloo shards "
        f"(1 thread each), {len(one)} updates"
    )
    if name == "fedhist":
        head += f" (buffer {config['buffer_size']}, h {config['history']})"
    if name == "feddgic":
        head += f" ({config['similarity_rounds']} grouping rounds)"
    parts = [head + ":"]
    info: dict[str, Any] = {"scale": SCALE, "D": D, "L": L, "clients": CLIENTS, "updates": len(one)}
    ratios = []
    for label, what in labels.items():
        idx = [i for i, r in enumerate(one) if r[0] == label]
        if not idx:
            continue
        t1 = [one[i][1] for i in idx]
        ts = [split[i][1] for i in idx]
        t2 = [max(two0[i][1], two1[i][1]) for i in idx]
        c_max = [max(two0[i][2], two1[i][2]) for i in idx]
        c_min = [min(two0[i][2], two1[i][2]) for i in idx]
        calls = [two0[i][3] for i in idx]
        nbytes = [two0[i][4] for i in idx]
        ratio = _med([b / a for a, b in zip(t1, t2, strict=True)])
        ratios.append(f"{ratio:.2f}x {what}")
        m1, m2, c = _med(t1), _med(t2), _med(c_max)
        rate = f" ({4 * D / m1 / 1e9:.1f} GB/s)"
        line = (
            f"  {what} x{len(idx)}: 1 shard {fmt_time(m1)}{rate if label != closing else ''}, "
            f"sharded path {fmt_time(_med(ts))}, 2 shards {fmt_time(m2)}"
        )
        if max(calls):
            line += (
                f"; collectives {fmt_time(c)} ({100 * c / m2:.1f}% of 2 shards; min over "
                f"ranks {fmt_time(_med(c_min))}), all_reduces {_span(calls)} of "
                f"{_span(nbytes)} B"
            )
        else:
            line += "; no collective"
        parts.append(line)
        key = what.replace(" ", "_").replace("-", "_")
        info.update({
            f"{key}_n": len(idx), f"{key}_one_s": m1, f"{key}_split_s": _med(ts),
            f"{key}_two_s": m2, f"{key}_two_rank0_s": _med([two0[i][1] for i in idx]),
            f"{key}_two_rank1_s": _med([two1[i][1] for i in idx]),
            f"{key}_collective_s": c, f"{key}_collective_min_rank_s": _med(c_min),
            f"{key}_allreduce_calls": int(np.median(calls)),
            f"{key}_allreduce_bytes": int(np.median(nbytes)), f"{key}_ratio_two_vs_one": ratio,
        })  # fmt: skip
    model, model_bytes = doc_model_bytes(name, layout)
    rounds = _rounds(two0, closing)
    if closing is not None:
        # Round 1 has no history (FedHist): the steady state is the median.
        r_calls, r_bytes = [r[0] for r in rounds], [r[1] for r in rounds]
        r_secs = [max(a[2], b[2]) for a, b in zip(rounds, _rounds(two1, closing), strict=True)]
        parts.append(
            f"  per round x{len(rounds)}: all_reduces {_span(r_calls)} of {_span(r_bytes)} B, "
            f"collectives {fmt_time(_med(r_secs))} (docs/sharding.md: {model_bytes} B, {model})"
        )
        info.update(round_n=len(rounds), round_allreduce_calls=int(np.median(r_calls)),
                    round_allreduce_bytes=int(np.median(r_bytes)))  # fmt: skip
    else:
        b = int(np.median([r[1] for r in rounds]))
        parts.append(f"  all_reduce bytes per update {b} B (docs/sharding.md: {model_bytes} B, "
                     f"{model})")  # fmt: skip
    vote = _med([max(a[5], b[5]) for a, b in zip(two0, two1, strict=True)])
    t_c = max(t_c0[0], t_c1[0])
    t_late = max(t_c0[1], t_c1[1])
    parts.append(
        f"  control: vote (8 B all_reduce before each update) {fmt_time(vote)}; t_c (8 B "
        f"all_reduce) {fmt_time(t_c)} back to back, {fmt_time(t_late)} for the shard that "
        "arrives last after the other waited 2 ms"
    )
    parts.append(
        f"  -> 2 shards / 1 shard time {', '.join(ratios)} (NOT a speed-up claim: 1 thread "
        "against 2 processes on the 2 cores, sharing memory bandwidth)"
    )
    info.update(doc_model_bytes=model_bytes, vote_s=vote, t_c_s=t_c, t_c_late_s=t_late)
    emit(benchmark, "\n".join(parts), info)


# ------------------------------------------------------------------ end to end over gRPC
#
# `test_bench_sharding_grpc`: what a client sees per update from a sharded server, against a
# plain single server, over real gRPC on loopback. For fedasync (elementwise: the shards only
# vote) and orthofl (one 16L-byte all_reduce per update besides the vote), at D = 1M and 4M
# float32 in a 6-tensor layout (`ModelLayout.from_named_shapes`: a small conv, an MLP head):
#
# - **1 shard**: `aggsrv serve` (shards = 1), one process;
# - **2 shards**: `aggsrv serve --shards 2 --rank 0|1 --dist-url tcp://127.0.0.1:PORT`, two
#   processes in one gloo group; the client (`aggsrv.client.Client`, registered at rank 0)
#   splits each update by the shard map and streams both slices at once, and assembles jobs
#   from both shards.
#
# All three server processes run during the whole benchmark (started together, ready when
# GetStatus answers on each), with `--state-dir ''`, `--auth none`, durability off and no rate
# limit, torch's default threads. One client per server, in the pytest process, both with the
# same initial model and the same DELTA (1e-3 x N(0, 1), reused). A round is, per candidate in
# turn (the one going first alternates): `get_job()` (timed: GetJob, the job's weights
# downloaded whole, from both shards when sharded), then `push(job, delta)` (timed: encode,
# stream, the server's checks, the strategy's update and, sharded, the vote, until the ack),
# which must be APPLIED. E2E_WARMUP rounds untimed, then E2E_UPDATES timed. Afterwards both
# servers hold the same model (fedasync bit for bit, orthofl within 1e-5): checked.
#
# Reported: median and p90 per call, the difference 2 shards - 1 shard of the medians (the
# sharding overhead per update, as a client sees it), the median of the per-round differences,
# and effective GB/s = 4D bytes / median time. The two shards, the single server and the client
# share this machine's 2 cores: no speed-up is expected, and none is claimed.

E2E_CASES: dict[str, dict[str, Any]] = {"fedasync": {"alpha": 0.6}, "orthofl": {}}
E2E_SIZES = {"1M": 2**20, "4M": 2**22}
E2E_WARMUP = 5
E2E_UPDATES = 20
E2E_READY_S = 120.0


def e2e_layout(target: int):
    """A 6-tensor layout of about `target` float32 values (a 3x3 conv, then a two-layer MLP
    head whose hidden width fills the rest)."""
    from aggsrv.layout import ModelLayout

    fixed = 32 * 3 * 3 * 3 + 32 + 10  # conv1.weight, conv1.bias, fc2.bias
    rows = max(1, round((target - fixed) / (1024 + 1 + 10)))
    return ModelLayout.from_named_shapes(
        [("conv1.weight", (32, 3, 3, 3)), ("conv1.bias", (32,)), ("fc1.weight", (rows, 1024)),
         ("fc1.bias", (rows,)), ("fc2.weight", (10, rows)), ("fc2.bias", (10,))]
    )  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ServeProc:
    """`python -m aggsrv.cli serve --host 127.0.0.1 --port PORT ...` (stderr in `log`)."""

    def __init__(self, log: Path, port: int, *args: str) -> None:
        import subprocess
        import sys

        self.address = f"127.0.0.1:{port}"
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, "-m", "aggsrv.cli", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--auth", "none", "--state-dir", "", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._log)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def close(self) -> None:
        """SIGTERM (rank 0 stops every shard), then SIGKILL after 20 s."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def _wait_ready(procs: list[_ServeProc], limit: float = E2E_READY_S) -> float:
    """Seconds until every process answers GetStatus (polled, retries 0)."""
    import grpc

    from aggsrv.client.client import Client

    t0 = time.monotonic()
    for p in procs:
        while True:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.address} exited with {p.proc.returncode}:\n{p.log()}")
            try:
                with Client(p.address, "bench-probe", timeout=2.0, retries=0) as probe:
                    probe.status()
                break
            except grpc.RpcError:
                if time.monotonic() - t0 > limit:
                    raise AssertionError(
                        f"{p.address} not ready after {limit} s:\n{p.log()}"
                    ) from None
                time.sleep(0.1)
    return time.monotonic() - t0


def _p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90)) if xs else math.nan


@pytest.mark.parametrize("size", list(E2E_SIZES))
@pytest.mark.parametrize("name", list(E2E_CASES))
def test_bench_sharding_grpc(benchmark: Any, name: str, size: str, tmp_path: Path) -> None:
    from aggsrv.client.client import Client
    from aggsrv.strategies import Status

    layout = e2e_layout(scaled(E2E_SIZES[size]))
    D = layout.numel
    initial = random_tensor(D, seed=SEED)
    delta = random_tensor(D, seed=SEED + 1).mul_(1e-3)
    settings = tmp_path / "serve.toml"
    table = "".join(f"{k} = {v!r}\n" for k, v in E2E_CASES[name].items())
    settings.write_text('rate_limit_per_second = 0.0\ndurability = "off"\n'
                        f"[strategy_config]\n{table}")  # fmt: skip
    common = ("--strategy", name, "--config", str(settings))
    url = f"tcp://127.0.0.1:{_free_port()}"
    procs: list[_ServeProc] = []
    clients: dict[str, Any] = {}
    try:
        procs.append(_ServeProc(tmp_path / "one.log", _free_port(), *common))
        for r in range(2):
            shard = ("--shards", "2", "--rank", str(r), "--dist-url", url)
            procs.append(_ServeProc(tmp_path / f"shard{r}.log", _free_port(), *common, *shard))
        ready_s = _wait_ready(procs)
        for cand, p in (("one", procs[0]), ("two", procs[1])):
            c = Client(p.address, "bench", timeout=60.0, retries=0)
            clients[cand] = c
            c.register(layout=layout, initial=initial)
        assert clients["one"].shard_map is None and clients["two"].shard_map is not None
        assert clients["two"].shard_map.bounds[-1] == D

        def one_update(c: Any) -> tuple[float, float]:
            t0 = time.perf_counter()
            job = c.get_job()
            t1 = time.perf_counter()
            res = c.push(job, delta, num_samples=10)
            t2 = time.perf_counter()
            assert res.status is Status.APPLIED, (name, res)
            return t1 - t0, t2 - t1

        def run() -> dict[str, list[tuple[float, float]]]:
            times: dict[str, list[tuple[float, float]]] = {"one": [], "two": []}
            for i in range(E2E_WARMUP + E2E_UPDATES):
                for cand in ("one", "two") if i % 2 == 0 else ("two", "one"):
                    t = one_update(clients[cand])
                    if i >= E2E_WARMUP:
                        times[cand].append(t)
            return times

        times = benchmark.pedantic(run, rounds=1, iterations=1)
        # Both servers made the same updates: same version, same model.
        total = E2E_WARMUP + E2E_UPDATES
        version_one, model_one = clients["one"].get_model()
        version_two, model_two = clients["two"].get_model()
        with Client(procs[2].address, "bench-probe", timeout=10.0, retries=0) as probe:
            version_rank1 = int(probe.status().version)
        assert version_one == version_two == version_rank1 == total, (
            version_one, version_two, version_rank1,
        )  # fmt: skip
        err = float((model_two.double() - model_one.double()).norm() / model_one.double().norm())
        if name == "fedasync":
            assert torch.equal(model_one, model_two), err
        else:
            assert err <= 1e-5, err
    finally:
        for c in clients.values():
            c.close()
        for p in reversed(procs):  # rank 1 first: rank 0's SIGTERM would stop it anyway
            p.close()

    nbytes = 4 * D
    push = {c: [t[1] for t in times[c]] for c in times}
    job = {c: [t[0] for t in times[c]] for c in times}
    info: dict[str, Any] = {"scale": SCALE, "D": D, "update_bytes": nbytes, "tensors": 6,
                            "updates": E2E_UPDATES, "warmup": E2E_WARMUP,
                            "ready_s": ready_s, "model_rel_err": err}  # fmt: skip
    parts = [
        f"sharding over gRPC {name} D={fmt_size(D)} ({nbytes / 1e6:.1f} MB, 6 tensors), 1 shard "
        f"vs 2 shard processes, {E2E_UPDATES} updates per candidate after {E2E_WARMUP} warm-up, "
        "interleaved:"
    ]
    for call, xs in (("push", push), ("get_job", job)):
        m1, m2 = _med(xs["one"]), _med(xs["two"])
        q1, q2 = _p90(xs["one"]), _p90(xs["two"])
        per_round = _med([b - a for a, b in zip(xs["one"], xs["two"], strict=True)])
        parts.append(
            f"  {call}: 1 shard p50 {fmt_time(m1)} p90 {fmt_time(q1)} ({nbytes / m1 / 1e9:.2f} "
            f"GB/s), 2 shards p50 {fmt_time(m2)} p90 {fmt_time(q2)} ({nbytes / m2 / 1e9:.2f} "
            f"GB/s); 2 - 1 shard {(m2 - m1) * 1e3:+.2f} ms (median per-round difference "
            f"{per_round * 1e3:+.2f} ms)"
        )
        info.update({
            f"{call}_one_p50_s": m1, f"{call}_one_p90_s": q1, f"{call}_two_p50_s": m2,
            f"{call}_two_p90_s": q2, f"{call}_diff_s": m2 - m1,
            f"{call}_diff_per_round_s": per_round, f"{call}_one_GBps": nbytes / m1 / 1e9,
            f"{call}_two_GBps": nbytes / m2 / 1e9,
        })  # fmt: skip
    same = "bit for bit" if err == 0.0 else f"rel. err {err:.1e}"
    parts.append(
        f"  start-up until all 3 processes answer GetStatus {ready_s:.1f} s; both models after "
        f"the run: version {total}, equal {same}"
    )
    parts.append(
        "  -> NOT a speed-up claim: the 2 shards, the single server and the client share this "
        "machine's 2 cores (loopback, no network card)"
    )
    emit(benchmark, "\n".join(parts), info)
