"""Shards that diverge stop the federation (issue 17; docs/sharding.md "Shards that diverge").

Two shard processes in one gloo group serve one federation after another; in each, one shard's
strategy is made to decide a call differently from the others (a plug-in bug, or state that has
drifted): it refuses an update the others apply, applies one rank 0 refuses, or refuses a job
rank 0 issued. After each call the shards compare what it did, so every shard must stop taking
writes on that call (UNAVAILABLE, a CRITICAL reason naming the call and the shards that differ,
health NOT_SERVING), while reads still answer."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import traceback
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.strategies import NotRegistered, Status, TooStale
from aggsrv.v1 import aggregation_pb2 as pb

WORLD = 2
ODD_SAMPLES = 13  # the update one shard decides differently
ODD_CLIENT = "c-odd"  # the client one shard refuses a job
# (case, the rank whose strategy differs, how)
CASES = [
    ("a follower refuses an update", 1, "refuse update"),
    ("rank 0 refuses an update", 0, "refuse update"),
    ("a follower refuses a job", 1, "refuse job"),
]


def _layout() -> ModelLayout:
    return ModelLayout.from_named_shapes([("a.weight", (9, 7)), ("a.bias", (9,)), ("b", (5,))])


def _differ(how: str):  # noqa: ANN202
    """Make this process's FedAsync decide one call differently; returns the undo."""
    from aggsrv.strategies.fedasync import FedAsync

    if how == "refuse update":
        name, original = "_check", FedAsync._check

        def patched(self, update, job, staleness, now):  # noqa: ANN001, ANN202
            if update.num_samples == ODD_SAMPLES:
                raise TooStale("this shard's strategy refuses it (injected)")
            return original(self, update, job, staleness, now)

    else:
        name, original = "job_for", FedAsync.job_for

        def patched(self, client_id, now):  # noqa: ANN001, ANN202
            if client_id == ODD_CLIENT:
                raise NotRegistered("this shard's strategy does not know the client (injected)")
            return original(self, client_id, now)

    had = name in FedAsync.__dict__
    setattr(FedAsync, name, patched)
    return lambda: setattr(FedAsync, name, original) if had else delattr(FedAsync, name)


def _shard_main(rank: int, init: str, queue: Any) -> None:
    try:
        import torch.distributed as dist

        from aggsrv.server.app import Server
        from aggsrv.server.config import ServerConfig
        from aggsrv.server.shards import ShardGroup

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
        for case, odd_rank, how in CASES:
            config = ServerConfig(
                host="127.0.0.1", port=0, auth="none", state_dir="", durability="off",
                device="cpu", strategy="fedasync", shards=WORLD, rank=rank,
                rate_limit_per_second=0.0, shard_heartbeat_seconds=0.2,
                shard_slice_wait_seconds=5.0, shard_timeout_seconds=30.0,
            )  # fmt: skip
            undo = _differ(how) if rank == odd_rank else None
            try:
                server = Server(config, ShardGroup.of(config))
                asyncio.run(_serve(server, rank, case, queue))
            finally:
                if undo is not None:
                    undo()
            queue.put(("failure", case, rank, server.federation.failure))
        dist.destroy_process_group()
    except Exception:
        queue.put(("error", None, rank, traceback.format_exc()))


async def _serve(server: Any, rank: int, case: str, queue: Any) -> None:
    port = await server.start()
    queue.put(("port", case, rank, port))
    await server.stop_requested.wait()
    await server.stop(1.0)


def _take(queue: Any, kind: str, case: str) -> dict[int, Any]:
    """One message of ``kind`` for ``case`` from every shard: rank -> its value."""
    got: dict[int, Any] = {}
    while len(got) < WORLD:
        msg, at, rank, value = queue.get(timeout=120)
        if msg == "error":
            raise AssertionError(f"shard {rank} failed:\n{value}")
        assert (msg, at) == (kind, case), (msg, at, kind, case)
        got[rank] = value
    return got


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="aggsrv.v1.Aggregation")
        return stub.Check(request, timeout=10).status


def _diverge(address: str, how: str, gen: torch.Generator) -> grpc.RpcError:
    """Make calls until the one a shard decides differently; the error it was answered."""
    layout = _layout()
    with Client(address, "c0", timeout=20, retries=0) as client:
        client.register(layout=layout, initial=torch.randn(layout.numel, generator=gen))
        job = client.get_job()
        delta = torch.randn(layout.numel, generator=gen)
        assert client.push(job, delta, num_samples=4).status is Status.APPLIED
        with pytest.raises(grpc.RpcError) as refused:
            if how == "refuse update":
                client.push(client.get_job(), delta, num_samples=ODD_SAMPLES)
            else:
                with Client(address, ODD_CLIENT, timeout=20, retries=0) as odd:
                    odd.register(layout=layout)
                    odd.get_job()
    return refused.value


def test_shards_that_decide_a_call_differently_stop_the_federation_on_every_shard(
    tmp_path: Path,
) -> None:
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        ctx.Process(target=_shard_main, args=(r, init, queue), daemon=True) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        for case, odd_rank, how in CASES:
            ports = _take(queue, "port", case)
            addresses = [f"127.0.0.1:{ports[r]}" for r in range(WORLD)]
            error = _diverge(addresses[0], how, gen)
            assert error.code() == grpc.StatusCode.UNAVAILABLE, (case, error)
            assert "diverged" in error.details(), (case, error.details())
            for address in addresses:
                with Client(address, "operator", timeout=20, retries=0) as op:
                    assert op.status().has_model  # reads still answer
                    assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING, case
            with Client(addresses[0], "late", timeout=20, retries=0) as late:
                with pytest.raises(grpc.RpcError) as refused:
                    late.register(layout=_layout())
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "diverged" in refused.value.details()
            for address in addresses:
                with Client(address, "operator", timeout=20, retries=0) as op:
                    op.admin_call("Shutdown", pb.ShutdownRequest(grace_seconds=1))
            failures = _take(queue, "failure", case)
            for rank, reason in failures.items():
                assert reason is not None and "the shards diverged on" in reason, (case, rank)
                if how == "refuse job":
                    assert f"a job call of client '{ODD_CLIENT}'" in reason, reason
                    assert f"rank {odd_rank} refused it" in reason, reason
                elif odd_rank == 0:
                    assert "rank 0 refused it" in reason and "rank 1 made it" in reason, reason
                else:
                    assert "rank 0 made it" in reason, reason
                    assert f"rank {odd_rank} refused it" in reason, reason
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
