"""The refusals a strategy answers with, each carrying the gRPC status the server maps it to."""

from __future__ import annotations

from typing import Any, ClassVar

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
    and ``reason`` a short machine-readable name of the refusal (logs, metrics). A subclass
    names them as class keywords, ``class TooStale(StrategyError, code="ABORTED",
    reason="too_stale")``, and inherits what it leaves out."""

    code: ClassVar[str] = "FAILED_PRECONDITION"
    reason: ClassVar[str] = "refused"

    def __init_subclass__(
        cls, *, code: str | None = None, reason: str | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if reason is not None:
            cls.reason = reason


class TooStale(StrategyError, code="ABORTED", reason="too_stale"):
    """The update's staleness exceeds ``max_staleness``."""


class JobSuperseded(StrategyError, code="ABORTED", reason="job_superseded"):
    """The update's job is no longer outstanding (done, replaced by a newer job, round closed)."""


class NotRegistered(StrategyError, code="NOT_FOUND", reason="not_registered"):
    """The client never registered with this strategy."""


class InvalidUpdate(StrategyError, code="INVALID_ARGUMENT", reason="invalid_update"):
    """The update's header does not match its job (unknown job, other client, base version)."""


class NonFiniteUpdate(InvalidUpdate, reason="non_finite_update"):
    """The update (or its float buffers) holds NaN or Inf."""


class NonFiniteResult(InvalidUpdate, reason="non_finite_result"):
    """Folding the update in would make the model or the strategy's state non-finite (a float32
    overflow of finite values): refused, so that no version is ever published with NaN/Inf."""


class UpdateNormTooLarge(InvalidUpdate, reason="update_norm"):
    """The client's delta has an L2 norm above ``max_update_norm``."""


class TooManySamples(InvalidUpdate, reason="num_samples"):
    """``num_samples`` is above ``max_num_samples``."""


class ShardsDisagree(RuntimeError):
    """The shards of a sharded server decided the same call differently: not a refusal of the
    call but a broken federation (the server stops taking writes)."""


class TooManyClients(StrategyError, code="RESOURCE_EXHAUSTED", reason="too_many_clients"):
    """Registering one more client would exceed ``max_clients``."""
