"""The settings every strategy shares (each strategy's config extends :class:`StrategyConfig`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from aggsrv.values import Recipe

__all__ = ["DEFAULT_JOB_LEASE_SECONDS", "DEFAULT_MAX_NUM_SAMPLES", "StrategyConfig"]

# The largest num_samples an update may declare unless the config says otherwise: more than any
# one client's local data in the usual benchmarks, small enough that a client cannot claim the
# weight of a whole federation by writing 2^64 - 1 into its header.
DEFAULT_MAX_NUM_SAMPLES = 1_000_000
# How long an issued job stays open unless the config says otherwise: far longer than local
# training takes, short enough that clients that went away do not pin model copies for good.
DEFAULT_JOB_LEASE_SECONDS = 3600.0


@dataclass
class StrategyConfig:
    """Settings every strategy shares: the client recipe, staleness bound and sampling seed,
    and the bounds every update must meet.

    ``local_epochs`` and ``local_steps`` are exclusive; with neither set a job is one epoch.
    ``max_update_norm`` (None: off) refuses an update whose delta (client weights minus the
    job's weights) has a larger L2 norm; ``max_num_samples`` refuses a larger ``num_samples``.
    ``job_lease_seconds`` (None: no lease) retires a job that long after it was issued, freeing
    the weights it started from; its update is then refused like a superseded job's.
    ``preset`` names one of the class's :attr:`PRESETS` (see :meth:`from_dict`).
    """

    seed: int = 0
    learning_rate: float = 0.01
    local_epochs: float | None = None
    local_steps: int | None = None
    batch_size: int = 32
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_staleness: int | None = None
    max_update_norm: float | None = None
    max_num_samples: int = DEFAULT_MAX_NUM_SAMPLES
    job_lease_seconds: float | None = DEFAULT_JOB_LEASE_SECONDS
    preset: str | None = None

    # Named sets of values (e.g. "paper": the paper's experimental settings) that a config
    # selects with ``preset = "NAME"``; keys set beside the preset override its values.
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    # One line per preset that needs saying, e.g. why the "paper" preset cannot learn in a short
    # run (``--print-config`` shows them).
    PRESET_NOTES: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        """Check the shared values; subclasses extend this."""
        if self.preset is not None:
            self._check_preset(self.preset)
        if self.local_epochs is not None and self.local_steps is not None:
            raise ValueError("set local_epochs or local_steps, not both")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        bound = self.max_update_norm
        if bound is not None and not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"max_update_norm must be a finite number > 0 or None, got {bound}")
        n = self.max_num_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_num_samples must be an integer >= 1, got {n!r}")
        lease = self.job_lease_seconds
        if lease is not None and not (math.isfinite(lease) and lease > 0):
            raise ValueError(f"job_lease_seconds must be a finite number > 0 or None, got {lease}")
        self.recipe()  # validates the recipe fields with Recipe's messages

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None = None) -> Self:
        """Build from a mapping (a TOML table), rejecting keys the config does not have."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(
                    f"unknown {cls.__name__} key {key!r}; known keys: {', '.join(sorted(known))}"
                )
        preset = data.get("preset", cls.__dataclass_fields__["preset"].default)
        if preset is not None:
            cls._check_preset(preset)
            data = {**cls.PRESETS[preset], **data}
        return cls(**data)

    @classmethod
    def _check_preset(cls, preset: object) -> None:
        if preset not in cls.PRESETS:
            names = ", ".join(sorted(cls.PRESETS)) or "none"
            raise ValueError(f"unknown {cls.__name__} preset {preset!r}; presets: {names}")

    def recipe(self, **overrides: Any) -> Recipe:
        """The client recipe these settings describe."""
        epochs = self.local_epochs
        if epochs is None and self.local_steps is None:
            epochs = 1.0
        return Recipe(
            local_epochs=epochs,
            local_steps=self.local_steps,
            learning_rate=self.learning_rate,
            batch_size=self.batch_size,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            **overrides,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values."""
        return dataclasses.asdict(self)
