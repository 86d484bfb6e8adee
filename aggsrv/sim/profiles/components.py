"""The kinds of profile component: per-client factors, per-job draws, and what they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np


@dataclass
class Context:
    """What every component needs to know about the run."""

    num_clients: int
    seed: int
    index: int  # position among the profile's components of the same kind
    # [num_clients, num_classes] training examples per client and label, when the caller knows
    # the data split (the simulator does); dropouts that choose by label need it.
    label_counts: np.ndarray | None = None


class Component:
    """One ingredient of a profile, built from its checked keys."""

    kind: ClassVar[str]
    keys: ClassVar[tuple[str, ...]] = ()
    once: ClassVar[bool] = True  # at most one per profile

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


class ClientFactor(Component):
    """A per-client multiplier of the job time."""

    def factor(self, client: int) -> float:
        raise NotImplementedError


class JobDraw(Component):
    """A per-job draw: a factor (``mul``) or added virtual seconds (``add``)."""

    mode: str

    def draw(self, client: int, round_: int) -> float:
        raise NotImplementedError
