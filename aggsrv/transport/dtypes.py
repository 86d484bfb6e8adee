"""Wire dtypes and the conversions between float tensors and their little-endian wire bytes.

The wire carries float32, float16 or bfloat16 (the high 16 bits of an IEEE float32, which is what
torch's bfloat16 stores), little-endian. On a little-endian host a float32 CPU tensor is its own
wire image (zero copy); half types cost exactly one conversion pass.
"""

from __future__ import annotations

import enum
import sys
import warnings

import torch

from .errors import UnsupportedDtype

__all__ = ["WireDtype", "from_wire", "is_wire_image", "to_wire", "wire_view"]

# Read at call time (not folded into constants) so tests can exercise the big-endian path.
_NATIVE_LITTLE = sys.byteorder == "little"


class WireDtype(enum.Enum):
    """A dtype on the wire: its name, element size in bytes and the torch dtype that holds it."""

    FLOAT32 = ("float32", 4, torch.float32)
    FLOAT16 = ("float16", 2, torch.float16)
    BFLOAT16 = ("bfloat16", 2, torch.bfloat16)

    def __init__(self, wire_name: str, itemsize: int, torch_dtype: torch.dtype) -> None:
        self.wire_name = wire_name
        self.itemsize = itemsize
        self.torch_dtype = torch_dtype

    @classmethod
    def parse(cls, value: WireDtype | str | torch.dtype) -> WireDtype:
        """A WireDtype from itself, a name ("float16", "FLOAT16", "bf16") or a torch dtype."""
        if isinstance(value, WireDtype):
            return value
        if isinstance(value, torch.dtype):
            for wd in cls:
                if wd.torch_dtype == value:
                    return wd
        elif isinstance(value, str):
            key = value.strip().lower()
            # Proto enums are often spelled DTYPE_FLOAT16 / WIRE_DTYPE_FLOAT16.
            for prefix in ("wire_dtype_", "dtype_"):
                key = key.removeprefix(prefix)
            key = _ALIASES.get(key, key)
            for wd in cls:
                if wd.wire_name == key:
                    return wd
        supported = ", ".join(wd.wire_name for wd in cls)
        raise UnsupportedDtype(f"unsupported wire dtype {value!r}: the wire carries {supported}")


_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def _swap_bytes(u8: torch.Tensor, itemsize: int) -> torch.Tensor:
    """A new contiguous uint8 tensor with the bytes of every element reversed."""
    return u8.view(-1, itemsize).flip(1).reshape(-1)


def is_wire_image(tensor: torch.Tensor, wire_dtype: WireDtype) -> bool:
    """True when a CPU tensor's memory already is its wire bytes (to_wire will not copy)."""
    return (
        _NATIVE_LITTLE
        and tensor.device.type == "cpu"
        and tensor.dtype == wire_dtype.torch_dtype
        and tensor.is_contiguous()
    )


def to_wire(tensor: torch.Tensor, wire_dtype: WireDtype) -> torch.Tensor:
    """`tensor` flattened to a contiguous CPU uint8 tensor of its little-endian wire bytes.

    No copy for a contiguous float32 CPU tensor sent as float32 on a little-endian host; one
    conversion pass otherwise (on the tensor's own device first, so a GPU ships half the bytes).
    """
    if not tensor.is_floating_point():
        raise UnsupportedDtype(
            f"cannot send a {tensor.dtype} tensor: only floating-point tensors go on the wire"
        )
    t = tensor.detach().to(dtype=wire_dtype.torch_dtype).to(device="cpu")
    flat = t.reshape(-1).contiguous()
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # torch calls a 0- or 1-element tensor contiguous whatever its stride, and .view
        # needs a unit stride: give it a fresh one.
        flat = torch.empty(flat.numel(), dtype=flat.dtype).copy_(flat)
    u8 = flat.view(torch.uint8)
    return u8 if _NATIVE_LITTLE else _swap_bytes(u8, wire_dtype.itemsize)


def wire_view(u8: torch.Tensor) -> memoryview:
    """A byte memoryview of a contiguous CPU uint8 tensor (zero copy; keeps the tensor alive)."""
    return memoryview(u8.numpy())


def from_wire(data: memoryview, wire_dtype: WireDtype) -> torch.Tensor:
    """A 1-D torch tensor of `wire_dtype` over the wire bytes `data` (zero copy when possible).

    The result may alias `data` (possibly read-only): only read from it, e.g. as `copy_` source.
    """
    if _NATIVE_LITTLE:
        return torch.frombuffer(data, dtype=wire_dtype.torch_dtype)
    u8 = torch.frombuffer(data, dtype=torch.uint8)
    return _swap_bytes(u8, wire_dtype.itemsize).view(wire_dtype.torch_dtype)


def _prime_frombuffer_warning() -> None:
    """Consume torch's warn-once about read-only buffers (protobuf `bytes` are read-only).

    from_wire only ever reads the aliasing tensor, so the warning does not apply; torch emits it
    once per process, so firing it here under a local filter silences it without touching the
    global warning filters.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0\0\0\0", dtype=torch.uint8)


_prime_frombuffer_warning()
