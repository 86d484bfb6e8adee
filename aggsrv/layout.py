"""ModelLayout: a model's named tensors <-> one flat vector, with offset tables and a layout hash.

See docs/design.md "The flat layout". The trainable parameters map to a flat vector of length D, one
segment per tensor in ``named_parameters()`` order (``offsets``, int64 ``[L+1]``) and one segment
per module (``module_offsets``: FedDGIC's "layer"). Float buffers that are not trained (BatchNorm
running statistics, frozen parameters) form a second flat section with its own offsets; integer
buffers (``num_batches_tracked``) stay outside both and are only listed. The hash covers names,
shapes and order of the trainable tensors, never dtypes, so clients may ship any wire dtype.

This module imports torch and numpy only: kernels, strategies, server and client all use it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

__all__ = ["LayoutMismatchError", "ModelLayout", "TensorSpec", "bind_flat"]

logger = logging.getLogger(__name__)

# Module types whose parameters are "normalisation" parameters (is_norm). _NormBase covers
# BatchNorm*, SyncBatchNorm and InstanceNorm*; LocalResponseNorm has no parameters.
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
_RUNNING_STATS = ("running_mean", "running_var")

Source = nn.Module | Mapping[str, torch.Tensor]


class LayoutMismatchError(ValueError):
    """A model, state dict or flat vector does not match the layout; the message names why."""


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a flat section: its shape and the segment it occupies."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    module: str
    is_norm: bool = False

    @property
    def end(self) -> int:
        """One past the last element of the segment."""
        return self.offset + self.numel


def _module_of(name: str) -> str:
    """The module prefix of a tensor name ("fc1.weight" -> "fc1", "scale" -> "")."""
    return name.rpartition(".")[0]


def _fmt_shape(shape: Sequence[int]) -> str:
    """A shape as a Python tuple literal, as people read it in messages."""
    return str(tuple(int(s) for s in shape))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _build_specs(
    names_and_shapes: Iterable[tuple[str, Sequence[int]]], norm: Iterable[bool] | None = None
) -> tuple[TensorSpec, ...]:
    """Lay tensors out back to back, validating names and shapes."""
    pairs = list(names_and_shapes)
    flags = [False] * len(pairs) if norm is None else list(norm)
    specs: list[TensorSpec] = []
    offset = 0
    for (name, shape), flag in zip(pairs, flags, strict=True):
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if not name.isascii():
            try:
                name.encode("utf-8")  # the layout hash is over the names' UTF-8 bytes
            except UnicodeEncodeError:
                raise ValueError(f"tensor name {name!r} is not valid Unicode text") from None
        shp = tuple(int(s) for s in shape)
        if any(s < 0 for s in shp):
            raise ValueError(f"{name}: negative dimension in shape {_fmt_shape(shp)}")
        n = _numel(shp)
        specs.append(TensorSpec(name, shp, offset, n, _module_of(name), bool(flag)))
        offset += n
    return tuple(specs)


def _is_uninitialized(t: torch.Tensor) -> bool:
    return isinstance(t, nn.parameter.UninitializedTensorMixin)


class ModelLayout:
    """Maps a model's trainable tensors to one flat vector of length D (and float buffers to a
    second one), with per-tensor and per-module offset tables and the wire layout hash.

    Build it with :meth:`from_module`, :meth:`from_state_dict` or :meth:`from_named_shapes`.
    Instances are immutable; the tensor tables are cached, so do not modify them in place.
    """

    def __init__(
        self,
        tensors: Iterable[tuple[str, Sequence[int]]],
        buffers: Iterable[tuple[str, Sequence[int]]] = (),
        norm_flags: Iterable[bool] | None = None,
        int_buffer_names: Iterable[str] = (),
    ) -> None:
        """Lay out ``tensors`` (trainable, in order) and ``buffers`` (float, not trained)."""
        self.specs: tuple[TensorSpec, ...] = _build_specs(tensors, norm_flags)
        self.buffer_specs: tuple[TensorSpec, ...] = _build_specs(buffers)
        self.int_buffer_names: tuple[str, ...] = tuple(int_buffer_names)
        seen: set[str] = set()
        for name in (
            *(s.name for s in self.specs),
            *(s.name for s in self.buffer_specs),
            *self.int_buffer_names,
        ):
            if name in seen:
                raise ValueError(f"duplicate tensor name {name!r} in layout")
            seen.add(name)
        self._index = {s.name: i for i, s in enumerate(self.specs)}
        # Module segments are runs of consecutive tensors sharing a prefix; named_parameters()
        # yields a module's own parameters together, so a run is the whole module.
        mod_names: list[str] = []
        mod_offs: list[int] = [0]
        for s in self.specs:
            if mod_names and mod_names[-1] == s.module:
                mod_offs[-1] = s.end
            else:
                mod_names.append(s.module)
                mod_offs.append(s.end)
        self.module_names: tuple[str, ...] = tuple(mod_names)
        self._module_offs = tuple(mod_offs)

    # ----------------------------------------------------------------------------- constructors

    @classmethod
    def from_module(cls, module: nn.Module) -> ModelLayout:
        """Layout of a module: parameters with ``requires_grad`` are trainable, the other float
        state-dict entries (running statistics, frozen parameters) are buffers; norm flags come
        from the module types."""
        norm_prefixes = {
            prefix for prefix, m in module.named_modules() if isinstance(m, _NORM_TYPES)
        }
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        # keep_vars=True hands back the live tensors (no copies) so aliases can be detected.
        return cls._build(module.state_dict(keep_vars=True), trainable, norm_prefixes, set())

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Any],
        trainable_names: Iterable[str],
        norm_names: Iterable[str] | None = None,
    ) -> ModelLayout:
        """Layout of a state dict: ``trainable_names`` are the flat parameters (laid out in the
        state dict's order), other float tensors are buffers, the rest stays outside.

        ``norm_names`` (tensor or module names) marks normalisation parameters explicitly;
        without it a module counts as a norm layer when it has running_mean/running_var.
        """
        trainable = list(trainable_names)
        for name in trainable:
            if name not in state_dict:
                raise LayoutMismatchError(f"missing tensor {name!r}: not in the state dict")
        if norm_names is None:
            prefixes = {_module_of(k) for k in state_dict if k.rpartition(".")[2] in _RUNNING_STATS}
            return cls._build(state_dict, trainable, prefixes, set())
        explicit = set(norm_names)
        known = set(trainable) | {_module_of(n) for n in trainable}
        unknown = sorted(explicit - known)
        if unknown:
            raise ValueError(f"norm_names {unknown} match no trainable tensor or module")
        return cls._build(state_dict, trainable, set(), explicit)

    @classmethod
    def _build(
        cls,
        state_dict: Mapping[str, Any],
        trainable: list[str],
        norm_prefixes: set[str],
        norm_tensors: set[str],
    ) -> ModelLayout:
        """Split a state dict into trainable, float-buffer and outside entries."""
        trainable_set = set(trainable)
        if len(trainable_set) != len(trainable):
            raise ValueError("trainable_names contains duplicates")
        tensors: list[tuple[str, tuple[int, ...]]] = []
        flags: list[bool] = []
        buffers: list[tuple[str, tuple[int, ...]]] = []
        others: list[str] = []
        seen_storage: set[tuple[Any, ...]] = set()
        for name, value in state_dict.items():
            if not isinstance(value, torch.Tensor):
                others.append(name)  # e.g. a module's _extra_state
                continue
            if _is_uninitialized(value):
                raise ValueError(f"{name}: uninitialized (lazy) tensor; run a forward pass first")
            # Tied weights appear under several names in a state dict but once in
            # named_parameters(); the first name owns the segment.
            key = None
            if value.numel() > 0 and value.device.type != "meta":
                key = (value.device, value.data_ptr(), value.dtype, value.shape, value.stride())
                if key in seen_storage and name not in trainable_set:
                    continue
                seen_storage.add(key)
            shape = tuple(value.shape)
            if name in trainable_set:
                if not value.is_floating_point():
                    raise LayoutMismatchError(
                        f"{name}: trainable tensors must be floating point, got {value.dtype}"
                    )
                tensors.append((name, shape))
                mod = _module_of(name)
                flags.append(name in norm_tensors or mod in norm_tensors or mod in norm_prefixes)
            elif value.is_floating_point():
                buffers.append((name, shape))
            else:
                others.append(name)
        return cls(tensors, buffers, flags, others)

    @classmethod
    def from_named_shapes(
        cls,
        names_and_shapes: Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int]]],
        norm_names: Iterable[str] | None = None,
    ) -> ModelLayout:
        """Layout from (name, shape) pairs alone, as the server sees a model (no buffers)."""
        pairs = list(
            names_and_shapes.items() if isinstance(names_and_shapes, Mapping) else names_and_shapes
        )
        explicit = set(norm_names or ())
        flags = [n in explicit or _module_of(n) in explicit for n, _ in pairs]
        return cls(pairs, norm_flags=flags)

    # ------------------------------------------------------------------------------- properties

    @property
    def names(self) -> tuple[str, ...]:
        """Trainable tensor names in layout order."""
        return tuple(s.name for s in self.specs)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Trainable tensor shapes in layout order."""
        return tuple(s.shape for s in self.specs)

    @property
    def numel(self) -> int:
        """D, the length of the flat parameter vector."""
        return self.specs[-1].end if self.specs else 0

    @property
    def whole(self) -> ModelLayout:
        """The whole model's layout: this one (a shard's ShardLayout answers the model's)."""
        return self

    @property
    def buffer_names(self) -> tuple[str, ...]:
        """Float buffer names in layout order."""
        return tuple(s.name for s in self.buffer_specs)

    @property
    def buffer_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Float buffer shapes in layout order."""
        return tuple(s.shape for s in self.buffer_specs)

    @property
    def buffer_numel(self) -> int:
        """Length of the flat float-buffer vector."""
        return self.buffer_specs[-1].end if self.buffer_specs else 0

    @cached_property
    def offsets(self) -> torch.Tensor:
        """CPU int64 ``[L+1]``: segment l of the flat vector is ``[offsets[l], offsets[l+1])``."""
        return torch.tensor([0, *(s.end for s in self.specs)], dtype=torch.int64)

    @cached_property
    def module_offsets(self) -> torch.Tensor:
        """CPU int64 ``[M+1]``: one segment per module (the union of its tensors)."""
        return torch.tensor(self._module_offs, dtype=torch.int64)

    @cached_property
    def is_norm(self) -> torch.Tensor:
        """CPU bool ``[L]``: True for parameters of normalisation layers."""
        return torch.tensor([s.is_norm for s in self.specs], dtype=torch.bool)

    @cached_property
    def buffer_offsets(self) -> torch.Tensor:
        """CPU int64 ``[B+1]``: offset table of the float-buffer section."""
        return torch.tensor([0, *(s.end for s in self.buffer_specs)], dtype=torch.int64)

    def manifest(self) -> list[list[Any]]:
        """The wire manifest ``[[name, [shape...]], ...]`` of the trainable tensors."""
        return [[s.name, list(s.shape)] for s in self.specs]

    def manifest_json(self) -> str:
        """The canonical JSON of :meth:`manifest`, the input of the layout hash (docs/wire.md
        "Layout and layout hash"): no spaces; only '"', '\\' and U+0000-U+001F escaped (json's
        own escapes, which are RFC 8785's); every other character as itself, so its UTF-8 bytes
        are hashed, never a \\uXXXX escape; dims as plain decimal integers."""
        return json.dumps(self.manifest(), separators=(",", ":"), ensure_ascii=False)

    @cached_property
    def hash(self) -> str:
        """SHA-256 hex of the manifest JSON's UTF-8 bytes: names, shapes and order, not dtypes."""
        return hashlib.sha256(self.manifest_json().encode("utf-8")).hexdigest()

    def index(self, name: str) -> int:
        """Position of a trainable tensor in the layout."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no trainable tensor {name!r} in layout") from None

    def spec(self, name: str) -> TensorSpec:
        """The spec of a trainable tensor by name."""
        return self.specs[self.index(name)]

    # ---------------------------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: tensors, buffers, norm names and outside buffers."""
        return {
            "tensors": self.manifest(),
            "buffers": [[s.name, list(s.shape)] for s in self.buffer_specs],
            "norm": [s.name for s in self.specs if s.is_norm],
            "int_buffers": list(self.int_buffer_names),
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as compact JSON."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | Sequence[Any]) -> ModelLayout:
        """Inverse of :meth:`to_dict`; a bare manifest list is accepted too."""
        if not isinstance(data, Mapping):
            return cls.from_named_shapes([(n, s) for n, s in data])
        norm = set(data.get("norm", ()))
        tensors = [(n, s) for n, s in data["tensors"]]
        return cls(
            tensors,
            [(n, s) for n, s in data.get("buffers", ())],
            [n in norm for n, _ in tensors],
            data.get("int_buffers", ()),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelLayout:
        """Inverse of :meth:`to_json` (or of :meth:`manifest_json`)."""
        return cls.from_dict(json.loads(text))

    # ---------------------------------------------------------------------------- dunder methods

    def _key(self) -> tuple[Any, ...]:
        return (self.names, self.shapes, self.buffer_names, self.buffer_shapes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelLayout):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __len__(self) -> int:
        return len(self.specs)

    def __repr__(self) -> str:
        return (
            f"ModelLayout(tensors={len(self.specs)}, numel={self.numel}, "
            f"modules={len(self.module_names)}, buffers={len(self.buffer_specs)}, "
            f"buffer_numel={self.buffer_numel}, hash={self.hash[:12]})"
        )

    # ------------------------------------------------------------------------- source resolution

    @staticmethod
    def _check_tensor(spec: TensorSpec, t: Any) -> torch.Tensor:
        """Validate one source/target tensor against its spec."""
        if not isinstance(t, torch.Tensor):
            raise LayoutMismatchError(f"{spec.name}: expected a tensor, got {type(t).__name__}")
        if _is_uninitialized(t):
            raise LayoutMismatchError(f"{spec.name}: uninitialized (lazy) parameter")
        if tuple(t.shape) != spec.shape:
            raise LayoutMismatchError(
                f"{spec.name}: expected {_fmt_shape(spec.shape)}, got {_fmt_shape(t.shape)}"
            )
        if not t.is_floating_point():
            raise LayoutMismatchError(f"{spec.name}: expected a floating tensor, got {t.dtype}")
        return t

    def _params_of(self, module: nn.Module) -> list[torch.Tensor]:
        """The module's parameters in layout order; extra trainable parameters are an error."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
        lookup = dict(module.named_parameters(remove_duplicate=False))
        out = []
        for spec in self.specs:
            if spec.name not in lookup:
                raise LayoutMismatchError(f"missing tensor {spec.name!r}: not a parameter")
            out.append(self._check_tensor(spec, lookup[spec.name]))
        ids = {id(t) for t in out}
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in ids:
                raise LayoutMismatchError(f"unexpected tensor {name!r}: not in the layout")
        return out

    @staticmethod
    def _resolve(module: nn.Module, name: str) -> Any:
        prefix, _, attr = name.rpartition(".")
        try:
            owner = module.get_submodule(prefix) if prefix else module
        except AttributeError:
            return None
        return getattr(owner, attr, None)

    def _tensors_of(
        self, source: Source, specs: Sequence[TensorSpec], trainable: bool
    ) -> list[torch.Tensor]:
        """Tensors of a module or mapping in ``specs`` order, validated against the specs."""
        if trainable and isinstance(source, nn.Module):
            return self._params_of(source)
        out = []
        for spec in specs:
            if isinstance(source, nn.Module):
                t = self._resolve(source, spec.name)
            elif isinstance(source, Mapping):
                t = source.get(spec.name)
            else:
                raise TypeError(f"expected an nn.Module or a mapping, got {type(source).__name__}")
            if t is None:
                raise LayoutMismatchError(f"missing tensor {spec.name!r}")
            out.append(self._check_tensor(spec, t))
        return out

    # ------------------------------------------------------------------------ flatten / unflatten

    @staticmethod
    def _check_flat(flat: Any, total: int, what: str) -> torch.Tensor:
        if not isinstance(flat, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(flat).__name__}")
        if flat.dim() != 1 or flat.shape[0] != total:
            raise LayoutMismatchError(
                f"{what} has shape {_fmt_shape(flat.shape)}, the layout needs ({total},)"
            )
        if not flat.is_floating_point():
            raise LayoutMismatchError(f"{what} must be floating point, got {flat.dtype}")
        return flat

    def _gather(
        self,
        tensors: Sequence[torch.Tensor],
        specs: Sequence[TensorSpec],
        total: int,
        out: torch.Tensor | None,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> torch.Tensor:
        if out is None:
            if dtype is None:
                dtype = tensors[0].dtype if tensors else torch.get_default_dtype()
                for t in tensors[1:]:
                    dtype = torch.promote_types(dtype, t.dtype)
            if device is None:
                device = tensors[0].device if tensors else torch.device("cpu")
            out = torch.empty(total, dtype=dtype, device=device)
        else:
            self._check_flat(out, total, "out")
            if dtype is not None and out.dtype != dtype:
                raise ValueError(f"out has dtype {out.dtype}, but dtype={dtype} was requested")
        with torch.no_grad():
            for spec, t in zip(specs, tensors, strict=True):
                # view() splits the 1-D slice, so strided `out` tensors work as well.
                out[spec.offset : spec.end].view(spec.shape).copy_(t)
        return out

    def _scatter(
        self,
        flat: torch.Tensor,
        specs: Sequence[TensorSpec],
        total: int,
        target: Source | None,
        trainable: bool,
        what: str,
    ) -> dict[str, torch.Tensor] | None:
        self._check_flat(flat, total, what)
        views = {s.name: flat[s.offset : s.end].view(s.shape) for s in specs}
        if target is None:
            return views
        tensors = self._tensors_of(target, specs, trainable)
        with torch.no_grad():
            for spec, t in zip(specs, tensors, strict=True):
                # copy_ under no_grad writes the parameter's own storage and bumps its version
                # counter, so a graph that saved the old value fails loudly instead of silently.
                t.copy_(views[spec.name])
        return None

    def flatten(
        self,
        source: Source,
        out: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Copy the trainable tensors of a module or state dict into one flat ``[D]`` vector.

        Bit-exact when the dtype is kept. Without ``out``/``dtype`` the result takes the
        promoted dtype of the tensors and the device of the first one.
        """
        tensors = self._tensors_of(source, self.specs, trainable=True)
        return self._gather(tensors, self.specs, self.numel, out, dtype, device)

    def flatten_buffers(
        self,
        source: Source,
        out: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Copy the float buffers of a module or state dict into one flat vector."""
        tensors = self._tensors_of(source, self.buffer_specs, trainable=False)
        return self._gather(tensors, self.buffer_specs, self.buffer_numel, out, dtype, device)

    def unflatten(
        self, flat: torch.Tensor, target: Source | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Without ``target``: a dict name -> view of ``flat`` (no copies). With a module or a
        mapping of tensors: copy each segment into the target's tensors in place, return None."""
        return self._scatter(flat, self.specs, self.numel, target, True, "flat vector")

    def unflatten_buffers(
        self, flat: torch.Tensor, target: Source | None = None
    ) -> dict[str, torch.Tensor] | None:
        """:meth:`unflatten` for the float-buffer section."""
        return self._scatter(
            flat, self.buffer_specs, self.buffer_numel, target, False, "flat buffer vector"
        )

    def bind_flat(
        self,
        module: nn.Module,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the module's parameters and their ``.grad`` views of two new flat ``[D]``
        buffers, so per-step work over all parameters is one call on the flat tensors.

        The current values are copied in; grads start at zero. ``dtype``/``device`` convert the
        module like ``module.to``. Autograd accumulates into an existing ``.grad`` in place, so
        the grads stay views across ``backward()`` calls. The binding breaks when something
        replaces ``.grad`` or ``.data``: use ``optimizer.zero_grad(set_to_none=False)`` (or
        ``flat_grads.zero_()``), not ``set_to_none=True``; avoid ``backward(create_graph=True)``
        and ``module.to(...)`` afterwards.
        """
        params = self._params_of(module)
        flat_p = self._gather(params, self.specs, self.numel, None, dtype, device)
        flat_g = torch.zeros_like(flat_p)
        with torch.no_grad():
            for spec, p in zip(self.specs, params, strict=True):
                p.data = flat_p[spec.offset : spec.end].view(spec.shape)
                p.grad = flat_g[spec.offset : spec.end].view(spec.shape)
        logger.debug("bound %d parameters (%d elements) to flat buffers", len(params), self.numel)
        return flat_p, flat_g


def bind_flat(
    module: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`ModelLayout.bind_flat` with the module's own layout."""
    return ModelLayout.from_module(module).bind_flat(module, dtype=dtype, device=device)
