"""Flower's ``ArrayRecord`` <-> aggsrv's flat layout.

A Flower ``Array`` holds its tensor as NumPy ``.npy`` bytes. Reading parses the NPY header and
views the payload in place (``np.frombuffer``: no copy), so turning a record into our flat [D]
vector costs one copy, into the flat buffer itself. Writing builds each ``Array``'s NPY bytes
straight from a view of the flat vector (one copy, into the bytes Flower keeps).
"""

from __future__ import annotations

import ast
import functools
import struct

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from aggsrv.layout import ModelLayout

NPY_MAGIC = b"\x93NUMPY"
NUMPY_STYPE = "numpy.ndarray"


def layout_of(record: ArrayRecord) -> ModelLayout:
    """The flat layout of a record: its arrays in record order, every one trainable."""
    return ModelLayout.from_named_shapes([(name, tuple(record[name].shape)) for name in record])


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


def record_to_flat(
    record: ArrayRecord, layout: ModelLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The record's arrays, in the layout's order, as one flat float32 [D] tensor."""
    names = list(record)
    if names != list(layout.names):
        raise ValueError(
            f"the record's arrays {names[:4]}... are not the layout's {list(layout.names)[:4]}..."
        )
    flat = torch.empty(layout.numel, dtype=torch.float32) if out is None else out
    flat_np = flat.numpy()
    offsets = layout.offsets.tolist()
    for i, name in enumerate(names):
        values = npy_view(record[name])
        if tuple(values.shape) != tuple(layout.shapes[i]):
            raise ValueError(
                f"array {name!r} has shape {values.shape}, the layout {layout.shapes[i]}"
            )
        # One copy (with the dtype conversion when the client sent float64 or float16).
        flat_np[offsets[i] : offsets[i + 1]] = values.reshape(-1)
    return flat


def flat_to_record(flat: torch.Tensor, layout: ModelLayout) -> ArrayRecord:
    """A flat [D] tensor as a Flower record with the layout's names and shapes (float32)."""
    if flat.numel() != layout.numel:
        raise ValueError(f"flat tensor has {flat.numel()} elements, the layout {layout.numel}")
    values = flat.detach().to("cpu", torch.float32).contiguous().numpy()
    offsets = layout.offsets.tolist()
    arrays: dict[str, Array] = {}
    for i, (name, shape) in enumerate(zip(layout.names, layout.shapes, strict=True)):
        part = values[offsets[i] : offsets[i + 1]].reshape(shape)
        arrays[name] = Array(
            dtype=str(part.dtype), shape=tuple(part.shape), stype=NUMPY_STYPE, data=_npy(part)
        )
    return ArrayRecord(array_dict=arrays, keep_input=True)


def _npy(a: np.ndarray) -> bytes:
    """``np.save`` bytes of a C-contiguous array: the header, then the values (one copy)."""
    header = repr({"descr": a.dtype.str, "fortran_order": False, "shape": tuple(a.shape)})
    # Version 1.0 header padded so the values start at a multiple of 64 (what np.save does).
    pad = 64 - (10 + len(header) + 1) % 64
    text = (header + " " * pad + "\n").encode("latin1")
    return NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(text)) + text + a.tobytes()
