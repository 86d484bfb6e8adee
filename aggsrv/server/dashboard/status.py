"""The dashboard's JSON document (``GET /api/status``): one snapshot of a running federation.

Built on the dashboard's HTTP thread from what is safe to read there: the published version,
copies of the client records and counters, the Prometheus metrics' own values, the strategy's
settings (fixed once it is made) and the last events the strategy emitted. It never reads the
strategy's tensors or any state a call on the aggregation thread may be changing.

The document (``format`` 1), documented for scripts in docs/operations.md:

``time``, ``started`` (server clock, Unix seconds), ``strategy`` {``name``, ``settings``,
``groups``: [[title, [keys]]]}, ``version``, ``versions_last_minute``, ``updates``
{``accepted``, ``applied``, ``buffered``, ``filtered``, ``duplicate``, ``rejected``},
``refusals`` {status code: count}, ``refusal_reasons`` [{``code``, ``reason``, ``count``}],
``data_withheld``, ``clients`` {``known``, ``states`` {state: count}, ``slowest`` [{``client``,
``seconds``}]}, ``staleness``, ``job_turnaround_seconds``, ``client_lag``,
``client_update_rate`` (each client's updates per minute), ``client_silence_seconds`` (per
registered client, the seconds since it last called; each of the five {``le``: upper bounds,
``counts``: per bucket, not cumulative, ``count``, ``sum``}), ``evaluation`` [{``version``,
``time``, ``metrics``}] (the last 500 ``--eval`` results), ``groups`` (FedDGIC's last grouping:
{``version``, ``k``, ``groups``: [[client ids]]} or null), ``dropped_flags`` (client ids the
strategy flags as dropped out now) and ``privacy`` (differential privacy's spending, as
GetStatus's PrivacyStatus, epsilon null when infinite; null without DP).

The page has no authentication: under differential privacy (``data_withheld`` true) it shows
what a non-admin caller of GetStatus sees (aggsrv.server.disclosure): ``updates.rejected``,
``refusals`` and ``refusal_reasons`` count only refusals for public reasons, ``privacy`` has no
``updates_clipped``, and a ``dp_seed`` in the settings reads "withheld". ``privacy.insecure_seed``
is true when the noise comes from a fixed ``dp_seed`` (no guarantee: the page warns).

``shards``: on rank 0 of a sharded federation, one row per shard, rank 0 first (GetStatus's
``shards``, aggsrv.server.shard_status): {``rank``, ``address``, ``begin``, ``end``,
``reachable``, ``error``, ``version``, ``takes_writes``, ``failure``, ``durability``,
``wal_bytes``, ``last_checkpoint`` ({``version``, ``time``} or null), ``last_heard`` (rank 0's
clock, Unix seconds, or null)}; null for a single server and on the other shards. The rest of
the document is rank 0's own, which sees every client: nothing in it grows with the shards.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import Histogram

from aggsrv.server.shard_status import shard_row_json

if TYPE_CHECKING:
    from aggsrv.server.federation import Federation
    from aggsrv.server.shard_status import ShardWatch

FORMAT = 1


def histogram_json(hist: Histogram) -> dict[str, Any]:
    """A prometheus-client histogram as per-bucket counts."""
    bounds: list[float] = []
    cumulative: list[float] = []
    total = count = 0.0
    for metric in hist.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket"):
                bounds.append(float(s.labels["le"]))
                cumulative.append(s.value)
            elif s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
    return _buckets_json(bounds, cumulative, count, total)


def _buckets_json(
    bounds: list[float], cumulative: list[float], count: float, total: float
) -> dict[str, Any]:
    counts = [c - p for c, p in zip(cumulative, [0.0, *cumulative[:-1]], strict=True)]
    return {
        "le": [b if math.isfinite(b) else None for b in bounds],  # None: +Inf (JSON has none)
        "counts": [int(c) for c in counts],
        "count": int(count),
        "sum": total,
    }


def values_json(values: list[int] | list[float], bounds: tuple[float, ...]) -> dict[str, Any]:
    from aggsrv.server.metrics import cumulative_counts

    cumulative = [float(c) for c in cumulative_counts(values, bounds)]
    return _buckets_json(list(bounds), cumulative, len(values), float(sum(values)))


# The counts of /api/status "updates" (and "rejected"): every outcome an upload can have.
UPDATE_OUTCOMES = ("accepted", "applied", "buffered", "filtered", "duplicate")


def setting_groups(config: Any, private: bool) -> list[list[Any]]:
    """The strategy's settings for people, as [title, [keys]]: the strategy's own, those every
    strategy has (the clients' recipe, staleness and norm bounds), and differential privacy's
    only when it is on."""
    from aggsrv.strategies import StrategyConfig
    from aggsrv.strategies.privacy import PrivacyConfig

    shared = {f.name for f in dataclasses.fields(StrategyConfig)}
    dp = {f.name for f in dataclasses.fields(PrivacyConfig)}
    keys = type(config).offered_keys()
    groups = [
        ["strategy", [k for k in keys if k not in shared and k not in dp]],
        ["every strategy: the clients' recipe and bounds", [k for k in keys if k in shared]],
    ]
    if private:
        groups.append(["differential privacy", [k for k in keys if k in dp]])
    return [g for g in groups if g[1]]


def status_document(fed: Federation, shard_watch: ShardWatch | None = None) -> dict[str, Any]:
    """The snapshot (HTTP thread); ``shard_watch``: rank 0's view of the shards, if sharded."""
    from aggsrv.server.metrics import RATE_BUCKETS, SILENCE_BUCKETS, STALENESS_BUCKETS

    now = fed.clock()
    metrics = fed.metrics
    clients = fed.clients_now()
    strategy = fed.strategy
    settings: dict[str, Any] = {}
    groups: list[list[Any]] = []
    if strategy is not None:
        settings = {k: _plain(v) for k, v in strategy.config.to_dict().items()}
        groups = setting_groups(strategy.config, private=fed.private)
    events = fed.strategy_events
    withheld = fed.private  # differential privacy: no caller of the page is an admin
    rejected, by_code, by_reason = fed.refusal_counts(full=not withheld)
    privacy = _privacy_json(fed.privacy_now())
    if privacy is not None and strategy is not None and strategy.privacy is not None:
        # A fixed dp_seed (dp_insecure_seed): the noise can be recomputed; the page says so.
        privacy["insecure_seed"] = not strategy.privacy.key.secure
    if withheld:
        if privacy is not None:
            privacy.pop("updates_clipped", None)
        if settings.get("dp_seed") is not None:  # it would let anyone recompute the noise
            settings["dp_seed"] = "withheld"
    return {
        "format": FORMAT,
        "time": now,
        "wall_time": time.time(),
        "started": fed.started_at,
        "strategy": {"name": fed.config.strategy, "settings": settings, "groups": groups},
        "has_model": strategy is not None,
        "version": fed.published_version if strategy is not None else None,
        "versions_last_minute": fed.publish_rate.last_minute(now),
        "updates": {
            **{k: int(fed.counters[k]) for k in UPDATE_OUTCOMES},
            "rejected": rejected,
        },
        "refusals": dict(sorted(by_code.items())),
        "refusal_reasons": [
            {"code": code, "reason": reason, "count": n}
            for (code, reason), n in sorted(by_reason.items())
        ],
        "data_withheld": withheld,
        "clients": {
            "known": len(fed.clients),
            "states": clients.states,
            "slowest": [{"client": c, "seconds": s} for c, s in clients.slowest],
        },
        "staleness": histogram_json(metrics.staleness),
        "job_turnaround_seconds": histogram_json(metrics.job_turnaround),
        "client_lag": values_json(clients.lags, STALENESS_BUCKETS),
        "client_update_rate": values_json(clients.update_rates, RATE_BUCKETS),
        "client_silence_seconds": values_json(clients.silences, SILENCE_BUCKETS),
        "evaluation": list(metrics.eval_history),
        "groups": events.groups,
        "dropped_flags": sorted(events.dropped),
        "privacy": privacy,
        "shards": _shards_json(shard_watch),
    }


def _shards_json(watch: ShardWatch | None) -> list[dict[str, Any]] | None:
    """Rank 0's rows of the shards (asking the others takes up to PROBE_TIMEOUT seconds)."""
    if watch is None or not watch.active:
        return None
    return [shard_row_json(row) for row in watch.rows_from_thread()]


def _privacy_json(spent: dict[str, Any] | None) -> dict[str, Any] | None:
    """JSON has no infinity: an infinite epsilon (no noise) is null."""
    if spent is None:
        return None
    eps = spent["epsilon"]
    return {**spent, "epsilon": eps if math.isfinite(eps) else None}


def _plain(value: Any) -> Any:
    """A settings value JSON can hold (tuples as lists, anything else as text)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)
