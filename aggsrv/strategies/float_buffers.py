"""The global float buffers of a model (BatchNorm running statistics) and how clients' fold in.

Float buffers are not trained, so there is no gradient or delta to aggregate: every client sends
its buffers as absolute values with each update (docs/design.md "The flat layout": a separate [B]
section), and the server keeps one global [B] vector that jobs and GetModel hand out. How the
clients' vectors combine follows what the strategy does with the weights, so the statistics
describe the same mixture of clients as the parameters they normalise:

* ``"mean"`` (FedAvg, FedProx, FedEN, FedBuff, CA2FL): the weighted mean of the buffers of the
  updates folded into a version, with the strategy's own weights (samples for FedAvg, the
  staleness weight for FedBuff); a version that folds in nothing keeps the old buffers.
* ``"latest"`` (MIFA, Fed-OGD): the uniform mean of every client's latest buffers, as those
  strategies average their latest-update cache.
* ``"own"`` (FedAsync, ORTHOFL): the strategy sets the new vector itself (a moving average with
  the same coefficient as the weights).

Like the model, a published buffer vector is never written again: each change makes a new
tensor, so jobs and snapshots may share it without copies. B is small (BatchNorm statistics
are ~0.1% of a ResNet's parameters), so sums are kept in float64 and nothing is recycled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from aggsrv.strategies.state_copy import restore_tensor

__all__ = ["BUFFER_RULES", "FloatBuffers"]

BUFFER_RULES = ("mean", "latest", "own")


class FloatBuffers:
    """The global [B] float buffers of one strategy plus what is pending for the next version."""

    def __init__(self, initial: torch.Tensor | None, numel: int, device: torch.device, rule: str):
        """``initial`` [B] (copied to float32 on ``device``); None only when ``numel`` is 0."""
        if rule not in BUFFER_RULES:
            raise ValueError(f"buffer rule must be one of {BUFFER_RULES}, got {rule!r}")
        self.rule = rule
        self.numel = numel
        self.device = device
        if numel == 0:
            if initial is not None and initial.numel() != 0:
                raise ValueError(
                    f"initial_buffers has {initial.numel()} elements but the layout has no float "
                    "buffers"
                )
            self.current: torch.Tensor | None = None
        else:
            if initial is None:
                raise ValueError(
                    f"the layout has {numel} float buffer elements (BatchNorm statistics): pass "
                    "initial_buffers"
                )
            if initial.dim() != 1 or initial.numel() != numel:
                raise ValueError(
                    f"initial_buffers must be a flat [{numel}] tensor, got {tuple(initial.shape)}"
                )
            if not bool(torch.isfinite(initial).all()):
                raise ValueError("initial_buffers contain NaN or Inf")
            self.current = initial.detach().to(device=device, dtype=torch.float32, copy=True)
        self._own: torch.Tensor | None = None  # "own": set for the next version, not yet in it
        self._sum: torch.Tensor | None = None  # "mean": float64 sum of weight * buffers
        self._weight = 0.0
        self._latest: dict[str, torch.Tensor] = {}  # "latest": client id -> its buffers

    @property
    def enabled(self) -> bool:
        """True when the model has float buffers."""
        return self.numel > 0

    def add(self, buffers: torch.Tensor, weight: float) -> None:
        """("mean") Fold ``weight * buffers`` into the next version's mean."""
        if not self.enabled or weight <= 0:
            return
        if self._sum is None:
            self._sum = torch.zeros(self.numel, dtype=torch.float64, device=self.device)
        self._sum.add_(buffers.to(torch.float64), alpha=float(weight))
        self._weight += float(weight)

    def remember(self, client_id: str, buffers: torch.Tensor) -> None:
        """("latest") Keep a copy of a client's buffers (its previous ones are replaced)."""
        if self.enabled:
            self._latest[client_id] = buffers.detach().to(torch.float32, copy=True)

    def forget(self, client_id: str) -> None:
        """("latest") Drop a client's remembered buffers."""
        self._latest.pop(client_id, None)

    def set(self, new: torch.Tensor) -> None:
        """("own") Make ``new`` (a tensor nobody writes again) the global buffers of the next
        version: they replace :attr:`current` when the version is published (:meth:`commit`)."""
        self._own = new

    @property
    def pending(self) -> torch.Tensor | None:
        """("own") The buffers :meth:`set` for the next version, not yet published."""
        return self._own

    def discard(self) -> None:
        """Forget what :meth:`set` staged (the update that computed it was refused)."""
        self._own = None

    def commit(self) -> None:
        """A version is being published: fold what is pending into a new global vector."""
        if not self.enabled:
            return
        if self._own is not None:
            self.current, self._own = self._own, None
        elif self.rule == "mean" and self._sum is not None and self._weight > 0:
            self.current = (self._sum / self._weight).to(torch.float32)
            self._sum = None
            self._weight = 0.0
        elif self.rule == "latest" and self._latest:
            stacked = torch.stack([b.to(torch.float64) for b in self._latest.values()])
            self.current = stacked.mean(dim=0).to(torch.float32)

    # --------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Plain values and tensors (the caller clones them)."""
        return {
            "rule": self.rule,
            "current": self.current,
            "sum": self._sum,
            "weight": self._weight,
            "latest": dict(self._latest),
        }

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        copy: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        """Restore :meth:`state_dict` output; ``copy(t, dtype)`` puts a saved tensor on the
        device (the strategy's shared copier, so jobs and the current buffers share again)."""
        if state["rule"] != self.rule:
            raise ValueError(f"saved buffer rule {state['rule']!r} is not {self.rule!r}")

        def dev(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
            if t is not None and tuple(t.shape) != (self.numel,):  # the one check beyond a copy
                raise ValueError(
                    f"saved float buffers have shape {tuple(t.shape)}, the layout B={self.numel}"
                )
            return restore_tensor(t, self.device, dtype, copy)

        current = dev(state["current"], torch.float32)
        if self.enabled and current is None:
            raise ValueError("saved state has no float buffers but the layout has some")
        self.current = current
        self._sum = dev(state["sum"], torch.float64)
        self._weight = float(state["weight"])
        latest = {str(c): dev(b, torch.float32) for c, b in state["latest"].items()}
        self._latest = {c: b for c, b in latest.items() if b is not None}
