"""The model versions a federation has published: immutable snapshots that readers (GetModel,
GetJob, GetStatus, evaluation) stream without locks, the newest ``retained_versions`` of them,
and the host copy of a device version, made once and shared by its readers.

Leases (aggsrv.strategies.buffers): the strategy reuses a retired version's buffer once no lease
on it is held. A snapshot holds one from its capture (on the aggregation thread, while the
version is the strategy's current one) until it leaves the retained versions; a reader takes
its own (:meth:`RetainedVersions.lease_snapshot`, on the event loop while the snapshot is
retained) for as long as it reads, and so does each host copy while it copies.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aggsrv.strategies import Job, Strategy
from aggsrv.strategies.buffers import NO_LEASE, Lease


@dataclass(frozen=True)
class Snapshot:
    """One retained version: immutable [D] weights (and [B] float buffers, None without any)
    that readers can stream without locks."""

    version: int
    weights: torch.Tensor
    created_at: float
    buffers: torch.Tensor | None = None
    # The host copy of a device version, made once off the event loop and shared by every
    # reader (RetainedVersions.on_host): {"copy": the future of {"weights": ..., "buffers": ...}}.
    host: dict[str, asyncio.Future] = field(default_factory=dict, compare=False, repr=False)
    # The snapshot's own lease on its weights, released when it leaves the retained versions.
    lease: Lease | None = field(default=None, compare=False, repr=False)

    def tensors(self, include_buffers: bool) -> dict[str, torch.Tensor]:
        """The named flat tensors GetModel streams."""
        out = {"weights": self.weights}
        if include_buffers and self.buffers is not None:
            out["buffers"] = self.buffers
        return out


def needs_host_copy(t: torch.Tensor) -> bool:
    """Whether streaming ``t`` needs a device-to-host copy first."""
    return t.device.type != "cpu"


def to_host(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """A host copy of a device tensor (blocking: run it off the event loop). ``pinned``: in
    page-locked memory, which a GPU fills at full bus speed (pageable memory is staged through
    a bounce buffer); torch's caching host allocator keeps such blocks (rounded up to a power
    of two) for reuse, so only the copies that exist once per version are pinned, and a
    failure to pin falls back to pageable memory."""
    if pinned and t.device.type == "cuda":
        try:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: pageable will do
            return t.detach().to("cpu")
        out.copy_(t.detach())
        return out
    return t.detach().to("cpu")


def _all_to_host(tensors: dict[str, torch.Tensor], pinned: bool = False) -> dict[str, torch.Tensor]:
    return {name: to_host(t, pinned) if needs_host_copy(t) else t for name, t in tensors.items()}


class LeaseHandoff:
    """A lease a call on the aggregation thread takes for a reader on the event loop that may
    go away before the call's result reaches it (a cancelled GetJob): either the call finds the
    reader gone and takes none, or the reader gives back what the call took."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lease = NO_LEASE
        self._gone = False

    def take(self, strategy: Strategy, *tensors: torch.Tensor) -> Lease:
        """(aggregation thread) The lease, unless the reader went away already."""
        with self._lock:
            if not self._gone:
                self._lease = strategy.lease(*tensors)
            return self._lease

    def abandon(self) -> None:
        """(event loop) The reader will not read: give back whatever was or will be taken."""
        with self._lock:
            self._gone = True
            lease, self._lease = self._lease, NO_LEASE
        lease.release()


class RetainedVersions:
    """The published versions readers see, and their shared host copies."""

    def __init__(
        self, keep: int, clock: Callable[[], float], strategy: Callable[[], Strategy | None]
    ) -> None:
        """``keep``: the newest versions retained (retained_versions); ``strategy``: the
        federation's, whose buffers the leases hold."""
        self._keep = keep
        self._clock = clock
        self._strategy = strategy
        self.snapshots: OrderedDict[int, Snapshot] = OrderedDict()
        self._version = 0  # the latest published version

    def snapshot_of(self, strategy: Strategy) -> Snapshot:
        """(aggregation thread) The strategy's current version as a snapshot holding a lease."""
        weights = strategy.global_model()
        return Snapshot(
            strategy.version, weights, self._clock(), strategy.global_buffers(),
            lease=strategy.lease(weights),
        )  # fmt: skip

    def retain(self, snap: Snapshot) -> None:
        """Publish ``snap``: readers see it from now on; the oldest beyond ``keep`` go."""
        self.snapshots[snap.version] = snap
        self._version = snap.version  # one int: readable from any thread
        while len(self.snapshots) > self._keep:
            release(self.snapshots.popitem(last=False)[1])

    def drop_all(self) -> None:
        """Forget every retained version (a new model replaces them)."""
        while self.snapshots:
            release(self.snapshots.popitem(last=False)[1])

    def lease_snapshot(self, snap: Snapshot) -> Lease:
        """A reader's lease on a retained snapshot's weights: take it on the event loop while
        ``snap`` is retained (no await between finding it and leasing it), release it when done
        reading (a stream, an evaluation)."""
        strategy = self._strategy()
        assert strategy is not None
        return strategy.lease(snap.weights)

    @property
    def published_version(self) -> int:
        """The latest published version, one GetModel serves now (0 before the model)."""
        return self._version

    def latest(self) -> Snapshot:
        return next(reversed(self.snapshots.values()))

    async def on_host(self, snap: Snapshot, include_buffers: bool) -> dict[str, torch.Tensor]:
        """The tensors GetModel streams, on the host: a device version's host copy is made once,
        off the event loop, and shared by every reader of that version."""
        tensors = snap.tensors(include_buffers)
        if not any(needs_host_copy(t) for t in tensors.values()):
            return tensors
        host = await self._host_copy(snap)
        return {name: host[name] for name in tensors}

    async def job_on_host(self, job: Job) -> dict[str, torch.Tensor]:
        """A job's tensors on the host: the weights (and buffers) of a retained version from its
        shared host copy, any other device tensor (a basis, a client's own model) copied off
        the event loop."""
        tensors = dict(job.tensors)
        if not any(needs_host_copy(t) for t in tensors.values()):
            return tensors
        snap = self.snapshots.get(job.base_version)
        shared = {}
        if snap is not None:
            shared = {id(snap.weights): "weights"}
            if snap.buffers is not None:
                shared[id(snap.buffers)] = "buffers"
        out: dict[str, torch.Tensor] = {}
        rest: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if id(t) in shared:
                assert snap is not None
                out[name] = (await self._host_copy(snap))[shared[id(t)]]
            elif needs_host_copy(t):
                rest[name] = t
            else:
                out[name] = t
        if rest:
            loop = asyncio.get_running_loop()
            # Held until the copy is done, even if the reader goes away meanwhile.
            lease = self._strategy().lease(*rest.values())
            copy = loop.run_in_executor(None, _all_to_host, rest)
            copy.add_done_callback(lambda _: lease.release())
            out.update(await copy)
        return {name: out[name] for name in tensors}

    async def _host_copy(self, snap: Snapshot) -> dict[str, torch.Tensor]:
        """{"weights", "buffers"} of ``snap`` on the host, copied once per version (in an
        executor thread: the event loop keeps serving meanwhile)."""
        future = snap.host.get("copy")
        if future is None:
            tensors = {"weights": snap.weights}
            if snap.buffers is not None:
                tensors["buffers"] = snap.buffers
            # Held until the copy is done: the readers waiting for it may all go away.
            lease = self._strategy().lease(snap.weights)
            # A version's one host copy, shared by its readers: pinned.
            future = asyncio.get_running_loop().run_in_executor(None, _all_to_host, tensors, True)
            future.add_done_callback(lambda _: lease.release())
            snap.host["copy"] = future

            def forget_failure(f: asyncio.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    snap.host.pop("copy", None)  # the next reader tries again

            future.add_done_callback(forget_failure)
        # Shielded: a reader that goes away does not cancel the copy the others wait for.
        return await asyncio.shield(future)


def release(snap: Snapshot) -> None:
    """Give back a snapshot's own lease (it left the retained or unpublished versions)."""
    if snap.lease is not None:
        snap.lease.release()
