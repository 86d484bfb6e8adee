"""The Strategy protocol of DESIGN.md "Strategies" and the types it shares with the server.

A strategy owns its state (device tensors, jobs it handed out, an RNG, the update ledger) and is
driven from one aggregation loop only, so it takes no locks. It reads time only from the ``now``
argument (seconds on the server's or the simulator's clock) and never imports gRPC.

Conventions every strategy here follows (the server is written against them):

* **Versions and snapshots.** ``version`` starts at 0 and grows by one whenever the global model
  changes. :meth:`Strategy.global_model` returns the [D] tensor of the current version; a strategy
  never writes into a tensor once it was published as a version (it builds the next version in a
  fresh tensor and swaps the reference), so the server may stream a snapshot to readers without
  copying or locking. A version may share its tensor with the previous one when nothing changed.
* **Jobs.** A client has at most one outstanding job. :meth:`Strategy.job_for` hands the same job
  again while the version it started from is still current (a reconnecting client gets the same
  job id), and otherwise issues a fresh job that supersedes the old one: an update for a
  superseded job is refused with :class:`JobSuperseded`. ``Job.tensors`` are shared read-only
  snapshots; the weights a job started from are kept for as long as a job refers to them (the
  strategy derives deltas and client weights from them) and are freed with the last such job.
* **Updates.** ``Update.tensor`` is a view of the server's validated staging slot, which is
  reused after :meth:`Strategy.on_update` returns: a strategy copies what it keeps.
* **Staleness** ``s = version - job.base_version`` at arrival: the version the update is applied
  to (a buffered update is folded into the current model when its buffer flushes).
  ``max_staleness`` refuses ``s > max_staleness`` with :class:`TooStale`.
* **Refusals.** Everything that can make an update fail is checked before any state changes, so a
  refused update leaves :meth:`Strategy.state_dict` bit-identical. Errors subclass
  :class:`StrategyError` and carry the gRPC status name the server maps them to.
* **Duplicates.** :class:`UpdateLedger` remembers the outcome of the last 1,024 accepted updates
  of each client. :meth:`Strategy.on_update` answers a replayed update id with
  ``DUPLICATE(original)`` without applying it again; the server may also consult
  ``strategy.ledger`` as soon as an update's header arrives and skip receiving the payload. The
  ledger is part of the strategy's state dict, so it survives checkpoints.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import logging
import math
import types
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch

from aggsrv.finite import count_non_finite
from aggsrv.layout import ModelLayout
from aggsrv.sharding import LocalReducer, Reducer
from aggsrv.strategies.buffers import VersionBuffers
from aggsrv.strategies.float_buffers import FloatBuffers

__all__ = [
    "FLOAT32_SAFE_MAX",
    "InvalidUpdate",
    "Job",
    "JobSuperseded",
    "NonFiniteResult",
    "NonFiniteUpdate",
    "NotRegistered",
    "Outcome",
    "ProjectionMode",
    "Recipe",
    "ShardsDisagree",
    "Status",
    "Strategy",
    "StrategyConfig",
    "StrategyError",
    "TooManyClients",
    "TooManySamples",
    "TooStale",
    "Update",
    "UpdateKind",
    "UpdateLedger",
    "UpdateNormTooLarge",
]

logger = logging.getLogger(__name__)

LEDGER_SIZE = 1024
# The largest num_samples an update may declare unless the config says otherwise: more than any
# one client's local data in the usual benchmarks, small enough that a client cannot claim the
# weight of a whole federation by writing 2^64 - 1 into its header.
DEFAULT_MAX_NUM_SAMPLES = 1_000_000
# Below float32's largest value by a margin for the rounding of the arithmetic that a bound on a
# step's reach stands for (strategies refuse an update whose step could reach past it).
FLOAT32_SAFE_MAX = float(torch.finfo(torch.float32).max) * (1.0 - 1e-3)
# How long an issued job stays open unless the config says otherwise: far longer than local
# training takes, short enough that clients that went away do not pin model copies for good.
DEFAULT_JOB_LEASE_SECONDS = 3600.0


# ------------------------------------------------------------------------------------- enums


class UpdateKind(enum.Enum):
    """What an update tensor holds: the client's final weights, or final minus start."""

    WEIGHTS = "WEIGHTS"
    DELTA = "DELTA"


class Status(enum.Enum):
    """How an accepted update was folded in (DESIGN.md "Outcome of an update")."""

    APPLIED = "APPLIED"
    BUFFERED = "BUFFERED"
    DUPLICATE = "DUPLICATE"


class ProjectionMode(enum.Enum):
    """Client-side gradient projection against a basis (Fed-OGD); NONE for plain SGD."""

    NONE = "NONE"
    WHOLE = "WHOLE"
    LAYERWISE = "LAYERWISE"


# ------------------------------------------------------------------------------------- errors


class StrategyError(Exception):
    """An update or request the strategy refuses; ``code`` is the gRPC status name to answer
    and ``reason`` a short machine-readable name of the refusal (logs, metrics)."""

    code: ClassVar[str] = "FAILED_PRECONDITION"
    reason: ClassVar[str] = "refused"


class TooStale(StrategyError):
    """The update's staleness exceeds ``max_staleness``."""

    code = "ABORTED"
    reason = "too_stale"


class JobSuperseded(StrategyError):
    """The update's job is no longer outstanding (done, replaced by a newer job, round closed)."""

    code = "ABORTED"
    reason = "job_superseded"


class NotRegistered(StrategyError):
    """The client never registered with this strategy."""

    code = "NOT_FOUND"
    reason = "not_registered"


class InvalidUpdate(StrategyError):
    """The update's header does not match its job (unknown job, other client, base version)."""

    code = "INVALID_ARGUMENT"
    reason = "invalid_update"


class NonFiniteUpdate(InvalidUpdate):
    """The update (or its float buffers) holds NaN or Inf."""

    reason = "non_finite_update"


class NonFiniteResult(InvalidUpdate):
    """Folding the update in would make the model or the strategy's state non-finite (a float32
    overflow of finite values): refused, so that no version is ever published with NaN/Inf."""

    reason = "non_finite_result"


class UpdateNormTooLarge(InvalidUpdate):
    """The client's delta has an L2 norm above ``max_update_norm``."""

    reason = "update_norm"


class TooManySamples(InvalidUpdate):
    """``num_samples`` is above ``max_num_samples``."""

    reason = "num_samples"


class ShardsDisagree(RuntimeError):
    """The shards of a sharded server decided the same call differently: not a refusal of the
    call but a broken federation (the server stops taking writes)."""


class TooManyClients(StrategyError):
    """Registering one more client would exceed ``max_clients``."""

    code = "RESOURCE_EXHAUSTED"
    reason = "too_many_clients"


# ------------------------------------------------------------------------------------- types


@dataclass(frozen=True)
class Recipe:
    """What a client runs for a job: plain local SGD plus the optional per-algorithm terms.

    Exactly one of ``local_epochs`` and ``local_steps`` is set; ``work_target`` is that amount,
    which ``Update.work_done`` is measured against. ``projection`` and ``only_conflicting`` steer
    Fed-OGD's projection against the job's ``basis`` tensor; ``elastic_lambda``/``elastic_alpha``
    add FedEN's elastic-net penalty lambda*(alpha*|w-w0|_1 + (1-alpha)/2*|w-w0|^2); ``proximal_mu``
    adds FedProx's mu/2*|w-w0|^2. ``extra`` holds named scalars for later algorithms.
    """

    local_epochs: float | None = 1.0
    local_steps: int | None = None
    learning_rate: float = 0.01
    batch_size: int = 32
    momentum: float = 0.0
    weight_decay: float = 0.0
    projection: ProjectionMode = ProjectionMode.NONE
    only_conflicting: bool = False
    elastic_lambda: float = 0.0
    elastic_alpha: float = 0.0
    proximal_mu: float = 0.0
    extra: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        """Check the values and freeze ``extra`` so a shared recipe cannot change."""
        if (self.local_epochs is None) == (self.local_steps is None):
            raise ValueError("Recipe needs exactly one of local_epochs and local_steps")
        if self.local_epochs is not None and not self.local_epochs > 0:
            raise ValueError(f"local_epochs must be > 0, got {self.local_epochs}")
        if self.local_steps is not None and not self.local_steps >= 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        for name in ("momentum", "weight_decay", "elastic_lambda", "proximal_mu"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):  # NaN fails `value < 0` too
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not 0.0 <= self.elastic_alpha <= 1.0:
            raise ValueError(f"elastic_alpha must be in [0, 1], got {self.elastic_alpha}")
        object.__setattr__(self, "projection", ProjectionMode(self.projection))
        object.__setattr__(
            self, "extra", types.MappingProxyType({str(k): float(v) for k, v in self.extra.items()})
        )

    @property
    def work_target(self) -> float:
        """The work a complete job does: epochs, or steps when the recipe counts steps."""
        return float(self.local_epochs if self.local_epochs is not None else self.local_steps)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (enum by name) for state dicts and the wire."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["projection"] = self.projection.value
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


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


@dataclass(frozen=True, eq=False)
class Update:
    """One validated client update as the server hands it to :meth:`Strategy.on_update`.

    ``tensor`` is the flat [D] float32 staging slot on the strategy's device, reused once
    ``on_update`` returns. ``work_done`` counts completed epochs or steps (as the recipe does).
    ``buffers`` is the client's flat [B] float buffers (absolute values, never a delta): required
    when the layout has float buffers, None otherwise; also a staging view.
    """

    client_id: str
    job_id: int
    base_version: int
    update_id: str
    num_samples: int
    work_done: float
    kind: UpdateKind
    tensor: torch.Tensor
    buffers: torch.Tensor | None = None


@dataclass(frozen=True)
class Outcome:
    """The answer to an update: APPLIED(version), BUFFERED(version) or DUPLICATE(original).

    For DUPLICATE, ``original`` is the status the update got first and ``version`` its version.
    ``staleness`` is the update's staleness when it was accepted (:meth:`Strategy.on_update`
    fills it in; a DUPLICATE repeats the original's); it does not take part in comparisons.
    """

    status: Status
    version: int
    original: Status | None = None
    staleness: int | None = field(default=None, compare=False)

    def to_tuple(self) -> tuple[str, int, str | None, int | None]:
        """Plain values for state dicts."""
        original = self.original and self.original.value
        return (self.status.value, self.version, original, self.staleness)

    @classmethod
    def from_tuple(cls, t: tuple[Any, ...] | list[Any]) -> Outcome:
        """Inverse of :meth:`to_tuple` (also reads the 3-tuples of states saved before the
        staleness was recorded)."""
        staleness = int(t[3]) if len(t) > 3 and t[3] is not None else None
        return cls(Status(t[0]), int(t[1]), Status(t[2]) if t[2] is not None else None, staleness)


# ------------------------------------------------------------------------------------- ledger


class UpdateLedger:
    """Outcomes of the last ``size`` accepted update ids of each client, for replay detection."""

    def __init__(self, size: int = LEDGER_SIZE) -> None:
        """Remember ``size`` update ids per client (DESIGN.md: 1,024)."""
        if size < 1:
            raise ValueError(f"ledger size must be >= 1, got {size}")
        self.size = size
        self._seen: dict[str, OrderedDict[str, Outcome]] = {}

    def lookup(self, client_id: str, update_id: str) -> Outcome | None:
        """The original outcome of a replayed update id, or None for a new one."""
        seen = self._seen.get(client_id)
        return None if seen is None else seen.get(update_id)

    def record(self, client_id: str, update_id: str, outcome: Outcome) -> None:
        """Remember an accepted update's outcome, forgetting the client's oldest beyond size."""
        seen = self._seen.setdefault(client_id, OrderedDict())
        seen[update_id] = outcome
        while len(seen) > self.size:
            seen.popitem(last=False)

    def __len__(self) -> int:
        """Number of remembered update ids over all clients."""
        return sum(len(s) for s in self._seen.values())

    def state_dict(self) -> dict[str, Any]:
        """Plain values, oldest first per client."""
        return {
            "size": self.size,
            "seen": {c: [[u, *o.to_tuple()] for u, o in s.items()] for c, s in self._seen.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.size = int(state["size"])
        self._seen = {
            c: OrderedDict((str(e[0]), Outcome.from_tuple(e[1:])) for e in entries)
            for c, entries in state["seen"].items()
        }


# ------------------------------------------------------------------------------------- config


@dataclass
class StrategyConfig:
    """Settings every strategy shares: the client recipe, staleness bound and sampling seed,
    and the bounds every update must meet.

    ``local_epochs`` and ``local_steps`` are exclusive; with neither set a job is one epoch.
    ``max_update_norm`` (None: off) refuses an update whose delta (client weights minus the
    job's weights) has a larger L2 norm; ``max_num_samples`` refuses a larger ``num_samples``.
    ``job_lease_seconds`` (None: no lease) retires a job that long after it was issued, freeing
    the weights it started from; its update is then refused like a superseded job's.
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

    def __post_init__(self) -> None:
        """Check the shared values; subclasses extend this."""
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
        return cls(**data)

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


# ------------------------------------------------------------------------------------- strategy


def _clone_tensors(obj: Any) -> Any:
    """Deep-copy the tensors of a nested state (dicts, lists) so it is a point-in-time record.

    Tensors that share memory share it in the copy too (each storage is copied once, over the
    bytes the state refers to): a version's weights held by fifty jobs are saved once, not fifty
    times, and :class:`SharedCopies` restores the sharing."""
    spans: dict[tuple[str, int], list[int]] = {}
    for t in _tensors_in(obj):
        if t.numel():
            lo, hi = _byte_extent(t)
            span = spans.setdefault(_storage_key(t), [lo, hi])
            span[0], span[1] = min(span[0], lo), max(span[1], hi)
    copies: dict[tuple[str, int], tuple[torch.UntypedStorage, int]] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if not t.numel():
            return t.clone()
        key = _storage_key(t)
        if key not in copies:
            lo, hi = spans[key]
            raw = torch.empty(0, dtype=torch.uint8, device=t.device)
            raw.set_(t.untyped_storage(), lo, (hi - lo,), (1,))
            copies[key] = (raw.clone().untyped_storage(), lo)
        storage, lo = copies[key]
        start = t.storage_offset() * t.element_size() - lo
        if start % t.element_size():  # views of one memory in dtypes that do not align
            return t.clone()
        return _view(storage, t, start // t.element_size())

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return clone(o)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return type(o)(walk(v) for v in o)
        return o

    return walk(obj)


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list | tuple):
            stack.extend(o)
    return out


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a non-empty tensor covers: [first, past the last)."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    size = t.element_size()
    return t.storage_offset() * size, (t.storage_offset() + last + 1) * size


def _view(storage: torch.UntypedStorage, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A tensor over ``storage`` with ``like``'s dtype, shape and strides at element ``offset``."""
    out = torch.empty(0, dtype=like.dtype, device=storage.device)
    return out.set_(storage, offset, like.shape, like.stride())


class SharedCopies:
    """Copies a loaded state's tensors onto a device, each storage once: tensors that shared
    memory when the state was saved share it again (as they did in the live strategy), so a
    restored server holds what the live one held. ``copy(t, dtype)`` is the restore's
    ``t.to(device, dtype, copy=True)``; a tensor converted to another dtype gets its own copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # storage key -> (the source storage, kept so its address is not reused; the copy)
        self._copies: dict[tuple[str, int], tuple[torch.UntypedStorage, torch.UntypedStorage]]
        self._copies = {}

    def __call__(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = t.detach()
        if (dtype is not None and t.dtype != dtype) or not t.numel():
            return t.to(device=self.device, dtype=dtype or t.dtype, copy=True)
        key = _storage_key(t)
        if key not in self._copies:
            source = t.untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8, device=t.device)
            raw.set_(source, 0, (source.nbytes(),), (1,))
            copy = raw.to(device=self.device, copy=True).untyped_storage()
            self._copies[key] = (source, copy)
        return _view(self._copies[key][1], t, t.storage_offset())


class Strategy(ABC):
    """Base class of every aggregation strategy: jobs, validation, ledger, snapshots, state.

    Subclasses set ``name`` and ``config_class`` and implement :meth:`_apply` (fold one accepted
    update in); they may override :meth:`job_for`, :meth:`_check` (extra refusals, no state
    change), :meth:`on_register`, :meth:`next_deadline`, :meth:`on_timer` and the
    ``_extra_state``/``_load_extra_state`` pair.
    """

    name: ClassVar[str] = "base"
    config_class: ClassVar[type[StrategyConfig]] = StrategyConfig
    # How clients' float buffers (BatchNorm statistics) fold into the global ones: see
    # aggsrv/strategies/float_buffers.py. "mean" strategies call self.float_buffers.add().
    buffer_rule: ClassVar[str] = "mean"

    def __init__(
        self,
        layout: ModelLayout,
        initial: torch.Tensor,
        config: StrategyConfig | Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        max_clients: int = 1024,
        initial_buffers: torch.Tensor | None = None,
        reducer: Reducer | None = None,
    ) -> None:
        """Start at version 0 from ``initial`` ([D], copied to float32 on ``device``) and, when
        the layout has float buffers, ``initial_buffers`` ([B]).

        On a shard of a sharded server (docs/sharding.md) ``layout`` is the shard's
        :class:`~aggsrv.sharding.ShardLayout`, ``initial`` its slice, and ``reducer`` sums
        partial results over the shards, so every shard takes the same decisions."""
        if isinstance(config, StrategyConfig):
            if not isinstance(config, self.config_class):
                raise TypeError(
                    f"{self.name} needs a {self.config_class.__name__}, got {type(config).__name__}"
                )
            self.config = config
        else:
            self.config = self.config_class.from_dict(config)
        if initial.dim() != 1 or initial.numel() != layout.numel:
            raise ValueError(
                f"initial must be a flat [{layout.numel}] tensor for this layout, "
                f"got shape {tuple(initial.shape)}"
            )
        if max_clients < 1:
            raise ValueError(f"max_clients must be >= 1, got {max_clients}")
        self.layout = layout
        self.max_clients = max_clients
        dev = torch.device(device) if device is not None else initial.device
        self._model = initial.detach().to(device=dev, dtype=torch.float32, copy=True)
        self.device = self._model.device  # normalised ("cuda" -> "cuda:0") for comparisons
        self.version = 0
        self._versions = VersionBuffers(layout.numel, self.device)
        self.float_buffers = FloatBuffers(
            initial_buffers, layout.buffer_numel, self.device, self.buffer_rule
        )
        # Elements that are variances (BatchNorm running_var): a negative one is refused.
        self._variance_index = torch.cat(
            [
                torch.arange(s.offset, s.end, device=self.device)
                for s in layout.buffer_specs
                if s.name.rpartition(".")[2] == "running_var"
            ]
            or [torch.zeros(0, dtype=torch.int64, device=self.device)]
        )
        # (version, max |x|): the version number, not the tensor, so no old version is kept.
        self._absmax: tuple[int, float] | None = None
        self.ledger = UpdateLedger()
        self._clients: dict[str, float] = {}  # client id -> registration time, in join order
        self._jobs: dict[int, Job] = {}  # outstanding jobs by id
        self._job_of: dict[str, int] = {}  # client id -> its outstanding job id
        # client id -> id of the last job whose update was accepted (for Heartbeat's COMPLETED)
        self._completed_job: dict[str, int] = {}
        self._next_job_id = 1
        self._now = 0.0  # the latest time a call brought (jobs issued without one take it)
        self._rng = torch.Generator(device="cpu")
        self._rng.manual_seed(int(self.config.seed))
        self._recipe = self.make_recipe()
        # Receives the strategy's events (FedDGIC's groupings, ...) as JSON-ready dicts: the
        # server and the simulator point it at their events.jsonl. Not part of the state.
        self.event_sink: Callable[[dict[str, Any]], None] | None = None
        self.reducer: Reducer = reducer if reducer is not None else LocalReducer()
        # What kernels get as reduce=: None on one server keeps their single-pass results.
        self.reduce = self.reducer.sum_ if self.reducer.world_size > 1 else None

    # --------------------------------------------------------------------------- public API

    def whole_norm(self, t: torch.Tensor) -> float:
        """The L2 norm (float64) of the whole-model vector whose slice ``t`` is: on one server
        ``t``'s own norm; on a shard the root of the squared norms summed over the shards."""
        if self.reduce is None:
            return float(torch.linalg.vector_norm(t, dtype=torch.float64))
        sq = torch.linalg.vector_norm(t, dtype=torch.float64).square().reshape(1)
        return float(self.reduce(sq).sqrt())

    @property
    def dim(self) -> int:
        """D, the length of the flat model."""
        return self._model.numel()

    @property
    def clients(self) -> tuple[str, ...]:
        """Registered client ids in the order they joined."""
        return tuple(self._clients)

    def global_model(self) -> torch.Tensor:
        """The current version's [D] weights: an immutable snapshot, never written again."""
        return self._model

    def global_buffers(self) -> torch.Tensor | None:
        """The current version's [B] float buffers (immutable snapshot), None without any."""
        return self.float_buffers.current

    def make_recipe(self) -> Recipe:
        """The recipe this strategy's jobs carry (FedProx adds its proximal term)."""
        return self.config.recipe()

    def on_register(self, client_id: str, now: float) -> None:
        """A client joined; registering again is a no-op."""
        self._now = float(now)
        if client_id in self._clients:
            return
        if len(self._clients) >= self.max_clients:
            raise TooManyClients(
                f"cannot register client {client_id!r}: the server holds max_clients="
                f"{self.max_clients} clients already; raise max_clients in the server config"
            )
        self._clients[client_id] = float(now)
        logger.debug("%s: client %s registered at %.3f", self.name, client_id, now)

    def job_for(self, client_id: str, now: float) -> Job | None:
        """The client's next job (default: always one, from the current version)."""
        self._require_registered(client_id)
        return self._issue_job(client_id, deadline=None, now=now)

    def on_update(self, update: Update, now: float) -> Outcome:
        """Fold one validated update in, or refuse it without changing any state.

        A replayed update id returns DUPLICATE with the original outcome and changes nothing.
        """
        prior = self.ledger.lookup(update.client_id, update.update_id)
        try:
            if prior is None:
                job = self._validate(update)
                self._require_leased(job, now)
                s = self.version - job.base_version
                self._check(update, job, s, now)
        except StrategyError:
            self._agree_on_update(prior is not None, refused=True)
            raise
        self._agree_on_update(prior is not None, refused=False)
        if prior is not None:
            return Outcome(
                Status.DUPLICATE, prior.version, original=prior.status, staleness=prior.staleness
            )
        self._retire_job(job)
        try:
            outcome = self._apply(update, job, s, now)
        except StrategyError:
            # _apply refuses only before its first change of state (see _require_finite), so
            # reopening the job restores the state exactly.
            self._reopen_job(job)
            self.float_buffers.discard()
            raise
        outcome = dataclasses.replace(outcome, staleness=s)
        self._now = float(now)
        self.ledger.record(update.client_id, update.update_id, outcome)
        self._completed_job[update.client_id] = job.job_id
        return outcome

    def _agree_on_update(self, duplicate: bool, refused: bool) -> None:
        """On a sharded server, check that every shard took the same branch for this update
        (a duplicate, refused, or to be applied) before the collectives that applying it makes:
        a shard whose state drifted would otherwise wait in a collective the others never
        enter. Shards that disagree raise ShardsDisagree (not a refusal: the federation stops)."""
        if self.reduce is None:
            return
        world, rank = self.reducer.world_size, self.reducer.rank
        # One slot per shard (0: applies it, 1: a duplicate, 2: refuses it), summed.
        branch = torch.zeros(world, dtype=torch.float64)
        branch[rank] = 2.0 if refused else float(duplicate)
        seen = [int(b) for b in self.reduce(branch).tolist()]
        if len(set(seen)) > 1:
            said = ("made it", "found it a duplicate", "refused it")
            raise ShardsDisagree(", ".join(f"rank {r} {said[b]}" for r, b in enumerate(seen)))

    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` wants to be called next (None: no timer): the strategy's own
        deadline (:meth:`_next_deadline`) or the first job lease to end, whichever is first."""
        own = self._next_deadline()
        expiry = self._next_expiry()
        if own is None or expiry is None:
            return own if expiry is None else expiry
        return min(own, expiry)

    def on_timer(self, now: float) -> None:
        """Retire the jobs whose lease ended by ``now``, then handle the strategy's own
        deadlines (:meth:`_on_timer`)."""
        self._now = float(now)
        self._expire_jobs(now)
        self._on_timer(now)

    def _next_deadline(self) -> float | None:
        """When the strategy's own timer is due (rounds, epochs; default: never)."""
        return None

    def _on_timer(self, now: float) -> None:
        """The strategy's own deadlines that passed by ``now`` (default: nothing)."""
        return None

    def staleness(self, job: Job) -> int:
        """``s = version - job.base_version`` if the job's update arrived now."""
        return self.version - job.base_version

    def outstanding_job(self, client_id: str) -> Job | None:
        """The client's outstanding job, if any."""
        job_id = self._job_of.get(client_id)
        return None if job_id is None else self._jobs[job_id]

    def job_state(self, client_id: str, job_id: int) -> str:
        """What became of ``job_id`` for ``client_id``: "current", "completed" (its update was
        accepted; the last such job per client is remembered), "superseded" (issued by this
        server, no longer open) or "unknown" (never issued, or another client's open job)."""
        job = self._jobs.get(job_id)
        if job is not None:
            return "current" if job.client_id == client_id else "unknown"
        if self._completed_job.get(client_id) == job_id:
            return "completed"
        if 1 <= job_id < self._next_job_id:
            return "superseded"
        return "unknown"

    def open_job(self, client_id: str, job_id: int) -> Job | None:
        """Job ``job_id`` if it is ``client_id``'s and still open (a shard serves its slice)."""
        job = self._jobs.get(job_id)
        return job if job is not None and job.client_id == client_id else None

    @property
    def jobs_issued(self) -> int:
        """How many jobs this strategy has issued (job ids are 1 to this number)."""
        return self._next_job_id - 1

    def check_data(self, update: Update) -> None:
        """The refusals that depend on the update's numbers rather than the strategy's state
        (InvalidUpdate), so that each shard of a sharded server can check its own slice before
        the shards vote; a replayed update id is not checked (it will be DUPLICATE)."""
        if self.ledger.lookup(update.client_id, update.update_id) is None:
            self._validate_numbers(update)

    # --------------------------------------------------------------------------- helpers

    def client_delta(
        self, update: Update, job: Job, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The update as client weights minus the job's start weights (into ``out`` if given).

        Without ``out`` a DELTA update returns the staging slot itself: read it before returning.
        """
        if update.kind is UpdateKind.DELTA:
            return update.tensor if out is None else out.copy_(update.tensor)
        return torch.sub(update.tensor, job.weights, out=out)

    def client_weights(
        self, update: Update, job: Job, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The client's final weights (start weights plus delta for a DELTA update)."""
        if update.kind is UpdateKind.WEIGHTS:
            return update.tensor if out is None else out.copy_(update.tensor)
        return torch.add(job.weights, update.tensor, out=out)

    def _new_model_buffer(self) -> torch.Tensor:
        """An uninitialised [D] float32 tensor for the next version: a retired version's memory
        once no snapshot, job or stream refers to it any more, else a new allocation."""
        return self._versions.take()

    def _publish(self, model: torch.Tensor) -> int:
        """Make ``model`` (a tensor nobody writes again) the next version; return the version.

        A non-finite ``model`` (or pending float buffers) is refused with NonFiniteResult and
        nothing is published: call it before any other change of state, or check the candidate
        first with :meth:`_require_finite`."""
        if model is not self._model:
            self._check_version(model)
        pending = self.float_buffers.pending
        if pending is not None:
            self._require_finite(pending, "the next version of the float buffers")
        if model is not self._model:
            self._versions.retire(self._model)
        self._model = model
        self.float_buffers.commit()
        self.version += 1
        return self.version

    def model_absmax(self) -> float:
        """max |x| over the current version (cached per version), for strategies that bound
        what a step can reach instead of computing it; on a sharded server the sum of the
        shards' maxima (a bound every shard computes alike)."""
        cached = self._absmax
        if cached is not None and cached[0] == self.version:
            return cached[1]
        lo, hi = torch.aminmax(self._model) if self.dim else (torch.zeros(()), torch.zeros(()))
        value = max(-float(lo), float(hi))
        if self.reduce is not None:
            value = float(self.reduce(torch.tensor([value], dtype=torch.float64)))
        self._absmax = (self.version, value)
        return value

    def _checked_absmax(self, t: torch.Tensor, what: str) -> float:
        """max |t| (NonFiniteResult if ``t`` holds NaN/Inf), the way :meth:`model_absmax`
        measures: on a sharded server the sum of the shards' maxima, so every shard decides
        alike."""
        lo, hi = torch.aminmax(t) if t.numel() else (torch.zeros(()), torch.zeros(()))
        value = max(-float(lo), float(hi))  # NaN in, NaN out; Inf in, Inf out
        if self.reduce is not None:
            value = float(self.reduce(torch.tensor([value], dtype=torch.float64)))
        if not math.isfinite(value):
            raise NonFiniteResult(
                f"applying this update would make {what} non-finite (NaN/Inf: a float32 "
                "overflow); it was refused and nothing changed. Send a smaller update."
            )
        return value

    def _require_reach(self, reach: float, what: str) -> None:
        """Refuse (NonFiniteResult) when a bound on the values a step could produce is past
        float32's range (:data:`FLOAT32_SAFE_MAX`)."""
        if not reach < FLOAT32_SAFE_MAX:
            raise NonFiniteResult(
                f"with this update {what} could reach {reach:.3g}, past float32's range; it "
                "was refused and nothing changed. Send a smaller update."
            )

    def _check_version(self, model: torch.Tensor) -> None:
        """Refuse (NonFiniteResult) a candidate next version that is not finite, handing its
        buffer back to the pool."""
        try:
            self._require_finite(model, "the next version of the model")
        except NonFiniteResult:
            self._versions.retire(model)
            raise

    def _require_finite(self, t: torch.Tensor, what: str) -> None:
        """Refuse the update being applied (NonFiniteResult) unless every element of ``t`` is
        finite. On a sharded server the shards agree (one all_reduce), so they refuse together.

        The rule every strategy here follows: before its first change of state, ``_apply``
        checks each value it is about to keep (a new cache row, a running sum, a version) and
        the model it would publish if its aggregation ran now, so an aggregation that a later
        update or timer triggers publishes a value that was checked already."""
        bad = count_non_finite(t)
        if self.reduce is not None:
            bad = int(self.reduce(torch.tensor([float(bad)], dtype=torch.float64)).item())
        if bad:
            raise NonFiniteResult(
                f"applying this update would make {what} non-finite ({bad} NaN/Inf values: a "
                "float32 overflow); it was refused and nothing changed. Send a smaller update."
            )

    def _require_finite_chunks(
        self, compute: Callable[[slice], torch.Tensor], what: str, chunk: int = 1 << 18
    ) -> None:
        """:meth:`_require_finite` of a [D] value given chunk by chunk (``compute(s)`` returns
        the elements ``s`` of the value), so a candidate is checked without a [D] temporary.

        Each chunk's float32 sum stays on the device (one synchronisation in all, not one per
        chunk); a chunk whose sum is not finite is computed again and counted exactly (a sum of
        finite values can overflow)."""
        parts = [slice(start, min(start + chunk, self.dim)) for start in range(0, self.dim, chunk)]
        sums = torch.zeros(len(parts), dtype=torch.float32, device=self.device)
        for i, part in enumerate(parts):
            sums[i] = compute(part).sum()
        suspects = (~torch.isfinite(sums)).nonzero().flatten().tolist()
        bad = sum(count_non_finite(compute(parts[i])) for i in suspects)
        if self.reduce is None:
            if bad:
                raise NonFiniteResult(
                    f"applying this update would make {what} non-finite ({bad} NaN/Inf "
                    "values: a float32 overflow); it was refused and nothing changed. Send a "
                    "smaller update."
                )
            return
        self._require_finite(torch.full((1,), math.nan if bad else 0.0), what)

    def _emit(self, event: str, now: float, **fields: Any) -> None:
        """Hand an event (plain JSON values) to :attr:`event_sink`, if one is set."""
        if self.event_sink is not None:
            record = {"event": event, "strategy": self.name, "version": self.version}
            record.update(time=float(now), **fields)
            self.event_sink(record)

    def _require_registered(self, client_id: str) -> None:
        if client_id not in self._clients:
            raise NotRegistered(
                f"client {client_id!r} is not registered with this server; call Register first"
            )

    def _issue_job(self, client_id: str, deadline: float | None, now: float | None = None) -> Job:
        """The client's outstanding job if it starts from the current version and its lease
        has not ended, else a new one issued at ``now`` (default: the latest time seen)."""
        now = self._now if now is None else float(now)
        old = self.outstanding_job(client_id)
        if old is not None and old.base_version == self.version and not self._expired(old, now):
            return old  # nothing changes (the log need not record this call)
        self._now = now
        if old is not None:
            self._retire_job(old)  # superseded: the client asked again, so it dropped the job
        job = Job(
            job_id=self._next_job_id,
            client_id=client_id,
            base_version=self.version,
            deadline=deadline,
            recipe=self._recipe,
            tensors=types.MappingProxyType(self._with_buffers(self._job_tensors(client_id))),
            issued_at=now,
        )
        self._next_job_id += 1
        self._jobs[job.job_id] = job
        self._job_of[client_id] = job.job_id
        return job

    def _job_tensors(self, client_id: str) -> dict[str, torch.Tensor]:
        """Named snapshots a new job carries; "weights" is the current model (shared)."""
        return {"weights": self._model}

    def _with_buffers(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Add the global float buffers as "buffers" unless the strategy chose the job's own
        (ORTHOFL hands a client its own statistics back, spec G6)."""
        current = self.float_buffers.current
        if current is not None:
            tensors.setdefault("buffers", current)
        return tensors

    def _retire_job(self, job: Job) -> None:
        """Forget an outstanding job; its start weights go with the last job referring to them."""
        del self._jobs[job.job_id]
        if self._job_of.get(job.client_id) == job.job_id:
            del self._job_of[job.client_id]

    def _expired(self, job: Job, now: float) -> bool:
        """Whether the job's lease has ended by ``now``."""
        lease = self.config.job_lease_seconds
        return lease is not None and now >= job.issued_at + lease

    def _next_expiry(self) -> float | None:
        """When the first open job's lease ends (jobs are kept in issue order)."""
        lease = self.config.job_lease_seconds
        if lease is None or not self._jobs:
            return None
        return min(job.issued_at for job in self._jobs.values()) + lease

    def _expire_jobs(self, now: float) -> None:
        """Retire every job whose lease has ended by ``now`` (and free what only it held)."""
        expired = [j for j in self._jobs.values() if self._expired(j, now)]
        for job in expired:
            self._retire_job(job)
            logger.info(
                "%s: job %d of %s retired: its lease of %g s ended", self.name, job.job_id,
                job.client_id, self.config.job_lease_seconds,
            )  # fmt: skip
        if expired:
            del job, expired
            self._versions.trim()

    def _require_leased(self, job: Job, now: float) -> None:
        """Refuse an update whose job's lease ended (the timer may not have retired it yet)."""
        if self._expired(job, now):
            raise JobSuperseded(
                f"job {job.job_id} was issued at {job.issued_at:.3f} and its lease "
                f"(job_lease_seconds={self.config.job_lease_seconds:g}) ended before the update "
                "arrived; discard this update and ask for a new job"
            )

    def _reopen_job(self, job: Job) -> None:
        """Undo :meth:`_retire_job` of the client's current job (an update refused while being
        applied). Both dicts are kept in job-id order (ids only grow), as state_dict lists them."""
        self._jobs[job.job_id] = job
        self._job_of[job.client_id] = job.job_id
        self._jobs = dict(sorted(self._jobs.items()))
        self._job_of = dict(sorted(self._job_of.items(), key=lambda item: item[1]))

    def _validate(self, update: Update) -> Job:
        """Checks every strategy makes before touching state; returns the update's job."""
        self._require_registered(update.client_id)
        t = update.tensor
        if t.dim() != 1 or t.numel() != self.dim or t.dtype != torch.float32:
            raise InvalidUpdate(
                f"update tensor must be flat float32 [{self.dim}], got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != self.device:
            raise InvalidUpdate(f"update tensor is on {t.device}, the strategy on {self.device}")
        if not isinstance(update.kind, UpdateKind):
            raise InvalidUpdate(f"update kind must be WEIGHTS or DELTA, got {update.kind!r}")
        if update.num_samples < 0 or not math.isfinite(update.work_done) or update.work_done < 0:
            raise InvalidUpdate(
                f"num_samples ({update.num_samples}) and work_done ({update.work_done}) must be "
                "finite and >= 0"
            )
        bound = self.config.max_num_samples
        if update.num_samples > bound:
            raise TooManySamples(
                f"num_samples {update.num_samples} is above max_num_samples={bound}: the update "
                "would outweigh the others by a count no client's data reaches; send the number "
                "of examples trained on, or raise max_num_samples in the strategy config"
            )
        self._validate_numbers(update)
        job = self._jobs.get(update.job_id)
        if job is None:
            if 1 <= update.job_id < self._next_job_id:
                raise JobSuperseded(
                    f"job {update.job_id} is no longer open (completed, replaced by a newer job "
                    "for this client, or its round closed); discard this update and ask for a "
                    "new job"
                )
            raise InvalidUpdate(f"job {update.job_id} was never issued by this server")
        if job.client_id != update.client_id:
            raise InvalidUpdate(
                f"job {job.job_id} belongs to client {job.client_id!r}, not {update.client_id!r}"
            )
        if update.base_version != job.base_version:
            raise InvalidUpdate(
                f"update says it started from version {update.base_version}, but job "
                f"{job.job_id} started from version {job.base_version}"
            )
        s = self.version - job.base_version
        bound = self.config.max_staleness
        if bound is not None and s > bound:
            raise TooStale(
                f"update from version {job.base_version} is {s} versions behind the current "
                f"version {self.version} (max_staleness={bound}); ask for a new job"
            )
        self._validate_norm(update, job)
        return job

    def _validate_numbers(self, update: Update) -> None:
        """The update's values: finite (NaN/Inf refused, naming where), and its float buffers."""
        t = update.tensor
        bad = count_non_finite(t)
        if bad:
            index = int((~torch.isfinite(t)).nonzero()[0])
            raise NonFiniteUpdate(
                f"the update holds {float(t[index])} at {self._locate(index)} ({bad} NaN/Inf "
                "values in all): NaN/Inf updates are refused"
            )
        self._validate_buffers(update.buffers)

    def _locate(self, index: int) -> str:
        """Where flat element ``index`` lies, for messages: "element 3 of 'fc.bias'"."""
        offsets = self.layout.offsets.tolist()
        layer = max(0, bisect.bisect_right(offsets, index) - 1)
        if layer < len(self.layout.names):
            return f"element {index - offsets[layer]} of {self.layout.names[layer]!r}"
        return f"element {index}"

    def _validate_norm(self, update: Update, job: Job) -> None:
        """``max_update_norm``: the L2 norm of the client's delta (float64; on a sharded server
        the whole model's, summed over the shards)."""
        bound = self.config.max_update_norm
        if bound is None:
            return
        if update.kind is UpdateKind.DELTA:
            norm = self.whole_norm(update.tensor)
        else:  # ||u - w||, chunk by chunk in float64: no [D] temporary
            u, w, step = update.tensor, job.weights, 1 << 18
            sq = sum(
                float((u[i : i + step].double() - w[i : i + step]).square().sum())
                for i in range(0, self.dim, step)
            )
            if self.reduce is not None:
                sq = float(self.reduce(torch.tensor([sq], dtype=torch.float64)))
            norm = math.sqrt(sq)
        if not norm <= bound:
            raise UpdateNormTooLarge(
                f"the update's delta has L2 norm {norm:.6g}, above max_update_norm={bound:g}; "
                "clip it before sending, or raise max_update_norm in the strategy config"
            )

    def _validate_buffers(self, b: torch.Tensor | None) -> None:
        """The update's float buffers: present exactly when the layout has some, [B] float32
        on the strategy's device, finite, and no negative variance."""
        n = self.float_buffers.numel
        if n == 0:
            if b is not None:
                raise InvalidUpdate("the update carries float buffers but the model has none")
            return
        if b is None:
            raise InvalidUpdate(
                f"the model has {n} float buffer elements (BatchNorm running statistics): the "
                'update must carry the client\'s as "buffers"'
            )
        if b.dim() != 1 or b.numel() != n or b.dtype != torch.float32 or b.device != self.device:
            raise InvalidUpdate(
                f"update buffers must be flat float32 [{n}] on {self.device}, got {b.dtype} "
                f"{tuple(b.shape)} on {b.device}"
            )
        if count_non_finite(b):
            raise NonFiniteUpdate("update buffers contain NaN or Inf")
        if self._variance_index.numel() and bool((b[self._variance_index] < 0).any()):
            raise InvalidUpdate("update buffers hold a negative running_var")

    def _check(self, update: Update, job: Job, staleness: int, now: float) -> None:
        """Strategy-specific refusals; must not change state (default: none)."""
        return None

    @abstractmethod
    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        """Fold an accepted update in (its job is already retired) and return its outcome."""

    # --------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly: a point-in-time copy (tensors cloned)."""
        bases: dict[int, torch.Tensor] = {}
        jobs = []
        for job in self._jobs.values():
            bases.setdefault(job.base_version, job.weights)
            jobs.append(
                {
                    "job_id": job.job_id,
                    "client_id": job.client_id,
                    "base_version": job.base_version,
                    "deadline": job.deadline,
                    "issued_at": job.issued_at,
                    "recipe": job.recipe.to_dict(),
                    "tensors": {k: v for k, v in job.tensors.items() if k != "weights"},
                }
            )
        state = {
            "strategy": self.name,
            "layout_hash": self.layout.hash,
            "config": self.config.to_dict(),
            "version": self.version,
            "model": self._model,
            "bases": bases,
            "clients": dict(self._clients),
            "jobs": jobs,
            "job_of": dict(self._job_of),
            "completed_job": dict(self._completed_job),
            "next_job_id": self._next_job_id,
            "now": self._now,
            "rng": self._rng.get_state(),
            "ledger": self.ledger.state_dict(),
            "float_buffers": self.float_buffers.state_dict(),
            "extra": self._extra_state(),
        }
        return _clone_tensors(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` output (same strategy and layout); a state that is
        refused part-way (ValueError) leaves the strategy as it was."""
        before = self.state_dict()
        try:
            self._load_state(state)
        except Exception:
            self._load_state(before)
            raise

    def _load_state(self, state: Mapping[str, Any]) -> None:
        if state["strategy"] != self.name:
            raise ValueError(f"state is for strategy {state['strategy']!r}, not {self.name!r}")
        if state["layout_hash"] != self.layout.hash:
            raise ValueError("state was saved for a different model layout (layout hash differs)")
        if state["config"] != self.config.to_dict():
            logger.warning("%s: resuming with a config that differs from the saved one", self.name)

        # One copy per saved storage, shared by every restore function of this load (the
        # subclasses' and the float buffers' too): what shared memory live shares it again.
        self._copy_saved = SharedCopies(self.device)

        def dev(t: torch.Tensor) -> torch.Tensor:
            return self._copy_saved(t, torch.float32)

        self.version = int(state["version"])
        self._model = dev(state["model"])
        self._absmax = None
        self._versions.clear()
        # One tensor per version, shared by every job that started from it (and the model).
        bases = {int(v): dev(t) for v, t in state["bases"].items()}
        if self.version in bases:
            bases[self.version] = self._model
        self._clients = {str(c): float(t) for c, t in state["clients"].items()}
        self._jobs = {}
        for j in state["jobs"]:
            tensors = {"weights": bases[int(j["base_version"])]}
            tensors.update({k: dev(v) for k, v in j["tensors"].items()})
            recipe = Recipe.from_dict(j["recipe"])
            job = Job(
                job_id=int(j["job_id"]),
                client_id=str(j["client_id"]),
                base_version=int(j["base_version"]),
                deadline=j["deadline"],
                recipe=recipe if recipe != self._recipe else self._recipe,
                tensors=types.MappingProxyType(tensors),
                issued_at=float(j.get("issued_at", 0.0)),  # states saved before leases: 0
            )
            self._jobs[job.job_id] = job
        self._job_of = {str(c): int(j) for c, j in state["job_of"].items()}
        self._completed_job = {str(c): int(j) for c, j in state["completed_job"].items()}
        self._next_job_id = int(state["next_job_id"])
        self._now = float(state.get("now", 0.0))
        self._rng.set_state(state["rng"].clone())
        self.ledger.load_state_dict(state["ledger"])
        self.float_buffers.load_state_dict(state["float_buffers"], self._copy_saved)
        self._load_extra_state(state["extra"])
        del self._copy_saved

    def _extra_state(self) -> dict[str, Any]:
        """Subclass state for :meth:`state_dict` (tensors are cloned by the caller)."""
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`_extra_state` returned; copy tensors with ``self._copy_saved(t,
        dtype)`` (a :class:`SharedCopies`), so that what shared memory live shares it again."""
        return None

    # --------------------------------------------------------------------------- changes

    # Side effects of job_for other than issuing a job (a class default: the count starts at 0).
    _side_effects: int = 0

    def _note_side_effect(self) -> None:
        """Call when a call that may issue no job changed state anyway (opened a round or an
        epoch, dispatched a client): the server then logs it, so that replay repeats it."""
        self._side_effects += 1

    @property
    def change_count(self) -> int:
        """A number that moves exactly when :meth:`job_for` changed the strategy's state: a job
        issued (which also retires the one it supersedes) or a noted side effect. The server
        logs a GetJob only when it moved; a strategy whose job_for changes anything else must
        call :meth:`_note_side_effect` (tests/test_strategy_durable_state.py checks all)."""
        return self._next_job_id + self._side_effects
