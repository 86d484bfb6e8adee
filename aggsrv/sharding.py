"""Shards of the flat layout, and the reductions that let shards act as one server (issue 9).

A sharded federation splits the flat [D] vector (docs/design.md "The flat layout") into N contiguous
slices, one per server process. A cut may fall inside a tensor, so a layer that holds most of
the parameters is still split evenly. Each shard keeps its slice of every [D] and [K, D] tensor.

A shard's offset tables keep all L segments, clipped to its slice: a segment the slice does not
touch has length 0 there, and a segment cut by the slice keeps only the part inside it. Per-
segment partial sums (dots, Gram matrices, squared norms) that a shard computes are therefore
indexed like the whole model's, and summing them over the shards gives the whole model's values.
A :class:`Reducer` does that sum: every shard then derives the same coefficients and takes the
same decisions from its slice.

This module imports torch and aggsrv.layout only (``torch.distributed`` when a
:class:`TorchReducer` is made).
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from aggsrv.layout import ModelLayout, TensorSpec

__all__ = [
    "LocalReducer", "LoggedReducer", "Reducer", "ShardLayout", "ShardMap", "SumsMismatch",
    "TorchReducer", "decode_sums", "encode_sums",
]  # fmt: skip

# Cuts fall on multiples of this many elements (256 bytes of float32): whole cache lines and
# vector registers on every shard; a slice is still within ALIGN elements of D / N.
ALIGN = 64


@dataclass(frozen=True)
class ShardMap:
    """The cut points of a flat [D] vector into N contiguous slices: shard r holds
    ``[bounds[r], bounds[r + 1])``. Slices may be empty (D < N * ALIGN)."""

    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        b = self.bounds
        if len(b) < 2 or b[0] != 0:
            raise ValueError(f"shard bounds must start at 0 and name at least one shard, got {b}")
        if any(int(x) != x or x < 0 for x in b) or any(b[i] > b[i + 1] for i in range(len(b) - 1)):
            raise ValueError(f"shard bounds must be non-decreasing integers, got {b}")

    @classmethod
    def even(cls, numel: int, shards: int, align: int = ALIGN) -> ShardMap:
        """N slices of as equal length as cuts on multiples of ``align`` allow."""
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if numel < 0 or align < 1:
            raise ValueError(f"numel must be >= 0 and align >= 1, got {numel} and {align}")
        cuts = [min(numel, round(numel * r / shards / align) * align) for r in range(1, shards)]
        return cls((0, *cuts, numel))

    @property
    def shards(self) -> int:
        """N, the number of shards."""
        return len(self.bounds) - 1

    @property
    def numel(self) -> int:
        """D, the length of the whole flat vector."""
        return self.bounds[-1]

    def slice(self, rank: int) -> tuple[int, int]:
        """``(lo, hi)``: the part of the flat vector that shard ``rank`` holds."""
        if not 0 <= rank < self.shards:
            raise ValueError(f"rank must be in [0, {self.shards}), got {rank}")
        return self.bounds[rank], self.bounds[rank + 1]

    def local_numel(self, rank: int) -> int:
        """The length of shard ``rank``'s slice."""
        lo, hi = self.slice(rank)
        return hi - lo

    def local_offsets(self, offsets: torch.Tensor | Sequence[int], rank: int) -> torch.Tensor:
        """A whole-model offset table (int64 [L+1] over [0, D]) as shard ``rank`` sees it: the
        same L segments clipped to its slice, in local coordinates (lengths 0 outside it)."""
        offs = torch.as_tensor(offsets, dtype=torch.int64)
        if offs.dim() != 1 or offs.numel() < 2 or int(offs[0]) != 0 or int(offs[-1]) != self.numel:
            raise ValueError(
                f"offsets must be an int64 [L+1] table from 0 to D = {self.numel}, got "
                f"{offs.tolist()[:4]}..."
            )
        lo, hi = self.slice(rank)
        return offs.clamp(lo, hi) - lo

    def owner(self, index: int) -> int:
        """The shard holding element ``index`` of the flat vector."""
        if not 0 <= index < self.numel:
            raise IndexError(f"index {index} outside [0, {self.numel})")
        return bisect.bisect_right(self.bounds, index) - 1  # empty slices share a bound

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` ([D] or [K, D], the last dimension split) per shard."""
        if flat.shape[-1] != self.numel:
            raise ValueError(f"last dimension {flat.shape[-1]} is not D = {self.numel}")
        return [flat[..., lo:hi] for lo, hi in zip(self.bounds, self.bounds[1:], strict=False)]

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole [D] (or [K, D]) tensor from one slice per shard."""
        if len(parts) != self.shards:
            raise ValueError(f"{len(parts)} parts for {self.shards} shards")
        for rank, part in enumerate(parts):
            if part.shape[-1] != self.local_numel(rank):
                raise ValueError(
                    f"part {rank} has {part.shape[-1]} elements, the shard {self.local_numel(rank)}"
                )
        return torch.cat(list(parts), dim=-1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what a client learns at registration)."""
        return {"bounds": list(self.bounds)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardMap:
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(int(b) for b in data["bounds"]))


class ShardLayout:
    """What a strategy on shard ``rank`` sees of the model: its slice of the flat vector with
    the whole model's L segments clipped to it (:meth:`ShardMap.local_offsets`), the whole
    model's names, shapes, norm flags and hash, and the float buffers (BatchNorm statistics,
    about 0.1% of a model) on rank 0 only.

    It answers the attributes strategies read from a :class:`ModelLayout` (``numel``,
    ``offsets``, ``module_offsets``, ``is_norm``, ``hash`` and the buffer section); ``whole``
    is the model's layout, for quantities of whole tensors (FedDGIC's module sizes)."""

    def __init__(self, whole: ModelLayout, shard_map: ShardMap, rank: int) -> None:
        if shard_map.numel != whole.numel:
            raise ValueError(
                f"the shard map covers {shard_map.numel} elements, the layout {whole.numel}"
            )
        self.whole = whole
        self.shard_map = shard_map
        self.rank = rank
        self.start, self.end = shard_map.slice(rank)
        self.numel = self.end - self.start
        self.offsets = shard_map.local_offsets(whole.offsets, rank)
        self.module_offsets = shard_map.local_offsets(whole.module_offsets, rank)
        self.is_norm = whole.is_norm
        self.hash = whole.hash
        self.names = whole.names
        self.shapes = whole.shapes
        own_buffers = rank == 0
        self.buffer_specs: tuple[TensorSpec, ...] = whole.buffer_specs if own_buffers else ()
        self.buffer_numel = whole.buffer_numel if own_buffers else 0
        self.buffer_offsets = (
            whole.buffer_offsets if own_buffers else torch.zeros(1, dtype=torch.int64)
        )

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        """This shard's slice (a view) of a whole-model [D] or [K, D] tensor."""
        return self.shard_map.split(flat)[self.rank]

    def __repr__(self) -> str:
        return (
            f"ShardLayout(rank {self.rank} of {self.shard_map.shards}: [{self.start}, {self.end}) "
            f"of D={self.whole.numel}, L={len(self.names)})"
        )


class Reducer(Protocol):
    """Sums partial results over the shards of one federation.

    ``sum_(t)`` replaces ``t`` in place by the elementwise sum of every shard's ``t`` (all
    shards call it with tensors of the same shape and dtype, in the same order) and returns it.
    The sum's order is fixed for a given number of shards, so results repeat run to run.
    """

    rank: int
    world_size: int

    def sum_(self, t: torch.Tensor) -> torch.Tensor: ...


class LocalReducer:
    """One shard, the whole model: the sum over shards is the tensor itself."""

    rank = 0
    world_size = 1

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t


class TorchReducer:
    """The sum over the processes of a ``torch.distributed`` group (gloo for CPU tensors, NCCL
    for CUDA ones): one ``all_reduce(SUM)`` per call.

    Float32 partial sums are reduced in float64 (a copy), so the sum over shards adds no
    float32 rounding of its own; float64 tensors are reduced in place.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group first "
                "(aggsrv serve --shards does)"
            )
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        if t.dtype == torch.float64 or not t.is_floating_point():
            self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self.group)
            return t
        wide = t.to(torch.float64)
        self._dist.all_reduce(wide, op=self._dist.ReduceOp.SUM, group=self.group)
        return t.copy_(wide)


def imbalance(shard_map: ShardMap) -> float:
    """The largest slice over the mean slice (1.0: perfectly even)."""
    sizes = [shard_map.local_numel(r) for r in range(shard_map.shards)]
    mean = shard_map.numel / shard_map.shards
    return max(sizes) / mean if mean > 0 else math.nan


class SumsMismatch(RuntimeError):
    """A replayed call asked for other sums than the live call reduced: the replay diverged."""


class LoggedReducer:
    """A shard's reducer that keeps what each sum over the shards returned, so that a shard can
    later replay a call alone, with no other shard to sum with.

    Live (:meth:`connect`), :meth:`sum_` sums through the group and keeps a copy of the result;
    rank 0 logs a call's copies with the call's record (:meth:`take`). A sum is the same on
    every shard, so rank 0's log holds every shard's. Replaying a call (:meth:`replaying`),
    :meth:`sum_` hands back the logged results in order instead, and the replayed call takes the
    same decisions bit for bit.
    """

    def __init__(self, rank: int, world_size: int, keep: bool = True) -> None:
        """``keep``: keep the results (rank 0, which logs them); the other shards need not."""
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self._inner: Reducer | None = None
        self._kept: list[torch.Tensor] = []
        self._logged: list[torch.Tensor] | None = None  # while replaying: what is left

    def connect(self, inner: Reducer) -> None:
        """Sum live through ``inner`` (the shards' group, once it is formed)."""
        self._inner = inner

    def take(self) -> list[torch.Tensor]:
        """The results summed since the last take."""
        kept, self._kept = self._kept, []
        return kept

    @contextlib.contextmanager
    def replaying(self, results: Sequence[torch.Tensor]) -> Iterator[None]:
        """Within the block, sums return ``results`` in order (a logged call's); every one of
        them must be used."""
        if self._logged is not None:
            raise RuntimeError("a replay is running already")
        self._logged = list(results)
        try:
            yield
            if self._logged:
                raise SumsMismatch(
                    f"the replayed call summed {len(results) - len(self._logged)} times over the "
                    f"shards, the live one {len(results)} times"
                )
        finally:
            self._logged = None

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        logged = self._logged
        if logged is not None:
            if not logged:
                raise SumsMismatch(f"the replayed call summed a {tuple(t.shape)} tensor more "
                                   "than the live one did")  # fmt: skip
            result = logged.pop(0)
            if result.shape != t.shape or result.dtype != t.dtype:
                raise SumsMismatch(
                    f"the replayed call summed a {t.dtype} {tuple(t.shape)} tensor where the "
                    f"live one summed a {result.dtype} {tuple(result.shape)} one"
                )
            return t.copy_(result)
        if self._inner is None:
            raise RuntimeError("a sum over the shards before they formed their group")
        out = self._inner.sum_(t)
        if self.keep:
            self._kept.append(out.detach().to("cpu", copy=True))
        return out


def encode_sums(results: Sequence[torch.Tensor]) -> list[list[Any]]:
    """Sums as plain JSON values (a log record's meta): [dtype, shape, base64 of the bytes]."""
    return [
        [str(t.dtype).removeprefix("torch."), list(t.shape),
         base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")]
        for t in results
    ]  # fmt: skip


def decode_sums(encoded: Sequence[Sequence[Any]]) -> list[torch.Tensor]:
    """The tensors :func:`encode_sums` wrote, bit for bit."""
    out = []
    for dtype_name, shape, data in encoded:
        dtype = getattr(torch, str(dtype_name))
        raw = bytearray(base64.b64decode(data))
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out.append(flat.reshape([int(n) for n in shape]).clone())
    return out
