"""The server under load: 64 client threads (each its own Client and id) loop get_job -> push
against ONE in-process server on loopback for a bounded time, with the write-ahead log as the
oracle.

Per case (fedasync and fedbuff with durability on, fedasync with durability off):

- the only refusals are the expected ones (backpressure RESOURCE_EXHAUSTED, ABORTED for a
  superseded job or a too-stale update); every RpcError code is collected and reported;
- every acknowledged (APPLIED/BUFFERED) update id was acknowledged once and the server's
  ``updates_accepted`` equals the number acknowledged;
- durability on: every acknowledged update id is in the log's "update" records exactly once,
  the log holds no other update (a refused one is never logged), the number of logged updates
  equals ``updates_accepted``, and replaying the log from checkpoint 1 gives the live strategy's
  whole state bit for bit (checkpoints every 300 updates rotate the log under load);
- the peak RSS growth of this process (server and clients share it) stays within the bound
  bench/test_bench_ingest.py's memory benchmark set for the server, (K + S + 2) x D x 4 bytes
  + 300 MB (K = 64 clients with a job each, S = max_concurrent_uploads staging slots, 2 models),
  plus what the in-process clients hold: 3 x K x D x 4 bytes (each client's job weights, its
  delta and its encoded upload). The growth is measured from VmRSS just before the server starts
  (VmHWM reset through /proc/self/clear_refs, else a 20 ms VmRSS sampler) to the peak VmHWM.

Each client gets its own TCP connection, as separate client processes would: gRPC shares one
HTTP/2 connection between channels of one process with identical arguments, so each Client is
given a slightly different max_message_bytes. ``test_64_clients_sharing_one_connection`` runs
the shared-connection case on its own (as the simulator's clients do): all 64 clients' calls on
one connection stay within the server's per-connection stream limit (128), so nothing is
refused (with a limit of 64 and job streams left unread to their end, some were refused).

Run with ``-s`` to see the figures (updates acknowledged, updates/s, refusals, peak RSS).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import RunningServer
from state_helpers import assert_same_state

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import durability
from aggsrv.server.config import ServerConfig
from aggsrv.server.federation import rebuild
from aggsrv.strategies import Strategy
from aggsrv.values import Status

N_CLIENTS = 64
D = 50_000  # 200 kB per update: 64 clients fit two cores
LOAD_SECONDS = 7.0
MAX_PUSHES_PER_CLIENT = 2_000  # bounds each loop in count as well as in time
SLOTS = 4  # max_concurrent_uploads (the default), the S of the memory bound
MB = 1e6
SC = grpc.StatusCode
# Backpressure (the concurrent-call limit), a superseded job or a too-stale update.
ALLOWED_CODES = {SC.RESOURCE_EXHAUSTED.name, SC.ABORTED.name}
REFUSED_STREAM = "RST_STREAM with error code 7"  # HTTP/2 REFUSED_STREAM, as gRPC reports it


def _layout() -> ModelLayout:
    return ModelLayout.from_named_shapes([("body.weight", (D - 100,)), ("body.bias", (100,))])


def _proc_status_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0])
    return out


def _reset_peak_rss() -> bool:
    """VmHWM back to the current RSS (``echo 5 > /proc/self/clear_refs``); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Samples VmRSS every 20 ms: the peak when VmHWM cannot be reset (ends with `stop`)."""

    def __init__(self) -> None:
        self.peak_kb = _proc_status_kb()["VmRSS"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_kb = max(self.peak_kb, _proc_status_kb()["VmRSS"])

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak_kb


def replay_log(config: ServerConfig, state_dir: Path) -> Strategy:
    """The strategy a fresh federation reaches from checkpoint 1 plus every logged record."""
    assert durability.list_checkpoints(state_dir)[0][0] == 1, "checkpoint 1 was pruned"
    strategy = rebuild(config, state_dir, 1).strategy
    assert strategy is not None
    return strategy


@dataclass
class LoadRun:
    """What one load run saw."""

    acked: list[tuple[str, str]]  # (client, update id) answered APPLIED/BUFFERED
    errors: Counter  # RpcError code name -> count
    details: Counter  # (code, details) -> count
    odd: list[str]  # answers that were neither an acknowledgement nor an RpcError
    wall: float
    status: object  # the server's StatusResponse after the run
    growth: int  # peak RSS - RSS before the server started, bytes
    baseline_kb: int
    peak_kb: int
    sampled: bool  # the peak is the sampler's (VmHWM could not be reset)
    live_state: dict | None = None
    config: ServerConfig | None = None
    extra: dict = field(default_factory=dict)


def run_load(
    *,
    strategy: str,
    strategy_config: dict,
    mode: str,
    state_dir: Path,
    seconds: float,
    own_connections: bool,
    seed: int,
) -> LoadRun:
    """64 client threads loop get_job -> push for `seconds`; the server is stopped at the end."""
    layout = _layout()
    x0 = torch.randn(D, generator=torch.Generator().manual_seed(seed)) * 0.1
    can_reset = _reset_peak_rss()
    baseline_kb = _proc_status_kb()["VmRSS"]
    sampler = RssSampler()
    try:
        srv = RunningServer(
            strategy=strategy,
            strategy_config=strategy_config,
            durability=mode,
            state_dir=str(state_dir) if mode == "on" else "",
            rate_limit_per_second=0,
            max_concurrent_uploads=SLOTS,
            # Checkpoints (and log rotations) under load; every segment kept for the oracle.
            checkpoint_every_updates=300,
            checkpoint_keep=1000,
        )
    except BaseException:
        sampler.stop()
        raise
    clients: list[Client] = []
    stopped = False
    try:
        for i in range(N_CLIENTS):
            # Distinct channel arguments: a subchannel (TCP connection) of its own.
            size = (4 << 20) + (4 * i if own_connections else 0)
            clients.append(
                Client(
                    srv.address, f"load-{i:02d}", retries=0, timeout=30.0, max_message_bytes=size
                )
            )
        assert clients[0].register(layout=layout, initial=x0).initial_model_adopted
        for c in clients[1:]:
            c.register(layout=layout)

        acked: list[list[tuple[str, str]]] = [[] for _ in clients]
        details: list[Counter] = [Counter() for _ in clients]
        odd: list[str] = []
        barrier = threading.Barrier(N_CLIENTS + 1, timeout=30)
        stop_at = [0.0]

        def worker(i: int) -> None:
            client = clients[i]
            gen = torch.Generator().manual_seed(seed + 1 + i)
            barrier.wait()
            for n in range(MAX_PUSHES_PER_CLIENT):
                if time.monotonic() >= stop_at[0]:
                    break
                uid = f"{client.client_id}-u{n}"
                try:
                    job = client.get_job(timeout=30.0)
                    delta = torch.randn(D, generator=gen) * 1e-3
                    result = client.push(job, delta, update_id=uid, num_samples=1, epochs=1.0)
                except grpc.RpcError as exc:
                    details[i][(exc.code().name, exc.details())] += 1
                    continue
                if result.status in (Status.APPLIED, Status.BUFFERED) and result.update_id == uid:
                    acked[i].append((client.client_id, uid))
                else:
                    odd.append(f"{uid}: answered {result}")

        threads = [
            threading.Thread(target=worker, args=(i,), name=f"load-{i}", daemon=True)
            for i in range(N_CLIENTS)
        ]
        for t in threads:
            t.start()
        stop_at[0] = time.monotonic() + seconds
        t0 = time.monotonic()
        barrier.wait()
        for t in threads:
            t.join(timeout=max(0.0, t0 + seconds + 60 - time.monotonic()))
        wall = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "a client thread hung"

        peak_kb = max(_proc_status_kb()["VmHWM"] if can_reset else 0, sampler.stop())
        status = clients[0].status()
        live_state = srv.state() if mode == "on" else None
        srv.stop()
        stopped = True
    finally:
        sampler.stop()
        for c in clients:
            c.close()
        if not stopped:
            srv.stop()
    merged = sum(details, Counter())
    errors: Counter = Counter()
    for (code, _), n in merged.items():
        errors[code] += n
    return LoadRun(
        acked=[key for per in acked for key in per],
        errors=errors,
        details=merged,
        odd=odd,
        wall=wall,
        status=status,
        growth=(peak_kb - baseline_kb) * 1024,
        baseline_kb=baseline_kb,
        peak_kb=peak_kb,
        sampled=not can_reset,
        live_state=live_state,
        config=srv.config,
    )


def _report(case: str, mode: str, run: LoadRun) -> int:
    """Print the figures; the memory bound in bytes."""
    bound = (N_CLIENTS + SLOTS + 2) * D * 4 + 300 * 10**6 + 3 * N_CLIENTS * D * 4
    s = run.status
    n = len(run.acked)
    print(
        f"\n[{case}] {N_CLIENTS} clients, D={D}, durability {mode}: {n} updates acknowledged in "
        f"{run.wall:.1f} s = {n / run.wall:.0f} updates/s (server: accepted "
        f"{s.updates_accepted}, applied {s.updates_applied}, rejected {s.updates_rejected} "
        f"{dict(s.rejected_by_code)}, version {s.version}); client errors "
        f"{dict(run.errors) or 'none'}; peak RSS growth {run.growth / MB:.0f} MB (RSS before "
        f"the server {run.baseline_kb * 1024 / MB:.0f} MB, peak {run.peak_kb * 1024 / MB:.0f} MB"
        f"{', sampled' if run.sampled else ''}) vs bound (K+S+2)xDx4 + 300 MB + 3xKxDx4 = "
        f"{bound / MB:.0f} MB"
    )
    return bound


def _check_acks(run: LoadRun, bound: int) -> None:
    s = run.status
    assert not run.odd, run.odd[:10]
    assert run.acked, "no update was acknowledged"
    assert len(set(run.acked)) == len(run.acked), "an update id was acknowledged twice"
    assert s.updates_accepted == len(run.acked), (s.updates_accepted, len(run.acked))
    assert s.updates_duplicate == 0 and s.uploads_in_progress == 0 and s.queue_depth == 0
    assert run.growth <= bound, f"peak RSS grew {run.growth / MB:.0f} MB > {bound / MB:.0f} MB"


def _check_log(case: str, run: LoadRun, state_dir: Path) -> None:
    """The log as the oracle: each acknowledged update logged once, nothing else, and a replay
    from checkpoint 1 reaching the live state bit for bit."""
    logged = [
        (r.meta["client"], r.meta["update_id"])
        for _, r in durability.iter_records(state_dir, 1)
        if r.kind == "update"
    ]
    twice = [k for k, n in Counter(logged).items() if n > 1]
    assert not twice, f"logged more than once: {twice[:10]}"
    missing = set(run.acked) - set(logged)
    assert not missing, f"acknowledged but not in the log: {sorted(missing)[:10]}"
    extra = set(logged) - set(run.acked)
    assert not extra, f"logged but never acknowledged: {sorted(extra)[:10]}"
    assert len(logged) == run.status.updates_accepted
    segments = durability.list_segments(state_dir)
    print(
        f"[{case}] log: {len(logged)} update records in {len(segments)} segments, "
        f"{sum(p.stat().st_size for _, p in segments) / MB:.0f} MB"
    )
    assert run.config is not None and run.live_state is not None
    assert_same_state(replay_log(run.config, state_dir).state_dict(), run.live_state)


CASES = {
    "fedasync-durable": ("fedasync", {}, "on"),
    "fedbuff-durable": ("fedbuff", {"buffer_size": 8}, "on"),
    "fedasync-nolog": ("fedasync", {}, "off"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_64_clients_under_load_every_ack_logged_once(case: str, tmp_path: Path) -> None:
    strategy, strategy_config, mode = CASES[case]
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"\n[{case}] random seed {seed}")
    state_dir = tmp_path / "state"
    run = run_load(
        strategy=strategy,
        strategy_config=strategy_config,
        mode=mode,
        state_dir=state_dir,
        seconds=LOAD_SECONDS,
        own_connections=True,
        seed=seed,
    )
    bound = _report(case, mode, run)
    assert set(run.errors) <= ALLOWED_CODES, run.details.most_common(5)
    _check_acks(run, bound)
    if mode == "on":
        _check_log(case, run, state_dir)


def test_64_clients_sharing_one_connection(tmp_path: Path) -> None:
    """All 64 Clients of this process on one HTTP/2 connection (gRPC's shared subchannel), one
    call in flight each: within the per-connection stream limit, so no stream is refused (a
    refused one would be UNAVAILABLE, never processed, and retried by the stock Client); the
    log holds exactly the acknowledged updates."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"\n[shared-connection] random seed {seed}")
    state_dir = tmp_path / "state"
    run = run_load(
        strategy="fedasync",
        strategy_config={},
        mode="on",
        state_dir=state_dir,
        seconds=3.0,
        own_connections=False,
        seed=seed,
    )
    bound = _report("fedasync-durable-shared-connection", "on", run)
    refused = sum(n for (code, text), n in run.details.items() if REFUSED_STREAM in text)
    print(f"[shared-connection] refused streams (REFUSED_STREAM -> UNAVAILABLE): {refused}")
    assert refused == 0, f"{refused} streams refused below the per-connection limit"
    others = {
        key: n
        for key, n in run.details.items()
        if key[0] not in ALLOWED_CODES and REFUSED_STREAM not in key[1]
    }
    assert not others, others
    _check_acks(run, bound)
    _check_log("shared-connection", run, state_dir)
