"""The settings every strategy shares (each strategy's config extends :class:`StrategyConfig`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from aggsrv.config_check import Count, check_fields
from aggsrv.config_file import Described
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
class StrategyConfig(Described):
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
    max_num_samples: Count = DEFAULT_MAX_NUM_SAMPLES
    job_lease_seconds: float | None = DEFAULT_JOB_LEASE_SECONDS
    preset: str | None = None

    # Named sets of values (e.g. "paper": the paper's experimental settings) that a config
    # selects with ``preset = "NAME"``; keys set beside the preset override its values.
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    # A one-line note per preset, printed beside its name by --print-config.
    PRESET_NOTES: ClassVar[Mapping[str, str]] = {}
    # The strategy's name in error messages: by default the class name without "Config",
    # lowercased, which is the strategy's name for every built-in strategy.
    KIND: ClassVar[str] = "strategy"
    # One line per key (aggsrv.config_file.Described: --print-config, docs/config.md), merged
    # along the class hierarchy by field_help, so a subclass that only changes a default keeps
    # its parent's description. A key whose value may be None says what "unset" means.
    HELP: ClassVar[Mapping[str, str]] = {
        "seed": "seed of the strategy's random choices (e.g. client sampling)",
        "learning_rate": "client learning rate",
        "local_epochs": "local epochs per job (fractions allowed); unset = local_steps, or 1 epoch",
        "local_steps": "local mini-batch steps per job; unset = local_epochs",
        "batch_size": "client mini-batch size",
        "momentum": "client SGD momentum",
        "weight_decay": "client weight decay",
        "max_staleness": "refuse updates more versions behind than this; unset = no bound",
        "max_update_norm": "refuse updates whose delta has a larger L2 norm; unset = no bound",
        "max_num_samples": "refuse updates that declare more samples than this",
        "job_lease_seconds": "retire a job this long after it was issued; unset = never",
        "preset": "a named set of values (listed above); keys given beside it win; unset = none",
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "KIND" not in vars(cls):
            cls.KIND = cls.__name__.removesuffix("Config").lower()

    def __post_init__(self) -> None:
        """Check the shared values; subclasses extend this."""
        # Types first (every field, the subclass's too), so the range checks compare numbers.
        check_fields(self, self.KIND)
        if self.preset is not None:
            self._check_preset(self.preset)
        if self.local_epochs is not None and self.local_steps is not None:
            raise ValueError("set local_epochs or local_steps, not both")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        bound = self.max_update_norm
        if bound is not None and not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"max_update_norm must be a finite number > 0 or None, got {bound}")
        lease = self.job_lease_seconds
        if lease is not None and not (math.isfinite(lease) and lease > 0):
            raise ValueError(f"job_lease_seconds must be a finite number > 0 or None, got {lease}")
        self.recipe()  # validates the recipe fields with Recipe's messages

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None = None) -> Self:
        """Build from a mapping (a TOML table), rejecting keys the config does not have."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        private = [k for k in data if k.startswith("dp_") and k not in known]
        if private:
            from aggsrv.strategies.privacy import refuse_privacy_keys

            refuse_privacy_keys(cls.KIND, private)
        for key in data:
            if key not in known:
                raise ValueError(
                    f"unknown {cls.__name__} key {key!r}; known keys: {', '.join(sorted(known))}"
                )
        preset = data.get("preset", cls.__dataclass_fields__["preset"].default)
        if isinstance(preset, str):  # another type is refused by the type check, naming it
            cls._check_preset(preset)
            data = {**cls.PRESETS[preset], **data}
        return cls(**data)

    @classmethod
    def typed(cls, config: StrategyConfig | Mapping[str, Any] | None, strategy: str) -> Self:
        """``config`` as this class: a config object as it is (TypeError naming ``strategy``
        unless it is one of this class), keys as :meth:`from_dict` reads them."""
        if not isinstance(config, StrategyConfig):
            return cls.from_dict(config)
        if not isinstance(config, cls):
            raise TypeError(f"{strategy} needs a {cls.__name__}, got {type(config).__name__}")
        return config

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
            # Differential privacy's client-side clipping (PrivacyConfig), else None.
            clip_norm=getattr(self, "client_clip_norm", None),
            **overrides,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values."""
        return dataclasses.asdict(self)

    @classmethod
    def offered_keys(cls) -> list[str]:
        """The keys a user may set: every field, but the ``dp_`` keys only for a strategy that
        supports differential privacy (FedEN has FedAvg's fields, and refuses them)."""
        from aggsrv.strategies.privacy import DP_STRATEGIES

        names = [f.name for f in dataclasses.fields(cls)]
        if cls.KIND in DP_STRATEGIES:
            return names
        return [n for n in names if not n.startswith("dp_")]
