"""Everything a run needs before its first event, built the same way for both transports: the
data set and its split, the model and its initial weights, the straggler profile, the attackers
(and the pool of honest deltas they share, which lives here so that every trainer of the run,
the grpc transport's client threads included, reads the same one)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from aggsrv.layout import ModelLayout
from aggsrv.sim.attacks import Attack, AttackedTrainer, make_attack
from aggsrv.sim.config import SimConfig
from aggsrv.sim.ids import client_id
from aggsrv.sim.local import Evaluator, LocalTrainer

__all__ = ["RunSetup", "client_id", "prepare"]

log = logging.getLogger(__name__)


@dataclass
class RunSetup:
    config: SimConfig
    dataset: Any  # aggsrv.data.Dataset
    parts: list[np.ndarray]
    partition_summary: list[dict]
    partition_table: str
    model: nn.Module
    layout: ModelLayout
    initial: torch.Tensor  # flat float32 [D], the seeded model's weights
    profile: Any  # aggsrv.sim.profiles.Profile
    initial_buffers: torch.Tensor | None = None  # flat float32 [B] (BatchNorm statistics)
    attack: Attack | None = None  # the config's `attack`: attackers and their shared pool

    def trainer(self) -> LocalTrainer | AttackedTrainer:
        """A trainer with its own model copy; under an attack, one that sends what the
        attackers craft."""
        trainer = LocalTrainer(
            copy.deepcopy(self.model),
            self.layout,
            self.dataset.x_train,
            self.dataset.y_train,
            self.parts,
            self.config.seed,
        )
        return trainer if self.attack is None else self.attack.wrap(trainer)

    def evaluator(self) -> Evaluator:
        return Evaluator(
            copy.deepcopy(self.model),
            self.layout,
            self.dataset.x_test,
            self.dataset.y_test,
            self.config.eval_batch_size,
        )


def prepare(config: SimConfig) -> RunSetup:
    """Load and split the data, build the seeded model and the profile; clear errors early."""
    from aggsrv.data import format_summary, load_dataset, partition, summarize
    from aggsrv.sim.models import build_model
    from aggsrv.sim.profiles import make_profile

    if config.threads:
        torch.set_num_threads(config.threads)
    ds = load_dataset(config.dataset, data_dir=config.data_dir, seed=config.seed)
    labels = ds.y_train.numpy()
    parts = partition(labels, config.clients, config.partition, config.seed, ds.num_classes)
    summary = summarize(parts, labels, ds.num_classes)
    torch.manual_seed(config.seed)
    model = build_model(config.model, ds.input_shape, ds.num_classes, **config.model_config)
    layout = ModelLayout.from_module(model)
    initial = layout.flatten(model, dtype=torch.float32).clone()
    initial_buffers = (
        layout.flatten_buffers(model, dtype=torch.float32).clone() if layout.buffer_numel else None
    )
    # The split's label counts: dropout:choose=label drops the clients holding the most of one.
    label_counts = np.array([row["labels"] for row in summary], dtype=np.int64)
    profile = make_profile(
        config.profile,
        config.clients,
        config.seed,
        base_time=config.base_time,
        label_counts=label_counts.reshape(config.clients, ds.num_classes),
    )
    attack = make_attack(config.attack, config.clients, config.seed, ds.num_classes)
    return RunSetup(
        config=config,
        dataset=ds,
        parts=parts,
        partition_summary=summary,
        partition_table=format_summary(summary),
        model=model,
        layout=layout,
        initial=initial,
        profile=profile,
        initial_buffers=initial_buffers,
        attack=attack,
    )
