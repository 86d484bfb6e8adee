"""Point-in-time copies of a strategy's state that keep tensor sharing: a version's weights held
by fifty jobs are copied (and checkpointed) once, and shared again on restore."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SharedCopies", "clone_tensors", "restore_tensor"]


def restore_tensor(
    t: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    copy: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """A saved tensor as a fresh ``dtype`` tensor on ``device`` (None stays None); through
    ``copy(t, dtype)`` when given (a load's :class:`SharedCopies`, so that tensors that shared
    memory when saved share it again)."""
    if t is None:
        return None
    if copy is not None:
        return copy(t, dtype)
    return t.detach().to(device=device, dtype=dtype, copy=True)


def clone_tensors(obj: Any) -> Any:
    """Deep-copy the tensors of a nested state (dicts, lists) so it is a point-in-time record.

    Tensors that share memory share it in the copy too (each storage is copied once, over the
    bytes the state refers to): a version's weights held by fifty jobs are saved once, not fifty
    times, and :class:`SharedCopies` restores the sharing."""
    spans: dict[tuple[str, int], list[int]] = {}
    for t in _tensors_in(obj):
        if t.numel():
            lo, hi = _byte_extent(t)
            span = spans.setdefault(_storage_key(t), [lo, hi])
            span[0], span[1] = min(span[0], lo), max(span[1], hi)
    copies: dict[tuple[str, int], tuple[torch.UntypedStorage, int]] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if not t.numel():
            return t.clone()
        key = _storage_key(t)
        if key not in copies:
            lo, hi = spans[key]
            raw = torch.empty(0, dtype=torch.uint8, device=t.device)
            raw.set_(t.untyped_storage(), lo, (hi - lo,), (1,))
            copies[key] = (raw.clone().untyped_storage(), lo)
        storage, lo = copies[key]
        start = t.storage_offset() * t.element_size() - lo
        if start % t.element_size():  # views of one memory in dtypes that do not align
            return t.clone()
        return _view(storage, t, start // t.element_size())

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return clone(o)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return type(o)(walk(v) for v in o)
        return o

    return walk(obj)


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list | tuple):
            stack.extend(o)
    return out


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a non-empty tensor covers: [first, past the last)."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    size = t.element_size()
    return t.storage_offset() * size, (t.storage_offset() + last + 1) * size


def _view(storage: torch.UntypedStorage, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A tensor over ``storage`` with ``like``'s dtype, shape and strides at element ``offset``."""
    out = torch.empty(0, dtype=like.dtype, device=storage.device)
    return out.set_(storage, offset, like.shape, like.stride())


class SharedCopies:
    """Copies a loaded state's tensors onto a device, each storage once: tensors that shared
    memory when the state was saved share it again (as they did in the live strategy), so a
    restored server holds what the live one held. ``copy(t, dtype)`` is the restore's
    ``t.to(device, dtype, copy=True)``; a tensor converted to another dtype gets its own copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # storage key -> (the source storage, kept so its address is not reused; the copy)
        self._copies: dict[tuple[str, int], tuple[torch.UntypedStorage, torch.UntypedStorage]]
        self._copies = {}

    def __call__(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = t.detach()
        if (dtype is not None and t.dtype != dtype) or not t.numel():
            return t.to(device=self.device, dtype=dtype or t.dtype, copy=True)
        key = _storage_key(t)
        if key not in self._copies:
            source = t.untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8, device=t.device)
            raw.set_(source, 0, (source.nbytes(),), (1,))
            copy = raw.to(device=self.device, copy=True).untyped_storage()
            self._copies[key] = (source, copy)
        return _view(self._copies[key][1], t, t.storage_offset())
