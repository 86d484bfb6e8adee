"""Differential privacy's client-side clipping: what a client sends when its job's recipe sets
``clip_norm`` (the server's strategy runs with ``dp_clipping = "client"``, docs/privacy.md).

The delta (the client's weights minus the job's weights) is scaled down to the L2 norm
``clip_norm`` over the whole model, measured in float64, with a margin for the rounding to the
wire's dtype (0.8 % for bfloat16). A DELTA update is the scaled delta; a WEIGHTS update is the
job's weights plus it. The server measures the norm again and refuses a delta more than 0.1 %
above ``clip_norm``.
"""

from __future__ import annotations

import torch

from aggsrv.values import UpdateKind

__all__ = ["clip_update"]


def clip_update(
    tensor: torch.Tensor,
    kind: UpdateKind,
    base: torch.Tensor,
    clip_norm: float,
    wire_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``tensor`` (a flat update of ``kind``) with its delta scaled to at most ``clip_norm``
    once rounded to ``wire_dtype`` (the dtype it travels in: rounding to nearest moves each
    element by at most its unit roundoff, so the norm is aimed that much below the bound);
    ``tensor`` itself when it is within the bound (never modified in place)."""
    delta = tensor if kind is UpdateKind.DELTA else tensor.double() - base.double()
    norm = float(torch.linalg.vector_norm(delta, dtype=torch.float64))
    bound = clip_norm / (1.0 + torch.finfo(wire_dtype).eps)
    if norm <= bound:
        return tensor
    factor = bound / norm
    if kind is UpdateKind.DELTA:
        return (tensor.double() * factor).to(tensor.dtype)
    return (base.double() + delta * factor).to(tensor.dtype)
