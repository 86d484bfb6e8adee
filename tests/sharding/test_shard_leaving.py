"""A shard that loses the federation leaves the broken process group at once, and its leaving
closes its connections: another survivor, waiting in a collective on it, fails then too, not
at the group's timeout (docs/sharding.md "Crashes and recovery": the survivors notice at once).

Three real shard processes join through the rendezvous (`ShardGroup.connect`) and sum again and
again; rank 0 is SIGKILLed. Each survivor keeps the `ShardLost` it got, as the server keeps an
error a while (a future's result, a gRPC handler's abort), then leaves as the server's healing
does first. Without care, that error's traceback reaches into torch's collective and keeps the
group, and its sockets, alive: the survivor waiting on the other then waits out the timeout.
Whether one survivor waits on the other depends on where the kill lands (it did in 5 runs of 14
without the fix); test_shard_lost_in_a_reduction.py checks the frames themselves every time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 30.0  # the group's timeout: what a survivor would wait without the fix

SHARD = textwrap.dedent(
    """
    import json, sys, time, types
    import torch
    import torch.distributed as dist
    from aggsrv.server.rendezvous import leave_group
    from aggsrv.server.shards import ShardGroup, ShardLost

    rank, url, timeout = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    config = types.SimpleNamespace(
        dist_url=url, rank=rank, shards=3, shard_timeout_seconds=timeout,
        shard_slice_wait_seconds=5.0, shard_order_wait_seconds=5.0, shard_heartbeat_seconds=1.0,
    )
    shards = ShardGroup.connect(config)
    print("READY", flush=True)
    kept = []  # the errors, held as the server holds them for a while
    t = torch.zeros(4, dtype=torch.float64)
    try:
        while True:  # rank 1 through the strategy's reducer, rank 2 as a vote: both all_reduce
            if rank == 1:
                shards.reducer.sum_(t)
            else:
                shards._collective("a vote", dist.all_reduce, t)
    except ShardLost as exc:
        lost = time.time()
        kept.append(exc)
    if rank != 0:
        leave_group()  # what healing does first
        print(json.dumps({"lost": lost, "message": str(kept[0])[:200]}), flush=True)
        time.sleep(120)  # alive: the other's connection to us closes by leave(), not by exit
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _line(proc: subprocess.Popen, deadline: float) -> str:
    """The process's next line of output, waiting no later than ``deadline``."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                if line:
                    return line.strip()
                raise AssertionError(f"shard exited ({proc.poll()}): {proc.stderr.read()[-2000:]}")
    raise AssertionError("no line from the shard in time")


def test_a_survivor_that_leaves_frees_the_others_waiting_on_it_at_once() -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(3):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SHARD, str(rank), url, str(TIMEOUT)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=REPO,
                    env=env,
                    start_new_session=True,
                )  # fmt: skip
            )
        start = time.monotonic() + 60
        assert [_line(p, start) for p in procs] == ["READY"] * 3
        time.sleep(0.5)  # summing
        procs[0].send_signal(signal.SIGKILL)
        killed = time.time()
        ends = {r: json.loads(_line(procs[r], time.monotonic() + TIMEOUT + 20)) for r in (1, 2)}
        waited = {r: round(e["lost"] - killed, 2) for r, e in ends.items()}
        for end in ends.values():
            assert "lost the federation" in end["message"], end
        # At once: well under the group's timeout (a survivor that waits it out takes 30 s).
        assert max(waited.values()) < 8.0, waited
    finally:
        for p in procs:  # every one killed before any is waited for
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(10)
            p.stdout.close()
            p.stderr.close()
