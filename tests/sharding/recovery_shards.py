"""Warm shard processes that serve sharded federations in-process (``Server(config, shards)``)
on a clock the test sets, for tests that SIGKILL a federation and resume it (tests/ is not a
package: import as ``from recovery_shards import ShardPool``).

Why a clock of the test's: a recovered federation is compared with an uninterrupted run of the
same calls, and the strategies' decisions depend on each call's ``now`` (rounds, epochs,
leases). Each worker reads its federation's clock from a shared value the test sets before each
call, and runs no timer of its own: the test fires rank 0's timer when its script says so. With
the calls made one at a time, two runs of a script then make the same calls with the same
inputs, whatever the machine's speed.

Why a pool: SIGKILL ends a process, and a fresh one spends seconds importing torch. The pool
keeps spare workers imported in the background while a test runs; a worker that served a
federation to its clean end goes back to the pool.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

import torch

# Calls a worker takes while it serves: ("timer",) on rank 0, ("state",), ("has_job", client),
# ("port",), ("whole",).
REPLY_TIMEOUT = 120.0


def _no_timer(self: Any, deadline: float | None) -> None:
    """DeadlineTimer.arm in a worker: the test fires the timers (see the module docstring)."""


def _durable_state(fed: Any) -> dict[str, Any]:
    """(aggregation thread) What a checkpoint and the log keep of a federation: the strategy's
    whole state, the registry (without lease expiries, which a GetJob extends in memory) and
    the counts that survive a restart."""
    from aggsrv.server.persistence import DURABLE_COUNTERS

    strategy = fed.strategy
    return {
        "version": strategy.version,
        "strategy": strategy.state_dict(),
        "clients": sorted(
            (c.client_id, c.registered_at, dict(c.labels)) for c in fed.clients.values()
        ),
        "counters": {k: fed.counters[k] for k in DURABLE_COUNTERS},
    }


async def _serve(config: Any, inbox: Any, outbox: Any) -> None:
    from aggsrv.server.app import Server
    from aggsrv.server.shards import ShardGroup

    # Joined by the test (a group that serves several federations), or at config.dist_url,
    # where a shard restarted after a loss meets the others again.
    joined = config.shards > 1 and not config.dist_url
    server = Server(config, ShardGroup.of(config) if joined else None)
    fed = server.federation
    try:
        port = await server.start()
    except Exception as exc:
        outbox.put(("refused", f"{type(exc).__name__}: {exc}"))
        fed.shutdown_threads()
        return
    outbox.put(("serving", port))
    loop = asyncio.get_running_loop()
    while not server.stop_requested.is_set():
        try:
            msg = await loop.run_in_executor(None, lambda: inbox.get(timeout=0.05))
        except queue.Empty:
            continue
        try:
            if msg[0] == "timer":
                await fed._fire_timer()  # what DeadlineTimer runs when the deadline passes
                reply: Any = None
            elif msg[0] == "state":
                reply = await fed.read(_durable_state, fed)
            elif msg[0] == "port":
                reply = server.port
            elif msg[0] == "whole":  # the federation takes writes again (after a loss)
                while fed.closing or fed.failure is not None:
                    await asyncio.sleep(0.05)
                reply = fed.version
            elif msg[0] == "has_job":
                job, _, lease = await fed.next_job(msg[1])  # the service's own call
                lease.release()
                reply = job is not None
            else:
                raise ValueError(f"unknown call {msg!r}")
            outbox.put(("reply", reply))
        except Exception:
            outbox.put(("error", traceback.format_exc()))
    await server.stop(1.0)
    outbox.put(("stopped", fed.failure))


def _worker_main(inbox: Any, outbox: Any, clock: Any) -> None:
    """A worker: imports everything once, then serves the federations it is sent."""
    try:
        import functools

        import torch.distributed as dist

        from aggsrv.server import app
        from aggsrv.server.config import ServerConfig
        from aggsrv.server.deadline_timer import DeadlineTimer
        from aggsrv.server.federation import Federation

        torch.set_num_threads(1)
        DeadlineTimer.arm = _no_timer
        app.Federation = functools.partial(Federation, clock=lambda: clock.value)
        outbox.put(("ready", None))
        while True:
            msg = inbox.get()
            if msg[0] == "exit":
                return
            if msg[0] == "serve":  # a federation that meets at its dist_url
                asyncio.run(_serve(ServerConfig(**msg[1]), inbox, outbox))
                continue
            _, init, rank, world = msg
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
            outbox.put(("joined", None))
            while True:
                msg = inbox.get()
                if msg[0] == "leave":
                    break
                asyncio.run(_serve(ServerConfig(**msg[1]), inbox, outbox))
            dist.destroy_process_group()
            outbox.put(("left", None))
    except Exception:
        outbox.put(("error", traceback.format_exc()))


class Worker:
    """One warm shard process, its mailboxes and its clock."""

    def __init__(self, ctx: Any) -> None:
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.clock = ctx.Value("d", 0.0, lock=False)
        self.proc = ctx.Process(
            target=_worker_main, args=(self.inbox, self.outbox, self.clock), daemon=True
        )
        self.proc.start()
        self.ready = False

    def expect(self, kind: str, timeout: float = REPLY_TIMEOUT) -> Any:
        """The next message, which must be ``kind`` (AssertionError with the worker's error)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got, value = self.outbox.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise AssertionError(
                        f"worker {self.proc.pid} died ({self.proc.exitcode})"
                    ) from None
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"worker {self.proc.pid}: no {kind} in {timeout} s"
                    ) from None
        if got != kind:
            raise AssertionError(f"worker {self.proc.pid}: {got} instead of {kind}: {value}")
        return value

    def call(self, *msg: Any) -> Any:
        self.inbox.put(msg)
        return self.expect("reply")

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(20)


class ShardPool:
    """Spare workers, spawned ahead of need (tests may take them from several threads)."""

    def __init__(self, spare: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.spare: deque[Worker] = deque(Worker(self.ctx) for _ in range(spare))
        self.target = spare
        self.busy: list[Worker] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[Worker]:
        """``n`` imported workers (spares are started to replace them)."""
        with self._lock:
            taken = [self.spare.popleft() if self.spare else Worker(self.ctx) for _ in range(n)]
            while len(self.spare) < self.target:
                self.spare.append(Worker(self.ctx))
            self.busy += taken
        for w in taken:
            if not w.ready:
                w.expect("ready")
                w.ready = True
        return taken

    def forget(self, workers: list[Worker]) -> None:
        """Workers that were killed."""
        with self._lock:
            for w in workers:
                self.busy.remove(w)

    def give_back(self, workers: list[Worker]) -> None:
        with self._lock:
            for w in workers:
                self.busy.remove(w)
                if w.proc.is_alive():
                    self.spare.appendleft(w)

    def close(self) -> None:
        """End every worker (idle ones hold nothing worth a clean exit)."""
        for w in [*self.spare, *self.busy]:
            w.kill()


class ShardGroupOfWorkers:
    """``world`` workers on one clock: joined by the test in one gloo group (``rendezvous``, a
    file), they serve federations one after another; without one, each federation meets at
    its configs' dist_url (a lost shard can then be restarted alone: :meth:`restart`)."""

    def __init__(self, pool: ShardPool, world: int, rendezvous: Path | None) -> None:
        self.pool = pool
        self.workers = pool.take(world)
        self.joined = rendezvous is not None
        for r, w in enumerate(self.workers):
            if rendezvous is not None:
                w.inbox.put(("join", f"file://{rendezvous}", r, world))
        for w in self.workers if self.joined else []:
            w.expect("joined")
        self.now = 1_000_000.0
        self.set_clock(self.now)

    def restart(self, rank: int, config: dict[str, Any]) -> None:
        """SIGKILL shard ``rank``, start it again in a fresh worker with ``config`` (resume),
        and wait until every shard takes writes again."""
        assert not self.joined
        victim = self.workers[rank]
        victim.kill()
        self.pool.forget([victim])
        self.workers[rank] = self.pool.take(1)[0]
        self.set_clock(self.now)
        self.workers[rank].inbox.put(("serve", config))
        self.workers[rank].expect("serving", 180)
        for w in self.workers:
            w.call("whole")

    def set_clock(self, now: float) -> None:
        self.now = now
        for w in self.workers:
            w.clock.value = now

    def tick(self, seconds: float) -> float:
        self.set_clock(self.now + seconds)
        return self.now

    def serve(self, configs: list[dict[str, Any]]) -> int:
        """Start one federation (a config per rank): rank 0's port."""
        for w, config in zip(self.workers, configs, strict=True):
            w.inbox.put(("serve", config))
        ports = [w.expect("serving", 180) for w in self.workers]
        return ports[0]

    def serve_refused(self, configs: list[dict[str, Any]]) -> list[str]:
        """Start a federation that must refuse to start: each rank's error."""
        for w, config in zip(self.workers, configs, strict=True):
            w.inbox.put(("serve", config))
        return [w.expect("refused", 180) for w in self.workers]

    def timer(self) -> None:
        self.workers[0].call("timer")

    def has_job(self, client: str) -> bool:
        return bool(self.workers[0].call("has_job", client))

    def states(self) -> list[dict[str, Any]]:
        """Every shard's durable state (:func:`_durable_state`), by rank."""
        for w in self.workers:
            w.inbox.put(("state",))
        return [w.expect("reply") for w in self.workers]

    def stopped(self) -> list[str | None]:
        """Wait for every shard to stop (after a Shutdown): each one's failure, if any."""
        return [w.expect("stopped", 60) for w in self.workers]

    def kill(self) -> None:
        """SIGKILL every shard process (they are not given back)."""
        for w in self.workers:
            w.kill()
        self.pool.forget(self.workers)
        self.workers = []

    def leave(self) -> None:
        """Leave the gloo group; the workers go back to the pool (workers that met at a
        dist_url end: their process group is not reused)."""
        if not self.joined:
            self.kill()
            return
        for w in self.workers:
            w.inbox.put(("leave",))
        for w in self.workers:
            w.expect("left")
        self.pool.give_back(self.workers)
        self.workers = []
