"""Where the shards of a federation meet, and meet again after one of them was lost
(docs/sharding.md "Crashes and recovery").

Rank 0 hosts a ``torch.distributed.TCPStore`` at ``--dist-url``; the other shards connect to it.
Each forming of the process group is an epoch: rank 0 opens the next one (an atomic counter in
the store), every shard joins it through a key prefix of its own, and rank 0 marks it formed
once the group is whole. A shard that finds the newest epoch formed already (it restarted faster
than the others noticed it was gone) waits for the next one. A lost rank 0 takes its store with
it: the others reconnect to the store its restarted process hosts.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from urllib.parse import urlparse

log = logging.getLogger("aggsrv.server.federation")

# How long a shard waits between two tries to reach the store or to find a new epoch.
RETRY_SECONDS = 0.2


class Rendezvous:
    """This shard's way into the process group, for its first forming and every later one."""

    def __init__(self, url: str, rank: int, world_size: int, timeout: float) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
            raise ValueError(f"--dist-url must be tcp://HOST:PORT, got {url!r}")
        self.host, self.port = parsed.hostname, parsed.port
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.epoch = 0
        self._store = None

    def _connect(self, stop: Callable[[], bool]) -> object:
        """The store: rank 0 hosts it (once per process), the others connect, retrying until it
        answers (rank 0 may be restarting)."""
        import torch.distributed as dist

        if self._store is not None:
            return self._store
        wait = datetime.timedelta(seconds=self.timeout)
        while True:
            try:
                self._store = dist.TCPStore(
                    self.host, self.port, self.world_size, is_master=self.rank == 0,
                    timeout=wait, wait_for_workers=False,
                )  # fmt: skip
                return self._store
            except (RuntimeError, OSError) as exc:
                if self.rank == 0 or stop():
                    raise
                log.info("shard %d: rank 0's store at %s:%d does not answer yet (%s)",
                         self.rank, self.host, self.port, str(exc)[:120])  # fmt: skip
                time.sleep(RETRY_SECONDS)

    def form(self, stop: Callable[[], bool] = lambda: False) -> int:
        """Join the next forming of the group (the default process group); its epoch. Blocks
        until every shard has joined; raises RuntimeError after ``timeout`` seconds without
        them (call again), or when ``stop()`` says to give up."""
        import torch.distributed as dist

        store = self._connect(stop)
        try:
            epoch = self._next_epoch(store, stop)
        except (RuntimeError, OSError):
            self._store = None  # rank 0's store went away: reconnect next time
            raise
        log.info("shard %d of %d: joining the group's epoch %d at %s:%d", self.rank,
                 self.world_size, epoch, self.host, self.port)  # fmt: skip
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"epoch/{epoch}", store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeout),
            pg_options=self._gloo_options(),
        )
        if self.rank == 0:
            store.set(f"formed/{epoch}", "1")
        self.epoch = epoch
        return epoch

    def _gloo_options(self) -> object | None:
        """Gloo listens on the address this machine reaches rank 0's store from (the host name
        may resolve to a loopback address, which the other hosts cannot reach), unless
        GLOO_SOCKET_IFNAME names the interface."""
        import torch.distributed as dist

        if os.environ.get("GLOO_SOCKET_IFNAME"):
            return None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((self.host, self.port))  # UDP: picks the route, sends nothing
            local = probe.getsockname()[0]
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
        return options

    def _next_epoch(self, store: object, stop: Callable[[], bool]) -> int:
        if self.rank == 0:
            return int(store.add("epoch", 1))  # type: ignore[attr-defined]
        while True:
            # Blocks (up to the store's timeout) until rank 0 has opened a first epoch.
            epoch = int(store.get("epoch"))  # type: ignore[attr-defined]
            if not store.check([f"formed/{epoch}"]):  # type: ignore[attr-defined]
                return epoch
            if stop():
                raise RuntimeError("the server is stopping")
            time.sleep(RETRY_SECONDS)

    def leave(self) -> None:
        """Leave the current group (its pending collectives fail at once); the store stays."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
