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
import fcntl
import gc
import ipaddress
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from urllib.parse import urlparse

log = logging.getLogger("aggsrv.server.federation")


class RendezvousError(ValueError):
    """Rank 0 cannot host the shards' store (its --dist-url address is taken, or not its own):
    waiting would not help."""


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
                if self.rank == 0:
                    raise RendezvousError(
                        f"rank 0 cannot listen for the shards at {self.host}:{self.port} "
                        f"(--dist-url): {exc}"
                    ) from exc
                if stop():
                    raise
                log.info("shard %d: rank 0's store at %s:%d does not answer yet (%s)",
                         self.rank, self.host, self.port, str(exc)[:120])  # fmt: skip
                time.sleep(RETRY_SECONDS)

    def form(self, stop: Callable[[], bool] = lambda: False) -> int:
        """Join the next forming of the group (the default process group); its epoch. Blocks
        until every shard has joined; raises RuntimeError after ``timeout`` seconds without
        them (call again), or when ``stop()`` says to give up."""
        import torch.distributed as dist

        self._bind_gloo()
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
        )
        if self.rank == 0:
            store.set(f"formed/{epoch}", "1")
        self.epoch = epoch
        return epoch

    def join(self, stop: Callable[[], bool]) -> int:
        """:meth:`form`, again and again until every shard is there (a shard that is down, or
        slow to notice a loss, makes a forming time out); its epoch. ``stop()`` gives up."""
        while True:
            try:
                return self.form(stop)
            except (RuntimeError, OSError) as exc:
                if stop():
                    raise
                log.warning("shard %d: the group did not form (%s); trying again", self.rank,
                            str(exc)[:200])  # fmt: skip
            leave_group()  # out of the handler: the error's frames may hold the group

    def _bind_gloo(self) -> None:
        """Gloo listens on the interface this machine reaches rank 0's store through, unless
        GLOO_SOCKET_IFNAME names one: by default it takes the address the host name resolves
        to, often a loopback one in /etc/hosts, which the other machines cannot reach."""
        if os.environ.get("GLOO_SOCKET_IFNAME"):
            return
        name = interface_towards(self.host, self.port)
        if name is not None:
            log.info("shard %d: gloo on interface %s (the route to %s)", self.rank, name,
                     self.host)  # fmt: skip
            os.environ["GLOO_SOCKET_IFNAME"] = name

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


def leave_group() -> None:
    """Leave the default process group (a shard's :class:`Rendezvous` store stays). Its
    connections must close now, so that a shard waiting in a collective on this one fails at
    once rather than at the group's timeout: the group is aborted, and freed (gloo closes them
    only then), which needs every reference to it gone, the frames of an error included
    (shards.ShardLost keeps none)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        dist.distributed_c10d._get_default_group().abort()
    except (RuntimeError, AttributeError) as exc:  # a torch without abort for gloo
        log.debug("could not abort the group: %s", exc)
    dist.destroy_process_group()
    # Garbage that still holds the group (a failed collective's frames, in a reference cycle)
    # is collected now, not whenever the collector next runs.
    gc.collect()


def interface_towards(host: str, port: int) -> str | None:
    """The name of the network interface holding the address this machine reaches ``host``
    from (a UDP connect picks the route and sends nothing); None for a loopback route or an
    address no interface holds (IPv4)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
        except OSError:
            return None
        local = probe.getsockname()[0]
        if ipaddress.ip_address(local).is_loopback:
            return None
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(answer[20:24]) == local:
                return name
    return None


SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
