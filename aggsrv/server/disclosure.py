"""What the server shows to whom when differential privacy is on (docs/privacy.md, "Who sees
what").

With the ``dp_`` keys the published versions carry a client-level (epsilon, delta) guarantee
under the zero-out relation: neighbouring federations differ in the *values* of one client's
updates (all set to zero), while who contributed to which version and when stays the same. So
the ids, versions, sizes and times of calls are public facts, and a quantity the server shows
is covered only if it is a function of those facts (or of the published, noised versions).

Everything else the server counts is *data-dependent*: it depends on what some update holds (a
clip count, a norm or cosine, a filter's verdict, a refusal for NaN/Inf or for an overflow the
values cause), is not noised, and lies outside the guarantee. With DP on it is withheld from
every view a non-admin can read: GetStatus for a client token (or for anyone when
authentication is off), the status page and its JSON, and the Prometheus port (which have no
authentication at all). GetStatus for an admin token still carries it; that view is outside the
guarantee, like the log, the write-ahead log, the checkpoints and the trace. Without DP nothing
is withheld.

Refusals are counted by (gRPC code, reason), the reason a word from a fixed set
(:func:`class_reason` of the refusing error's class, or the name of the check that failed).
:data:`PUBLIC_REASONS` and :data:`DATA_REASONS` classify every reason the server can count (a
test finds them all in the code); a reason in neither is withheld (fail closed).

Under DP the refusals that read values are mostly gone rather than hidden: a delta holding
NaN/Inf is clipped to zero and taken (aggsrv.strategies.dp_clipping ``private_delta``), so the
version published is the zero-out neighbour's, and ``max_update_norm`` and the update filters are
refused with the dp_ keys. One remains: ``non_finite_result``, a next version (or a sum, or
FedAdam's moments) that would overflow float32. Every contribution is clipped to C, so it can
happen only when the published model or FedAdam's moments (functions of earlier releases) come
within a step of float32's largest value, 3.4e38, or C itself is of that order (a model that
has already diverged, for all to see). It is withheld from non-admin views like the other
data-dependent reasons, but the version that then does not appear still tells it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "DATA_REASONS",
    "DATA_SERIES",
    "PUBLIC_REASONS",
    "class_reason",
    "is_public",
    "public_refusals",
]

# Refusals decided by public facts alone: the caller's credentials and rate, ids and header
# fields, the framing, length and checksum of the stream (what a client that follows the wire
# contract sends whatever its values are), the job's state, versions, leases and timing, and
# the accountant (who contributed to which version).
PUBLIC_REASONS = frozenset(
    {
        # the request's checks (aggsrv.server.requests and .service)
        "request",  # no model yet, bad framing, receive limits, labels, idle timeout, unparseable
        "credentials",  # no valid token
        "permission",  # a token for another client
        "bad_header",  # kind, dtype or the first message
        "bad_id",  # a malformed client or update id
        "wrong_shard",  # the slice went to another shard
        "unknown_job",  # a job id the server never wrote
        "in_flight",  # the same update id on another stream
        "rate_limited",
        "unknown_client",
        "layout_mismatch",
        "tensor_sizes",  # the header's tensor sizes
        "cut_off",  # the stream ended before its trailer
        "device_memory",  # no device memory for an upload in flight (its size is the model's)
        # the decoder (aggsrv.transport.errors): framing, lengths and the CRC of the bytes
        "codec_error",
        "bad_chunk",
        "chunk_too_large",
        "wrong_length",
        "unsupported_dtype",
        "truncated",
        "checksum_mismatch",  # the trailer disagrees with the bytes received (a broken channel)
        # the strategies (aggsrv.strategies.errors, .privacy) and the shards
        "too_stale",  # versions
        "job_superseded",  # the job's state and lease: versions and timing
        "not_registered",
        "too_many_clients",
        # Under DP an InvalidUpdate is a header or job mismatch: the checks of values have their
        # own classes below, and the one on float buffers (a negative running_var) cannot happen
        # (DP refuses models with float buffers).
        "invalid_update",
        "privacy_budget_spent",  # the accountant: who contributed to which version
        "slice_missing",  # a sharded server: a slice did not arrive in time
        "relay_failed",  # rank 0 could not forward a slice to its shard (the network)
    }
)

# Refusals that depend on the update's content. Under DP the server never makes non_finite,
# non_finite_update (a NaN/Inf delta is clipped to zero) or update_norm_too_large
# (max_update_norm is refused with the dp_ keys); non_finite_result remains (module docstring).
DATA_REASONS = frozenset(
    {
        "non_finite",  # the decoder found NaN/Inf (under DP: float buffers only; DP refuses them)
        "non_finite_update",  # the strategy found NaN/Inf
        "non_finite_result",  # the values would make the next version (or a sum) overflow float32
        "update_norm_too_large",  # max_update_norm
        # num_samples above max_num_samples: a header field, which the zero-out relation leaves
        # as it is, but it is the client's data-set size, which the guarantee does not cover
        "too_many_samples",
        "strategy_error",  # a refusal of no more specific class: not known to be public
    }
)

# Prometheus families (names without _total, _bucket, ...) that describe updates' values: not
# served under DP. Filter verdicts (aggsrv_updates_filtered, GetStatus filtered_by_reason) all
# read the values; the update filters are refused with the dp_ keys anyway. The time one update
# takes to fold in depends on its values too (a NaN/Inf delta is zeroed, per-layer clipping
# scales only the layers it clips), so aggsrv_aggregation_seconds goes as well.
DATA_SERIES = frozenset(
    {
        "aggsrv_update_norm",
        "aggsrv_update_norm_outliers",
        "aggsrv_update_cosine",
        "aggsrv_update_cosine_outliers",
        "aggsrv_updates_filtered",
        "aggsrv_updates_clipped",
        "aggsrv_dp_updates_clipped",
        "aggsrv_aggregation_seconds",
    }
)


def class_reason(cls: type) -> str:
    """A refusing exception class as a reason: NonFiniteResult -> non_finite_result."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


def is_public(reason: str) -> bool:
    """Whether a refusal for ``reason`` depends on public facts only (unknown: it does not)."""
    return reason in PUBLIC_REASONS


def public_refusals(
    by_reason: Mapping[tuple[str, str], int],
) -> tuple[int, dict[str, int], dict[tuple[str, str], int]]:
    """(total, by code, by (code, reason)) of the refusals for public reasons only."""
    kept = {key: n for key, n in by_reason.items() if n and is_public(key[1])}
    by_code: dict[str, int] = {}
    for (code, _), n in kept.items():
        by_code[code] = by_code.get(code, 0) + n
    return sum(kept.values()), by_code, kept
