"""Bit-identity of nested state dicts, shared by the strategy and server tests (tests/ is not a
package: import as `from state_helpers import assert_same_state`)."""

from __future__ import annotations

from typing import Any

import torch


def assert_same_state(a: Any, b: Any, path: str = "state") -> None:
    """Tensors byte for byte (so NaN payloads and -0.0 count) with equal dtype and shape;
    dicts with the same keys in the same order; lists/tuples of the same type; == for the rest."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (
            f"{path}: tensor values differ"
        )
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} / {b}"
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
