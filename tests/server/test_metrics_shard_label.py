"""The shard label of a sharded server's metrics (aggsrv.server.metrics), in process: a single
server's exposition is unlabelled, a shard's labels every sample with its rank (the families a
single server fills, unchanged), and the per-client series are rank 0's only."""

from __future__ import annotations

import random

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aggsrv.server.metrics import ClientsNow, ServerMetrics


def _samples(source) -> list:
    text = generate_latest(source).decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _fill(metrics: ServerMetrics, updates: int) -> None:
    for _ in range(updates):
        metrics.record_update("APPLIED", staleness=random.randint(0, 9))
    metrics.record_refusal("ABORTED", "cut_off")
    metrics.gauge("global_version", "The latest global model version", lambda: updates)
    metrics.watch_clients(lambda: ClientsNow({"active": 1}, [0], [("c0", 1.5)], [2.0], [0.5]))


def test_a_single_server_is_unlabelled_and_a_shard_labels_every_sample() -> None:
    updates = random.randint(1, 20)
    single, shards = ServerMetrics(), [ServerMetrics(shard=r) for r in range(3)]
    for m in (single, *shards):
        _fill(m, updates)
    assert single.exposed is single.registry
    plain = _samples(single.exposed)
    assert plain and all("shard" not in s.labels for s in plain)
    for rank, m in enumerate(shards):
        labelled = _samples(m.exposed)
        assert {s.labels.get("shard") for s in labelled} == {str(rank)}
        # The same families and values as the registry a single server would serve.
        assert [(s.name, {**s.labels, "shard": str(rank)}, s.value) for s in _samples(m.registry)
                ] == [(s.name, s.labels, s.value) for s in labelled]  # fmt: skip
        applied = [s.value for s in labelled if s.labels.get("outcome") == "applied"
                   and s.name == "aggsrv_updates_total"]  # fmt: skip
        assert applied == [updates]
        names = {s.name for s in labelled}
        # Per-client series: rank 0 (and a single server) only, so they never multiply by N.
        assert ("aggsrv_slowest_job_seconds" in names) == (rank == 0)
        assert ("aggsrv_clients" in names) == (rank == 0)
    assert "aggsrv_clients" in {s.name for s in plain}


def test_a_restricted_scrape_is_labelled_too() -> None:
    m = ServerMetrics(shard=1)
    _fill(m, 3)
    only = _samples(m.exposed.restricted_registry(["aggsrv_global_version"]))
    assert [(s.name, s.labels, s.value) for s in only] == [
        ("aggsrv_global_version", {"shard": "1"}, 3.0)
    ]
