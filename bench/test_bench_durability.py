"""What durability costs: the same pushes to a server with `durability = "off"` and `"on"` (every
accepted update appended to the write-ahead log and fsynced before its ack; group commit).

Run: `pytest bench/test_bench_durability.py --benchmark-only -s` (about a minute; the log goes
to a temporary directory on the disk that holds /tmp). `AGGSRV_BENCH_SCALE=0.01` for a smoke run.

- `test_bench_durability_ingest`: one client pushes a D = 16M float32 delta (64 MB) to fedasync,
  interleaved between the two servers. The physical limit of the durable path's extra time is the
  disk: measured in the same run as appending 64 MB to a growing file and fdatasync-ing it.
- `test_bench_durability_ingest_processes`: the same, cold and in separate processes: two
  `aggsrv serve` processes (fedasync, `--durability on` with its state directory, and `off`), one
  client process that pushes the 64 MB delta to each and appends it to a file beside the state
  directory + fdatasync (the disk), in rotating order, `os.sync()` before every step, after 10
  warm-up pushes per server. Target of the issue (shown, not asserted): on <= 1.15x max(off,
  disk). The line also gives the disk step's fdatasync alone (the rest is the write), each
  server's CPU per timed round (from /proc: the get_job, the push and what the server did in
  the background meanwhile), and, from the durable server's /metrics and its log segments, how
  long acks waited for the log's fsync, the checkpoints taken, and whether updates were logged
  in parts as they arrived or whole once applied.
- `test_bench_durability_small`: 32 client threads loop get_job + push of D = 100K deltas (400 kB)
  against each server: updates/s, push p50/p99, and fsyncs per update (below 1 when group commit
  shares an fsync between concurrent acks).

- `test_bench_durability_resume`: how long `aggsrv serve --resume` takes from spawn to SERVING
  against the length of the log it replays. 8 client threads push D = 50K deltas to a durable
  fedasync server that never checkpoints after the first (so the log is all there is); after 0,
  250, 500 and 1,000 updates the state directory is copied, and each copy is resumed by a fresh
  `aggsrv serve` process (three times, the medians kept): spawn to SERVING, and the replay's own
  time from the server's log line; the replay rate is compared with the rate the same server took
  the updates in (target: replay at least as fast as live ingest). Beside it, the longest log is
  replayed in a fresh process on its main thread (where resume ran before) and on the
  aggregation thread (where it runs now, as live aggregation does).

No target is asserted: the ingest issue's target (>= 0.7x a bare receiver) applies to `off`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch
from conftest import REPS, SCALE, emit, fmt_size, median_ratio, scaled
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ingest_helpers import AggsrvServer, interleaved_prepared

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import durability
from aggsrv.values import Status, UpdateKind

MB = 1e6
D_INGEST = scaled(16 * 2**20)
D_SMALL = scaled(100_000)
N_CLIENTS = 32
PER_CLIENT = int(os.environ.get("AGGSRV_BENCH_SMALL_UPDATES", "20"))
D_RESUME = scaled(50_000)
RESUME_UPDATES = [0, 250, 500, 1000]
RESUME_CLIENTS = 8
REPO = Path(__file__).resolve().parents[1]


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


# The client of `test_bench_durability_ingest_processes`, in a process of its own: registers on
# each server, warms up, then times each round's steps in rotating order, `os.sync()` first.
_COLD_CLIENT = r"""
import gc, json, os, sys, time, urllib.request
import numpy as np, torch
sys.path.insert(0, "bench")
from ingest_helpers import process_cpu_seconds
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.values import UpdateKind
args = json.loads(sys.argv[1])
D, reps, warmup = args["D"], args["reps"], args["warmup"]
layout = ModelLayout.from_named_shapes([("w", (D,))])
delta = torch.randn(D) * 1e-3
clients = {n: Client(a, f"cold-{n}") for n, a in args["servers"].items()}
statuses = []
def push(name):
    c = clients[name]
    job = c.get_job()
    t0 = time.perf_counter()
    statuses.append(c.push(job, delta, kind=UpdateKind.DELTA, num_samples=1).status.name)
    return time.perf_counter() - t0
data = np.random.default_rng().integers(0, 255, 4 * D, dtype=np.uint8).tobytes()
fd = os.open(args["disk"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
disk_sync = []
def disk():
    t0 = time.perf_counter()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    t1 = time.perf_counter()
    os.fdatasync(fd)
    disk_sync.append(time.perf_counter() - t1)
    return time.perf_counter() - t0
steps = {**{n: (lambda n=n: push(n)) for n in clients}, "disk": disk}
for c in clients.values():
    c.register(layout=layout, initial=torch.zeros(D) + 0.5)
for name in clients:
    for _ in range(warmup):
        push(name)
for _ in range(3):
    disk()
disk_sync.clear()
metrics = lambda: urllib.request.urlopen(args["metrics"], timeout=30).read().decode()
before = metrics()
times = {n: [] for n in steps}
names = list(steps)
gc.collect()
gc.disable()
cpu_before = {n: process_cpu_seconds(pid) for n, pid in args["pids"].items()}
for r in range(reps):
    k = r % len(names)
    for n in names[k:] + names[:k]:
        os.sync()
        times[n].append(steps[n]())
cpu = {n: process_cpu_seconds(pid) - cpu_before[n] for n, pid in args["pids"].items()}
gc.enable()
after = metrics()
os.close(fd)
for c in clients.values():
    c.close()
print(json.dumps({"times": times, "disk_sync": disk_sync, "server_cpu": cpu,
                  "statuses": statuses, "metrics": [before, after]}))
"""

_WAL_HEADER = struct.Struct("<4sQI")  # a record's magic, body length, CRC (durability's format)


def _aggsrv_command() -> list[str]:
    """The `aggsrv` console script of this interpreter's environment (`python -m aggsrv.cli`
    where there is none)."""
    script = shutil.which("aggsrv", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "aggsrv.cli"]


def _wait_serving(proc: subprocess.Popen, port: int, log_path: str, limit: float = 300) -> None:
    """Poll the gRPC health check of the server process `proc` on `port` until SERVING."""
    t0 = time.monotonic()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            assert proc.poll() is None, Path(log_path).read_text()[-2000:]
            assert time.monotonic() - t0 < limit, f"not SERVING after {limit:.0f} s"
            try:
                req = health_pb2.HealthCheckRequest(service="")
                if health.Check(req, timeout=0.5).status == 1:  # SERVING
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.01)


def _stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (the server stops cleanly), SIGKILL after 120 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _wal_records(state: str) -> dict[str, int]:
    """The records of the log segments in `state` by kind, from their headers and meta: "part"
    (an upload's bytes logged while it arrived), "update" naming its parts ("update_parts"),
    "update" holding its tensors ("update_whole": logged once applied), and the rest."""
    counts = {"part": 0, "update_parts": 0, "update_whole": 0, "other": 0}
    for _, path in durability.list_segments(state):
        with open(path, "rb") as f:
            size, at = os.fstat(f.fileno()).st_size, 0
            while at + _WAL_HEADER.size + 4 <= size:
                magic, body, _ = _WAL_HEADER.unpack(f.read(_WAL_HEADER.size))
                if magic != durability.WAL_MAGIC or at + _WAL_HEADER.size + body > size:
                    break  # a torn tail
                (meta_len,) = struct.unpack("<I", f.read(4))
                doc = json.loads(f.read(meta_len))
                if doc["kind"] == "update":
                    counts["update_parts" if "parts" in doc["meta"] else "update_whole"] += 1
                else:
                    counts[doc["kind"] if doc["kind"] == "part" else "other"] += 1
                at += _WAL_HEADER.size + body
                f.seek(at)
    return counts


def _metric(text: str, name: str) -> float:
    """A sample's value in Prometheus text (0 when absent)."""
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_bench_durability_ingest_processes(benchmark) -> None:
    """`test_bench_durability_ingest` cold and in separate processes: two `aggsrv serve`
    processes (durability on with its state directory, off without one), one client process
    that pushes the same delta to each and appends it to a file beside the state directory
    (+ fdatasync), in rotating order, with `os.sync()` before every step (no dirty page cache
    left over from the step before). Target of the issue (shown, not asserted): on <= 1.15x
    max(off, disk)."""
    D = D_INGEST
    nbytes = D * 4
    tmp = tempfile.mkdtemp(prefix="aggsrv-bench-cold-")
    state = os.path.join(tmp, "state")
    metrics_port = _free_port()
    flags = {
        "off": ["--durability", "off", "--state-dir", ""],
        "on": ["--durability", "on", "--state-dir", state, "--metrics-port", str(metrics_port)],
    }
    procs: dict[str, subprocess.Popen] = {}
    ports: dict[str, int] = {}
    try:
        for name, extra in flags.items():
            port = ports[name] = _free_port()
            log_path = os.path.join(tmp, f"serve-{name}.log")
            cmd = [*_aggsrv_command(), "serve", "--strategy", "fedasync", "--host", "127.0.0.1",
                   "--port", str(port), "--auth", "none", "--rate-limit", "0", *extra]  # fmt: skip
            with open(log_path, "w") as log_file:
                procs[name] = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    cwd=tmp,
                )  # fmt: skip
        for name, proc in procs.items():
            _wait_serving(proc, ports[name], os.path.join(tmp, f"serve-{name}.log"))
        args = {
            "D": D, "reps": REPS, "warmup": 10, "disk": os.path.join(tmp, "disk-append"),
            "servers": {n: f"127.0.0.1:{p}" for n, p in ports.items()},
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            "pids": {n: p.pid for n, p in procs.items()},
        }  # fmt: skip

        def client() -> dict:
            proc = subprocess.run(
                [sys.executable, "-c", _COLD_CLIENT, json.dumps(args)],
                capture_output=True, text=True, cwd=REPO, timeout=1800,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-4000:]
            return json.loads(proc.stdout.splitlines()[-1])

        result = benchmark.pedantic(client, rounds=1, iterations=1)
        wal = _wal_records(state)  # before the final checkpoint on stop prunes segments
    finally:
        for proc in procs.values():
            _stop_process(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    assert all(s == "APPLIED" for s in result["statuses"]), set(result["statuses"])
    times = {n: np.asarray(v) for n, v in result["times"].items()}
    med = {n: float(np.median(v)) for n, v in times.items()}
    rate = {n: nbytes / MB / t for n, t in med.items()}
    disk_sync = float(np.median(result["disk_sync"]))
    # A server's CPU over the timed rounds (a get_job and a push each, and what the server did
    # in the background meanwhile: checkpoints, the log's writes), per round.
    cpu_per_round = {n: c / REPS for n, c in result["server_cpu"].items()}
    floor = np.maximum(times["off"], times["disk"])
    ratio = median_ratio(times["on"], floor)  # per round: on / max(off, disk)
    target = 1.15
    before, after = result["metrics"]
    delta = {
        m: _metric(after, m) - _metric(before, m)
        for m in ("aggsrv_wal_sync_seconds_sum", "aggsrv_wal_sync_seconds_count",
                  "aggsrv_checkpoints_total", "aggsrv_checkpoint_seconds_sum")
    }  # fmt: skip
    info = {
        "scale": SCALE,
        "D": D,
        "bytes": nbytes,
        "rounds": REPS,
        **{f"{n}_s": t for n, t in med.items()},
        **{f"{n}_MBps": r for n, r in rate.items()},
        **{f"{n}_rounds_s": v.tolist() for n, v in times.items()},
        "on_vs_max_off_disk": ratio,
        "on_vs_max_off_disk_of_medians": med["on"] / max(med["off"], med["disk"]),
        "target_on_vs_max_off_disk": target,
        "target_met": ratio <= target,
        "disk_fdatasync_s": disk_sync,
        **{f"server_cpu_per_round_{n}_s": c for n, c in cpu_per_round.items()},
        **{f"wal_{k}_records": v for k, v in wal.items()},
        "ack_wal_sync_waits": delta["aggsrv_wal_sync_seconds_count"],
        "ack_wal_sync_seconds": delta["aggsrv_wal_sync_seconds_sum"],
        "checkpoints": delta["aggsrv_checkpoints_total"],
        "checkpoint_seconds": delta["aggsrv_checkpoint_seconds_sum"],
    }

    def cell(n: str) -> str:
        v = times[n] * 1e3
        return f"{med[n] * 1e3:.0f} ms ({v.min():.0f}-{v.max():.0f}, {rate[n]:.0f} MB/s)"

    line = (
        f"durability ingest cold, processes, fedasync D={fmt_size(D)} ({nbytes / MB:.0f} MB), "
        f"os.sync before each step, {REPS} rounds: off {cell('off')}, on {cell('on')}, disk "
        f"append+fdatasync {cell('disk')} (of which fdatasync {disk_sync * 1e3:.0f} ms) -> on = "
        f"{ratio:.2f}x max(off, disk)  [<= {target}x {'ok' if ratio <= target else 'MISSED'}]; "
        f"server CPU per round (get_job + push): off {cpu_per_round['off'] * 1e3:.0f} ms, on "
        f"{cpu_per_round['on'] * 1e3:.0f} ms; durable server in the rounds: ack waits on "
        f"the log's fsync {delta['aggsrv_wal_sync_seconds_sum'] / REPS * 1e3:.0f} ms/round, "
        f"{delta['aggsrv_checkpoints_total']:.0f} checkpoints "
        f"({delta['aggsrv_checkpoint_seconds_sum']:.1f} s); log segments left: "
        f"{wal['part']} parts, {wal['update_parts']} updates naming parts, "
        f"{wal['update_whole']} logged whole"
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _resume_seconds(state: str, config: str) -> tuple[float, int, float]:
    """Spawn `aggsrv serve --resume state` and wait for SERVING: (seconds, records replayed,
    seconds the replay took by the server's log)."""
    port = _free_port()
    log_path = os.path.join(os.path.dirname(state), f"resume-{port}.log")
    cmd = [sys.executable, "-m", "aggsrv.cli", "serve", "--config", config, "--host",
           "127.0.0.1", "--port", str(port), "--resume", state]  # fmt: skip
    with open(log_path, "w") as log_file:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file, cwd=REPO)
        try:
            _wait_serving(proc, port, log_path)
            took = time.monotonic() - t0
        finally:
            proc.kill()
            proc.wait(timeout=30)
    found = re.search(
        r"after replaying (\d+) logged records in ([0-9.]+) s", Path(log_path).read_text()
    )
    assert found, Path(log_path).read_text()[-2000:]
    return took, int(found.group(1)), float(found.group(2))


# Replays a state directory's whole log in a fresh process, as `aggsrv serve --resume` would,
# either on the main thread (where resume ran before) or on the federation's aggregation thread.
_REPLAY = r"""
import sys, time
from aggsrv.server import durability as D, persistence
from aggsrv.server.config import ServerConfig
from aggsrv.server.federation import Federation, rebuild
state, config, where = sys.argv[1:4]
cfg = ServerConfig.load(config)
t0 = time.perf_counter()
if where == "main":
    fed = Federation(cfg)
    persistence.restore(fed, D.load_checkpoint(D.checkpoint_path(state, 1)))
    for _, record in D.iter_records(state, 1):
        fed.replay(record)
    fed.shutdown_threads()
else:
    rebuild(cfg, state, 1)
print(time.perf_counter() - t0)
"""


def _replay_threads(state: str, config: str) -> dict[str, float]:
    """Median seconds to load checkpoint 1 and replay the whole log in a fresh process, on its
    main thread and on its aggregation thread (interleaved, three times each)."""
    times: dict[str, list[float]] = {"main": [], "aggregation": []}
    for _ in range(3):
        for where in times:
            proc = subprocess.run(
                [sys.executable, "-c", _REPLAY, state, config, where],
                capture_output=True, text=True, cwd=REPO, timeout=600, check=True,
            )  # fmt: skip
            times[where].append(float(proc.stdout.split()[-1]))
    return {k: float(np.median(v)) for k, v in times.items()}


def test_bench_durability_resume(benchmark) -> None:
    D = D_RESUME
    layout = _layout(D)
    tmp = tempfile.mkdtemp(prefix="aggsrv-bench-resume-")
    config = os.path.join(tmp, "server.toml")
    settings = (
        'strategy = "fedasync"\nauth = "none"\ndurability = "on"\nrate_limit_per_second = 0.0\n'
        "checkpoint_every_updates = 0\ncheckpoint_every_seconds = 0\ncheckpoint_every_bytes = 0\n"
    )
    Path(config).write_text(settings)
    server = AggsrvServer(
        strategy="fedasync", durability="on", state_dir=os.path.join(tmp, "state"),
        rate_limit_per_second=0.0, checkpoint_every_updates=0, checkpoint_every_seconds=0,
        checkpoint_every_bytes=0,
    )  # fmt: skip
    clients = [Client(server.address, f"resume-{i}") for i in range(RESUME_CLIENTS)]
    pool = ThreadPoolExecutor(max_workers=RESUME_CLIENTS, thread_name_prefix="bench-client")
    copies: dict[int, str] = {}
    ingest_s = 0.0
    try:
        clients[0].register(layout=layout, initial=torch.randn(D))
        list(pool.map(lambda c: c.register(layout=layout), clients[1:]))
        done = 0
        for n in RESUME_UPDATES:
            per = [(n - done) // RESUME_CLIENTS + (i < (n - done) % RESUME_CLIENTS)
                   for i in range(RESUME_CLIENTS)]  # fmt: skip

            def work(i: int, per: list[int] = per) -> None:
                c = clients[i]
                for _ in range(per[i]):
                    c.push(c.get_job(), torch.randn(D) * 1e-3, kind=UpdateKind.DELTA)

            t0 = time.perf_counter()
            list(pool.map(work, range(RESUME_CLIENTS)))
            ingest_s += time.perf_counter() - t0
            done = n
            # Every push was acknowledged, so its records are on disk: a consistent copy.
            copies[n] = shutil.copytree(server.config.state_dir, os.path.join(tmp, f"log-{n}"))
    finally:
        pool.shutdown(wait=True)
        for c in clients:
            c.close()
        server.stop()
    ingest_rate = RESUME_UPDATES[-1] / ingest_s
    resume: dict[int, float] = {}
    records: dict[int, int] = {}
    replay: dict[int, float] = {}
    for n, state in copies.items():
        runs = [_resume_seconds(state, config) for _ in range(3)]
        resume[n] = float(np.median([t for t, _, _ in runs]))
        records[n] = runs[0][1]
        replay[n] = float(np.median([r for _, _, r in runs]))
    benchmark.pedantic(
        lambda: _resume_seconds(copies[RESUME_UPDATES[-1]], config), rounds=1, iterations=1
    )
    threads = _replay_threads(copies[RESUME_UPDATES[-1]], config)
    shutil.rmtree(tmp, ignore_errors=True)
    rates = {n: n / max(replay[n], 1e-6) for n in RESUME_UPDATES[1:]}
    info = {
        "scale": SCALE,
        "D": D,
        "live_ingest_updates_per_s": ingest_rate,
        **{f"resume_{n}_updates_s": resume[n] for n in RESUME_UPDATES},
        **{f"replay_{n}_updates_s": replay[n] for n in RESUME_UPDATES},
        **{f"records_{n}": records[n] for n in RESUME_UPDATES},
        **{f"replay_{n}_updates_per_s": rates[n] for n in rates},
        **{f"replay_{k}_thread_s": v for k, v in threads.items()},
    }
    cells = ", ".join(
        f"{n} updates ({records[n]} records) {resume[n]:.2f} s (replay {replay[n]:.2f} s)"
        for n in RESUME_UPDATES
    )
    slowest = min(rates.values())
    line = (
        f"durability resume fedasync D={fmt_size(D)}: spawn to SERVING: {cells}; replay "
        f"{slowest:.0f}+ updates/s vs live ingest {ingest_rate:.0f} updates/s "
        f"({RESUME_CLIENTS} clients) -> replay = {slowest / ingest_rate:.1f}x live"
        f"  [>= 1x live {'ok' if slowest >= ingest_rate else 'MISSED'}]; the "
        f"{records[RESUME_UPDATES[-1]]} records replayed in a fresh process on its main thread "
        f"(where resume ran before) {threads['main']:.2f} s, on its aggregation thread "
        f"{threads['aggregation']:.2f} s"
    )
    emit(benchmark, line, info)
