"""What durability costs: the same pushes to a server with `durability = "off"` and `"on"` (every
accepted update appended to the write-ahead log and fsynced before its ack; group commit).

Run: `pytest bench/test_bench_durability.py --benchmark-only -s` (about a minute; the log goes
to a temporary directory on the disk that holds /tmp). `AGGSRV_BENCH_SCALE=0.01` for a smoke run.

- `test_bench_durability_ingest`: one client pushes a D = 16M float32 delta (64 MB) to fedasync,
  interleaved between the two servers. The physical limit of the durable path's extra time is the
  disk: measured in the same run as appending 64 MB to a growing file and fdatasync-ing it.
- `test_bench_durability_small`: 32 client threads loop get_job + push of D = 100K deltas (400 kB)
  against each server: updates/s, push p50/p99, and fsyncs per update (below 1 when group commit
  shares an fsync between concurrent acks).

No target is asserted: the ingest issue's target (>= 0.7x a bare receiver) applies to `off`.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from conftest import REPS, SCALE, emit, fmt_size, median_ratio, scaled
from ingest_helpers import AggsrvServer, interleaved_prepared

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.strategies.base import Status, UpdateKind

MB = 1e6
D_INGEST = scaled(16 * 2**20)
D_SMALL = scaled(100_000)
N_CLIENTS = 32
PER_CLIENT = int(os.environ.get("AGGSRV_BENCH_SMALL_UPDATES", "20"))


def _layout(D: int) -> ModelLayout:
    return ModelLayout.from_named_shapes([("w", (D,))])


def _servers(tmp: str, **config) -> dict[str, AggsrvServer]:
    common = {"strategy": "fedasync", "rate_limit_per_second": 0.0, **config}
    return {
        "off": AggsrvServer(**common),
        "on": AggsrvServer(**common, durability="on", state_dir=os.path.join(tmp, "state")),
    }


def _disk_append_sync(tmp: str, nbytes: int, reps: int) -> float:
    """Median seconds to append `nbytes` to a growing file and fdatasync it, after 3 untimed
    appends: what the log does, so the durable path's physical limit. (On this VM fresh pages
    cost far more than rewritten ones once a few hundred MB are written: a fresh file per
    repetition would measure a rate the log never sees.)"""
    data = np.random.default_rng().integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    path = os.path.join(tmp, "disk-append")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    times = []
    try:
        for r in range(reps + 3):
            t0 = time.perf_counter()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fdatasync(fd)
            if r >= 3:
                times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return float(np.median(times))


def test_bench_durability_ingest(benchmark) -> None:
    D = D_INGEST
    nbytes = D * 4
    layout = _layout(D)
    delta = torch.randn(D) * 1e-3
    tmp = tempfile.mkdtemp(prefix="aggsrv-bench-wal-")
    servers = _servers(tmp)
    clients = {n: Client(s.address, f"ingest-{n}") for n, s in servers.items()}
    outcomes: list[Status] = []
    try:
        for c in clients.values():
            c.register(layout=layout, initial=torch.zeros(D) + 0.5)

        def push(name: str):
            c = clients[name]
            return lambda job: outcomes.append(
                c.push(job, delta, kind=UpdateKind.DELTA, num_samples=1).status
            )

        for name in clients:  # steady state: recycled version buffers (bench_ingest's reason)
            for _ in range(servers[name].config.retained_versions + 2):
                push(name)(clients[name].get_job())
        times = interleaved_prepared({n: (clients[n].get_job, push(n)) for n in clients}, REPS)
        benchmark.pedantic(lambda: push("on")(clients["on"].get_job()), rounds=1, iterations=1)
        wal = servers["on"].server.federation.store.wal
        fsyncs, fsync_s = wal.fsync_count, wal.fsync_seconds
        disk = _disk_append_sync(tmp, nbytes, REPS)
    finally:
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop()
    assert all(s is Status.APPLIED for s in outcomes), set(outcomes)
    med = {n: float(np.median(v)) for n, v in times.items()}
    rate = {n: nbytes / MB / t for n, t in med.items()}
    ratio = median_ratio(times["off"], times["on"])  # on MB/s / off MB/s per round
    info = {
        "scale": SCALE,
        "D": D,
        "bytes": nbytes,
        **{f"{n}_s": t for n, t in med.items()},
        **{f"{n}_MBps": r for n, r in rate.items()},
        "on_vs_off": ratio,
        "disk_append_fdatasync_MBps": nbytes / MB / disk,
        "on_minus_off_s": med["on"] - med["off"],
        "wal_fsyncs": fsyncs,
        "wal_fsync_seconds": fsync_s,
    }
    line = (
        f"durability ingest fedasync D={fmt_size(D)} ({nbytes / MB:.0f} MB): off "
        f"{med['off'] * 1e3:.0f} ms ({rate['off']:.0f} MB/s), on {med['on'] * 1e3:.0f} ms "
        f"({rate['on']:.0f} MB/s) -> on = {ratio:.2f}x off; the log's extra "
        f"{(med['on'] - med['off']) * 1e3:.0f} ms vs the disk's append+fdatasync of the same bytes "
        f"{disk * 1e3:.0f} ms ({nbytes / MB / disk:.0f} MB/s)"
    )
    emit(benchmark, line, info)


def test_bench_durability_small(benchmark) -> None:
    D = D_SMALL
    layout = _layout(D)
    tmp = tempfile.mkdtemp(prefix="aggsrv-bench-wal-")
    servers = _servers(tmp)
    deltas = [torch.randn(D) * 1e-3 for _ in range(N_CLIENTS)]
    clients = {
        n: [Client(s.address, f"small-{i}") for i in range(N_CLIENTS)] for n, s in servers.items()
    }
    statuses: list[Status] = []
    lock = threading.Lock()
    pool = ThreadPoolExecutor(max_workers=N_CLIENTS, thread_name_prefix="bench-client")

    def run(name: str, per: int) -> tuple[float, list[float]]:
        barrier = threading.Barrier(N_CLIENTS)

        def work(i: int) -> tuple[float, float, list[float]]:
            c, d = clients[name][i], deltas[i]
            lat, st = [], []
            barrier.wait()
            t_start = time.perf_counter()
            for _ in range(per):
                job = c.get_job()
                t0 = time.perf_counter()
                st.append(c.push(job, d, kind=UpdateKind.DELTA, num_samples=1).status)
                lat.append(time.perf_counter() - t0)
            with lock:
                statuses.extend(st)
            return t_start, time.perf_counter(), lat

        results = list(pool.map(work, range(N_CLIENTS)))
        wall = max(r[1] for r in results) - min(r[0] for r in results)
        return wall, [x for r in results for x in r[2]]

    walls: dict[str, list[float]] = {"off": [], "on": []}
    lat: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for name, cs in clients.items():
            cs[0].register(layout=layout, initial=torch.randn(D))
            list(pool.map(lambda c: c.register(layout=layout), cs[1:]))
            run(name, 2)  # warm-up
        wal = servers["on"].server.federation.store.wal
        fsyncs0 = wal.fsync_count
        for r in range(REPS):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                w, l_ = run(name, PER_CLIENT)
                walls[name].append(w)
                lat[name].extend(l_)
        fsyncs = wal.fsync_count - fsyncs0
        benchmark.pedantic(lambda: run("on", PER_CLIENT), rounds=1, iterations=1)
    finally:
        pool.shutdown(wait=True)
        for cs in clients.values():
            for c in cs:
                c.close()
        for s in servers.values():
            s.stop()
    assert all(s is Status.APPLIED for s in statuses), set(statuses)
    n_up = N_CLIENTS * PER_CLIENT
    ups = {n: n_up / float(np.median(w)) for n, w in walls.items()}
    p = {n: np.percentile(np.asarray(v), [50, 99]) for n, v in lat.items()}
    ratio = median_ratio(walls["off"], walls["on"])
    per_update = fsyncs / (n_up * REPS)
    info = {
        "scale": SCALE,
        "D": D,
        "clients": N_CLIENTS,
        **{f"{n}_updates_per_s": u for n, u in ups.items()},
        **{f"{n}_push_p50_s": float(v[0]) for n, v in p.items()},
        **{f"{n}_push_p99_s": float(v[1]) for n, v in p.items()},
        "on_vs_off": ratio,
        "fsyncs_per_update": per_update,
    }
    line = (
        f"durability small updates fedasync {N_CLIENTS} clients D={fmt_size(D)}: off "
        f"{ups['off']:.0f} updates/s (push p50 {p['off'][0] * 1e3:.1f} ms, p99 "
        f"{p['off'][1] * 1e3:.1f} ms), on {ups['on']:.0f} updates/s (p50 {p['on'][0] * 1e3:.1f} "
        f"ms, p99 {p['on'][1] * 1e3:.1f} ms) -> on = {ratio:.2f}x off; {per_update:.2f} fsyncs "
        "per update (group commit; jobs are logged too)"
    )
    emit(benchmark, line, info)
