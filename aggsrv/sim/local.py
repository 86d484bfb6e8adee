"""What a simulated client and the evaluator do with data: seeded batches, local training of a
job through :func:`aggsrv.client.train` (the same loop real clients run), and test evaluation.

Both transports use these, so a client's local work depends only on (seed, client, round) and
the job's weights: `inproc` and `grpc` runs train the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from aggsrv.client.train import TrainResult, train
from aggsrv.layout import ModelLayout

__all__ = ["ClientBatches", "Evaluator", "LocalTrainer", "draw_seed", "partial_recipe"]

# Streams of draws seeded by (seed, client, round, stream): distinct from the profile's.
BATCH_STREAM = 101


def draw_seed(*key: int) -> int:
    """A 63-bit seed from a tuple of integers (numpy's SeedSequence mixes them well)."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(2, np.uint64)[0] >> 1)


class ClientBatches:
    """Mini-batches of one client's examples, reshuffled per pass by a seeded generator.

    A plain tensor-indexing loader: a DataLoader's worker and collate machinery costs more than
    the training step for the small models simulations use.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> None:
        if x.shape[0] == 0:
            raise ValueError("a client has no examples: use fewer clients or another partition")
        self.x, self.y = x, y
        self.batch_size = batch_size
        self._gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(self.x.shape[0] / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(self.x.shape[0], generator=self._gen)
        for i in range(0, order.numel(), self.batch_size):
            idx = order[i : i + self.batch_size]
            yield self.x[idx], self.y[idx]


def partial_recipe(recipe, fraction: float):
    """The recipe a straggler runs when it does only ``fraction`` of the local work (FedEN)."""
    if fraction >= 1.0:
        return recipe
    if recipe.local_steps is not None:
        return dataclasses.replace(recipe, local_steps=max(1, round(recipe.local_steps * fraction)))
    return dataclasses.replace(recipe, local_epochs=recipe.local_epochs * fraction)


@dataclass
class LocalTrainer:
    """One model instance that trains every simulated client's jobs in turn."""

    model: nn.Module
    layout: ModelLayout
    x: torch.Tensor  # the training set, all clients
    y: torch.Tensor
    parts: list[np.ndarray]  # example indices per client
    seed: int

    def __post_init__(self) -> None:
        # Each client's examples gathered once: indexing the whole set per batch would copy more.
        self._xs = [self.x[torch.from_numpy(p)] for p in self.parts]
        self._ys = [self.y[torch.from_numpy(p)] for p in self.parts]

    def num_samples(self, client: int) -> int:
        return int(self._ys[client].shape[0])

    def labels(self, client: int) -> torch.Tensor:
        """The labels ``client`` trains on."""
        return self._ys[client]

    def set_labels(self, client: int, labels: torch.Tensor) -> None:
        """Replace ``client``'s training labels (a data-poisoning attack), one per example."""
        if labels.shape != self._ys[client].shape:
            raise ValueError(
                f"client {client} has {self._ys[client].shape[0]} examples, got labels of "
                f"shape {tuple(labels.shape)}"
            )
        self._ys[client] = labels.to(self._ys[client].dtype)

    def run(
        self,
        client: int,
        round_: int,
        weights: torch.Tensor,
        recipe,
        work_fraction: float = 1.0,
        basis: torch.Tensor | None = None,
        buffers: torch.Tensor | None = None,
    ) -> TrainResult:
        """Train ``client``'s job number ``round_`` from ``weights`` (and the job's float
        ``buffers``, when the model has any); the result owns its tensors."""
        recipe = partial_recipe(recipe, work_fraction)
        batches = ClientBatches(
            self._xs[client],
            self._ys[client],
            recipe.batch_size,
            draw_seed(self.seed, client, round_, BATCH_STREAM),
        )
        return train(
            self.model, batches, recipe, weights, layout=self.layout, basis=basis,
            start_buffers=buffers, device="cpu",
        )  # fmt: skip


class Evaluator:
    """Test accuracy and mean cross-entropy of flat global weights."""

    def __init__(
        self,
        model: nn.Module,
        layout: ModelLayout,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int = 2048,
    ) -> None:
        self.model = model
        self.layout = layout
        self.x, self.y = x, y
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(
        self, weights: torch.Tensor, buffers: torch.Tensor | None = None
    ) -> tuple[float, float]:
        self.layout.unflatten(weights, self.model)
        if buffers is not None:
            self.layout.unflatten_buffers(buffers, self.model)
        self.model.eval()
        correct = 0
        loss = 0.0
        for i in range(0, self.x.shape[0], self.batch_size):
            xb, yb = self.x[i : i + self.batch_size], self.y[i : i + self.batch_size]
            logits = self.model(xb)
            loss += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
        n = self.x.shape[0]
        return correct / n, loss / n
