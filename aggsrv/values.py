"""The value types clients, strategies and the server share.

What an update holds (:class:`UpdateKind`), how it was folded in (:class:`Status`,
:class:`Outcome`), what a client runs (:class:`Recipe`, :class:`ProjectionMode`) and an update as
a strategy receives it (:class:`Update`). They sit below the strategies in the layers, so a
client imports them without loading any strategy.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "FilterReason", "Outcome", "PendingReason", "ProjectionMode", "QuantizedValues", "Recipe",
    "Status", "Update", "UpdateKind",
]  # fmt: skip


class UpdateKind(enum.Enum):
    """What an update tensor holds: the client's final weights, or final minus start."""

    WEIGHTS = "WEIGHTS"
    DELTA = "DELTA"


class Status(enum.Enum):
    """How an update the strategy took was handled (docs/design.md "Outcome of an update"):
    folded in (APPLIED, BUFFERED), a replay (DUPLICATE), or its job consumed but the update
    left out by the strategy's update filter (FILTERED, with a :class:`FilterReason`)."""

    APPLIED = "APPLIED"
    BUFFERED = "BUFFERED"
    DUPLICATE = "DUPLICATE"
    FILTERED = "FILTERED"


class FilterReason(enum.IntEnum):
    """Why an update filter left an update out (Status.FILTERED). The numbers are the wire's
    (aggregation.proto ``FilterReason``; docs/wire.md "Filtered updates")."""

    UNSPECIFIED = 0
    NORM_OUTLIER = 1  # its delta's norm is far above the recent accepted updates' (norm filter)


class ProjectionMode(enum.Enum):
    """Client-side gradient projection against a basis (Fed-OGD); NONE for plain SGD."""

    NONE = "NONE"
    WHOLE = "WHOLE"
    LAYERWISE = "LAYERWISE"


@dataclass(frozen=True)
class Recipe:
    """What a client runs for a job: plain local SGD plus the optional per-algorithm terms.

    Exactly one of ``local_epochs`` and ``local_steps`` is set; ``work_target`` is that amount,
    which ``Update.work_done`` is measured against. ``projection`` and ``only_conflicting`` steer
    Fed-OGD's projection against the job's ``basis`` tensor; ``elastic_lambda``/``elastic_alpha``
    add FedEN's elastic-net penalty lambda*(alpha*|w-w0|_1 + (1-alpha)/2*|w-w0|^2); ``proximal_mu``
    adds FedProx's mu/2*|w-w0|^2. ``extra`` holds named scalars for later algorithms.
    ``clip_norm``: differential privacy's client-side clipping (the client scales its delta down
    to this L2 norm before sending).
    """

    local_epochs: float | None = 1.0
    local_steps: int | None = None
    learning_rate: float = 0.01
    batch_size: int = 32
    momentum: float = 0.0
    weight_decay: float = 0.0
    projection: ProjectionMode = ProjectionMode.NONE
    only_conflicting: bool = False
    elastic_lambda: float = 0.0
    elastic_alpha: float = 0.0
    proximal_mu: float = 0.0
    extra: Mapping[str, float] = field(default_factory=dict, hash=False)
    clip_norm: float | None = None
    # The quantized values the server accepts in the update ("int8", "int4"; docs/wire.md
    # "Quantized values") and the block size it suggests (0: 128).
    update_quantizations: tuple[str, ...] = ()
    quantization_block: int = 0

    def __post_init__(self) -> None:
        """Check the values and freeze ``extra`` so a shared recipe cannot change."""
        if (self.local_epochs is None) == (self.local_steps is None):
            raise ValueError("Recipe needs exactly one of local_epochs and local_steps")
        if self.local_epochs is not None and not self.local_epochs > 0:
            raise ValueError(f"local_epochs must be > 0, got {self.local_epochs}")
        if self.local_steps is not None and not self.local_steps >= 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        for name in ("momentum", "weight_decay", "elastic_lambda", "proximal_mu"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):  # NaN fails `value < 0` too
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not 0.0 <= self.elastic_alpha <= 1.0:
            raise ValueError(f"elastic_alpha must be in [0, 1], got {self.elastic_alpha}")
        c = self.clip_norm
        if c is not None and not (math.isfinite(c) and c > 0):
            raise ValueError(f"clip_norm must be a finite number > 0 or None, got {c}")
        unknown = set(self.update_quantizations) - {"int8", "int4"}
        if unknown:
            raise ValueError(f"update_quantizations are int8 and int4, got {sorted(unknown)}")
        object.__setattr__(self, "update_quantizations", tuple(self.update_quantizations))
        if not 0 <= self.quantization_block <= 1 << 16:
            raise ValueError(
                f"quantization_block must be in [0, 65536], got {self.quantization_block}"
            )
        object.__setattr__(self, "projection", ProjectionMode(self.projection))
        object.__setattr__(
            self, "extra", types.MappingProxyType({str(k): float(v) for k, v in self.extra.items()})
        )

    @property
    def work_target(self) -> float:
        """The work a complete job does: epochs, or steps when the recipe counts steps."""
        return float(self.local_epochs if self.local_epochs is not None else self.local_steps)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (enum by name) for state dicts and the wire."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["projection"] = self.projection.value
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


# The largest magnitude of a code (INT8 -128..127, INT4 -8..7, whatever the wire refuses): a
# scale at most FLT_MAX / it decodes only finite values.
_CODE_MAGNITUDE = {8: 128, 4: 8}
_FLT_MAX = float(torch.finfo(torch.float32).max)


def finite_scale_limit(bits: int) -> float:
    """The largest scale whose every code (even one the wire refuses) decodes finite."""
    return _FLT_MAX / _CODE_MAGNITUDE[bits]


@dataclass(frozen=True, eq=False)
class QuantizedValues:
    """``numel`` values as blockwise absmax codes (the wire's quantized values, docs/wire.md):
    value i is the binary32 product ``float32(code_i) * scales[i // block]``.

    ``codes``: int8 [numel] (``bits`` 8) or the uint8 bytes of packed 4-bit codes
    [ceil(numel / 2)] (``bits`` 4, value 2j in the low nibble of byte j); ``scales``: float32
    [ceil(numel / block)], each finite, not negative and at most FLT_MAX / 128 (FLT_MAX / 8 for 4
    bits), so that every value is finite whatever its code: a strategy folds them in without
    checking them again. Both contiguous CPU tensors, only read.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    block: int
    bits: int
    numel: int
    # The squared norm from the codes, once known (see squared_norm).
    _squared: list[float] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        """Check the shapes, dtypes and scales (one read of the scales, none of the codes)."""
        bits, block, n = self.bits, self.block, self.numel
        if bits not in _CODE_MAGNITUDE:
            raise ValueError(f"bits must be 8 or 4, got {bits!r}")
        for name, v in (("block", block), ("numel", n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "block" else 0):
                raise ValueError(f"{name} must be an integer >= {int(name == 'block')}, got {v!r}")
        want = (torch.int8, n) if bits == 8 else (torch.uint8, (n + 1) // 2)
        nblocks = -(-n // block)
        for name, t, dtype, count in (
            ("codes", self.codes, *want),
            ("scales", self.scales, torch.float32, nblocks),
        ):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != (count,):
                got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t)
                raise ValueError(
                    f"{name} of {n} {bits}-bit values in blocks of {block} must be {dtype} "
                    f"[{count}], got {got}"
                )
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous CPU tensor, got one on {t.device}")
        if bits == 4 and n % 2 and int(self.codes[-1]) >> 4:
            raise ValueError(f"the padding nibble after the last of {n} 4-bit values must be 0")
        if nblocks:
            s = self.scales
            low, high = float(s.min()), float(s.max())
            limit = finite_scale_limit(bits)
            if not (low >= 0 and high <= limit):  # NaN fails both
                raise ValueError(
                    f"scales must be finite, not negative and at most {limit:.6g} (so that every "
                    f"value is finite), got values in [{low!r}, {high!r}]"
                )

    @property
    def nbytes(self) -> int:
        """The bytes of codes and scales."""
        return self.codes.numel() + 4 * self.scales.numel()

    def squared_norm(self) -> float:
        """``sum_b scale_b^2 * sum_{i in b} code_i^2`` in float64: the squared L2 norm of the exact
        products ``code * scale`` (before each value's rounding to binary32). A kernel that read
        the codes anyway may have noted it (:meth:`note_squared_norm`); else one read of them."""
        if not self._squared:
            from aggsrv import kernels  # the kernels load numba: not before a strategy needs them

            self._squared.append(
                kernels.code_squares(
                    self.codes, self.scales, self.block, self.numel, bits=self.bits, backend="cpu"
                )
            )
        return self._squared[0]

    def note_squared_norm(self, value: float) -> None:
        """Remember :meth:`squared_norm`, computed by a kernel in a pass it made anyway."""
        self._squared[:] = [float(value)]

    @property
    def norm(self) -> float:
        """The L2 norm, the root of :meth:`squared_norm`."""
        return math.sqrt(self.squared_norm())

    def chunk_elements(self, about: int) -> int:
        """A chunk length near ``about`` (at least one block) at which :meth:`span` can cut the
        values: whole blocks, and whole bytes of 4-bit codes."""
        step = self.block if self.bits == 8 or self.block % 2 == 0 else 2 * self.block
        return step * max(1, about // step)

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of values [start, end), views: ``start`` a multiple of the block (and
        even for 4 bits: see :meth:`chunk_elements`), ``end`` at most numel."""
        step = self.chunk_elements(1)
        if start % step or not 0 <= start <= end <= self.numel:
            raise ValueError(
                f"values [{start}, {end}) of {self.numel} do not start on a chunk of {step}"
            )
        codes = self.codes[start:end] if self.bits == 8 else self.codes[start // 2 : (end + 1) // 2]
        return codes, self.scales[start // self.block : -(-end // self.block)]

    def decode(self, out: torch.Tensor) -> torch.Tensor:
        """The float32 values written into ``out`` ([numel], CPU), bit for bit as the wire
        decodes them; returns out."""
        from aggsrv import kernels  # the kernels load numba: not before a strategy needs them

        return kernels.dequantize(
            self.codes, self.scales, self.block, bits=self.bits, out=out, backend="cpu"
        )


@dataclass(frozen=True, eq=False)
class Update:
    """One validated client update as the server hands it to :meth:`Strategy.on_update`.

    ``tensor`` is the flat [D] float32 staging slot on the strategy's device, reused once
    ``on_update`` returns. ``work_done`` counts completed epochs or steps (as the recipe does).
    ``buffers`` is the client's flat [B] float buffers (absolute values, never a delta): required
    when the layout has float buffers, None otherwise; also a staging view. ``norm``: the L2
    norm of ``tensor`` in float64 when the code that built the update computed it on the way
    (the server's decoder does, in its NaN/Inf pass), so a strategy that clips need not read
    the tensor again; None: the strategy computes it. ``non_finite``: set by a strategy under
    differential privacy on the zero delta it put in place of one holding NaN/Inf (its clip
    factor ``min(1, C / inf)`` is 0); never set by the code that hands updates in. ``finite``:
    the code that built the update has proven every value of ``tensor`` finite (the server's
    decoder does, in the pass that reads it), so the strategy does not count NaN/Inf again. A
    strategy trusts it: set it only where the values were checked.

    ``quantized``: the tensor's values as the wire's codes, not yet decoded (``tensor`` is then a
    buffer of the right shape whose contents are undefined): a strategy that folds codes in
    (:meth:`Strategy.folds_quantized_updates`) reads them without a float32 copy; any other gets
    the update :meth:`materialized`, decoded into ``tensor`` first.
    """

    client_id: str
    job_id: int
    base_version: int
    update_id: str
    num_samples: int
    work_done: float
    kind: UpdateKind
    tensor: torch.Tensor
    buffers: torch.Tensor | None = None
    norm: float | None = None
    non_finite: bool = False
    quantized: QuantizedValues | None = None
    finite: bool = False

    def __post_init__(self) -> None:
        """Quantized values must be the tensor's: as many, on the CPU."""
        q = self.quantized
        if q is None:
            return
        if not isinstance(q, QuantizedValues):
            raise TypeError(f"quantized must be QuantizedValues or None, got {type(q).__name__}")
        t = self.tensor
        if not isinstance(t, torch.Tensor) or t.numel() != q.numel or t.device.type != "cpu":
            got = (tuple(t.shape), str(t.device)) if isinstance(t, torch.Tensor) else type(t)
            raise ValueError(
                f"quantized values of {q.numel} elements need a CPU tensor of as many to decode "
                f"into, got {got}"
            )

    def materialized(self) -> Update:
        """This update with its quantized values decoded into ``tensor`` (itself when there are
        none): what a strategy that does not fold codes reads."""
        if self.quantized is None:
            return self
        self.quantized.decode(self.tensor.view(-1))
        return dataclasses.replace(self, quantized=None)


class PendingReason(enum.IntEnum):
    """Why a strategy has no job for a client yet (``Strategy.job_for`` returned None). The
    numbers are the wire's (aggregation.proto ``PendingReason``; docs/wire.md "Pending reasons")."""

    UNSPECIFIED = 0
    NO_ROUND_OPEN = 1  # no round or epoch is open: waiting for clients, or for the next one
    NOT_SELECTED = 2  # a round is open, but the client was not sampled into it
    ALREADY_REPORTED = 3  # the client reported in the open round or epoch
    UPDATE_BUFFERED = 4  # the client's update waits in the strategy's buffer

    @property
    def text(self) -> str:
        """The reason in words (JobPending.reason)."""
        return _PENDING_TEXT[self]


_PENDING_TEXT = {
    PendingReason.UNSPECIFIED: "waiting for the strategy",
    PendingReason.NO_ROUND_OPEN: "no round is open: waiting for the next one to open",
    PendingReason.NOT_SELECTED: "not selected for the open round: waiting for the next round",
    PendingReason.ALREADY_REPORTED: "already reported in the open round: waiting for the next",
    PendingReason.UPDATE_BUFFERED: "the last update waits in the buffer: waiting for it to fold in",
}


@dataclass(frozen=True)
class Outcome:
    """The answer to an update: APPLIED(version), BUFFERED(version), FILTERED(version, reason)
    or DUPLICATE(original).

    For DUPLICATE, ``original`` is the status the update got first and ``version`` its version.
    ``staleness`` is the update's staleness when it was accepted (:meth:`Strategy.on_update`
    fills it in; a DUPLICATE repeats the original's); it does not take part in comparisons.
    FILTERED (and a DUPLICATE of one) carries the filter's ``reason`` and ``detail`` (a
    sentence for people); ``version`` is then the version current when it was left out.
    ``clipped``: an update filter clipped the update before it was folded in (APPLIED or
    BUFFERED; not repeated by a DUPLICATE).
    """

    status: Status
    version: int
    original: Status | None = None
    staleness: int | None = field(default=None, compare=False)
    reason: FilterReason | None = None
    detail: str = field(default="", compare=False)
    clipped: bool = field(default=False, compare=False)

    def to_tuple(self) -> tuple[Any, ...]:
        """Plain values for state dicts: (status, version, original, staleness[, reason,
        detail]); the filter's fields only when there is a reason, so other outcomes keep the
        4-tuples earlier states hold."""
        original = self.original and self.original.value
        plain = (self.status.value, self.version, original, self.staleness)
        if self.reason is None:
            return plain
        return (*plain, int(self.reason), self.detail)

    @classmethod
    def from_tuple(cls, t: tuple[Any, ...] | list[Any]) -> Outcome:
        """Inverse of :meth:`to_tuple` (also reads the 3-tuples of states saved before the
        staleness was recorded)."""
        staleness = int(t[3]) if len(t) > 3 and t[3] is not None else None
        reason = FilterReason(int(t[4])) if len(t) > 4 and t[4] is not None else None
        detail = str(t[5]) if len(t) > 5 else ""
        original = Status(t[2]) if t[2] is not None else None
        return cls(Status(t[0]), int(t[1]), original, staleness, reason, detail)
