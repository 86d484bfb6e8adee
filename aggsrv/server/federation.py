"""Federation state behind the gRPC service: the strategy and the one aggregation thread that
drives it, the client registry with leases, retained model snapshots, staging slots, counters.

Every strategy call runs on a single worker thread (the aggregation loop), one at a time, so a
strategy needs no locks and heavy kernels never block the event loop that serves gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from aggsrv.layout import ModelLayout
from aggsrv.server.config import ServerConfig
from aggsrv.strategies import Strategy, make_strategy
from aggsrv.transport import StagingSlot

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ClientRecord:
    """What the server knows of one registered client."""

    client_id: str
    registered_at: float
    lease_expires: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """One retained version: immutable [D] weights (and [B] float buffers, None without any)
    that readers can stream without locks."""

    version: int
    weights: torch.Tensor
    created_at: float
    buffers: torch.Tensor | None = None

    def tensors(self, include_buffers: bool) -> dict[str, torch.Tensor]:
        """The named flat tensors GetModel streams."""
        out = {"weights": self.weights}
        if include_buffers and self.buffers is not None:
            out["buffers"] = self.buffers
        return out


class EventLog:
    """Appends strategy events to a JSON-lines file, one flushed line per event (the file
    outlives a crash; events are diagnostics, not state)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        log.info("event %s at v%s", record.get("event"), record.get("version"))


class Federation:
    """The server's state; all strategy access goes through :meth:`call`."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.started_at = clock()
        self.device = _resolve_device(config.device)
        self.layout: ModelLayout | None = None
        self.strategy: Strategy | None = None
        self.clients: dict[str, ClientRecord] = {}
        self.snapshots: OrderedDict[int, Snapshot] = OrderedDict()
        self.counters: Counter[str] = Counter()
        self.rejected_by_code: Counter[str] = Counter()
        self.uploads_in_progress = 0  # uploads occupying a staging slot
        self.updates_waiting = 0  # validated updates handed to the aggregation loop, not yet done
        self.in_flight_updates: set[tuple[str, str]] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggregation")
        self._slots: asyncio.Queue[StagingSlot] | None = None
        self._changed = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self.closing = False

    # ------------------------------------------------------------------ the aggregation loop

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the aggregation thread, after every call queued before it."""
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._executor, fn, *args)
        self._after_call()
        return result

    def _after_call(self) -> None:
        """Publish a new snapshot if the version moved, wake waiting job streams, re-arm timers."""
        strategy = self.strategy
        if strategy is None:
            return
        if not self.snapshots or next(reversed(self.snapshots)) != strategy.version:
            self._retain(
                Snapshot(
                    strategy.version,
                    strategy.global_model(),
                    self.clock(),
                    strategy.global_buffers(),
                )
            )
            self._changed.set()
            self._changed = asyncio.Event()
        self._arm_timer()

    def notify(self) -> None:
        """Wake job streams waiting for a state change (a registration, a round opening)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, timeout: float) -> None:
        """Return after the next state change or `timeout` seconds."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.strategy.next_deadline() if self.strategy is not None else None
        if deadline is None or self.closing:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, deadline - self.clock())
        self._timer = loop.call_later(delay, lambda: loop.create_task(self._fire_timer()))

    async def _fire_timer(self) -> None:
        if self.strategy is None or self.closing:
            return
        strategy = self.strategy
        await self.call(lambda: strategy.on_timer(self.clock()))
        self.notify()

    # ------------------------------------------------------------------ model and versions

    def adopt(
        self, layout: ModelLayout, weights: torch.Tensor, buffers: torch.Tensor | None = None
    ) -> None:
        """Create the strategy from the first model (initial weights and float buffers become
        version 0)."""
        cfg = self.config
        self.strategy = make_strategy(
            cfg.strategy,
            layout=layout,
            initial=weights,
            initial_buffers=buffers,
            config=cfg.strategy_config,
            device=self.device,
            max_clients=cfg.max_clients,
        )
        if cfg.events_file:
            self.strategy.event_sink = EventLog(cfg.events_file)
        self.layout = layout
        self._slots = asyncio.Queue()
        for _ in range(cfg.max_concurrent_uploads):
            self._slots.put_nowait(staging_slot(layout, pin_memory=self.device.type == "cuda"))
        self._retain(
            Snapshot(0, self.strategy.global_model(), self.clock(), self.strategy.global_buffers())
        )
        log.info(
            "model adopted: %d parameters in %d tensors, layout %s, strategy %s",
            layout.numel, len(layout.names), layout.hash[:12], self.strategy.name,
        )  # fmt: skip

    def _retain(self, snap: Snapshot) -> None:
        self.snapshots[snap.version] = snap
        while len(self.snapshots) > self.config.retained_versions:
            self.snapshots.popitem(last=False)

    @property
    def version(self) -> int:
        return self.strategy.version if self.strategy is not None else 0

    def latest(self) -> Snapshot:
        return next(reversed(self.snapshots.values()))

    # ------------------------------------------------------------------ clients and slots

    def touch(self, client_id: str) -> None:
        """Renew a client's lease."""
        rec = self.clients.get(client_id)
        if rec is not None:
            rec.lease_expires = self.clock() + self.config.lease_seconds

    def active_clients(self) -> int:
        now = self.clock()
        return sum(1 for r in self.clients.values() if r.lease_expires >= now)

    async def acquire_slot(self) -> StagingSlot:
        """Wait for a free staging slot: the backpressure that bounds concurrent uploads."""
        assert self._slots is not None
        return await self._slots.get()

    def release_slot(self, slot: StagingSlot) -> None:
        assert self._slots is not None
        self._slots.put_nowait(slot)

    def queue_depth(self) -> int:
        """Validated updates waiting for (or being folded in by) the aggregation loop."""
        return self.updates_waiting

    def reject(self, code_name: str) -> None:
        self.counters["rejected"] += 1
        self.rejected_by_code[code_name] += 1

    async def close(self) -> None:
        self.closing = True
        if self._timer is not None:
            self._timer.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)


def payload_sizes(layout: ModelLayout, main: str) -> dict[str, int]:
    """Name -> elements of an upload: ``main`` ("update" or "weights", D) and, when the model has
    float buffers, "buffers" (B): every update and initial model must carry the statistics."""
    b = layout.buffer_numel
    return {main: layout.numel, **({"buffers": b} if b else {})}


def staging_slot(layout: ModelLayout, pin_memory: bool = False) -> StagingSlot:
    """A landing area for one upload of this model: [D] plus the [B] float buffers, if any."""
    b = layout.buffer_numel
    return StagingSlot(layout.numel, {"buffers": b} if b else None, pin_memory=pin_memory)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device
