"""Per-update Byzantine filters for the strategies that fold one update in at a time (FedAsync,
ORTHOFL, FedDGIC, Fed-OGD): checks that need no other client's row, only the arriving update and
a small state of the accepted ones (docs/strategies.md "Update filters").

A strategy config's ``update_filter`` holds a chain of ``name:key=value`` steps joined by ``>``
(:mod:`aggsrv.spec_text`), applied in order to the update's delta ``u`` = client weights minus
the job's start weights (float64); a step sees the delta the previous step let through.

* ``norm:factor=3.0,window=50,warmup=5``: refuse (Status.FILTERED, NORM_OUTLIER) when
  ``|u| > factor * median(|u_j|)`` over the norms of the last ``window`` accepted updates; while
  fewer than ``warmup`` were accepted every update passes.
* ``centered_clip:tau=none,beta=0.9,factor=2.0,window=50,warmup=5``: the asynchronous form of
  centered clipping (Karimireddy, He and Jaggi 2021): with the centre ``v`` (zero at start) the
  delta becomes ``u' = v + (u - v) * min(1, tau / |u - v|)``, which the strategy then applies;
  after it was folded in, ``v <- beta v + (1 - beta) u'`` (server momentum of the accepted
  updates). Clipping is not a refusal: the update is APPLIED or BUFFERED as usual and counted.
  ``tau`` unset: ``tau = factor * median(|u_j - v_j|)`` over the last ``window`` accepted
  updates' distances to the centre (before clipping), no clipping while fewer than ``warmup``
  were accepted. Why: the centred-clipping analysis wants ``tau`` of the order of the honest
  updates' spread around the momentum; with an honest majority the median distance estimates
  that spread whatever the minority sends, and in high dimension honest distances concentrate
  near it, so ``factor = 2`` leaves honest updates (nearly always) untouched while an outlier is
  pulled to twice the typical distance.

Both are a deterministic function of the filter state and the update (float64 norms, medians
of floats), so a server that replays its write-ahead log reaches the same decisions. On a
sharded server every norm is of the whole model (the strategy's ``whole_norm``/``delta_norm``
sum squared norms over the shards), so every shard decides alike.

The chain changes no state while it screens (:meth:`UpdateFilters.screen`): the strategy folds
the update in first and then calls :meth:`UpdateFilters.commit`, or, for a refusal,
:meth:`UpdateFilters.count_refusal`. Memory: ``centered_clip`` keeps ``v`` ([D] float64), one
[D] float64 scratch (``u - v``) and a [D] float32 buffer for the clipped update, and makes two
[D] float64 temporaries while it screens (the delta, and u' when it clips).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from aggsrv.spec_text import NamedSpec, check_params, parse_chain
from aggsrv.strategies.config import StrategyConfig
from aggsrv.strategies.job import Job
from aggsrv.values import FilterReason, Update, UpdateKind

__all__ = [
    "FILTER_NAMES", "CenteredClip", "FilteredConfig", "NormFilter", "Screening", "UpdateFilters",
    "parse",
]  # fmt: skip

logger = logging.getLogger(__name__)

WHAT = "update_filter"


def _median(values: list[float]) -> float:
    """The median (the mean of the two middle values for an even count), in float64."""
    return float(np.median(np.asarray(values, dtype=np.float64)))


def _check_window(spec: NamedSpec, window: int, warmup: int) -> None:
    if window < 1:
        raise ValueError(f"{WHAT} {spec.name!r}: window must be >= 1, got {window}")
    if not 1 <= warmup <= window:
        raise ValueError(f"{WHAT} {spec.name!r}: warmup must be in [1, window], got {warmup}")


def _positive(spec: NamedSpec, key: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{WHAT} {spec.name!r}: {key} must be a finite number > 0, got {value}")


@dataclass
class _Step:
    """One step's verdict on an update: a refusal, or what to keep once it is folded in."""

    refusal: tuple[FilterReason, str] | None = None
    clipped: bool = False
    commit: Callable[[], None] | None = None


class NormFilter:
    """``norm``: refuse a delta whose norm is over ``factor`` times the median of the last
    ``window`` accepted norms (none refused during the first ``warmup``)."""

    name: ClassVar[str] = "norm"
    PARAMS: ClassVar[Mapping[str, Any]] = {"factor": float, "window": int, "warmup": int}

    def __init__(self, spec: NamedSpec) -> None:
        p = check_params(WHAT, spec, self.PARAMS)
        self.factor = float(p.get("factor", 3.0))
        self.window = int(p.get("window", 50))
        self.warmup = int(p.get("warmup", 5))
        _positive(spec, "factor", self.factor)
        _check_window(spec, self.window, self.warmup)
        self.norms: list[float] = []  # of the last `window` accepted updates, oldest first

    def bound(self) -> float | None:
        """The largest norm that passes now (None: warm-up, everything passes)."""
        if len(self.norms) < self.warmup:
            return None
        return self.factor * _median(self.norms)

    def screen(self, norm: float) -> _Step:
        bound = self.bound()
        if bound is not None and not norm <= bound:
            return _Step(
                refusal=(
                    FilterReason.NORM_OUTLIER,
                    f"the update's delta has L2 norm {norm:.6g}, above {self.factor:g} x the "
                    f"median {bound / self.factor:.6g} of the last {len(self.norms)} accepted "
                    "updates' norms (update_filter 'norm'); it was not folded in",
                )
            )

        def keep() -> None:
            self.norms.append(norm)
            del self.norms[: -self.window]

        return _Step(commit=keep)

    def state_dict(self) -> dict[str, Any]:
        return {"norms": list(self.norms)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.norms = [float(x) for x in state["norms"]][-self.window :]


class CenteredClip:
    """``centered_clip``: replace the delta by ``v + (u - v) min(1, tau / |u - v|)`` around the
    momentum ``v`` of the accepted (clipped) deltas (module docstring: the adaptive ``tau``)."""

    name: ClassVar[str] = "centered_clip"
    PARAMS: ClassVar[Mapping[str, Any]] = {
        "tau": (float, type(None)), "beta": float, "factor": float, "window": int, "warmup": int,
    }  # fmt: skip

    def __init__(self, spec: NamedSpec, dim: int, device: torch.device) -> None:
        p = check_params(WHAT, spec, self.PARAMS)
        self.tau = p.get("tau")
        self.beta = float(p.get("beta", 0.9))
        self.factor = float(p.get("factor", 2.0))
        self.window = int(p.get("window", 50))
        self.warmup = int(p.get("warmup", 5))
        if self.tau is not None:
            _positive(spec, "tau", self.tau)
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"{WHAT} {spec.name!r}: beta must be in [0, 1), got {self.beta}")
        _positive(spec, "factor", self.factor)
        _check_window(spec, self.window, self.warmup)
        self.dim, self.device = dim, device
        self.centre = torch.zeros(dim, dtype=torch.float64, device=device)  # v
        self.distances: list[float] = []  # |u - v| of the last `window` accepted updates
        self._diff = torch.empty(0, dtype=torch.float64, device=device)  # u - v, until commit
        self._out = torch.empty(0, dtype=torch.float32, device=device)  # u', for the strategy

    def radius(self) -> float | None:
        """``tau`` now (None: adaptive and still warming up, no clipping)."""
        if self.tau is not None:
            return float(self.tau)
        if len(self.distances) < self.warmup:
            return None
        return self.factor * _median(self.distances)

    def screen(
        self, delta64: torch.Tensor, whole_norm: Callable[[torch.Tensor], float]
    ) -> tuple[_Step, torch.Tensor | None]:
        """The verdict and, when it clips, u' as float32 (a buffer reused at the next call)."""
        if self._diff.numel() != self.dim:
            self._diff = torch.empty(self.dim, dtype=torch.float64, device=self.device)
        diff = torch.sub(delta64, self.centre, out=self._diff)
        distance = whole_norm(diff)
        tau = self.radius()
        scale = 1.0 if tau is None or distance <= tau else tau / distance
        clipped_out = None
        if scale < 1.0:
            if self._out.numel() != self.dim:
                self._out = torch.empty(self.dim, dtype=torch.float32, device=self.device)
            self._out.copy_(torch.add(self.centre, diff, alpha=scale))
            clipped_out = self._out
        step = 1.0 - self.beta

        def keep() -> None:
            # v <- beta v + (1 - beta) u' with u' = v + scale (u - v): v + (1 - beta) scale (u - v)
            self.centre.add_(self._diff, alpha=step * scale)
            self.distances.append(distance)
            del self.distances[: -self.window]

        return _Step(clipped=clipped_out is not None, commit=keep), clipped_out

    def state_dict(self) -> dict[str, Any]:
        return {"centre": self.centre, "distances": list(self.distances)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        centre = state["centre"]
        if tuple(centre.shape) != (self.dim,):
            raise ValueError(
                f"saved centered_clip centre has shape {tuple(centre.shape)}, D={self.dim}"
            )
        self.centre = centre.to(device=self.device, dtype=torch.float64, copy=True)
        self.distances = [float(x) for x in state["distances"]][-self.window :]


FILTER_NAMES = (NormFilter.name, CenteredClip.name)


def parse(text: Any) -> list[NamedSpec]:
    """Check an ``update_filter`` value (names and parameters), for the config's
    ``__post_init__``; ValueError names what is wrong."""
    steps = parse_chain(text, WHAT)
    for spec in steps:
        if spec.name == NormFilter.name:
            NormFilter(spec)
        elif spec.name == CenteredClip.name:
            CenteredClip(spec, 0, torch.device("cpu"))
        else:
            raise ValueError(
                f"{WHAT} {str(spec)!r}: unknown filter {spec.name!r} (filters: "
                f"{', '.join(FILTER_NAMES)})"
            )
    return steps


@dataclass
class FilteredConfig(StrategyConfig):
    """The ``update_filter`` key of the strategies that take one update at a time."""

    HELP: ClassVar[Mapping[str, str]] = {
        "update_filter": "per-update filters joined by '>': norm:factor=3 (refuse outliers), "
        "centered_clip:beta=0.9 (clip); unset = none",
    }

    update_filter: str | None = None

    def __post_init__(self) -> None:
        """Check the filter chain, so a TOML or command-line mistake is named at once."""
        super().__post_init__()
        if self.update_filter is not None:
            parse(self.update_filter)


@dataclass
class Screening:
    """What :meth:`UpdateFilters.screen` decided: the update the strategy folds in (the
    original, or a DELTA holding the clipped delta), or a refusal."""

    update: Update
    refusal: tuple[FilterReason, str] | None = None
    clipped: bool = False
    _commits: list[Callable[[], None]] = field(default_factory=list)


class UpdateFilters:
    """An ``update_filter`` chain with its state and counters (part of the strategy's state)."""

    def __init__(self, text: str, dim: int, device: torch.device) -> None:
        self.text = text
        self._shape = (dim, device)
        self.steps: list[NormFilter | CenteredClip] = [
            NormFilter(s) if s.name == NormFilter.name else CenteredClip(s, dim, device)
            for s in parse(text)
        ]
        self.filtered: dict[str, int] = {}  # refusals by FilterReason name
        self.clipped = 0

    def screen(
        self,
        update: Update,
        job: Job,
        delta_norm: Callable[[Update, Job], float],
        whole_norm: Callable[[torch.Tensor], float],
    ) -> Screening:
        """Run the chain on ``update``; changes no state. ``delta_norm``/``whole_norm`` are the
        strategy's (whole-model norms on a sharded server)."""
        result = Screening(update)
        for f in self.steps:
            current = result.update
            if isinstance(f, NormFilter):
                step = f.screen(delta_norm(current, job))
            else:
                step, clipped = f.screen(_delta64(current, job), whole_norm)
                if clipped is not None:
                    # A new tensor: the decoder's norm was the old one's.
                    result.update = dataclasses.replace(
                        current, kind=UpdateKind.DELTA, tensor=clipped, norm=None
                    )
            if step.refusal is not None:
                return Screening(update, refusal=step.refusal)
            result.clipped |= step.clipped
            if step.commit is not None:
                result._commits.append(step.commit)
        return result

    def commit(self, screening: Screening) -> None:
        """The screened update was folded in: keep its statistics."""
        for keep in screening._commits:
            keep()
        self.clipped += screening.clipped

    def count_refusal(self, screening: Screening) -> None:
        """The screened update was left out."""
        assert screening.refusal is not None
        name = screening.refusal[0].name
        self.filtered[name] = self.filtered.get(name, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "steps": [f.state_dict() for f in self.steps],
            "filtered": dict(self.filtered),
            "clipped": self.clipped,
        }

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; a state saved for another chain (or none) starts this
        chain afresh, as a server resumed with a changed ``update_filter`` must."""
        if state is None or state["text"] != self.text or len(state["steps"]) != len(self.steps):
            saved = None if state is None else state["text"]
            logger.warning(
                "update_filter: the saved state is for %r, the config says %r: starting the "
                "filters afresh", saved, self.text,
            )  # fmt: skip
            fresh = UpdateFilters(self.text, *self._shape)
            self.steps, self.filtered, self.clipped = fresh.steps, {}, 0
            return
        for f, s in zip(self.steps, state["steps"], strict=True):
            f.load_state_dict(s)
        self.filtered = {str(k): int(v) for k, v in state["filtered"].items()}
        self.clipped = int(state["clipped"])


def _delta64(update: Update, job: Job) -> torch.Tensor:
    """The update's delta (client weights minus the job's start weights) in float64."""
    if update.kind is UpdateKind.DELTA:
        return update.tensor.to(torch.float64)
    return update.tensor.to(torch.float64) - job.weights
