"""Prometheus metrics of one server (prometheus-client), served on ``--metrics-port``.

Each server owns a registry of its own, so several servers in one process (tests) never share
counters. Gauges that mirror federation state are read when scraped (callbacks), not pushed.

The port has no authentication: under differential privacy (:meth:`ServerMetrics.withhold_data`)
it serves no series that depends on what an update holds (aggsrv.server.disclosure).

A shard of a sharded federation labels every series it serves ``shard="RANK"`` (a Prometheus
scraping all N shards tells them apart and sums them with ``sum without(shard)``); a single
server's series carry no such label, as before. The per-client series (``watch_clients``) are
rank 0's only: it sees every client, and the other shards' copies would multiply them by N.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase

from aggsrv.server.disclosure import DATA_SERIES, is_public

log = logging.getLogger(__name__)

# Staleness is a version count: powers of two up to the usual max_staleness bounds.
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, float("inf"))
# One strategy call on the aggregation thread: microseconds (FedAsync on a small model) to
# seconds (a FedDGIC grouping over a large cache).
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, float("inf"),
)  # fmt: skip
FSYNC_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, float("inf"))
# A job's turnaround (issue to update receipt): a phone's seconds to a straggler's hours.
TURNAROUND_BUCKETS = (
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
    float("inf"),
)  # fmt: skip
# An update's L2 norm: decades from a tiny fine-tuning step to a diverging client.
NORM_BUCKETS = tuple(10.0**e for e in range(-4, 5)) + (float("inf"),)
COSINE_BUCKETS = tuple(round(-1.0 + 0.2 * i, 1) for i in range(11)) + (float("inf"),)
# Seconds since a client last called: a second to a day.
SILENCE_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, 86400.0, float("inf"))
# A client's updates per minute: a phone once an hour to a fast worker many times a second.
RATE_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0, 3600.0, float("inf"))
SLOWEST = 10  # clients named by aggsrv_slowest_job_seconds: a bounded set
EVAL_HISTORY = 500  # --eval results the dashboard keeps


class ServerMetrics:
    """The server's counters, histograms and gauges under the ``aggsrv_`` prefix."""

    def __init__(self, registry: CollectorRegistry | None = None, shard: int | None = None) -> None:
        """``shard``: this process's rank in a sharded federation (its series are labelled
        with it); None for a single server."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.shard = shard
        r = self.registry
        self.updates = Counter(
            "aggsrv_updates", "Updates by outcome: applied, buffered, duplicate, or the gRPC "
            "status code of a refusal (lower case)", ["outcome"], registry=r,
        )  # fmt: skip
        self.refusals = Counter(
            "aggsrv_refusals", "Refused uploads by gRPC status (lower case) and reason: the "
            "check that failed (unknown_client, layout_mismatch, rate_limited, unknown_job, "
            "cut_off, ...) or the refusing error's class (non_finite, checksum_mismatch, "
            "stale_update, ...)", ["code", "reason"], registry=r,
        )  # fmt: skip
        self.filtered = Counter(
            "aggsrv_updates_filtered", "Updates the strategy's update filter left out (answered "
            "FILTERED), by reason (FilterReason name, lower case)", ["reason"], registry=r,
        )  # fmt: skip
        self.clipped = Counter(
            "aggsrv_updates_clipped", "Updates the strategy's update filter clipped before "
            "folding them in (APPLIED or BUFFERED)", registry=r,
        )  # fmt: skip
        self.received_bytes = Counter(
            "aggsrv_received_bytes", "Payload bytes received in update and model uploads",
            registry=r,
        )  # fmt: skip
        self.sent_bytes = Counter(
            "aggsrv_sent_bytes", "Payload bytes sent in jobs and models", registry=r
        )
        self.aggregation_seconds = Histogram(
            "aggsrv_aggregation_seconds", "Time the strategy took to fold one update in",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.staleness = Histogram(
            "aggsrv_staleness", "Staleness s = V_apply - v_base of accepted updates",
            buckets=STALENESS_BUCKETS, registry=r,
        )  # fmt: skip
        self.fsync_seconds = Histogram(
            "aggsrv_wal_sync_seconds", "Time an acknowledgement waited for the write-ahead log",
            buckets=FSYNC_BUCKETS, registry=r,
        )  # fmt: skip
        self.checkpoints = Counter("aggsrv_checkpoints", "Checkpoints written", registry=r)
        self.checkpoint_seconds = Histogram(
            "aggsrv_checkpoint_seconds", "Time to take and write one checkpoint",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.auth_failures = Counter(
            "aggsrv_auth_failures", "Calls refused for their credentials", ["code"], registry=r
        )
        self.rate_limited = Counter(
            "aggsrv_rate_limited", "Calls refused by the per-client rate limit", registry=r
        )
        self.job_turnaround = Histogram(
            "aggsrv_job_turnaround_seconds", "Time from a job's issue to its update's receipt",
            buckets=TURNAROUND_BUCKETS, registry=r,
        )  # fmt: skip
        self.buffer_fill_seconds = Histogram(
            "aggsrv_buffer_fill_seconds", "A buffered strategy (FedBuff, CA2FL, FedHist): time "
            "from the first update in its empty buffer to the step that empties it",
            buckets=TURNAROUND_BUCKETS, registry=r,
        )  # fmt: skip
        self.update_norm = Histogram(
            "aggsrv_update_norm", "L2 norm of each update received whole (from its NaN check)",
            buckets=NORM_BUCKETS, registry=r,
        )  # fmt: skip
        self.update_norm_outliers = Counter(
            "aggsrv_update_norm_outliers", "Updates whose norm lies far from the recent ones "
            "(log-norm beyond 3.5 robust sd of the last 512): a client to look at",
            registry=r,
        )  # fmt: skip
        self.update_cosine = Histogram(
            "aggsrv_update_cosine", "Cosine of each DELTA update to the model's recent change "
            "(the last second or more of versions)", buckets=COSINE_BUCKETS, registry=r,
        )  # fmt: skip
        self.update_cosine_outliers = Counter(
            "aggsrv_update_cosine_outliers", "Updates whose cosine to the model's recent change "
            "lies far from the recent updates' (beyond 3.5 robust sd of the last 512)",
            registry=r,
        )  # fmt: skip
        self.versions_published = Counter(
            "aggsrv_versions_published", "Global versions published (their rate: rate(...))",
            registry=r,
        )  # fmt: skip
        self.eval_metrics = Gauge(
            "aggsrv_eval", "The last --eval hook result by metric name", ["metric"], registry=r
        )
        self.eval_version = Gauge(
            "aggsrv_eval_version", "The global version the last evaluation ran on", registry=r
        )
        # The last --eval results, oldest first, for the dashboard's curve.
        self.eval_history: deque[dict] = deque(maxlen=EVAL_HISTORY)
        self._gauges: dict[str, Gauge] = {}
        self._http = None
        self.private = False  # differential privacy: data-dependent series withheld

    def withhold_data(self) -> None:
        """Differential privacy is on: the families of ``DATA_SERIES`` leave the registry (a
        gauge of them is not registered either), refusals for data-dependent reasons and
        filter verdicts are not counted, so the unauthenticated port serves none of them."""
        self.private = True
        for family in list(vars(self).values()):
            if isinstance(family, MetricWrapperBase) and family.describe()[0].name in DATA_SERIES:
                self.registry.unregister(family)

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge read from federation state at scrape time (not served when it is one of
        ``DATA_SERIES`` and the metrics are private)."""
        full = f"aggsrv_{name}"
        g = Gauge(
            full, doc, registry=None if self.private and full in DATA_SERIES else self.registry
        )
        g.set_function(read)
        self._gauges[name] = g

    def watch_clients(self, read: Callable[[], ClientsNow]) -> None:
        """Scrape-time metrics of the clients (``read`` on the metrics thread); none on a shard
        of rank >= 1 (rank 0 serves them for the whole federation)."""
        if not self.shard:
            self.registry.register(_ClientsCollector(read))

    @property
    def exposed(self) -> CollectorRegistry | ShardLabelled:
        """What the /metrics endpoint serves: the registry, its series labelled with the shard
        on a sharded server."""
        if self.shard is None:
            return self.registry
        return ShardLabelled(self.registry, str(self.shard))

    def record_update(
        self,
        outcome: str,
        staleness: int | None = None,
        filter_reason: str | None = None,
        clipped: bool = False,
    ) -> None:
        """An update taken (APPLIED, BUFFERED, DUPLICATE or FILTERED)."""
        if self.private and (filter_reason is not None or outcome.lower() == "filtered"):
            return  # a filter's verdict reads the values
        self.updates.labels(outcome=outcome.lower()).inc()
        if filter_reason is not None:
            self.filtered.labels(reason=filter_reason.lower()).inc()
        if clipped and not self.private:
            self.clipped.inc()
        if staleness is not None:
            self.staleness.observe(staleness)

    def record_refusal(self, code: str, reason: str) -> None:
        """A refused upload, by gRPC code name and reason (not counted here when the metrics
        are private and the reason is data-dependent: aggsrv.server.disclosure)."""
        if self.private and not is_public(reason):
            return
        self.updates.labels(outcome=code.lower()).inc()
        self.refusals.labels(code=code.lower(), reason=reason).inc()

    def record_eval(self, version: int, metrics: dict[str, float]) -> None:
        self.eval_history.append(
            {"version": version, "time": time.time(), "metrics": dict(metrics)}
        )
        self.eval_version.set(version)
        for name, value in metrics.items():
            self.eval_metrics.labels(metric=name).set(value)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint on its own thread; return the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.exposed)
        self._http = server
        bound = server.server_address[1]
        log.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class ShardLabelled:
    """A registry's series, each with ``shard="RANK"`` added, for the exposition code
    (prometheus_client calls ``collect`` and, for ``?name[]=`` scrapes, ``restricted_registry``).
    A constant label here rather than a label on every family: the families stay the same
    objects a single server fills, and no call site names the shard."""

    def __init__(self, registry: CollectorRegistry | Any, shard: str) -> None:
        self.registry = registry
        self.shard = shard

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            labelled = copy.copy(family)
            labelled.samples = [
                s._replace(labels={**s.labels, "shard": self.shard}) for s in family.samples
            ]
            yield labelled

    def restricted_registry(self, names: Iterable[str]) -> ShardLabelled:
        return ShardLabelled(self.registry.restricted_registry(names), self.shard)


@dataclass(frozen=True)
class ClientsNow:
    """What the clients' metrics show at one scrape."""

    states: dict[str, int]
    lags: list[int]  # global version minus the base of each held job
    slowest: list[tuple[str, float]]  # (client, seconds holding its job), longest first
    update_rates: list[float]  # per client: updates per minute over its last few updates
    silences: list[float]  # per registered client: seconds since it last called


class _ClientsCollector:
    """``aggsrv_clients{state}``, ``aggsrv_client_lag``, ``aggsrv_client_update_rate``,
    ``aggsrv_client_silence_seconds`` and ``aggsrv_slowest_job_seconds``, computed when
    Prometheus scrapes: bounded sets, whatever the number of clients."""

    def __init__(self, read: Callable[[], ClientsNow]) -> None:
        self.read = read

    def describe(self):  # no samples at registration: read() needs a running federation
        return []

    def collect(self):
        try:
            now = self.read()
        except Exception:  # a scrape must not fail whole for these
            log.exception("the clients' metrics could not be read")
            return
        yield _labelled_gauge(
            "aggsrv_clients", "Registered clients by state: active (holds a job), idle, "
            "straggling (holds a job for over 2 typical turnarounds and 1 s), dropped_out "
            "(silent for 5 typical turnarounds and 30 s, or lease expired)", "state",
            now.states.items(),
        )  # fmt: skip
        # Gauge histograms: of the clients now, so their counts go down too.
        yield _gauge_histogram(
            "aggsrv_client_lag", "Per client holding a job now: global version minus the job's "
            "base", now.lags, STALENESS_BUCKETS,
        )  # fmt: skip
        yield _gauge_histogram(
            "aggsrv_client_update_rate", "Per client with two updates or more: its updates per "
            "minute over its last 8 (the spread of client speeds)", now.update_rates,
            RATE_BUCKETS,
        )  # fmt: skip
        yield _gauge_histogram(
            "aggsrv_client_silence_seconds", "Per registered client: seconds since it last "
            "called (last seen), for how long the quiet ones have been quiet", now.silences,
            SILENCE_BUCKETS,
        )  # fmt: skip
        # No rank label: the value orders them, and a client keeps one series whatever its rank.
        yield _labelled_gauge(
            "aggsrv_slowest_job_seconds", f"The {SLOWEST} clients holding their job longest: "
            "its age", "client", now.slowest,
        )  # fmt: skip


def _labelled_gauge(
    name: str, doc: str, label: str, values: Iterable[tuple[str, float]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in values:
        family.add_metric([key], value)
    return family


def _gauge_histogram(
    name: str, doc: str, values: list[int] | list[float], bounds: tuple[float, ...]
) -> GaugeHistogramMetricFamily:
    family = GaugeHistogramMetricFamily(name, doc)
    counts = cumulative_counts(values, bounds)
    buckets = [(_le(le), c) for le, c in zip(bounds, counts, strict=True)]
    family.add_metric([], buckets, gsum_value=float(sum(values)))
    return family


def cumulative_counts(values: list[int] | list[float], bounds: tuple[float, ...]) -> list[int]:
    """How many of ``values`` are <= each bound: one sort, not one pass per bucket, since a
    scrape at 10^5 clients must not hold the GIL from the event loop for long."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    return np.searchsorted(ordered, np.asarray(bounds, dtype=np.float64), side="right").tolist()


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else str(float(bound))
