"""Evaluation while serving: an operator's ``module:function`` run on the global model every N
versions, on its own thread so aggregation never waits for it.

The hook is called as ``fn(state_dict)`` with the global model's named tensors (the trainable
parameters and the float buffers, CPU, float32; copies the hook may keep) and returns a mapping
of metric names to numbers, e.g. ``{"accuracy": 0.91, "loss": 0.27}``.
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

    def poll(self) -> None:
        """Start an evaluation if one is due and none is running (event-loop thread)."""
        fed = self.fed
        if fed.strategy is None or not fed.snapshots or fed.closing:
            return
        if self._running is not None and not self._running.done():
            return
        snap = fed.versions.latest()
        if snap.version < self._next:
            return
        self._next = (snap.version // self.every + 1) * self.every
        loop = asyncio.get_running_loop()
        lease = fed.versions.lease_snapshot(snap)  # held while the evaluation reads the weights
        self._running = loop.run_in_executor(self._pool, self._evaluate, snap)
        self._running.add_done_callback(lambda _: lease.release())
        self._running.add_done_callback(lambda f: self._done(snap.version, f))

    def _evaluate(self, snap: Snapshot) -> dict[str, float]:
        layout = self.fed.layout
        assert layout is not None
        state = {k: v.detach().cpu().clone() for k, v in layout.unflatten(snap.weights).items()}
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
