"""Who is slow, who left: ClientActivity's states, lags and top-N by hand, and the metrics built
on it scraped from a real server's /metrics."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch
from server_helpers import (
    RunningServer,
    raw_push,
    scrape_metrics,
    tiny_model,
    update_messages,
)

from aggsrv.client.client import Client
from aggsrv.server.client_activity import ClientActivity
from aggsrv.server.dashboard.status import status_document
from aggsrv.v1 import tensor_pb2 as tpb


def test_states_lags_and_the_slowest_by_hand() -> None:
    a = ClientActivity(
        straggler_factor=2.0, dropout_jobs=5.0, straggler_floor=0.0, dropout_floor=0.0
    )
    lease = 1e9
    everyone = [(c, lease) for c in "abcde"]
    # Before any turnaround: nobody straggles or drops out (no typical time yet).
    for c in "abcd":
        a.job_issued(c, job_id=1, base_version=0, now=0.0)
    assert a.states(100.0, everyone) == {"active": 4, "idle": 1, "straggling": 0,
                                         "dropped_out": 0}  # fmt: skip
    assert a.update_received("a", 1, now=1.0) == 1.0
    assert a.update_received("b", 1, now=3.0) == 3.0
    assert a.update_received("b", 1, now=4.0) is None  # not held any more
    assert a.update_received("c", 99, now=4.0) is None  # not the job it holds
    assert a.typical_turnaround() == 2.0
    a.job_issued("a", job_id=2, base_version=2, now=5.0)
    a.job_issued("a", job_id=2, base_version=2, now=6.0)  # again: keeps its issue time
    a.seen("e", 8.0)
    # At t = 8.5 (typical 2 s): a holds its job 3.5 s > 4? no: active; c and d hold theirs
    # 8.5 s > 4 s: straggling; b and e are idle (seen 5.5 s and 0.5 s ago, < 10 s).
    assert a.states(8.5, everyone) == {"active": 1, "idle": 2, "straggling": 2,
                                       "dropped_out": 0}  # fmt: skip
    # At t = 14.5: b and c last called at 4.0 (a refused or repeated push is still a call),
    # 10.5 s > 5 x 2 s: dropped out; d's lease ran out; a holds its job 9.5 s: straggling.
    leases = [(c, 13.0 if c == "d" else lease) for c in "abcde"]
    assert a.states(14.5, leases) == {"active": 0, "idle": 1, "straggling": 1,
                                      "dropped_out": 3}  # fmt: skip
    assert a.states(14.0, leases)["dropped_out"] == 1  # 10 s is not more than 10 s
    assert sorted(a.lags(version=5)) == [3, 5, 5]  # a holds base 2; c, d base 0
    assert a.slowest(10.0, 2) == [("d", 10.0), ("c", 10.0)] or a.slowest(10.0, 2) == [
        ("c", 10.0), ("d", 10.0)
    ]  # fmt: skip
    assert a.slowest(10.0, 5)[-1] == ("a", 5.0)
    # Update rates: a sent at 1.0; b at 3.0 and 4.0 (a repeat still arrived): 1 in 1 s.
    assert a.update_rates() == [60.0]
    for t in (20.0, 21.0, 23.0):
        a.update_received("a", 7, now=t)  # 4 arrivals over 22 s: 3 per 22 s
    assert sorted(a.update_rates()) == [pytest.approx(3 * 60.0 / 22.0), 60.0]
    # Last seen: a at 23 (its last update), b at 4, e at 8; "z" registered but never seen here.
    assert a.silences(30.0, ["a", "b", "e", "z"]) == [7.0, 26.0, 22.0, 0.0]


_scrape = scrape_metrics


def test_a_real_servers_metrics_count_jobs_turnarounds_and_versions() -> None:
    srv = RunningServer(strategy="fedasync", metrics_port=0, rate_limit_per_second=0.0)
    try:
        with Client(srv.address, "c1") as c1, Client(srv.address, "c2") as c2:
            c1.register(tiny_model(8))
            c2.register(tiny_model(8))
            D = c1.layout.numel
            held = c2.get_job()  # c2 keeps its job: active, lag grows as c1 pushes
            for _ in range(3):
                c1.push(c1.get_job(), torch.randn(D))
            m = _scrape(srv.server.metrics_port)
            assert m[("aggsrv_job_turnaround_seconds_count", frozenset())] == 3
            assert m[("aggsrv_versions_published_total", frozenset())] == 3
            states = {s: m[("aggsrv_clients", frozenset({("state", s)}))] for s in
                      ("active", "idle", "straggling", "dropped_out")}  # fmt: skip
            assert sum(states.values()) == 2 and states["dropped_out"] == 0
            assert states["idle"] >= 1  # c1 holds no job after its push
            # One held job (c2's, base 0) at version 3: one lag of 3.
            assert m[("aggsrv_client_lag_gcount", frozenset())] == 1
            # c1 sent 3 updates (a rate); c2 none yet.
            assert m[("aggsrv_client_update_rate_gcount", frozenset())] == 1
            # Both are registered and were seen within the last second or so.
            assert m[("aggsrv_client_silence_seconds_gcount", frozenset())] == 2
            assert m[("aggsrv_client_silence_seconds_bucket", frozenset({("le", "5.0")}))] == 2
            assert m[("aggsrv_client_lag_gsum", frozenset())] == 3
            assert m[("aggsrv_client_lag_bucket", frozenset({("le", "2.0")}))] == 0
            assert m[("aggsrv_client_lag_bucket", frozenset({("le", "4.0")}))] == 1
            (slowest,) = [k for k in m if k[0] == "aggsrv_slowest_job_seconds"]
            assert dict(slowest[1]) == {"client": "c2"} and m[slowest] >= 0
            c2.push(held, torch.randn(D))
            m = _scrape(srv.server.metrics_port)
            assert m[("aggsrv_job_turnaround_seconds_count", frozenset())] == 4
            assert m[("aggsrv_client_lag_gcount", frozenset())] == 0
    finally:
        srv.stop()


def test_a_buffered_strategys_fill_and_fill_time_reach_the_metrics() -> None:
    srv = RunningServer(
        strategy="fedbuff", strategy_config={"buffer_size": 3}, metrics_port=0,
        rate_limit_per_second=0.0,
    )  # fmt: skip
    try:
        with Client(srv.address, "c1") as c1:
            c1.register(tiny_model(12))
            D = c1.layout.numel
            m = _scrape(srv.server.metrics_port)
            assert m[("aggsrv_buffer_size", frozenset())] == 3
            assert m[("aggsrv_buffer_updates", frozenset())] == 0
            for _ in range(2):
                c1.push(c1.get_job(), torch.randn(D))
            m = _scrape(srv.server.metrics_port)
            assert m[("aggsrv_buffer_updates", frozenset())] == 2
            assert m[("aggsrv_buffer_fill_seconds_count", frozenset())] == 0
            t0 = time.monotonic()
            time.sleep(0.3)
            c1.push(c1.get_job(), torch.randn(D))  # the third: a step empties the buffer
            m = _scrape(srv.server.metrics_port)
            assert m[("aggsrv_buffer_updates", frozenset())] == 0
            assert m[("aggsrv_buffer_fill_seconds_count", frozenset())] == 1
            for _ in range(9):  # three more steps: one fill time each
                c1.push(c1.get_job(), torch.randn(D))
            m = _scrape(srv.server.metrics_port)
            assert m[("aggsrv_buffer_fill_seconds_count", frozenset())] == 4
            took = m[("aggsrv_buffer_fill_seconds_sum", frozenset())]
            assert 0.3 <= took <= 0.3 + (time.monotonic() - t0) + 5.0
    finally:
        srv.stop()


def test_strategy_events_keep_the_last_grouping_and_the_flags_and_pass_them_on() -> None:
    from aggsrv.server.dashboard.events import StrategyEvents

    seen: list[dict] = []
    events = StrategyEvents(then=seen.append)
    grouping = {"event": "grouping", "version": 4, "k": 2, "clients": ["a", "b", "c", "d"],
                "labels": [1, 0, 1, 0]}  # fmt: skip
    events(grouping)
    assert events.groups == {"version": 4, "k": 2, "groups": [["b", "d"], ["a", "c"]]}
    events({"event": "dropout", "client": "c", "dropped": True})
    events({"event": "dropout", "client": "a", "dropped": True})
    events({"event": "dropout", "client": "c", "dropped": False})  # back
    assert events.dropped == {"a"} and len(seen) == 4 and seen[0] is grouping


def test_the_publish_rate_counts_past_four_thousand_a_minute() -> None:
    from aggsrv.server.dashboard.events import PublishRate

    rate = PublishRate()
    for i in range(12_000):  # 100 versions a second for 120 s
        rate.published(i / 100.0)
    assert rate.last_minute(119.995) == 6000  # versions from 60.0 on
    assert rate.last_minute(1000.0) == 0  # a quiet minute counts none


def test_refusals_are_counted_by_status_and_a_bounded_reason() -> None:
    """Each way an upload is refused adds one to its (status, reason): the check that failed or
    the refusing error's class, never the caller's text."""
    srv = RunningServer(strategy="fedasync", metrics_port=0, rate_limit_per_second=0.0)
    try:
        with Client(srv.address, "c1") as client:
            client.register(tiny_model(3))
            job = client.get_job()
            D = client.layout.numel
            good = torch.randn(D)
            nan = good.clone()
            nan[5] = float("nan")
            short = [tpb.TensorInfo(name="update", numel=D - 1)]
            cases = [
                update_messages(client, job, good, client_id="nobody"),
                update_messages(client, job, good, layout_hash="0" * 64),
                update_messages(client, job, nan),
                update_messages(client, job, good[:-1], tensors=short),
                update_messages(client, job, good, dtype=7),
                update_messages(client, job, good, base_version=job.base_version + 5),
                update_messages(client, job, good, job_id="999"),
                update_messages(client, job, good)[:-2],  # cut before its last chunk
            ]
            for messages in cases:
                assert isinstance(raw_push(srv.address, messages), grpc.RpcError)

        def refusals() -> dict[tuple[str, str], float]:
            return {
                (dict(labels)["code"], dict(labels)["reason"]): v
                for (name, labels), v in scrape_metrics(srv.server.metrics_port).items()
                if name == "aggsrv_refusals_total"
            }

        # The server counts a refusal just after it answered it: wait for all eight.
        deadline = time.monotonic() + 10
        while sum(refusals().values()) < len(cases) and time.monotonic() < deadline:
            time.sleep(0.05)
        got = refusals()
        assert got == {
            ("not_found", "unknown_client"): 1,
            ("failed_precondition", "layout_mismatch"): 1,
            ("invalid_argument", "non_finite"): 1,
            ("invalid_argument", "tensor_sizes"): 1,
            ("invalid_argument", "bad_header"): 1,
            ("invalid_argument", "invalid_update"): 2,  # base not the job's; no such job
            ("data_loss", "cut_off"): 1,
        }
        doc = status_document(srv.federation)
        assert {(r["code"], r["reason"]): r["count"] for r in doc["refusal_reasons"]}[
            ("INVALID_ARGUMENT", "non_finite")
        ] == 1
    finally:
        srv.stop()


def test_bucket_counts_match_counting_each_bucket() -> None:
    """Scrape-time histograms count values <= each bound (Prometheus's `le`), bounds included,
    for any mix of values, none at all, or +Inf."""
    from aggsrv.server.metrics import RATE_BUCKETS, SILENCE_BUCKETS, cumulative_counts

    rng = np.random.default_rng()
    for bounds in (RATE_BUCKETS, SILENCE_BUCKETS):
        for n in (0, 1, 7, 1001):
            values = rng.choice([*bounds[:-1], 0.0, 1e9], size=n).tolist()
            values += rng.exponential(100.0, size=n).tolist()
            expect = [sum(1 for v in values if v <= b) for b in bounds]
            assert cumulative_counts(values, bounds) == expect
