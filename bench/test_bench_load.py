"""The server's load curve: updates/s, latency and RSS per client as concurrent clients grow.

Run: `pytest bench/test_bench_load.py --benchmark-only -s` (N = 8, 64, 256, 1024 clients, D = 100K:
about 2 minutes, a fresh server per N; estimated, not yet run at full size on the 2-core
development machine). Smoke run: `AGGSRV_BENCH_SCALE=0.01 AGGSRV_BENCH_LOAD_CLIENTS=8,64 pytest
bench/test_bench_load.py --benchmark-only -s` (about 40 s). Knobs: `AGGSRV_BENCH_LOAD_CLIENTS`
(comma list of N), `AGGSRV_BENCH_LOAD_SECONDS` (timed window per N, default 10),
`AGGSRV_BENCH_LOAD_PROCS` (client processes, default 2), `AGGSRV_BENCH_SCALE` (multiplies D).

**Server.** `python bench/ingest_helpers.py serve` in a subprocess (its RSS and CPU time are its
own), fresh for every N: fedasync, `auth = "none"`, `durability = "off"`, no state_dir, and
`--config` overrides of three limits: `rate_limit_per_second = 0` (no token bucket: the clients
loop as fast as the server answers), `max_clients` = `max_concurrent_rpcs` = max(2048, 2 x the
largest N): the default `max_clients` (1024) is exactly the largest N, and the default
`max_concurrent_rpcs` (256) is below it: every client holds one call at a time (its GetJob
stream or its upload), so with 1024 clients gRPC itself would answer RESOURCE_EXHAUSTED.
Unchanged on purpose: `max_concurrent_uploads` (4 staging slots; further uploads wait, unread,
which is part of the curve) and `max_streams_per_connection` (128: a connection carries 64
clients here).

**Clients.** N clients, ids `load-0` .. `load-{N-1}`, split over `AGGSRV_BENCH_LOAD_PROCS` (2)
client processes (`python bench/test_bench_load.py clients`, driven through stdin/stdout): each
runs ONE asyncio event loop over grpc.aio, one channel per 64 clients, each channel its own TCP
connection (`grpc.use_local_subchannel_pool`; gRPC would otherwise share one connection between
the channels of a process). 1024 OS threads with a sync `Client` each would measure the GIL of
the benchmark; two processes keep a single Python event loop from being the load's ceiling
(each line shows the client processes' CPU, so a saturated generator is visible). The clients
speak the real protocol: Register (a header; `load-0` first registers from this process with the
initial D-element model through `Client.register`), GetJob (server stream: header, chunks and
trailer decoded into a staging slot by `aggsrv.transport.Decoder`, CRC-32C and finiteness
checked), PushUpdate (client stream: an `UpdateHeader` as `Client.push` builds it, then the
chunk and trailer messages of `aggsrv.protocol.chunk_stream`, built once per process from one
random D-element delta, CRC-32C by the project's `Encoder`). Each client loops get_job + push;
every push must come back APPLIED and the server's `updates_applied` must equal the pushes
acknowledged (asserted; speed is not).

**Per N.** The server's VmRSS is read idle (1 s after it serves), after the model's
registration and after all N registrations; VmHWM is then reset (`/proc/PID/clear_refs`) and
read after the run. Warm-up: until every client has had one push acknowledged, and at least
2 s; then a timed window of `AGGSRV_BENCH_LOAD_SECONDS` (10 s) of wall clock, counted in
pushes acknowledged within it (the loops then finish their calls and stop). One line per N
(here from a smoke run, scale 0.01, on a machine busy with other work: the format, not a figure):

```
load fedasync N=64 D=1.0K (4 kB): 368 updates/s (3682 in 10.0 s; push p50 161.5 ms p99 358.9 ms,
  get_job p50 12.5 ms) | RSS idle 259 MB, +6.6 MB registered (104 kB/client), peak +11.1 MB
  (173 kB/client) | server 2.64 ms CPU/update, 0.97 cores (event loop 0.63, busiest other
  thread 0.18), clients 0.68 cores (max process 0.35), machine 2.0/2 cores busy  (load 4.5)
```

- `updates/s`: pushes acknowledged in the window / its length; each is a whole loop (a 400 kB
  job download and a 400 kB upload);
- `push` p50/p99: from the upload's start (the job in hand) to the ack, over the window's pushes;
  `get_job` p50: from the call to its trailer;
- RSS: `+.. registered` = VmRSS after the N registrations minus idle (the model's fixed part,
  `model` in extra_info, included), `peak` = VmHWM over warm-up and window minus idle; per
  client = that / N;
- CPU, from `/proc/PID/stat` and `/proc/PID/task/TID/stat` (utime + stime) over the window:
  the server's CPU time per update, its cores in use, of which its main thread (the asyncio
  event loop that serves gRPC: every message of every call passes through it) and its busiest
  other thread (the aggregation thread, gRPC's pollers, torch); the client processes' cores;
  and the whole machine's busy cores from `/proc/stat` (anything else running counts there).

**Where it bends, and why.** The summary line names the first N whose updates/s grew by 10 %
or less over the previous N, or whose push p99 more than doubled (computed from the lines, not
fixed). Closed-loop clients: until the server saturates, more clients give more updates/s at
about the same latency; past it updates/s stays flat and latency grows with N (Little's law:
latency ~ N / rate). The CPU columns at the bend say which resource ran out: the event loop
near 1.0 core means the server's single gRPC thread is the limit (more cores would not help;
sharding or fewer, larger messages would); the machine's busy cores near its core count with
the loop below 1.0 means the machine is (clients and server share it: on a 2-core box the
curve then bends early and says little about a dedicated server); a client process near 1.0
core means the load generator is (raise AGGSRV_BENCH_LOAD_PROCS). The summary prints the
hint these thresholds give (0.85 core, 90 % of the cores); RSS per client past the bend shows
what waiting clients cost (queued job downloads and upload windows), the figure to size a
server's memory by.

Nothing is asserted about speed or memory (shared machine); correctness is asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from conftest import SCALE, emit, fmt_size, scaled
from ingest_helpers import (
    layered_layout,
    proc_status_kb,
    process_cpu_seconds,
    reset_peak_rss,
    stat_cpu_seconds,
    stop_server_process,
)

from aggsrv import protocol as P
from aggsrv.client.client import Client, register_header
from aggsrv.transport import Decoder, StagingSlot, WireDtype
from aggsrv.transport.errors import CodecError
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import UpdateKind

MB = 1e6
MIB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
HELPER = Path(__file__).with_name("ingest_helpers.py")
D_LOAD = scaled(100_000)
CLIENTS = [
    int(x) for x in os.environ.get("AGGSRV_BENCH_LOAD_CLIENTS", "8,64,256,1024").split(",") if x
]
WINDOW_S = float(os.environ.get("AGGSRV_BENCH_LOAD_SECONDS", "10"))
WARMUP_MIN_S = 2.0
PROCS = max(1, int(os.environ.get("AGGSRV_BENCH_LOAD_PROCS", "2")))
PER_CHANNEL = 64  # clients sharing one channel (one TCP connection)
LIMIT = max(2048, 2 * max(CLIENTS))  # max_clients and max_concurrent_rpcs
MESSAGE_BYTES = 4 * MIB  # the channels' limit both ways, as Client's default
CALL_TIMEOUT = 300.0
STEP_TIMEOUT = 600.0  # the parent's wait for one answer of a client process
TICKS = os.sysconf("SC_CLK_TCK")
BEND_GROWTH = 0.10  # updates/s growing by this much or less ...
BEND_P99 = 2.0  # ... or the push p99 growing by more than this factor: the curve bends


# --------------------------------------------------------------------------------------------
# The client process: N/P asyncio clients on one event loop
# --------------------------------------------------------------------------------------------


class _Slots:
    """Staging slots for job downloads, reused: as many as downloads decode at once."""

    def __init__(self) -> None:
        self.free: list[StagingSlot] = []

    def take(self, numel: int) -> StagingSlot:
        while self.free:
            slot = self.free.pop()
            if slot.flat.numel() == numel:
                return slot
        return StagingSlot(numel)

    def give(self, slot: StagingSlot) -> None:
        self.free.append(slot)


async def _get_job(
    stub: pb_grpc.AggregationStub, request: pb.GetJobRequest, slots: _Slots
) -> pb.JobHeader:
    """One GetJob stream read to its end: the header, every chunk decoded into a staging slot,
    the trailer's length and CRC-32C checked (as `Client.get_job`, without keeping a copy)."""
    header = decoder = slot = None
    finished = False
    try:
        async for msg in stub.GetJob(request, timeout=CALL_TIMEOUT):
            kind = msg.WhichOneof("kind")
            if kind == "header":
                header = msg.header
                sizes = {t.name: int(t.numel) for t in header.tensors}
                slot = slots.take(sum(sizes.values()))
                decoder = Decoder(slot, sizes, P.wire_dtype(header.dtype), 64 * MIB)
            elif kind == "chunk":
                if decoder is None:
                    raise ConnectionError("chunk before header")
                decoder.feed(msg.chunk.tensor, msg.chunk.offset, msg.chunk.data)
            elif kind == "trailer":
                if decoder is None or finished:
                    raise ConnectionError("trailer out of place")
                decoder.finish(msg.trailer.crc32c, msg.trailer.payload_bytes)
                finished = True
            # "pending": fedasync always has a job; a pending message is only waited past
    finally:
        if slot is not None:
            slots.give(slot)
    if header is None or not finished:
        raise ConnectionError("GetJob stream ended before its trailer")
    return header


async def _client_process() -> None:
    """Protocol on stdin/stdout, one JSON object a line: config -> {"registered"}; {"go"} ->
    {"warm"} once every client had a push acknowledged; {"t0", "t1"} (time.monotonic of the
    window, system-wide on Linux) -> the results once every loop has stopped after t1."""
    loop = asyncio.get_running_loop()

    async def read() -> dict[str, Any]:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            raise SystemExit(0)  # the parent went away
        return json.loads(line)

    def send(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    cfg = await read()
    D, ids, address = int(cfg["D"]), list(cfg["ids"]), cfg["address"]
    layout = layered_layout(D)
    options = [
        ("grpc.max_receive_message_length", MESSAGE_BYTES),
        ("grpc.max_send_message_length", MESSAGE_BYTES),
        ("grpc.use_local_subchannel_pool", 1),  # a connection per channel, not per process
    ]
    n_channels = -(-len(ids) // PER_CHANNEL)
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(n_channels)]
    stubs = [pb_grpc.AggregationStub(ch) for ch in channels]
    limit = asyncio.Semaphore(64)

    async def register(i: int) -> pb.RegisterResponse:
        async with limit:
            request = pb.RegisterRequest(header=register_header(ids[i], layout, MESSAGE_BYTES))
            return await stubs[i // PER_CHANNEL].Register(iter([request]), timeout=CALL_TIMEOUT)

    resps = await asyncio.gather(*(register(i) for i in range(len(ids))))
    assert all(r.layout_hash == layout.hash and r.strategy == "fedasync" for r in resps)
    # Client._fit_chunk: the negotiated chunk, 64 bytes below our message limit.
    chunk_bytes = max(4, min(resps[0].limits.chunk_bytes or MIB, (MESSAGE_BYTES - 64) // 4 * 4))
    gen = torch.Generator().manual_seed(int(cfg["seed"]))
    delta = torch.randn(D, generator=gen) * 1e-3
    # The update's chunk and trailer messages, identical for every push of this process.
    body = list(P.chunk_stream({"update": delta}, WireDtype.FLOAT32, chunk_bytes, pb.UpdateMessage))
    send({"registered": len(ids), "channels": n_channels, "messages_per_push": len(body) + 1})

    await read()  # go
    window = [float("inf"), float("inf")]
    warm: set[int] = set()
    all_warm = asyncio.Event()
    done: list[tuple[float, float, float]] = []  # (ack time, push s, get_job s)
    outcomes: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    slots = _Slots()

    async def run(i: int) -> None:
        stub, cid = stubs[i // PER_CHANNEL], ids[i]
        job_request = pb.GetJobRequest(
            client_id=cid,
            layout_hash=layout.hash,
            dtype=P.WIRE_TO_PB[WireDtype.FLOAT32],
            max_receive_message_bytes=MESSAGE_BYTES,
        )
        while time.monotonic() < window[1]:
            try:
                ta = time.monotonic()
                job = await _get_job(stub, job_request, slots)
                tb = time.monotonic()
                header = pb.UpdateHeader(  # as Client.push builds it
                    client_id=cid,
                    job_id=job.job_id,
                    base_version=job.base_version,
                    update_id=uuid.uuid4().hex,
                    num_samples=1,
                    work=pb.WorkDone(complete=True),
                    kind=P.KIND_TO_PB[UpdateKind.DELTA],
                    dtype=P.WIRE_TO_PB[WireDtype.FLOAT32],
                    layout_hash=layout.hash,
                    tensors=[tpb.TensorInfo(name="update", numel=D)],
                )
                messages = iter([pb.UpdateMessage(header=header), *body])
                resp = await stub.PushUpdate(messages, timeout=CALL_TIMEOUT)
                tc = time.monotonic()
            except grpc.RpcError as exc:
                errors[f"{type(exc).__name__} {exc.code().name}: {exc.details()}"[:200]] += 1
                all_warm.set()  # report at once: the parent fails the benchmark
                await asyncio.sleep(0.1)
                continue
            except (CodecError, ConnectionError) as exc:
                errors[f"{type(exc).__name__}: {exc}"[:200]] += 1
                all_warm.set()
                await asyncio.sleep(0.1)
                continue
            outcomes[pb.Outcome.Name(resp.outcome)] += 1
            done.append((tc, tc - tb, tb - ta))
            if i not in warm:
                warm.add(i)
                if len(warm) == len(ids):
                    all_warm.set()

    tasks = [asyncio.create_task(run(i)) for i in range(len(ids))]
    await all_warm.wait()
    send({"warm": len(warm), "errors": dict(errors)})
    msg = await read()
    window[0], window[1] = float(msg["t0"]), float(msg["t1"])
    await asyncio.gather(*tasks)
    t0, t1 = window
    inside = [d for d in done if t0 <= d[0] <= t1]
    send(
        {
            "window_updates": len(inside),
            "push_s": [d[1] for d in inside],
            "get_job_s": [d[2] for d in inside],
            "acked": len(done),
            "outcomes": dict(outcomes),
            "errors": dict(errors),
            "slots": len(slots.free),
        }
    )
    for ch in channels:
        await ch.close()


def client_main() -> int:
    torch.set_num_threads(1)  # the clients barely use torch; leave the cores to the server
    asyncio.run(_client_process())
    return 0


# --------------------------------------------------------------------------------------------
# The benchmark process
# --------------------------------------------------------------------------------------------


class _Child:
    """A client process and a thread that queues its stdout lines."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "clients"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        line = self.lines.get(timeout=timeout)
        if not line:
            raise RuntimeError(f"client process {self.proc.pid} exited ({self.proc.poll()})")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)  # a failed run leaves its loops running: kill it
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (utime + stime) of every live thread of `pid`, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue  # the thread ended meanwhile
    return out


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as fh:
        vals = [int(x) for x in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already inside user/nice
    return (total - idle) / TICKS, total / TICKS


def _cpu_sample(server: int, clients: list[int]) -> dict[str, Any]:
    return {
        "server": process_cpu_seconds(server),
        "threads": _thread_cpu(server),
        "clients": [process_cpu_seconds(p) for p in clients],
        "machine": _machine_busy(),
        "t": time.monotonic(),
    }


def _sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))


def _start_server() -> tuple[subprocess.Popen, str]:
    config = {"rate_limit_per_second": 0, "max_clients": LIMIT, "max_concurrent_rpcs": LIMIT}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HELPER),
            "serve",
            "--strategy",
            "fedasync",
            "--config",
            json.dumps(config),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("PORT "), f"server subprocess said {line!r}"
    return proc, f"127.0.0.1:{int(line.split()[1])}"


def _run_n(N: int, D: int) -> dict[str, Any]:
    """One point of the curve: a fresh server, N clients over PROCS processes."""
    layout = layered_layout(D)
    n_procs = min(PROCS, N)
    children = [_Child() for _ in range(n_procs)]  # they import while the server starts
    proc = None
    try:
        proc, address = _start_server()
        pid = proc.pid
        time.sleep(1.0)  # let start-up settle (threads, lazy imports)
        idle = proc_status_kb(pid)["VmRSS"]
        with Client(address, "load-0") as first:
            resp = first.register(layout=layout, initial=torch.randn(D))
            assert resp.initial_model_adopted
            assert resp.limits.max_concurrent_uploads >= 1
            slots = int(resp.limits.max_concurrent_uploads)
        model = proc_status_kb(pid)["VmRSS"]
        ids = [f"load-{i}" for i in range(N)]
        cuts = [round(k * N / n_procs) for k in range(n_procs + 1)]
        for k, child in enumerate(children):
            part = ids[cuts[k] : cuts[k + 1]]
            child.send({"address": address, "ids": part, "D": D, "seed": 1000 + k})
        reg = [c.recv() for c in children]
        assert sum(r["registered"] for r in reg) == N
        time.sleep(0.5)
        registered = proc_status_kb(pid)["VmRSS"]
        can_reset = reset_peak_rss(pid)

        t_go = time.monotonic()
        for c in children:
            c.send({"go": True})
        for c in children:
            w = c.recv()
            assert not w["errors"], f"N={N}: calls failed in the warm-up: {w['errors']}"
        warm_s = time.monotonic() - t_go
        _sleep_until(t_go + WARMUP_MIN_S)
        t0 = time.monotonic() + 0.2
        t1 = t0 + WINDOW_S
        for c in children:
            c.send({"t0": t0, "t1": t1})
        client_pids = [c.proc.pid for c in children]
        _sleep_until(t0)
        cpu0 = _cpu_sample(pid, client_pids)
        _sleep_until(t1)
        cpu1 = _cpu_sample(pid, client_pids)
        results = [c.recv() for c in children]
        peak = proc_status_kb(pid)["VmHWM"]
        with Client(address, "load-status") as c:
            status = c.status()
    finally:
        for c in children:
            c.stop()
        if proc is not None:
            stop_server_process(proc)

    outcomes: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for r in results:
        outcomes.update(r["outcomes"])
        errors.update(r["errors"])
    acked = sum(r["acked"] for r in results)
    assert not errors, f"N={N}: calls failed: {dict(errors)}"
    assert set(outcomes) == {"OUTCOME_APPLIED"}, f"N={N}: outcomes {dict(outcomes)}"
    assert int(status.updates_applied) == acked == outcomes["OUTCOME_APPLIED"], (
        f"N={N}: server applied {status.updates_applied}, clients saw {acked} acks"
    )
    n_win = sum(r["window_updates"] for r in results)
    assert n_win > 0, f"N={N}: no push was acknowledged within the {WINDOW_S:g} s window"
    push = np.asarray([x for r in results for x in r["push_s"]])
    gj = np.asarray([x for r in results for x in r["get_job_s"]])

    span = cpu1["t"] - cpu0["t"]
    server_cpu = cpu1["server"] - cpu0["server"]
    threads = {
        tid: s - cpu0["threads"].get(tid, 0.0) for tid, s in cpu1["threads"].items()
    }  # threads born in the window count from 0
    loop_cpu = threads.pop(pid, 0.0)  # the main thread runs the asyncio loop (asyncio.run)
    other_max = max(threads.values(), default=0.0)
    client_cores = [(b - a) / span for a, b in zip(cpu0["clients"], cpu1["clients"], strict=True)]
    (busy0, total0), (busy1, total1) = cpu0["machine"], cpu1["machine"]
    machine_cores = (busy1 - busy0) / (total1 - total0) * (os.cpu_count() or 1)
    kb = 1024
    base = idle
    peak_kb = peak if can_reset else max(peak, registered)
    row = {
        "clients": N,
        "client_processes": n_procs,
        "channels": sum(r["channels"] for r in reg),
        "window_s": t1 - t0,
        "warmup_s": max(warm_s, WARMUP_MIN_S),
        "window_updates": n_win,
        "updates_per_s": n_win / (t1 - t0),
        "push_p50_s": float(np.percentile(push, 50)),
        "push_p99_s": float(np.percentile(push, 99)),
        "get_job_p50_s": float(np.percentile(gj, 50)),
        "get_job_p99_s": float(np.percentile(gj, 99)),
        "updates_applied": acked,
        "idle_rss_bytes": idle * kb,
        "model_rss_bytes": (model - base) * kb,
        "registered_rss_bytes": (registered - base) * kb,
        "peak_rss_bytes": (peak_kb - base) * kb,
        "peak_reset": can_reset,
        "registered_kB_per_client": (registered - base) * kb / 1e3 / N,
        "peak_kB_per_client": (peak_kb - base) * kb / 1e3 / N,
        "server_cpu_s_per_update": server_cpu / n_win,
        "server_cores": server_cpu / span,
        "event_loop_cores": loop_cpu / span,
        "busiest_other_thread_cores": other_max / span,
        "client_cores": client_cores,
        "machine_busy_cores": machine_cores,
        "cpu_count": os.cpu_count(),
        "max_concurrent_uploads": slots,
    }
    return row


def _line(r: dict[str, Any], D: int) -> str:
    ms = 1e3
    return (
        f"load fedasync N={r['clients']} D={fmt_size(D)} ({D * 4 / 1e3:.0f} kB): "
        f"{r['updates_per_s']:.0f} updates/s ({r['window_updates']} in {r['window_s']:.1f} s; "
        f"push p50 {r['push_p50_s'] * ms:.1f} ms p99 {r['push_p99_s'] * ms:.1f} ms, get_job p50 "
        f"{r['get_job_p50_s'] * ms:.1f} ms) | RSS idle {r['idle_rss_bytes'] / MB:.0f} MB, "
        f"+{r['registered_rss_bytes'] / MB:.1f} MB registered "
        f"({r['registered_kB_per_client']:.0f} kB/client), peak +{r['peak_rss_bytes'] / MB:.1f} MB"
        f" ({r['peak_kB_per_client']:.0f} kB/client){'' if r['peak_reset'] else ' [cumulative]'}"
        f" | server {r['server_cpu_s_per_update'] * ms:.2f} ms CPU/update, "
        f"{r['server_cores']:.2f} cores (event loop {r['event_loop_cores']:.2f}, busiest other "
        f"thread {r['busiest_other_thread_cores']:.2f}), clients {sum(r['client_cores']):.2f} "
        f"cores (max process {max(r['client_cores']):.2f}), machine "
        f"{r['machine_busy_cores']:.1f}/{r['cpu_count']} cores busy"
    )


def _bend(rows: list[dict[str, Any]]) -> tuple[int | None, str]:
    """The first row whose updates/s grew by <= BEND_GROWTH or whose p99 grew > BEND_P99x over
    the previous row: (its index, why), or (None, '')."""
    for i in range(1, len(rows)):
        prev, cur = rows[i - 1], rows[i]
        growth = cur["updates_per_s"] / prev["updates_per_s"] - 1.0
        p99 = cur["push_p99_s"] / prev["push_p99_s"]
        why = []
        if growth <= BEND_GROWTH:
            why.append(f"updates/s {growth * 100:+.0f} %")
        if p99 > BEND_P99:
            why.append(f"push p99 x{p99:.1f}")
        if why:
            return i, f"{', '.join(why)} vs N={prev['clients']}"
    return None, ""


def _hint(r: dict[str, Any]) -> str:
    """Which resource the CPU columns say ran out (thresholds in the module docstring)."""
    if r["event_loop_cores"] >= 0.85:
        return "the server's event loop thread is saturated (one core)"
    if r["busiest_other_thread_cores"] >= 0.85:
        return "a server worker thread (aggregation or gRPC poller) is saturated"
    if r["machine_busy_cores"] >= 0.9 * r["cpu_count"]:
        return "the machine's cores are saturated (server, clients and anything else running)"
    if max(r["client_cores"]) >= 0.85:
        return "a client process is saturated (the load generator: raise AGGSRV_BENCH_LOAD_PROCS)"
    return (
        "no CPU saturated: waiting (staging slots, max_concurrent_uploads="
        f"{r['max_concurrent_uploads']}, or the loopback)"
    )


def test_bench_load_curve(benchmark) -> None:
    D = D_LOAD
    rows: list[dict[str, Any]] = []
    lines: list[str] = []

    def run() -> None:
        for N in CLIENTS:
            row = _run_n(N, D)
            rows.append(row)
            line = _line(row, D)
            lines.append(line)
            emit(benchmark, line, {f"N{N}": row, "lines": lines})

    benchmark.pedantic(run, rounds=1, iterations=1)

    i, why = _bend(rows)
    curve = ", ".join(f"{r['clients']}: {r['updates_per_s']:.0f}" for r in rows)
    p99s = ", ".join(f"{r['push_p99_s'] * 1e3:.0f}" for r in rows)
    summary = f"load curve fedasync D={fmt_size(D)}: updates/s by N {curve}; push p99 ms {p99s}"
    if i is None:
        summary += f" -> no bend up to N={rows[-1]['clients']}"
        bend_n = None
    else:
        r = rows[i]
        bend_n = r["clients"]
        summary += (
            f" -> bends at N={bend_n} ({why}); there: server {r['server_cores']:.2f} cores "
            f"(event loop {r['event_loop_cores']:.2f}), clients {sum(r['client_cores']):.2f}, "
            f"machine {r['machine_busy_cores']:.1f}/{r['cpu_count']} busy: {_hint(r)}"
        )
    info = {
        "scale": SCALE,
        "D": D,
        "clients": CLIENTS,
        "window_s": WINDOW_S,
        "client_processes": PROCS,
        "clients_per_channel": PER_CHANNEL,
        "server_limit_overrides": {
            "rate_limit_per_second": 0,
            "max_clients": LIMIT,
            "max_concurrent_rpcs": LIMIT,
        },
        "bend_clients": bend_n,
        "bend_why": why,
        "curve": rows,
        "lines": lines + [summary],
    }
    emit(benchmark, summary, info)


if __name__ == "__main__":
    if sys.argv[1:] != ["clients"]:
        sys.exit("usage: python bench/test_bench_load.py clients (started by the benchmark)")
    sys.exit(client_main())
