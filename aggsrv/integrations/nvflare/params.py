"""NVIDIA FLARE's parameter dicts <-> aggsrv's flat rows.

A FLARE ``FLModel`` carries its parameters as a dict of name -> array: NumPy arrays with the
NumPy exchange format, torch tensors with the PyTorch one, lazy references (``materialize()``)
when the server offloads streamed tensors to disk. :class:`ParamsLayout` is the first reply's
dict read once: its floating-point entries, in dict order, are laid end to end as one flat
vector of D values (what the aggsrv kernels aggregate); its other entries (``num_batches_tracked``
and other counters) are kept aside and passed through from one reply, as FLARE's own mean leaves
integer entries to the first contribution's dtype rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["ParamsLayout", "ParamsMismatchError", "materialized"]


class ParamsMismatchError(ValueError):
    """A reply's parameters do not match the layout of the round (names, shapes or kinds)."""


def materialized(value: Any) -> Any:
    """The array behind a FLARE lazy reference (disk offload), or the value itself."""
    materialize = getattr(value, "materialize", None)
    return materialize() if callable(materialize) else value


def as_tensor(value: Any, name: str) -> torch.Tensor:
    """A CPU tensor view of a NumPy array or torch tensor (no copy where the dtype allows)."""
    value = materialized(value)
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise ParamsMismatchError(f"parameter {name!r} is an object array, not numbers")
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, (int, float, np.number)):
        return torch.as_tensor(np.asarray(value))
    raise ParamsMismatchError(
        f"parameter {name!r} is a {type(value).__name__}, not a NumPy array or torch tensor"
    )


@dataclass(frozen=True)
class Entry:
    """One float parameter's place in the flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class ParamsLayout:
    """Where each floating-point entry of a parameter dict sits in the flat [D] vector.

    ``numpy`` says which kind of arrays the round carries, so :meth:`to_params` answers in it.
    """

    def __init__(
        self, entries: list[Entry], kept: tuple[str, ...], numpy: bool, order: tuple[str, ...]
    ) -> None:
        self.entries = entries
        self.kept = kept
        self.numpy = numpy
        self.order = order
        self.numel = sum(e.numel for e in entries)
        self._names = {e.name for e in entries}

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> ParamsLayout:
        """The layout of one reply's parameter dict."""
        if not isinstance(params, Mapping) or not params:
            raise ParamsMismatchError("the reply has no parameters (an empty or missing dict)")
        entries: list[Entry] = []
        kept: list[str] = []
        offset = 0
        numpy = True
        for name, value in params.items():
            t = as_tensor(value, name)
            if t.is_floating_point():
                numpy = numpy and isinstance(materialized(value), np.ndarray)
                entries.append(Entry(name, tuple(t.shape), offset, t.numel()))
                offset += t.numel()
            else:
                kept.append(name)
        if not entries:
            raise ParamsMismatchError("the reply has no floating-point parameters to aggregate")
        return cls(entries, tuple(kept), numpy, tuple(params))

    def check(self, params: Mapping[str, Any]) -> None:
        """Refuse a dict with other names than the layout's (another model, a partial reply)."""
        if not isinstance(params, Mapping):
            raise ParamsMismatchError(f"the reply's parameters are a {type(params).__name__}")
        names = set(params)
        missing = [e.name for e in self.entries if e.name not in names]
        missing += [n for n in self.kept if n not in names]
        unknown = [n for n in params if n not in self._names and n not in self.kept]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}")
            if unknown:
                parts.append(f"unknown {unknown[:4]}{'...' if len(unknown) > 4 else ''}")
            raise ParamsMismatchError(
                f"the reply's parameters differ from the round's ({'; '.join(parts)}): a "
                "different model?"
            )

    def tensors(self, params: Mapping[str, Any]):
        """(entry, tensor) for every float entry, each shape checked against the layout."""
        self.check(params)
        for e in self.entries:
            t = as_tensor(params[e.name], e.name)
            if tuple(t.shape) != e.shape:
                raise ParamsMismatchError(
                    f"parameter {e.name!r} has shape {tuple(t.shape)}, the round's {e.shape}"
                )
            if not t.is_floating_point():
                raise ParamsMismatchError(
                    f"parameter {e.name!r} is {t.dtype}, the round's is floating point"
                )
            yield e, t

    def to_flat(self, params: Mapping[str, Any]) -> torch.Tensor:
        """The dict's float entries as one flat float32 [D] tensor, checked as :meth:`tensors`."""
        flat = torch.empty(self.numel, dtype=torch.float32)
        for e, t in self.tensors(params):
            flat[e.offset : e.offset + e.numel].copy_(t.reshape(-1))
        return flat

    def to_params(self, flat: torch.Tensor, kept: Mapping[str, Any]) -> dict[str, Any]:
        """The flat [D] vector as a parameter dict in the layout's order (float32 views of
        ``flat``: no copy), with the kept entries from ``kept``."""
        flat = flat.detach().to("cpu", torch.float32).contiguous()
        floats: dict[str, Any] = {}
        for e in self.entries:
            part = flat[e.offset : e.offset + e.numel].view(e.shape)
            floats[e.name] = part.numpy() if self.numpy else part
        return {
            name: floats[name] if name in floats else materialized(kept[name])
            for name in self.order
        }
