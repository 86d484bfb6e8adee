"""The client side of :class:`~aggsrv.integrations.flower.AggsrvStrategy` for a Flower ClientApp.

Two ways to train a job that an AggsrvStrategy sent:

* :func:`train_job`: aggsrv's own local loop (:func:`aggsrv.client.train.train`) runs the job's
  recipe: epochs or steps, learning rate, momentum, FedProx's term, FedEN's elastic net, Fed-OGD's
  projection against the job's basis. Then :func:`reply` answers the message.
* A ClientApp's own training loop calls the per-step pieces: :func:`project_gradients_` (Fed-OGD:
  remove the component of the gradient along the job's basis, per layer or whole) after
  ``loss.backward()`` and :func:`add_elastic_net_gradient_` (FedEN's penalty) before
  ``optimizer.step()``.

Everything here works on a plain ``torch.nn.Module`` whose ``named_parameters()`` match the
record's arrays (the model the ServerApp's initial ArrayRecord came from).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from torch import nn

from aggsrv import kernels
from aggsrv.client.train import TrainResult, train
from aggsrv.integrations.flower.arrays import (
    flat_to_record,
    layout_of,
    record_to_buffers,
    record_to_flat,
)
from aggsrv.integrations.flower.strategy import BASE_VERSION, JOB_ID, LAYOUT, RECIPE_PREFIX
from aggsrv.layout import ModelLayout
from aggsrv.values import Recipe

EXTRA_PREFIX = RECIPE_PREFIX + "extra."


@dataclass(frozen=True)
class FlowerJob:
    """An AggsrvStrategy job as a ClientApp receives it."""

    job_id: int
    base_version: int
    recipe: Recipe
    layout: ModelLayout
    weights: torch.Tensor  # flat [D] float32 start weights
    tensors: Mapping[str, torch.Tensor]  # further flat job tensors by name (Fed-OGD: "basis")
    config: Mapping[str, Any]  # the whole config record (the ServerApp's own keys too)
    buffers: torch.Tensor | None = None  # flat [B] float buffers to start from (BatchNorm)


def recipe_from_config(config: Mapping[str, Any]) -> Recipe:
    """The job's recipe from the ``aggsrv.recipe.*`` keys of its config record."""
    values: dict[str, Any] = {}
    extra: dict[str, float] = {}
    for key, value in config.items():
        if key.startswith(EXTRA_PREFIX):
            extra[key[len(EXTRA_PREFIX) :]] = float(value)
        elif key.startswith(RECIPE_PREFIX):
            values[key[len(RECIPE_PREFIX) :]] = value
    if "local_steps" in values and "local_epochs" not in values:
        values["local_epochs"] = None  # a step-counted job: the dataclass default is 1 epoch
    return Recipe(**values, extra=extra)


def job_from_message(
    msg: Message, arrayrecord_key: str = "arrays", configrecord_key: str = "config"
) -> FlowerJob:
    """Decode a TRAIN message of AggsrvStrategy (ValueError if it is not one)."""
    content = msg.content
    config = dict(content[configrecord_key])
    if JOB_ID not in config:
        raise ValueError(f"the message's config has no {JOB_ID!r}: not an AggsrvStrategy job")
    arrays: ArrayRecord = content[arrayrecord_key]
    layout = _job_layout(msg, arrayrecord_key, configrecord_key)
    tensors = {
        name[len("aggsrv.") :]: record_to_flat(record, layout)
        for name, record in content.array_records.items()
        if name.startswith("aggsrv.")
    }
    return FlowerJob(
        job_id=int(config[JOB_ID]),
        base_version=int(config[BASE_VERSION]),
        recipe=recipe_from_config(config),
        layout=layout,
        weights=record_to_flat(arrays, layout),
        tensors=tensors,
        config=config,
        buffers=record_to_buffers(arrays, layout),
    )


def train_job(
    model: nn.Module, loader: Iterable[Any], job: FlowerJob, **train_kwargs: Any
) -> TrainResult:
    """Run the job's recipe on ``model`` from the job's weights and float buffers (aggsrv's
    local loop)."""
    model_layout = ModelLayout.from_module(model)
    if model_layout.hash != job.layout.hash:
        raise ValueError(
            "the model's trainable parameters (names and shapes, in named_parameters() order) "
            "differ from the job's: build the ServerApp's initial ArrayRecord from "
            "model.state_dict(), or pass model= to AggsrvStrategy when some float parameters "
            "are frozen"
        )
    # A job without statistics (a parameters-only record) leaves the model's own in place.
    if job.layout.buffer_numel and model_layout.buffer_names != job.layout.buffer_names:
        raise ValueError(
            f"the model's float buffers {list(model_layout.buffer_names)[:4]} differ from the "
            f"job's {list(job.layout.buffer_names)[:4]}"
        )
    return train(
        model, loader, job.recipe, job.weights, layout=model_layout,
        basis=job.tensors.get("basis"), start_buffers=job.buffers, **train_kwargs,
    )  # fmt: skip


def reply(
    msg: Message,
    weights: torch.Tensor | nn.Module,
    num_examples: int,
    metrics: Mapping[str, float] | None = None,
    layout: ModelLayout | None = None,
    buffers: torch.Tensor | None = None,
) -> Message:
    """The reply AggsrvStrategy expects: final weights (and float buffers: BatchNorm's running
    statistics) as "arrays", "num-examples" and any further metrics in "metrics".

    ``weights`` is the trained model, or its flat [D] weights with ``layout`` and, when the
    layout has float buffers, the flat [B] ``buffers``. Statistics go back only when the job
    carried some (a parameters-only job leaves each client its own)."""
    with_stats = bool(_job_layout(msg).buffer_numel)
    if isinstance(weights, nn.Module):
        layout = ModelLayout.from_module(weights)
        flat = layout.flatten(weights, dtype=torch.float32)
        if with_stats and layout.buffer_numel:
            buffers = layout.flatten_buffers(weights, dtype=torch.float32)
    else:
        if layout is None:
            raise ValueError("a flat weights tensor needs its layout")
        flat = weights
    if with_stats and buffers is None:
        raise ValueError(
            "the job carried float buffers (BatchNorm statistics): pass the trained ones as "
            "buffers= (TrainResult.buffers)"
        )
    record = MetricRecord({"num-examples": int(num_examples), **dict(metrics or {})})
    arrays = flat_to_record(flat, layout, buffers if with_stats else None)
    content = RecordDict({"arrays": arrays, "metrics": record})
    return Message(content, reply_to=msg)


def _job_layout(
    msg: Message, arrayrecord_key: str = "arrays", configrecord_key: str = "config"
) -> ModelLayout:
    """The layout a job message was sent with: the ServerApp's, else its record's."""
    config = msg.content.config_records.get(configrecord_key, {})
    if LAYOUT in config:
        return ModelLayout.from_json(config[LAYOUT])
    return layout_of(msg.content[arrayrecord_key])


# ------------------------------------------------------------------ per-step helpers


@torch.no_grad()
def project_gradients_(
    model: nn.Module, job: FlowerJob, *, layout: ModelLayout | None = None
) -> bool:
    """Fed-OGD's step direction in place: each parameter's ``.grad`` loses its component along
    the job's basis (per tensor for a LAYERWISE recipe, over the whole vector for WHOLE; only a
    conflicting component with ``only_conflicting``). False (nothing done) without a basis or a
    projection in the recipe. Call after ``loss.backward()``, before ``optimizer.step()``."""
    basis = job.tensors.get("basis")
    mode = job.recipe.projection.value
    if basis is None or mode == "NONE" or not bool(basis.any()):
        return False
    layout = layout or ModelLayout.from_module(model)
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    g = torch.cat([_grad(p).reshape(-1) for p in params]).to(torch.float32)
    offsets = layout.offsets if mode == "LAYERWISE" else None
    kernels.project_out(
        g, basis.to(g.device), offsets, only_conflicting=job.recipe.only_conflicting, out=g
    )
    start = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(g[start : start + n].view_as(p))
        start += n
    return True


@torch.no_grad()
def add_elastic_net_gradient_(model: nn.Module, job: FlowerJob) -> bool:
    """FedEN's elastic-net subgradient added to each parameter's ``.grad`` in place:
    ``lambda*(1-alpha)*(w - a) + lambda*alpha*sign(w - a)`` with ``a = 0`` (Eq. 9) or the job's
    start weights (``elastic_centre`` = 1), the same terms and rounding as aggsrv's own loop.
    False when the recipe has no elastic net. Call after ``loss.backward()``."""
    recipe = job.recipe
    lam, alpha = float(recipe.elastic_lambda), float(recipe.elastic_alpha)
    if lam <= 0:
        return False
    if recipe.extra.get("elastic_solver", 0.0) == 1.0:
        raise ValueError("this job uses the proximal solver: use train_job, not a gradient term")
    at_start = recipe.extra.get("elastic_centre", 0.0) == 1.0
    exclude = recipe.extra.get("elastic_exclude_biases", 0.0) == 1.0
    model_layout = ModelLayout.from_module(model)  # the record's layout has no norm flags
    norm = dict(zip(model_layout.names, model_layout.is_norm.tolist(), strict=True))
    l1, l2 = lam * alpha, lam * (1.0 - alpha)
    start = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        n = p.numel()
        if exclude and (name.endswith("bias") or norm.get(name, False)):
            # Biases and normalisation parameters stay unpenalised (docs/algorithms/feden.md G14).
            start += n
            continue
        w = p.detach()
        z = w - job.weights[start : start + n].view_as(w).to(w) if at_start else w
        grad = _grad(p)
        if l2 != 0:
            grad.add_(z * l2)
        if l1 != 0:
            grad.add_(torch.sign(z), alpha=l1)
        start += n
    return True


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


__all__ = [
    "FlowerJob",
    "add_elastic_net_gradient_",
    "job_from_message",
    "project_gradients_",
    "recipe_from_config",
    "reply",
    "train_job",
]
