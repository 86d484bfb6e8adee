"""Flower's ``ArrayRecord`` <-> aggsrv's flat layout.

A Flower ``Array`` holds its tensor as NumPy ``.npy`` bytes. Reading parses the NPY header and
views the payload in place (``np.frombuffer``: no copy), so turning a record into our flat [D]
vector costs one copy, into the flat buffer itself. Writing builds each ``Array``'s NPY bytes
straight from a view of the flat vector (one copy, into the bytes Flower keeps).

Records are read by name, so a record may be a whole ``model.state_dict()`` (Flower's idiom):
trainable parameters go to the flat [D] vector, float buffers (BatchNorm running statistics) to
the flat [B] buffer section, and integer buffers (``num_batches_tracked``) are outside both
(docs/design.md "The flat layout").
"""

from __future__ import annotations

import ast
import functools
import struct
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from aggsrv.layout import ModelLayout

NPY_MAGIC = b"\x93NUMPY"
NUMPY_STYPE = "numpy.ndarray"
# Float entries of a state dict that are statistics, not parameters (BatchNorm's).
RUNNING_STATS = ("running_mean", "running_var")


def layout_of(record: ArrayRecord, trainable: Iterable[str] | None = None) -> ModelLayout:
    """The flat layout of a record, its arrays in record order.

    ``trainable`` names the parameters; without it every float array is trainable except
    BatchNorm's ``running_mean``/``running_var``, which are float buffers (and mark their module
    as a normalisation layer). Non-float arrays (``num_batches_tracked``) stay outside the
    layout. A record of a model with other frozen float tensors needs ``trainable`` (or
    ``ModelLayout.from_module(model)``) to be laid out as ``aggsrv serve`` lays it out.
    """
    meta = {
        name: torch.empty(tuple(record[name].shape), dtype=_torch_dtype(record[name]),
                          device="meta")
        for name in record
    }  # fmt: skip
    if trainable is None:
        trainable = [
            name
            for name, t in meta.items()
            if t.is_floating_point() and name.rpartition(".")[2] not in RUNNING_STATS
        ]
    return ModelLayout.from_state_dict(meta, list(trainable))


def _torch_dtype(array: Array) -> torch.dtype:
    """A torch dtype of the array's kind (float32 for every float, int64 otherwise): the layout
    only needs to know float from not, and meta tensors need some dtype."""
    kind = np.dtype(array.dtype).kind if array.dtype != "bfloat16" else "f"
    return torch.float32 if kind == "f" else torch.int64


def npy_view(array: Array) -> np.ndarray:
    """The array's values as a read-only view of its NPY bytes (no copy for plain .npy)."""
    if array.stype != NUMPY_STYPE:
        raise ValueError(f"unsupported Flower array serialization {array.stype!r}")
    data = array.data
    if data[:6] != NPY_MAGIC:
        return array.numpy()
    major = data[6]
    if major == 1:
        (hlen,) = struct.unpack_from("<H", data, 8)
        start = 10
    else:
        (hlen,) = struct.unpack_from("<I", data, 8)
        start = 12
    parsed = _npy_header(data[start : start + hlen])
    if parsed is None:
        return array.numpy()
    dtype, shape, count = parsed
    return np.frombuffer(data, dtype=dtype, count=count, offset=start + hlen).reshape(shape)


@functools.lru_cache(maxsize=4096)
def _npy_header(text: bytes) -> tuple[np.dtype, tuple[int, ...], int] | None:
    """(dtype, shape, count) of an NPY header; None for what a plain view cannot read.
    Cached: a model's records repeat the same few headers, and parsing one costs ~30 us."""
    header = ast.literal_eval(text.decode("latin1"))
    dtype = np.dtype(header["descr"])
    if header.get("fortran_order") or dtype.hasobject:
        return None
    shape = tuple(int(n) for n in header["shape"])
    return dtype, shape, int(np.prod(shape, dtype=np.int64))


def _named(record: ArrayRecord, layout: ModelLayout) -> None:
    """Refuse a record with arrays the layout does not know (a different model)."""
    known = {*layout.names, *layout.buffer_names, *layout.int_buffer_names}
    unknown = [name for name in record if name not in known]
    if unknown:
        raise ValueError(
            f"the record has arrays the layout does not know: {unknown[:4]}"
            f"{'...' if len(unknown) > 4 else ''} (a different model?)"
        )


def _gather(
    record: ArrayRecord, specs: Iterable[tuple[str, tuple[int, ...]]], flat: torch.Tensor, what: str
) -> torch.Tensor:
    """Copy the record's arrays ``specs`` (name, shape) into consecutive segments of ``flat``."""
    flat_np = flat.numpy()
    start = 0
    for name, shape in specs:
        if name not in record:
            raise ValueError(f"the record has no array {name!r} ({what} of the layout)")
        values = npy_view(record[name])
        if tuple(values.shape) != tuple(shape):
            raise ValueError(f"array {name!r} has shape {values.shape}, the layout {shape}")
        end = start + values.size
        # One copy (with the dtype conversion when the client sent float64 or float16).
        flat_np[start:end] = values.reshape(-1)
        start = end
    return flat


def record_to_flat(
    record: ArrayRecord, layout: ModelLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The record's trainable arrays, in the layout's order, as one flat float32 [D] tensor.

    Arrays are found by name; float and integer buffers in the record are skipped here (see
    :func:`record_to_buffers`); an array the layout does not know is an error."""
    _named(record, layout)
    flat = torch.empty(layout.numel, dtype=torch.float32) if out is None else out
    return _gather(record, zip(layout.names, layout.shapes, strict=True), flat, "a parameter")


def record_to_buffers(
    record: ArrayRecord, layout: ModelLayout, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The record's float buffers (BatchNorm statistics) as one flat float32 [B] tensor; None
    when the layout has none."""
    if not layout.buffer_numel:
        return None
    _named(record, layout)
    flat = torch.empty(layout.buffer_numel, dtype=torch.float32) if out is None else out
    specs = zip(layout.buffer_names, layout.buffer_shapes, strict=True)
    return _gather(record, specs, flat, "a float buffer")


def flat_to_record(
    flat: torch.Tensor,
    layout: ModelLayout,
    buffers: torch.Tensor | None = None,
    extra: Mapping[str, Array] | None = None,
) -> ArrayRecord:
    """A flat [D] tensor as a Flower record with the layout's names and shapes (float32).

    ``buffers`` ([B]) adds the float buffers and ``extra`` further arrays as they are (the
    integer buffers), so the record loads into the model with ``load_state_dict``."""
    if flat.numel() != layout.numel:
        raise ValueError(f"flat tensor has {flat.numel()} elements, the layout {layout.numel}")
    arrays = _arrays(flat, layout.names, layout.shapes)
    if buffers is not None:
        if buffers.numel() != layout.buffer_numel:
            raise ValueError(
                f"buffers have {buffers.numel()} elements, the layout {layout.buffer_numel}"
            )
        arrays.update(_arrays(buffers, layout.buffer_names, layout.buffer_shapes))
    arrays.update(extra or {})
    return ArrayRecord(array_dict=arrays, keep_input=True)


def _arrays(
    flat: torch.Tensor, names: Iterable[str], shapes: Iterable[tuple[int, ...]]
) -> dict[str, Array]:
    """One float32 ``Array`` per (name, shape) segment of ``flat``."""
    values = flat.detach().to("cpu", torch.float32).contiguous().numpy().reshape(-1)
    arrays: dict[str, Array] = {}
    start = 0
    for name, shape in zip(names, shapes, strict=True):
        part = values[start : start + int(np.prod(shape, dtype=np.int64))].reshape(shape)
        start += part.size
        arrays[name] = Array(
            dtype=str(part.dtype), shape=tuple(part.shape), stype=NUMPY_STYPE, data=_npy(part)
        )
    return arrays


def _npy(a: np.ndarray) -> bytes:
    """``np.save`` bytes of a C-contiguous array: the header, then the values (one copy)."""
    header = repr({"descr": a.dtype.str, "fortran_order": False, "shape": tuple(a.shape)})
    # Version 1.0 header padded so the values start at a multiple of 64 (what np.save does).
    pad = 64 - (10 + len(header) + 1) % 64
    text = (header + " " * pad + "\n").encode("latin1")
    return NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(text)) + text + a.tobytes()
