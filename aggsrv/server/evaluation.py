"""Evaluation while serving: an operator's ``module:function`` run on the global model every N
versions, on its own thread so aggregation never waits for it.

The hook is called as ``fn(state_dict)`` with the global model's named tensors (the trainable
parameters and the float buffers, CPU, float32; copies the hook may keep) and returns a mapping
of metric names to numbers, e.g. ``{"accuracy": 0.91, "loss": 0.27}``.

A sharded federation evaluates on rank 0: it fetches the other shards' slices of the version over
gRPC (aggsrv.server.relay, as for a whole GetModel), on the event loop and never on the
aggregation thread, then runs the hook on the same whole model one server would hold. The other
shards do not evaluate.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from aggsrv.imports import load_callable
from aggsrv.server.relay import ShardLinks, service_token
from aggsrv.v1 import aggregation_pb2 as pb

if TYPE_CHECKING:
    from aggsrv.server.federation import Federation, Snapshot

log = logging.getLogger(__name__)
EvalHook = Callable[[dict[str, torch.Tensor]], Mapping[str, float]]


def load_hook(spec: str) -> EvalHook:
    """Import ``package.module:function``; ValueError naming what is missing."""
    return load_callable(spec, "eval hook")


class Evaluator:
    """Runs the hook on the newest snapshot whenever the version passed the next multiple of
    ``every``; one evaluation at a time (versions that pass meanwhile are skipped, not queued)."""

    def __init__(self, federation: Federation, hook: EvalHook, every: int) -> None:
        self.fed = federation
        self.hook = hook
        self.every = every
        self._next = 0  # evaluate version 0 (the starting model) first
        self._running: asyncio.Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval")
        self._links: ShardLinks | None = None  # rank 0 of a sharded federation: the other shards
        self._metadata: list[tuple[str, str]] = []  # its credentials there

    def poll(self) -> None:
        """Start an evaluation if one is due and none is running (event-loop thread)."""
        fed = self.fed
        if fed.strategy is None or not fed.snapshots or fed.closing or fed.follower:
            return
        if self._running is not None and not self._running.done():
            return
        snap = fed.versions.latest()
        if snap.version < self._next:
            return
        self._next = (snap.version // self.every + 1) * self.every
        loop = asyncio.get_running_loop()
        lease = fed.versions.lease_snapshot(snap)  # held while the evaluation reads the weights
        if fed.shards is not None and fed.shards.world_size > 1:
            self._running = asyncio.ensure_future(self._evaluate_whole(snap))
        else:
            self._running = loop.run_in_executor(self._pool, self._evaluate, snap)
        self._running.add_done_callback(lambda _: lease.release())
        self._running.add_done_callback(lambda f: self._done(snap.version, f))

    async def _evaluate_whole(self, snap: Snapshot) -> dict[str, float]:
        """Rank 0 of a sharded federation: the version made whole from every shard's slice (the
        same tensors a whole GetModel streams), then the hook on the evaluation thread."""
        fed = self.fed
        if self._links is None:
            assert fed.shards is not None
            self._links = ShardLinks(fed.shards, fed.config)
            token = service_token(fed.config)
            self._metadata = [("authorization", f"Bearer {token}")] if token else []
        links = self._links
        own = await fed.versions.on_host(snap, False)
        ask = links.slice_request(pb.GetModelRequest(client_id="aggsrv-eval"), version=snap.version)
        whole = await links.whole("GetModel", ask, own, self._metadata)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._evaluate, snap, whole["weights"])

    def _evaluate(self, snap: Snapshot, weights: torch.Tensor | None = None) -> dict[str, float]:
        """The hook on ``snap`` (``weights``: its whole weights when the federation is sharded)."""
        layout = self.fed.layout
        assert layout is not None
        layout = layout.whole
        weights = snap.weights if weights is None else weights
        state = {k: v.detach().cpu().clone() for k, v in layout.unflatten(weights).items()}
        if snap.buffers is not None:
            state.update(
                {
                    k: v.detach().cpu().clone()
                    for k, v in layout.unflatten_buffers(snap.buffers).items()
                }
            )
        result = self.hook(state)
        if not isinstance(result, Mapping):
            raise TypeError(f"the eval hook returned {type(result).__name__}, not a mapping")
        metrics = {str(k): float(v) for k, v in result.items()}
        return {k: v for k, v in metrics.items() if math.isfinite(v)}

    def _done(self, version: int, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            log.error("eval hook failed on version %d: %s", version, exc, exc_info=exc)
            return
        metrics = fut.result()
        self.fed.last_eval = (version, metrics)
        self.fed.metrics.record_eval(version, metrics)
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
        fields = {"event": "eval", "version": version, "metrics": metrics}
        log.info("evaluation of version %d: %s", version, shown, extra=fields)

    async def close(self) -> None:
        running = self._running
        if running is not None and not running.done():
            await asyncio.wait([running])
        self._pool.shutdown(wait=False)
        if self._links is not None:
            await self._links.close()
