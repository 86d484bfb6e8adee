"""The refusals a strategy answers with, each carrying the gRPC status the server maps it to."""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "InvalidUpdate",
    "JobSuperseded",
    "NonFiniteResult",
    "NonFiniteUpdate",
    "NotRegistered",
    "ShardsDisagree",
    "StrategyError",
    "TooManyClients",
    "TooManySamples",
    "TooStale",
    "UpdateNormTooLarge",
]


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
