"""Recycling the [D] buffers of retired model versions, under explicit leases.

Every accepted update that makes a new version needs a fresh [D] tensor: the current one is a
published snapshot that job and model streams may still be reading. Allocating it anew costs
more than the arithmetic on a large model (a 64 MB tensor from the OS is 16K page faults, each
zeroing a page: ~12 ms here, against ~5 ms for the fused update itself), so the buffers of
retired versions are reused.

A buffer is reused only when its version is retired (its owner, the strategy, replaced it) and
no lease on it is held. Whoever reads a version tensor beyond the call that handed it out holds
a lease while it reads: a job for as long as it is outstanding, a retained snapshot, a model or
job stream, a host copy, an evaluation. A lease is taken on a tensor or any view of it (the key
is its storage), and only while the buffer is still safe to read: by the owner, or by a reader
that holds a lease already (a retained snapshot's) when it takes its own.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["Lease", "VersionBuffers"]


class _Entry:
    """A buffer under lease: the tensor (kept alive, so its address is not reused while the
    entry exists), its lease count, and whether its version was retired."""

    __slots__ = ("leases", "retired", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.leases = 0
        self.retired = False


class Lease:
    """Held version buffers; :meth:`release` (or leaving a ``with`` block) gives them back.
    Releasing twice is a no-op, so a reader can release in every exit path."""

    __slots__ = ("_keys", "_pool")

    def __init__(self, pool: VersionBuffers | None, keys: tuple[int, ...]) -> None:
        self._pool = pool
        self._keys = keys

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._release(self._keys)

    @property
    def held(self) -> bool:
        return self._pool is not None and bool(self._keys)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


NO_LEASE = Lease(None, ())


class VersionBuffers:
    """A pool of [numel] float32 buffers on one device for successive model versions.

    ``take()`` returns a buffer nobody reads: a spare (a retired, unleased buffer) or a new
    allocation. ``retire(t)`` hands back a version that was replaced: a spare at once if no
    lease is held on it, else when the last lease is released. ``lease(*tensors)`` holds
    buffers against reuse. At most ``max_spares`` spares are kept; others are let go.

    Thread-safe: the strategy takes and retires on the aggregation thread, readers lease and
    release on the event loop and in copy threads.
    """

    def __init__(self, numel: int, device: torch.device, max_spares: int = 2) -> None:
        self.numel = numel
        self.device = torch.device(device)
        self.max_spares = max_spares
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}  # storage address -> buffer under lease
        self._spares: list[torch.Tensor] = []
        self.recycled = 0  # buffers handed out again (diagnostics, tests)
        self.allocated = 0

    def _key(self, t: torch.Tensor) -> int | None:
        """The storage address of ``t`` if it can be a pool buffer (or a view of one)."""
        if t.device != self.device or t.dtype != torch.float32:
            return None
        storage = t.untyped_storage()
        if storage.nbytes() != self.numel * 4:
            return None
        return storage.data_ptr()

    def _whole(self, t: torch.Tensor) -> bool:
        return (
            self._key(t) is not None
            and t.shape == (self.numel,)
            and t.is_contiguous()
            and t._base is None
            and t.storage_offset() == 0
        )

    def lease(self, *tensors: torch.Tensor | None) -> Lease:
        """Hold these tensors' buffers against reuse until the lease is released (tensors that
        cannot be pool buffers, and None, are ignored)."""
        keys = []
        with self._lock:
            for t in tensors:
                if t is None:
                    continue
                key = self._key(t)
                if key is None:
                    continue
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry(t)
                    # A spare leased again (its reader took the lease late): not reused now.
                    for i, s in enumerate(self._spares):
                        if s.untyped_storage().data_ptr() == key:
                            entry.tensor, entry.retired = self._spares.pop(i), True
                            break
                entry.leases += 1
                keys.append(key)
        return Lease(self, tuple(keys)) if keys else NO_LEASE

    def _release(self, keys: tuple[int, ...]) -> None:
        with self._lock:
            for key in keys:
                entry = self._entries[key]
                entry.leases -= 1
                if entry.leases == 0:
                    del self._entries[key]
                    if entry.retired:
                        self._spare(entry.tensor)

    def _spare(self, t: torch.Tensor) -> None:
        """(lock held) Keep a retired, unleased whole buffer for reuse, if there is room."""
        room = len(self._spares) < self.max_spares
        if room and self._whole(t) and not any(s is t for s in self._spares):
            self._spares.append(t)

    def retire(self, t: torch.Tensor) -> None:
        """``t``, a version its owner replaced (or a scratch buffer it no longer needs), may be
        reused once no lease on it is held (ignored unless it is a whole pool-shaped buffer)."""
        if not self._whole(t):
            return
        with self._lock:
            entry = self._entries.get(t.untyped_storage().data_ptr())
            if entry is not None:
                entry.retired = True
                if entry.tensor._base is not None or entry.tensor.shape != (self.numel,):
                    entry.tensor = t  # the spare is the whole buffer, not a reader's view
            else:
                self._spare(t)

    def take(self) -> torch.Tensor:
        """A [numel] float32 buffer (uninitialised) that nobody reads."""
        with self._lock:
            if self._spares:
                self.recycled += 1
                return self._spares.pop()
            self.allocated += 1
        return torch.empty(self.numel, dtype=torch.float32, device=self.device)

    def leased(self, t: torch.Tensor) -> int:
        """How many leases are held on ``t``'s buffer (diagnostics, tests)."""
        key = self._key(t)
        with self._lock:
            entry = self._entries.get(key) if key is not None else None
            return entry.leases if entry is not None else 0

    def clear(self) -> None:
        """Let the spares go (e.g. after loading a state); leases stay held."""
        with self._lock:
            self._spares.clear()

    def __len__(self) -> int:
        """The spares kept for reuse."""
        return len(self._spares)
