"""Recycling the [D] buffers of retired model versions.

Every accepted update that makes a new version needs a fresh [D] tensor: the current one is a
published snapshot that job and model streams may still be reading. Allocating it anew costs
more than the arithmetic on a large model (a 64 MB tensor from the OS is 16K page faults, each
zeroing a page: ~12 ms here, against ~5 ms for the fused update itself), so retired versions
are kept as candidates and reused once nothing else refers to them.

"Nothing else" is checked twice, because readers may hold the tensor object (snapshots, jobs,
stream generators) or only views of its memory (slices, numpy arrays being encoded): the
Python reference count of the tensor and the use count of its storage must both be the pool's
own. Where the storage count cannot be read (a torch without the private hook), nothing is
recycled and every version is a fresh allocation, as before.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["VersionBuffers"]

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class VersionBuffers:
    """A pool of [numel] float32 buffers on one device for successive model versions.

    ``retire(t)`` hands over a version that was just replaced (it stays readable by whoever
    holds it); ``take()`` returns a buffer nobody else refers to: a recycled candidate or a new
    allocation. At most ``max_candidates`` retired versions are watched; older ones are let go
    (freed when their last reader drops them), so the pool never holds more than that.
    """

    def __init__(
        self, numel: int, device: torch.device, max_candidates: int = 32, max_spares: int = 2
    ) -> None:
        self.numel = numel
        self.device = device
        self.max_candidates = max_candidates
        # Candidates nobody else refers to cost memory of their own: keep this many for reuse
        # and let the rest go (those still read by others cost nothing extra while watched).
        self.max_spares = max_spares
        self._candidates: list[torch.Tensor] = []
        self.recycled = 0  # buffers handed out again (diagnostics, tests)
        self.allocated = 0
        # The references a candidate has when only the pool holds it, measured through the same
        # path take() uses (list slot, loop variable, argument), so no interpreter detail of
        # getrefcount is hard-coded.
        probe = [torch.empty(0)]
        c = probe[0]
        self._own_refs = self._refs(c)

    @staticmethod
    def _refs(t: torch.Tensor) -> int:
        return sys.getrefcount(t)

    def _unreferenced(self, c: torch.Tensor) -> bool:
        """True if only the pool refers to candidate `c` (its object and its memory)."""
        if _storage_use_count is None or self._refs(c) > self._own_refs + 1:
            return False  # +1: this method's own argument
        storage = c.untyped_storage()  # one more reference to the storage while we look
        return _storage_use_count(storage._cdata) <= 2

    def retire(self, t: torch.Tensor) -> None:
        """Watch `t`, a replaced version, for reuse (ignored unless it is a whole pool-shaped
        contiguous buffer that owns its memory)."""
        if (
            t.shape != (self.numel,)
            or t.dtype != torch.float32
            or t.device != self.device
            or not t.is_contiguous()
            or t._base is not None
            or t.untyped_storage().nbytes() != self.numel * 4
        ):
            return
        if any(c is t for c in self._candidates):
            return
        self._candidates.append(t)
        if len(self._candidates) > self.max_candidates:
            del self._candidates[0]
        self.trim()

    def trim(self) -> None:
        """Let go of the unreferenced candidates beyond ``max_spares`` (the oldest first), so
        that versions whose last reader went away (an expired job, a dropped snapshot) are
        freed rather than kept for reuse."""
        # Indexing, not enumerate(): its reused result tuple would hold one more reference.
        pool = self._candidates
        spares = [i for i in range(len(pool)) if self._unreferenced(pool[i])]
        for i in reversed(spares[: max(0, len(spares) - self.max_spares)]):
            del self._candidates[i]

    def take(self) -> torch.Tensor:
        """A [numel] float32 buffer (uninitialised) that nobody else refers to."""
        for i in range(len(self._candidates)):
            c = self._candidates[i]
            if self._unreferenced(c):
                del self._candidates[i]
                self.recycled += 1
                return c
        self.allocated += 1
        return torch.empty(self.numel, dtype=torch.float32, device=self.device)

    def clear(self) -> None:
        """Let every candidate go (e.g. after loading a state)."""
        self._candidates.clear()

    def __len__(self) -> int:
        return len(self._candidates)
