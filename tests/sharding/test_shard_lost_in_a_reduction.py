"""A shard lost while a strategy sums over the shards (inside a call) is a lost shard, like one
lost in a vote or an announcement: the federation heals when it is back (docs/sharding.md
"Crashes and recovery"), rather than stopping for good as after a bug."""

from __future__ import annotations

import asyncio

import pytest
import torch

from aggsrv.server import shards as S
from aggsrv.server.aggregation_loop import AggregationLoop
from aggsrv.server.fail_stop import DurabilityError, FailStop


class _BrokenGroup:
    """torch.distributed's error when a peer's connection closes mid all_reduce."""

    rank, world_size = 0, 2

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")


def test_a_reduction_that_loses_its_peer_raises_shard_lost() -> None:
    reducer = S.GroupReducer(_BrokenGroup())
    with pytest.raises(S.ShardLost, match="lost the federation during a sum over the shards"):
        reducer.sum_(torch.ones(3))


def test_a_call_that_loses_a_shard_in_a_reduction_fails_as_a_lost_shard() -> None:
    stopped: list[str] = []
    fail_stop = FailStop(on_stop=stopped.append)
    fail_stop.heals = True
    loop = AggregationLoop(fail_stop, settle=lambda: None)
    reducer = S.GroupReducer(_BrokenGroup())

    async def run() -> None:
        with pytest.raises(DurabilityError):
            await loop.call(reducer.sum_, torch.ones(2))

    try:
        asyncio.run(run())
    finally:
        loop.shutdown()
    assert fail_stop.lost_shard and fail_stop.failure is not None
    assert "not whole" in fail_stop.failure and "retry" in fail_stop.failure
    assert stopped
