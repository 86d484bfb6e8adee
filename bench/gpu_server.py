"""The server end to end with a CUDA cache against the same run with a CPU cache: `aggsrv serve`
in its own process, N client processes on loopback pushing DELTA updates through
`aggsrv.client.Client`, one line per run and a cuda/cpu comparison at the end.

    python bench/gpu_server.py                  # GPU machine: 67 and 400 MB models, fedbuff and
                                                # orthofl, durability off and on, cpu then cuda
    python bench/gpu_server.py --model-mb 400 --strategy orthofl --durability off
    python bench/gpu_server.py --dry-run        # CPU: 0.5 MB model, 2 clients, device cpu only,
                                                # every figure checked, exit 1 on a failure

Run from the repository root (it imports tests/support/server_helpers.py and bench helpers).

Each run starts a fresh server (`--device cpu` or `cuda`, `--auth none`, no rate limit, fedbuff
with buffer_size = the number of clients, durability on with a state directory in a temporary
folder or off with none). The first client registers with a random initial model of a layered
layout (bench/ingest_helpers.py `layered_layout`), the others with the layout only. Every client
then loops get_job -> push of a DELTA: `--warmup` untimed updates each, then, from a common
start, `--updates` timed updates each (or as many as fit in `--seconds`). Each client draws two
random deltas before the run and alternates them, so drawing random numbers (seconds at 100M
values) stays out of the figures: the loop's cost is the server's, the transfers and the client
library's.

A line per run (an illustration of the format, not a measurement):

    400 MB fedbuff durability off cuda: 3.10 updates/s, 1240.0 MB/s, push p50 1180.2 ms
      p99 1391.0 ms, GPU busy 0.12  (4 clients, 32 timed updates in 10.32 s, version 9)

- updates/s: timed pushes of all clients together / the window (common start to the last
  client's last answer); MB/s: the payload bytes of those pushes (10^6 bytes) / the window;
- push p50/p99: each push's latency as its client saw it (the upload and the server's answer;
  the get_job before it is not included), over every timed push of every client;
- GPU busy: mean of `nvidia-smi` utilization.gpu (share of time a kernel was running) sampled
  every 100 ms over the window; "n/a" without nvidia-smi; the cpu run shows the same GPU idling
  (a figure near 0 says nothing else used it);
- version: the server's model version at the end (fedbuff makes one per buffer_size updates).

The comparison pairs the cpu and cuda runs of the same model, strategy and durability: the
time per update (1 / updates/s) of each and cuda/cpu; the target is cuda/cpu <= 1.1x for the
large model (shown for every pair, never asserted). Every run is checked (every push answered
APPLIED or BUFFERED, the server counted them all as accepted, its version advanced, the figures
finite and positive); a failed check makes the exit status 1. Without CUDA, anything but a
`--devices cpu` run (dry or not) stops at once (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ingest_helpers import layered_layout  # noqa: E402
from server_helpers import ServeProcess, free_port  # noqa: E402

from aggsrv.client.client import Client  # noqa: E402
from aggsrv.values import Status, UpdateKind  # noqa: E402

MB = 10**6  # model sizes and MB/s in 10^6 bytes: 67 MB = 16.75M float32 values
TARGET = 1.1  # the bound on cuda/cpu time per update for a large upload
ACCEPTED = {Status.APPLIED.value, Status.BUFFERED.value}
BANK = 2  # random deltas each client draws before a run and alternates
CLIENT_TIMEOUT_S = 600.0  # per call: a 400 MB upload to a durable server waits on fsyncs
STEP_LIMIT_S = 1800.0  # how long the bench waits on a client's answer before giving up

FULL = {
    "model_mb": "67,400",
    "strategy": "fedbuff,orthofl",
    "durability": "off,on",
    "devices": "cpu,cuda",
    "clients": 4,
    "updates": 8,
    "warmup": 1,
}
DRY = {
    "model_mb": "0.5",
    "strategy": "fedbuff,orthofl",
    "durability": "off,on",
    "devices": "cpu",
    "clients": 2,
    "updates": 3,
    "warmup": 1,
}


# --------------------------------------------------------------------------------------------
# Client processes
# --------------------------------------------------------------------------------------------


def _client_main(conn: Connection, index: int) -> None:
    """A client process: answers the bench's commands (setup, push, close) one at a time, with
    a dict, or {"error": ...} when the command raised."""
    torch.set_num_threads(1)  # the client barely computes; leave the cores to the server
    # An interrupt of the whole group (Ctrl-C, a time limit) is the bench's to handle: it stops
    # its clients (and they end with it, as daemons).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    state: dict[str, Any] = {"banks": {}}
    handlers = {"setup": _setup, "push": _push, "close": _close}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        try:
            conn.send(handlers[msg["cmd"]](state, index, msg))
        except Exception as exc:  # the bench reports it with the server's log
            conn.send({"error": f"client {index}: {type(exc).__name__}: {exc}"})
    _close(state, index, {})
    conn.close()
    # Nothing left to flush: skip the interpreter's teardown of torch and gRPC (about a second
    # per process, paid after every bench run).
    os._exit(0)


def _setup(state: dict[str, Any], index: int, msg: dict[str, Any]) -> dict[str, Any]:
    D = int(msg["D"])
    layout = layered_layout(D)
    if D not in state["banks"]:
        state["banks"].clear()  # one model size at a time: 2 x 400 MB per client is plenty
        gen = torch.Generator().manual_seed(1000 + index)
        state["banks"][D] = [torch.randn(D, generator=gen).mul_(1e-3) for _ in range(BANK)]
    client = Client(msg["address"], f"bench-{index}", timeout=CLIENT_TIMEOUT_S)
    state["client"] = client
    initial = None
    if msg["initial"]:
        initial = torch.randn(D, generator=torch.Generator().manual_seed(7))
    resp = client.register(layout=layout, initial=initial)
    return {"adopted": bool(resp.initial_model_adopted)}


def _push(state: dict[str, Any], index: int, msg: dict[str, Any]) -> dict[str, Any]:
    """`count` get_job -> push rounds (or until `seconds` passed), from monotonic time `t0`."""
    client: Client = state["client"]
    bank = state["banks"][client.layout.numel]
    t0 = msg.get("t0")
    if t0 is not None:
        while (left := t0 - time.monotonic()) > 0:
            time.sleep(left)
    count, seconds = int(msg["count"]), float(msg.get("seconds") or 0.0)
    push_s: list[float] = []
    job_s: list[float] = []
    statuses: Counter[str] = Counter()
    payload = 0
    start = time.monotonic()
    i = 0
    while (seconds > 0 and time.monotonic() - start < seconds) or (seconds <= 0 and i < count):
        a = time.monotonic()
        job = client.get_job(timeout=CLIENT_TIMEOUT_S)
        b = time.monotonic()
        res = client.push(job, bank[i % BANK], kind=UpdateKind.DELTA, num_samples=1)
        c = time.monotonic()
        job_s.append(b - a)
        push_s.append(c - b)
        statuses[res.status.value] += 1
        payload += res.payload_bytes
        i += 1
    return {
        "push_s": push_s,
        "job_s": job_s,
        "statuses": dict(statuses),
        "payload": payload,
        "start": start,
        "end": time.monotonic(),
    }


def _close(state: dict[str, Any], index: int, msg: dict[str, Any]) -> dict[str, Any]:
    client = state.pop("client", None)
    if client is not None:
        client.close()
    return {}


class Clients:
    """N client processes ("spawn": no forked gRPC or CUDA state), kept for every run so each
    run pays only its own setup."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(child, i), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def send(self, i: int, msg: dict[str, Any]) -> None:
        try:
            self.conns[i].send(msg)
        except OSError:
            self.procs[i].join(timeout=5)
            raise RuntimeError(f"client {i}: process exited ({self.procs[i].exitcode})") from None

    def recv(self, i: int, limit: float = STEP_LIMIT_S) -> dict[str, Any]:
        conn = self.conns[i]
        if not conn.poll(limit):
            raise RuntimeError(f"client {i}: no answer within {limit:g} s")
        try:
            out = conn.recv()
        except EOFError:
            raise RuntimeError(f"client {i}: process exited ({self.procs[i].exitcode})") from None
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def all(self, msg: dict[str, Any], indices: range | None = None) -> list[dict[str, Any]]:
        indices = indices if indices is not None else range(len(self.conns))
        for i in indices:
            self.send(i, msg)
        return [self.recv(i) for i in indices]

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # its process is gone already
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():  # stuck in a call to a server that is gone
                proc.kill()
                proc.join(timeout=10)
        for conn in self.conns:
            conn.close()


# --------------------------------------------------------------------------------------------
# GPU busy fraction
# --------------------------------------------------------------------------------------------


def _server_gpu_id() -> str:
    """nvidia-smi's id of the server's cuda device (the first visible one), by its UUID: CUDA
    numbers devices fastest first unless CUDA_DEVICE_ORDER says otherwise, nvidia-smi by PCI
    bus, and a CUDA_VISIBLE_DEVICES entry may itself be a UUID or a MIG id."""
    try:
        import torch

        if torch.cuda.is_available():
            uuid = str(torch.cuda.get_device_properties(0).uuid)
            return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    except Exception:  # noqa: BLE001 - fall back to the environment's first entry
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


class GpuSampler:
    """`nvidia-smi --query-gpu=timestamp,utilization.gpu -lms 100` in a subprocess while it is
    open; `busy(t0, t1)` is the mean utilization (0..1) of the samples stamped within the wall
    clock window, None without nvidia-smi or samples."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        cmd = [exe, "--query-gpu=timestamp,utilization.gpu", "--format=csv,noheader,nounits"]
        cmd += ["-lms", "100", f"--id={_server_gpu_id()}"]
        # The samples carry nvidia-smi's own stamps; line buffering only makes them arrive early.
        stdbuf = shutil.which("stdbuf")
        if stdbuf:
            cmd = [stdbuf, "-oL", *cmd]
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            stamp, _, value = line.rpartition(",")
            try:
                util = float(value)
            except ValueError:
                continue  # "[N/A]", "[Not Supported]"
            try:
                t = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except ValueError:
                t = time.time()
            self.samples.append((t, util))

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def busy(self, t0: float, t1: float) -> float | None:
        inside = [u for t, u in self.samples if t0 <= t <= t1]
        return sum(inside) / len(inside) / 100.0 if inside else None


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    model_mb: float
    D: int
    strategy: str
    durability: str
    device: str
    clients: int
    updates: int = 0  # timed pushes, all clients
    window_s: float = 0.0
    payload: int = 0
    push_ms: list[float] = field(default_factory=list)
    gpu_busy: float | None = None
    version: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[float, str, str]:
        return (self.model_mb, self.strategy, self.durability)

    @property
    def ups(self) -> float:
        return self.updates / self.window_s if self.window_s > 0 else float("nan")

    @property
    def mbps(self) -> float:
        return self.payload / MB / self.window_s if self.window_s > 0 else float("nan")

    def pct(self, q: float) -> float:
        return float(np.percentile(self.push_ms, q)) if self.push_ms else float("nan")

    def name(self) -> str:
        return f"{self.model_mb:g} MB {self.strategy} durability {self.durability} {self.device}"

    def line(self) -> str:
        busy = "n/a" if self.gpu_busy is None else f"{self.gpu_busy:.2f}"
        return (
            f"{self.name()}: {self.ups:.2f} updates/s, {self.mbps:.1f} MB/s, "
            f"push p50 {self.pct(50):.1f} ms p99 {self.pct(99):.1f} ms, GPU busy {busy}  "
            f"({self.clients} clients, {self.updates} timed updates in {self.window_s:.2f} s, "
            f"version {self.version})"
        )


def _strategy_config(strategy: str, clients: int) -> dict[str, Any]:
    # One fedbuff step per round of the clients; orthofl runs with its defaults.
    return {"buffer_size": clients} if strategy == "fedbuff" else {}


def _config_file(path: Path, strategy: str, clients: int) -> Path:
    """The `--config` TOML: `aggsrv serve` takes strategy keys only from a file."""
    lines = ["[strategy_config]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in _strategy_config(strategy, clients).items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_one(run: Run, clients: Clients, args: argparse.Namespace, tmp: Path) -> Run:
    """One server, `run.clients` clients: register, warm up, time; the figures and checks."""
    tag = f"{run.model_mb:g}mb-{run.strategy}-{run.durability}-{run.device}"
    state_dir = tmp / f"state-{tag}"
    serve_args = [
        "--strategy", run.strategy,
        "--config", str(_config_file(tmp / f"{tag}.toml", run.strategy, run.clients)),
        "--device", run.device,
        "--rate-limit", "0",
        "--durability", run.durability,
        # "" keeps an off run from writing checkpoints into the default ./aggsrv-state.
        "--state-dir", str(state_dir) if run.durability == "on" else "",
    ]  # fmt: skip
    server = ServeProcess(tmp / f"{tag}.log", free_port(), *serve_args)
    sampler: GpuSampler | None = None
    try:
        server.wait_serving(limit=120.0)
        setup = {"cmd": "setup", "address": server.address, "D": run.D}
        # The first registers alone, so its initial model is the one the server adopts.
        (first,) = clients.all({**setup, "initial": True}, range(1))
        if not first["adopted"]:
            run.failures.append("the first client's initial model was not adopted")
        clients.all({**setup, "initial": False}, range(1, run.clients))
        warm = clients.all({"cmd": "push", "count": args.warmup})
        sampler = GpuSampler()
        t0 = time.monotonic() + 0.2  # every client has its message before the clock starts
        wall0 = time.time() + (t0 - time.monotonic())
        timed = clients.all(
            {"cmd": "push", "count": args.updates, "seconds": args.seconds, "t0": t0},
            range(run.clients),
        )
        end = max(r["end"] for r in timed)
        wall1 = time.time() - (time.monotonic() - end)
        sampler.close()
        run.gpu_busy = sampler.busy(wall0, wall1)
        clients.all({"cmd": "close"}, range(run.clients))
        with Client(server.address, "bench-status", timeout=30.0) as probe:
            status = probe.status()
    except Exception as exc:
        log = server.log()[-4000:]
        raise RuntimeError(f"{run.name()}: {exc}\n--- server log ---\n{log}") from exc
    finally:
        if sampler is not None:
            sampler.close()
        try:
            if server.proc.poll() is None:
                server.terminate(timeout=120.0)
        except subprocess.TimeoutExpired:
            pass  # close() kills it
        server.close()
        shutil.rmtree(state_dir, ignore_errors=True)

    run.updates = sum(len(r["push_s"]) for r in timed)
    run.window_s = end - t0
    run.payload = sum(r["payload"] for r in timed)
    run.push_ms = [x * 1e3 for r in timed for x in r["push_s"]]
    run.version = int(status.version)
    statuses: Counter[str] = Counter()
    for r in warm + timed:
        statuses.update(r["statuses"])
    run.statuses = dict(statuses)
    check(run, int(status.updates_accepted), status.durability)
    return run


def check(run: Run, accepted: int, durability: str) -> None:
    """The sanity checks of a run; failures go to run.failures."""
    if durability != run.durability:
        run.failures.append(f"the server runs with durability {durability!r}")
    pushed = sum(run.statuses.values())
    refused = {s: n for s, n in run.statuses.items() if s not in ACCEPTED}
    if refused:
        run.failures.append(f"pushes not accepted: {refused}")
    if accepted != pushed:
        run.failures.append(f"the server accepted {accepted} updates, the clients pushed {pushed}")
    if run.version <= 0:
        run.failures.append(f"the model version did not advance (version {run.version})")
    if run.updates <= 0:
        run.failures.append("no timed push")
    figures = {"updates/s": run.ups, "MB/s": run.mbps, "p50": run.pct(50), "p99": run.pct(99)}
    if run.gpu_busy is not None:
        figures["GPU busy"] = run.gpu_busy + 1.0  # 0 is a fine reading: only check it is finite
    bad = {k: v for k, v in figures.items() if not (math.isfinite(v) and v > 0)}
    if bad:
        run.failures.append(f"figures not finite and positive: {bad}")


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def comparison(runs: list[Run]) -> list[str]:
    by_key: dict[tuple[float, str, str], dict[str, Run]] = {}
    for r in runs:
        by_key.setdefault(r.key, {})[r.device] = r
    pairs = [(k, d["cpu"], d["cuda"]) for k, d in by_key.items() if "cpu" in d and "cuda" in d]
    if not pairs:
        return ["comparison: needs a cpu and a cuda run of the same case (--devices cpu,cuda)"]
    out = [f"comparison, time per update (window / updates), cuda/cpu target <= {TARGET}x:"]
    for (mb, strategy, durability), cpu, cuda in pairs:
        ms_cpu, ms_cuda = 1e3 / cpu.ups, 1e3 / cuda.ups
        ratio = ms_cuda / ms_cpu
        verdict = "ok" if ratio <= TARGET else "over"
        out.append(
            f"  {mb:g} MB {strategy} durability {durability}: cpu {ms_cpu:.1f} ms, "
            f"cuda {ms_cuda:.1f} ms -> {ratio:.2f}x [{verdict}]; push p50 cuda/cpu "
            f"{cuda.pct(50) / cpu.pct(50):.2f}x; GPU busy "
            + ("n/a" if cuda.gpu_busy is None else f"{cuda.gpu_busy:.2f}")
        )
    return out


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; run every case, cpu before cuda; print the lines and ratios."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU only: tiny model, 2 clients, a few updates each, checked",
    )
    p.add_argument(
        "--model-mb",
        help=f"model sizes in MB (10^6 bytes of float32), comma-separated "
        f"(default {FULL['model_mb']}; dry run {DRY['model_mb']})",
    )
    p.add_argument("--strategy", help=f"strategies (default {FULL['strategy']})")
    p.add_argument("--durability", help=f"on and/or off (default {FULL['durability']})")
    p.add_argument(
        "--devices",
        help=f"server devices, in order (default {FULL['devices']}; dry run {DRY['devices']})",
    )
    p.add_argument("--clients", type=int, help=f"client processes (default {FULL['clients']})")
    p.add_argument(
        "--updates", type=int, help=f"timed updates per client (default {FULL['updates']})"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="time each run for this many seconds instead of --updates",
    )
    p.add_argument("--warmup", type=int, help="untimed updates per client first (default 1)")
    args = p.parse_args(argv)
    for key, value in (DRY if args.dry_run else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    devices = _split(args.devices)
    if "cuda" in devices and not torch.cuda.is_available():
        if args.dry_run:
            print("no CUDA device: drop cuda from --devices for a dry run", file=sys.stderr)
        else:
            print("no CUDA device: use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    if args.clients < 1 or args.updates < 1 or args.warmup < 0:
        p.error("--clients and --updates must be >= 1, --warmup >= 0")
    sizes = [float(x) for x in _split(args.model_mb)]
    cases = [
        (mb, s, d) for mb in sizes for s in _split(args.strategy) for d in _split(args.durability)
    ]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"aggsrv serve end to end: {args.clients} clients, {args.warmup} warm-up + "
          f"{args.updates if args.seconds <= 0 else f'{args.seconds:g} s of'} updates each, "
          f"GPU {gpu}, torch {torch.__version__}", flush=True)  # fmt: skip

    runs: list[Run] = []
    tmp = Path(tempfile.mkdtemp(prefix="aggsrv-gpu-server-"))
    clients = Clients(args.clients)
    interrupted = False
    try:
        for mb, strategy, durability in cases:
            D = max(1, round(mb * MB / 4))
            for device in devices:
                run = Run(mb, D, strategy, durability, device, args.clients)
                runs.append(run_one(run, clients, args, tmp))
                print(run.line(), flush=True)
                for f in run.failures:
                    print(f"  FAILED: {f}", flush=True)
    except RuntimeError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Stopped from outside (Ctrl-C, a time limit): the pairs already run still compare.
        interrupted = True
    finally:
        clients.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for line in comparison(runs):
        print(line)
    if interrupted:
        print(f"interrupted after {len(runs)} of {len(cases) * len(devices)} runs", file=sys.stderr)
        return 130
    failed = [r for r in runs if r.failures]
    if failed:
        print(f"{len(failed)} of {len(runs)} runs failed their checks", file=sys.stderr)
        return 1
    if args.dry_run:
        print("dry run: all ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
