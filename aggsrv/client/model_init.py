"""The initial model for ``aggsrv serve --model-init FILE``, classified into trainable tensors
and float buffers exactly as a client's :meth:`ModelLayout.from_module` does, so the server's
layout (hash and buffers) is the one every client of that model registers with.

FILE is either a plain ``torch.save(model.state_dict())`` or, for models a state dict cannot
describe (frozen parameters, float buffers other than BatchNorm statistics, LayerNorm or
GroupNorm parameters that strategies treat as norm parameters), what :func:`save_model_init`
writes: the state dict with the client's layout beside it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from aggsrv.layout import ModelLayout

__all__ = ["load_model_init", "save_model_init", "state_dict_layout"]

FORMAT_KEY = "aggsrv_model_init"  # version of save_model_init's format
_RUNNING_STATS = ("running_mean", "running_var")


def save_model_init(model: nn.Module, path: str | os.PathLike[str]) -> ModelLayout:
    """Write `model` for ``--model-init`` with the layout a client builds from it; returns it."""
    layout = ModelLayout.from_module(model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({FORMAT_KEY: 1, "layout": layout.to_dict(), "state_dict": state}, path)
    return layout


def state_dict_layout(state: Mapping[str, Any]) -> ModelLayout:
    """The layout a client builds from a module of torch.nn layers with this state dict: the
    BatchNorm/InstanceNorm running statistics are float buffers (their modules are the norm
    layers), num_batches_tracked stays outside, every other float tensor is trainable, and a
    tensor stored under several names (tied weights) is laid out once, under its first."""
    trainable: list[str] = []
    seen: set[tuple[Any, ...]] = set()
    for name, value in state.items():
        if not torch.is_tensor(value) or not value.is_floating_point():
            continue
        if name.rpartition(".")[2] in _RUNNING_STATS:
            continue
        if value.numel():
            key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if key in seen:
                continue
            seen.add(key)
        trainable.append(name)
    return ModelLayout.from_state_dict(state, trainable)


def load_model_init(
    path: str | os.PathLike[str],
) -> tuple[ModelLayout, torch.Tensor, torch.Tensor | None]:
    """(layout, flat float32 weights, flat float32 buffers or None) from a --model-init file."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: expected a state dict saved with torch.save")
    if FORMAT_KEY in saved:
        if saved[FORMAT_KEY] != 1 or not isinstance(saved.get("state_dict"), dict):
            raise ValueError(f"{path}: not a model file save_model_init wrote (format 1)")
        layout = ModelLayout.from_dict(saved["layout"])
        state = saved["state_dict"]
    else:
        state = saved
        layout = state_dict_layout(state)
    weights = layout.flatten(state, dtype=torch.float32)
    buffers = layout.flatten_buffers(state, dtype=torch.float32) if layout.buffer_numel else None
    return layout, weights, buffers
