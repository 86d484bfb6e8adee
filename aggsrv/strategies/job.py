"""A unit of client work as a strategy hands it out and keeps it until the update arrives."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from aggsrv.values import Recipe

__all__ = ["Job"]


@dataclass(frozen=True, eq=False)
class Job:
    """One unit of client work: start from ``tensors["weights"]`` (version ``base_version``).

    ``deadline`` is in seconds on the strategy's clock (None: no deadline). ``tensors`` maps names
    to flat [D] snapshots (always "weights"; Fed-OGD adds "basis") that are never mutated.
    """

    job_id: int
    client_id: str
    base_version: int
    deadline: float | None
    recipe: Recipe
    tensors: Mapping[str, torch.Tensor]
    issued_at: float = 0.0  # on the strategy's clock; the job's lease runs from here

    @property
    def weights(self) -> torch.Tensor:
        """The weights the client starts from."""
        return self.tensors["weights"]
