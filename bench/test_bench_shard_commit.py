"""What the sharded durable commit costs a push (docs/sharding.md, the shards' write-ahead logs):
a client's push latency against `aggsrv serve --shards 2` with and without state directories, on
loopback, interleaved in one run, with the fsyncs and log bytes per update on each shard and the
commit's steps timed inside the server processes.

Run: `pytest bench/test_bench_shard_commit.py --benchmark-only -s` (3-5 minutes at scale 1;
the logs go to a temporary directory on the disk that holds /tmp, about 1.5 GB per case at D =
4M, deleted afterwards). `AGGSRV_BENCH_SCALE=0.01` for a smoke run.

For fedasync (elementwise: the shards only vote) and orthofl (one all_reduce besides the vote),
at D = 1M and 4M float32 (`e2e_layout` of test_bench_sharding.py, 6 tensors), candidates all
running throughout, each under bench/shard_commit_probe.py (`aggsrv serve` with timing probes;
`--auth none`, no rate limit, torch's default threads):

- **no state**: `--shards 2`, `--state-dir ''` (nothing written: the baseline, the sharded push
  without durability);
- **commit**: `--shards 2`, a state directory per shard, durability on: every shard appends its
  slice to its log while it arrives ("part" records, their writeback started at once); a shard
  of rank >= 1 appends a small slice record naming them and fsyncs before it votes; rank 0
  applies, appends its update record (the call, naming its parts) and fsyncs it (group commit),
  then tells the other shards its decision is durable, and only then do they answer their
  slices;
- **1 server**: one unsharded `aggsrv serve` with a state directory, durability on (the update
  logged in parts while it arrives, its record, one fsync): for reference;
- **before** (only when `AGGSRV_BENCH_BEFORE=DIR` names a source tree of an older commit, e.g.
  `git archive 8a8ef95^ | tar -x -C DIR`): that commit's `--shards 2` with `--state-dir ''`,
  run with `PYTHONPATH=DIR` (the client stays this tree's).

Checkpoints are off in the durable candidates (`checkpoint_every_updates`, `_seconds`, `_bytes`
= 0; the first checkpoint, at registration, is before the timed rounds): the figures are the
commit's alone. One client per candidate in the pytest process. A round is, per candidate in
turn (the six orders of three in turn; the fourth candidate last), `get_job()` then
`push(job, delta)` (APPLIED), both timed; then the disk floor: the bytes of one slice record
(2D bytes) appended to a file in the same temporary directory and fdatasync'ed, then those of a
whole update (4D). WARMUP rounds untimed (the first, cold push of each candidate is reported
apart), then UPDATES timed. Afterwards every candidate is at the same version with the same
model (fedasync bit for bit, orthofl within 1e-5): checked.

Counted per update over the timed rounds, for each shard of the durable candidates:

- **fsyncs**: the probe's count of fdatasync/fsync syscalls that started inside the candidate's
  push calls, inside its GetJob calls, and in the whole timed span (a sync the benchmark did not
  wait for included); beside them the server's own `aggsrv_wal_sync_seconds_count` (Prometheus,
  scraped before and after: the acknowledgements that waited for the log);
- **bytes**: the log's growth on disk (the `wal-*.log` files), the probe's `append` bytes by
  record kind, and the `aggsrv_wal_bytes` gauge's growth.

The commit's steps, medians over the timed pushes (each process's probe events matched to the
push that contains them; times relative to the push's start): rank 0's announce of the update,
the follower's slice record (write, then fsync), the vote (rank 0 waits in it for the follower's
fsync), rank 0's own record (write, then fsync), the durable notice (from rank 0's fsync to the
follower releasing its answer), and the client's end.

Before the servers start, about the bytes the run will write are touched and freed in the pytest
process (see PREFAULT: this VM backs guest memory at its first touch, at 0.22 GB/s, and a growing
log's page cache takes fresh pages); `AGGSRV_BENCH_PREFAULT=0` measures the cold case.

Effective GB/s = 4D bytes / median push. The five (seven) server processes and the client share
this machine's 2 cores and one disk: no target is asserted (they are shown).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SCALE, emit, fmt_size, fmt_time, random_tensor, scaled
from test_bench_sharding import _free_port, _wait_ready, e2e_layout

CASES: dict[str, dict[str, Any]] = {"fedasync": {"alpha": 0.6}, "orthofl": {}}
SIZES = {"1M": 2**20, "4M": 2**22}
WARMUP = 5
UPDATES = int(os.environ.get("AGGSRV_BENCH_COMMIT_UPDATES", "24"))
SEED = 20261129
PROBE = Path(__file__).resolve().parent / "shard_commit_probe.py"
BEFORE = os.environ.get("AGGSRV_BENCH_BEFORE", "")
# Fresh guest memory: this VM backs a page the first time it is touched (0.22 GB/s measured here,
# 7 GB/s for memory touched before, by any process), and a growing log's page cache takes fresh
# pages. Touching (then freeing) about what the run will write first gives the logs pages backed
# already, as on a server whose memory has been used. AGGSRV_BENCH_PREFAULT=0: cold pages. (On
# 2026-11-29, at load 11-23, the 8.4 MB appends took ~17 ms either way: see bench/README.md.)
PREFAULT = os.environ.get("AGGSRV_BENCH_PREFAULT", "1") != "0"
TARGET_ADDED_S = 0.002  # the commit's added latency per update at D = 4M on 2 shards
SYNCS = ("fdatasync", "fsync")


class _ProbedServe:
    """`python bench/shard_commit_probe.py EVENTS serve ...` (stderr in `log`); its metrics on
    `metrics_port`."""

    def __init__(self, tmp: Path, name: str, *args: str, pythonpath: str = "") -> None:
        port, self.metrics_port = _free_port(), _free_port()
        self.address = f"127.0.0.1:{port}"
        self.events_path = tmp / f"{name}.events.json"
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, str(PROBE), str(self.events_path), "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--auth", "none", "--metrics-port", str(self.metrics_port)]
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        self.proc = subprocess.Popen([*cmd, *args], stdout=subprocess.DEVNULL, stderr=self._log,
                                     env=env)  # fmt: skip

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def metrics(self) -> dict[str, float]:
        """The aggsrv_wal_* samples (summed over labels) of its /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for m in re.finditer(r"^(aggsrv_wal_\w+?)(?:\{[^}]*\})? (\S+)$", text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def close(self) -> list[list[Any]]:
        """SIGTERM, then SIGKILL after 30 s; the probe's events (none if it was killed)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        if not self.events_path.exists():
            return []
        return json.loads(self.events_path.read_text())


def _wal_bytes_on_disk(state: Path | None) -> int:
    return sum(p.stat().st_size for p in state.glob("wal-*.log")) if state else 0


def _disk_floor(path: Path, nbytes: int, buf: bytes) -> tuple[float, float]:
    """Append `nbytes` to `path` and fdatasync it, as the log does: (write s, fdatasync s)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        view = memoryview(buf)[:nbytes]
        t0 = time.monotonic()
        while view:
            view = view[os.write(fd, view) :]
        t1 = time.monotonic()
        os.fdatasync(fd)
        return t1 - t0, time.monotonic() - t1
    finally:
        os.close(fd)


def _med(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else math.nan


def _p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90)) if xs else math.nan


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1e3:.2f} ms"


def _inside(events: list[list[Any]], step: str, lo: float, hi: float) -> list[list[Any]]:
    """`step` events that started in [lo, hi]."""
    return [e for e in events if e[0] == step and lo <= e[1] <= hi]


def _first(events: list[list[Any]], step: str, lo: float, hi: float, test: Any = None) -> Any:
    for e in _inside(events, step, lo, hi):
        if test is None or test(e):
            return e
    return None


def _steps(rank0: list, rank1: list, windows: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Per push, the commit's steps in seconds ('at': since the push's start); `rank1` is empty
    for the single server."""
    out: dict[str, list[float]] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None:
            out.setdefault(key, []).append(value)

    for p0, p1 in windows:
        upd0 = _first(rank0, "apply_update", p0, p1)
        ann = _first(rank0, "announce", p0, p1, lambda e: e[3][0] == "update")
        vote0 = _first(rank0, "vote", p0, p1)
        app0 = _first(rank0, "append", p0, p1, lambda e: e[3][0] == "update")
        applied = vote0[2] if vote0 is not None else upd0[1] if upd0 is not None else None
        if applied is None:
            continue
        # make_durable runs on the event loop after the call, with or without a log
        dur0 = _first(rank0, "make_durable", applied, p1)
        sync0 = _first(rank0, "fdatasync", app0[2], p1) if app0 else None
        notice = _first(rank0, "announce", applied, p1, lambda e: e[3][0] == "durable")
        prep1 = _first(rank1, "prepare", p0, p1)
        app1 = _first(rank1, "append", p0, p1, lambda e: e[3][0] == "slice")
        sync1 = _first(rank1, "fdatasync", prep1[1], prep1[2]) if prep1 else None
        vote1 = _first(rank1, "vote", p0, p1)
        res1 = _first(rank1, "resolve", p0, p1, lambda e: e[3][0])
        for who, events in (("rank 0", rank0), ("follower", rank1)):
            parts = [e for e in _inside(events, "append", p0, p1) if e[3][0] == "part"]
            if parts:
                add(f"{who} parts: the first written (at)", parts[0][2] - p0)
                add(f"{who} parts: the last written (at)", max(e[2] for e in parts) - p0)
        if upd0 is not None:
            add("rank 0 takes the update (at)", upd0[1] - p0)
        if ann is not None:
            add("rank 0 announces it (at)", ann[1] - p0)
            add("announce broadcast", ann[2] - ann[1])
        if app1 is not None:
            add("follower slice record write", app1[2] - app1[1])
        if sync1 is not None:
            add("follower slice record fdatasync", sync1[2] - sync1[1])
        if vote1 is not None:
            add("follower vote", vote1[2] - vote1[1])
        if vote0 is not None:
            add("rank 0 vote (waits for the follower)", vote0[2] - vote0[1])
            add("rank 0 vote ends (at)", vote0[2] - p0)
        if app0 is not None:
            add("rank 0 apply (to its record)", app0[1] - applied)
            add("rank 0 record write", app0[2] - app0[1])
        if dur0 is not None:
            add("rank 0 apply, record included (vote end to call done)", dur0[1] - applied)
            add("rank 0 call done (at)", dur0[1] - p0)
            add("rank 0 waits for its fsync", dur0[2] - dur0[1])
        if sync0 is not None:
            add("  its fdatasync", sync0[2] - sync0[1])
        if dur0 is not None and res1 is not None:
            add("rank 0 durable to follower answer", res1[1] - dur0[2])
        if notice is not None:
            add("durable notice broadcast", notice[2] - notice[1])
        if res1 is not None:
            add("follower answers (at)", res1[1] - p0)
        if upd0 is not None:
            add("rank 0 answers (at)", upd0[2] - p0)
        add("push ends (at)", p1 - p0)
    return out


def _counts(events: list[list[Any]], windows: list[tuple[float, float]]) -> int:
    return sum(len(_inside(events, s, lo, hi)) for lo, hi in windows for s in SYNCS)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("name", list(CASES))
def test_bench_shard_commit(benchmark: Any, name: str, size: str, tmp_path: Path) -> None:
    from aggsrv.client.client import Client
    from aggsrv.strategies import Status

    layout = e2e_layout(scaled(SIZES[size]))
    D = layout.numel
    initial = random_tensor(D, seed=SEED)
    delta = random_tensor(D, seed=SEED + 1).mul_(1e-3)
    table = "".join(f"{k} = {v!r}\n" for k, v in CASES[name].items())
    off = tmp_path / "off.toml"
    off.write_text('rate_limit_per_second = 0.0\ndurability = "off"\n'
                   f"[strategy_config]\n{table}")  # fmt: skip
    on = tmp_path / "on.toml"
    on.write_text('rate_limit_per_second = 0.0\ndurability = "on"\ncheckpoint_every_updates = 0\n'
                  "checkpoint_every_seconds = 0\ncheckpoint_every_bytes = 0\n"
                  f"[strategy_config]\n{table}")  # fmt: skip
    cands = ["off", "commit", "one"] + (["before"] if BEFORE else [])
    states: dict[str, Path | None] = {
        "off0": None, "off1": None, "commit0": tmp_path / "commit0",
        "commit1": tmp_path / "commit1", "one": tmp_path / "one", "before0": None, "before1": None,
    }  # fmt: skip
    procs: dict[str, _ProbedServe] = {}
    clients: dict[str, Any] = {}
    events: dict[str, list[list[Any]]] = {}
    common = ("--strategy", name)

    def start(key: str, config: Path, *extra: str, pythonpath: str = "") -> None:
        state = states[key]
        procs[key] = _ProbedServe(tmp_path, key, *common, "--config", str(config),
                                  "--state-dir", str(state) if state else "", *extra,
                                  pythonpath=pythonpath)  # fmt: skip

    def start_all() -> float:
        """Start every candidate; seconds until all answer. A port taken between `_free_port`
        and the server's bind (other programs run here too) starts them all again."""
        for attempt in range(3):
            start("one", on)
            for cand, config in (("off", off), ("commit", on), ("before", off)):
                if cand not in cands:
                    continue
                url = f"tcp://127.0.0.1:{_free_port()}"
                for r in range(2):
                    shard = ("--shards", "2", "--rank", str(r), "--dist-url", url)
                    start(f"{cand}{r}", config, *shard,
                          pythonpath=BEFORE if cand == "before" else "")  # fmt: skip
            try:
                return _wait_ready(list(procs.values()))
            except AssertionError as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
                for key in sorted(procs, key=lambda k: k.endswith("0")):
                    procs.pop(key).close()
                for state in states.values():
                    if state is not None:
                        shutil.rmtree(state, ignore_errors=True)
        raise AssertionError("unreachable")

    if PREFAULT:  # the logs of the run: 2D per shard, 4D for 1 server, 6D for the floor
        warm = np.ones((WARMUP + UPDATES) * 14 * D, dtype=np.uint8)
        del warm
    try:
        ready_s = start_all()
        for cand in cands:
            c = Client(procs[cand if cand == "one" else f"{cand}0"].address, "bench",
                       timeout=60.0, retries=0)  # fmt: skip
            clients[cand] = c
            c.register(layout=layout, initial=initial)
            assert (c.shard_map is None) == (cand == "one"), cand

        # (get_job start, get_job end = push start, push end), monotonic, per candidate
        calls: dict[str, list[tuple[float, float, float]]] = {c: [] for c in cands}
        floor: dict[str, list[tuple[float, float]]] = {"slice": [], "whole": []}
        buf = os.urandom(4 * D)
        before_timed: dict[str, dict[str, float]] = {}
        disk_before: dict[str, int] = {}

        def run() -> None:
            orders = list(itertools.permutations(("off", "commit", "one")))
            for i in range(WARMUP + UPDATES):
                if i == WARMUP:
                    for key, p in procs.items():
                        if states[key] is not None:
                            before_timed[key] = p.metrics()
                            disk_before[key] = _wal_bytes_on_disk(states[key])
                order = list(orders[i % len(orders)]) + (["before"] if BEFORE else [])
                for cand in order:
                    c = clients[cand]
                    t0 = time.monotonic()
                    job = c.get_job()
                    t1 = time.monotonic()
                    res = c.push(job, delta, num_samples=10)
                    t2 = time.monotonic()
                    assert res.status is Status.APPLIED, (cand, res)
                    calls[cand].append((t0, t1, t2))
                floor["slice"].append(_disk_floor(tmp_path / "floor.bin", 2 * D, buf))
                floor["whole"].append(_disk_floor(tmp_path / "floor.bin", 4 * D, buf))

        benchmark.pedantic(run, rounds=1, iterations=1)
        after_timed = {k: procs[k].metrics() for k in before_timed}
        disk_after = {k: _wal_bytes_on_disk(states[k]) for k in disk_before}
        total = WARMUP + UPDATES
        models = {}
        for cand in cands:
            version, models[cand] = clients[cand].get_model()
            assert version == total, (cand, version)
        for cand in cands:
            if cand == "off":
                continue
            a, b = models["off"].double(), models[cand].double()
            err = float((a - b).norm() / a.norm())
            if name == "fedasync":
                assert torch.equal(models["off"], models[cand]), (cand, err)
            else:
                assert err <= 1e-5, (cand, err)
    finally:
        for c in clients.values():
            c.close()
        for key in sorted(procs, key=lambda k: k.endswith("0")):  # rank 1 first
            events[key] = procs[key].close()
        for state in states.values():
            if state is not None:
                shutil.rmtree(state, ignore_errors=True)
        (tmp_path / "floor.bin").unlink(missing_ok=True)

    nbytes = 4 * D
    timed = {c: xs[WARMUP:] for c, xs in calls.items()}
    push = {c: [t2 - t1 for _, t1, t2 in xs] for c, xs in timed.items()}
    job = {c: [t1 - t0 for t0, t1, _ in xs] for c, xs in timed.items()}
    cold = {c: xs[0][2] - xs[0][1] for c, xs in calls.items()}
    span = (min(xs[0][0] for xs in timed.values()), max(xs[-1][2] for xs in timed.values()))
    info: dict[str, Any] = {"scale": SCALE, "D": D, "update_bytes": nbytes, "updates": UPDATES,
                            "warmup": WARMUP, "ready_s": ready_s, "prefault": PREFAULT}  # fmt: skip
    label = {"off": "no state", "commit": "commit", "one": "1 server", "before": "before"}
    parts = [
        f"shard commit {name} D={fmt_size(D)} ({nbytes / 1e6:.1f} MB), 2 shards with "
        f"--state-dir '' vs state dirs (durable) vs 1 durable server"
        + (" vs the older tree" if BEFORE else "")
        + f", {UPDATES} updates each after {WARMUP} warm-up, interleaved, "
        + ("memory touched first:" if PREFAULT else "cold memory (AGGSRV_BENCH_PREFAULT=0):")
    ]
    for what, xs in (("push", push), ("get_job", job)):
        line = f"  {what}:"
        for c in cands:
            m = _med(xs[c])
            line += (f" {label[c]} p50 {fmt_time(m)} p90 {fmt_time(_p90(xs[c]))}"
                     f" ({nbytes / m / 1e9:.2f} GB/s);")  # fmt: skip
            info.update({f"{what}_{c}_p50_s": m, f"{what}_{c}_p90_s": _p90(xs[c])})
        parts.append(line.rstrip(";"))
    added = _med(push["commit"]) - _med(push["off"])
    per_round = _med([b - a for a, b in zip(push["off"], push["commit"], strict=True)])
    vs_one = _med(push["commit"]) - _med(push["one"])
    added_p90 = _p90(push["commit"]) - _p90(push["off"])
    added_job = _med(job["commit"]) - _med(job["off"])
    met = added <= TARGET_ADDED_S
    parts.append(
        f"  added by the commit (commit - no state): p50 {added * 1e3:+.2f} ms (median per-round "
        f"difference {per_round * 1e3:+.2f} ms), p90 {added_p90 * 1e3:+.2f} "
        f"ms  [<= {TARGET_ADDED_S * 1e3:.0f} ms at 4M: {'ok' if met else 'MISSED'}"
        f"{'' if size == '4M' else ' (target is for 4M)'}]; commit - 1 server: p50 "
        f"{vs_one * 1e3:+.2f} ms; GetJob commit - no state {added_job * 1e3:+.2f} ms"
    )
    if BEFORE:
        parts.append(
            f"  no state - before: p50 {(_med(push['off']) - _med(push['before'])) * 1e3:+.2f} ms"
        )
    parts.append(
        "  cold (first) push: " + ", ".join(f"{label[c]} {fmt_time(cold[c])}" for c in cands)
    )
    info.update(added_s=added, added_per_round_s=per_round, commit_minus_one_s=vs_one,
                target_met=met, **{f"cold_push_{c}_s": cold[c] for c in cands})  # fmt: skip
    fl = {k: (_med([w for w, _ in v]), _med([s for _, s in v])) for k, v in floor.items()}
    parts.append(
        f"  disk floor (append + fdatasync, same disk): {2 * D / 1e6:.1f} MB write "
        f"{_ms(fl['slice'][0])} + fdatasync {_ms(fl['slice'][1])}; {4 * D / 1e6:.1f} MB write "
        f"{_ms(fl['whole'][0])} + fdatasync {_ms(fl['whole'][1])}"
    )
    info.update(floor_slice_write_s=fl["slice"][0], floor_slice_sync_s=fl["slice"][1],
                floor_whole_write_s=fl["whole"][0], floor_whole_sync_s=fl["whole"][1])  # fmt: skip
    # fsyncs and bytes per update, per durable process
    for key in ("commit0", "commit1", "one"):
        ev = events.get(key, [])
        cand = "one" if key == "one" else "commit"
        pushes = [(t1, t2) for _, t1, t2 in timed[cand]]
        jobs = [(t0, t1) for t0, t1, _ in timed[cand]]
        n_push, n_job = _counts(ev, pushes), _counts(ev, jobs)
        n_all = _counts(ev, [span])
        kinds: dict[str, int] = {}
        for e in ev:
            if e[0] == "append" and span[0] <= e[1] <= span[1]:
                kinds[e[3][0]] = kinds.get(e[3][0], 0) + e[3][1]
        m0, m1 = before_timed.get(key, {}), after_timed.get(key, {})
        waits = m1.get("aggsrv_wal_sync_seconds_count", 0) - m0.get(
            "aggsrv_wal_sync_seconds_count", 0
        )
        gauge = m1.get("aggsrv_wal_bytes", 0) - m0.get("aggsrv_wal_bytes", 0)
        disk = disk_after.get(key, 0) - disk_before.get(key, 0)
        who = {"commit0": "commit rank 0", "commit1": "commit rank 1", "one": "1 server"}[key]
        by_kind = ", ".join(f"{k} {v / UPDATES / 1e6:.3f} MB" for k, v in sorted(kinds.items()))
        parts.append(
            f"  {who}: fsyncs per update {n_push / UPDATES:.2f} in push + {n_job / UPDATES:.2f} "
            f"in GetJob ({n_all / UPDATES:.2f} in the timed span; aggsrv_wal_sync_seconds_count "
            f"+{waits / UPDATES:.2f}); log bytes per update {disk / UPDATES / 1e6:.3f} MB on disk "
            f"(wal_bytes gauge {gauge / UPDATES / 1e6:.3f} MB; appended: {by_kind or 'none'})"
        )
        info.update({f"{key}_fsyncs_push": n_push / UPDATES, f"{key}_fsyncs_job": n_job / UPDATES,
                     f"{key}_fsyncs_span": n_all / UPDATES,
                     f"{key}_wal_sync_count": waits / UPDATES,
                     f"{key}_disk_bytes": disk / UPDATES, f"{key}_gauge_bytes": gauge / UPDATES,
                     f"{key}_probe_events": len(ev)})  # fmt: skip
    # the commit's steps, beside the same steps without state and on the single server
    steps = {}
    for cand, r0, r1 in (("commit", "commit0", "commit1"), ("off", "off0", "off1"),
                         ("one", "one", None)):  # fmt: skip
        windows = [(t1, t2) for _, t1, t2 in timed[cand]]
        steps[cand] = _steps(events.get(r0, []), events.get(r1, []) if r1 else [], windows)
        info.update({f"steps_{cand}_{k.strip()}": _med(v) for k, v in steps[cand].items()})
    parts.append("  steps, median over the pushes (commit | no state | 1 server):")
    for key in steps["commit"] | steps["off"] | steps["one"]:
        row = " | ".join(_ms(_med(steps[c].get(key, []))) for c in ("commit", "off", "one"))
        parts.append(f"    {key}: {row}")
    emit(benchmark, "\n".join(parts), info)
