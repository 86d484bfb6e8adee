"""A sharded federation keeps the single server's promise across crashes: every update a client
saw acknowledged is in the model exactly once after any SIGKILL of any subset of the shards and a
restart with --resume, whether every shard is restarted or the lost one alone rejoins
(docs/sharding.md "Crashes and recovery"). The oracle is tests/support/shard_kills.py's exact
count of one-hot updates.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from shard_kills import (
    D,
    ShardProcesses,
    check_exactly_once,
    flush,
    kill_at_random,
    layout,
    push_until_acked,
    start_pushing,
    wait_for,
)  # fmt: skip

from aggsrv.client import Client


@pytest.mark.parametrize("shards", [2])
def test_every_acknowledged_update_survives_killing_every_shard(tmp_path: Path,
                                                                shards: int) -> None:  # fmt: skip
    """SIGKILL all shards between two batches of pushes, resume: the count is exact."""
    fed = ShardProcesses(tmp_path, shards)
    acked: list[str] = []
    try:
        fed.start(resume=False)
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=layout(), initial=torch.zeros(D))
        stop = threading.Event()
        for batch in range(2):
            wait_for(fed, start_pushing(fed, 5, acked, stop, first=5 * batch))
            fed.kill(list(range(shards)))
            fed.start(resume=True)
        flush(fed.address, acked)
        check_exactly_once(fed, acked)
    finally:
        fed.close()


@pytest.mark.parametrize("shards", [3])
def test_random_sigkills_lose_no_acknowledged_update(tmp_path: Path, shards: int) -> None:
    """Clients push all the while; at random moments one shard, rank 0 or all of them are
    SIGKILLed, then the federation is restarted with --resume (every shard: a shard that lost
    its peers refuses writes until it is restarted). Every acknowledged update is counted
    exactly once."""
    rng = random.Random()
    fed = ShardProcesses(tmp_path, shards)
    acked: list[str] = []
    stop = threading.Event()
    try:
        fed.start(resume=False)
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=layout(), initial=torch.zeros(D))
        threads = start_pushing(fed, 12, acked, stop)
        kill_at_random(fed, rng)
        wait_for(fed, threads)
        flush(fed.address, acked)
        check_exactly_once(fed, acked)
    finally:
        stop.set()
        fed.close()


def _health(address: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


# Rank 0 alone on 3 shards (the others reconnect to its new store) and a follower on 2; the
# soak (bench/test_soak_shard_kills.py) draws the victim at random for as long as you ask.
@pytest.mark.parametrize(("shards", "victim"), [(2, 1), (3, 0)])
def test_a_shard_restarted_alone_rejoins_while_the_others_stay_up(
    tmp_path: Path, shards: int, victim: int
) -> None:
    """SIGKILL one shard while clients push; the others stay up (same processes), answer reads
    and refuse writes with UNAVAILABLE and a retry hint; the killed shard alone is restarted
    with --resume, the federation is whole again, and every acknowledged update is counted
    exactly once."""
    fed = ShardProcesses(tmp_path, shards)
    acked: list[str] = []
    stop = threading.Event()
    try:
        fed.start(resume=False)
        survivors = [r for r in range(shards) if r != victim]
        pids = {r: fed.procs[r].proc.pid for r in survivors}
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=layout(), initial=torch.zeros(D))
        threads = start_pushing(fed, 10, acked, stop)
        time.sleep(random.uniform(0.5, 1.5))
        fed.kill([victim])
        survivor = fed.procs[survivors[0]].address
        # The survivors notice at once, within a heartbeat when idle; one waiting in a sum on
        # another survivor when that one leaves the group (the bound covers its timeout, 20 s).
        deadline = time.monotonic() + 45
        while True:
            with Client(survivor, "reader", timeout=5, retries=0) as op:
                failure = op.status().failure
            if failure or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert "not whole" in failure and "retry" in failure, failure
        if victim != 0:  # rank 0 answers reads of its slice meanwhile; writes are refused
            with Client(fed.address, "reader", timeout=5, retries=0) as op:
                assert op.status().version >= 0
                with pytest.raises(grpc.RpcError) as refused:
                    op.register(layout=layout())
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "retry" in refused.value.details()
        time.sleep(random.uniform(0.0, 1.0))
        fed.start(resume=True, ranks=[victim])
        wait_for(fed, threads)
        assert {r: fed.procs[r].proc.pid for r in survivors} == pids  # never restarted
        assert all(fed.procs[r].proc.poll() is None for r in range(shards))
        from grpc_health.v1 import health_pb2

        assert _health(fed.address) == health_pb2.HealthCheckResponse.SERVING
        flush(fed.address, acked)
        check_exactly_once(fed, acked)
    finally:
        stop.set()
        fed.close()


def test_stopping_rank_0_checkpoints_every_shard_at_the_same_call(tmp_path: Path) -> None:
    """SIGTERM to rank 0 stops both shards cleanly (exit 0), each with a final checkpoint cut at
    the same call; the resumed federation starts from it and goes on exactly."""
    from aggsrv.server import durability as DUR

    fed = ShardProcesses(tmp_path, 2)
    acked: list[str] = []
    try:
        fed.start(resume=False)
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=layout(), initial=torch.zeros(D))
        push_until_acked("c0", fed.address, 6, acked, threading.Event())
        assert fed.procs[0].terminate() == 0
        assert fed.procs[1].proc.wait(30) == 0
        seqs = []
        for r in range(2):
            number, path = DUR.latest_checkpoint(tmp_path / f"shard{r}")
            payload = DUR.load_checkpoint(path)
            assert payload["shard"]["rank"] == r and payload["shard"]["shards"] == 2
            seqs.append((payload["shard"]["seq"], payload["state"]["version"]))
        assert seqs[0] == seqs[1] and seqs[0][1] == 1  # 6 updates: one step of 4
        fed.start(resume=True)
        push_until_acked("c1", fed.address, 2, acked, threading.Event())
        check_exactly_once(fed, acked)
    finally:
        fed.close()


@pytest.mark.parametrize("victim", [1, 0])
def test_shards_that_were_not_lost_keep_their_state(tmp_path: Path, victim: int) -> None:
    """A shard lost between two calls: the others keep their state as it is (they load nothing
    from disk; their logs say no 'resumed'), the restarted shard alone loads its checkpoint and
    replays rank 0's calls after it, and the federation goes on exactly."""
    fed = ShardProcesses(tmp_path, 3)
    acked: list[str] = []
    try:
        fed.start(resume=False)
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=layout(), initial=torch.zeros(D))
        push_until_acked("c0", fed.address, 9, acked, threading.Event())  # past a checkpoint
        fed.kill([victim])
        fed.start(resume=True, ranks=[victim])
        push_until_acked("c1", fed.address, 3, acked, threading.Event())
        flush(fed.address, acked)
        check_exactly_once(fed, acked)
        for r in range(3):
            text = (tmp_path / f"shard{r}-1.log").read_text()
            assert "resumed from checkpoint" not in text, (r, text[-2000:])
        rejoined = (tmp_path / f"shard{victim}-2.log").read_text()
        assert f"shard {victim} resumed from checkpoint" in rejoined, rejoined[-2000:]
    finally:
        fed.close()


def test_every_shard_counts_the_fsync_of_its_slice_in_its_metrics(tmp_path: Path) -> None:
    """Each shard's wal_sync_seconds histogram counts the fsyncs it waits for: rank 0's of its
    records, and a shard of rank >= 1's of each slice it makes durable before it votes."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    from server_helpers import free_port

    ports = [free_port(), free_port()]
    fed = ShardProcesses(tmp_path, 2)
    acked: list[str] = []

    def synced(rank: int) -> float:
        url = f"http://127.0.0.1:{ports[rank]}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "aggsrv_wal_sync_seconds_count":
                    assert sample.labels["shard"] == str(rank)
                    return sample.value
        return 0.0

    try:
        fed.start(False, None, lambda rank: ["--metrics-port", str(ports[rank])])
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=layout(), initial=torch.zeros(D))
        before = [synced(0), synced(1)]
        push_until_acked("c0", fed.address, 5, acked, threading.Event())
        after = [synced(0), synced(1)]
        assert after[1] - before[1] == 5, (before, after)  # one per slice
        assert after[0] - before[0] >= 5, (before, after)  # its records, jobs' too
    finally:
        fed.close()
