"""A shard lost while a strategy sums over the shards (inside a call) is a lost shard, like one
lost in a vote or an announcement: the federation heals when it is back (docs/sharding.md
"Crashes and recovery"), rather than stopping for good as after a bug."""

from __future__ import annotations

import asyncio
import gc
import weakref

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


class _Held:
    """Stands for the process group: what torch's collective holds in its frames."""


def _failing_collective(refs: list) -> None:
    group = _Held()  # a local of the raising frame, as torch's all_reduce holds the group
    refs.append(weakref.ref(group))
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")


@pytest.mark.parametrize("where", ["reduction", "collective"])
def test_a_kept_shard_lost_does_not_hold_what_the_failed_collective_held(where: str) -> None:
    """The server keeps a ShardLost a while (a future, a handler's abort) and leaves the group
    meanwhile: the error must not keep torch's frames, which hold the process group (its
    connections would stay open, and a shard waiting on this one would wait out the timeout).
    Automatic collection is off: the frames must go with the error's own references."""
    refs: list = []
    if where == "reduction":

        class _Inner:
            rank, world_size = 1, 3

            def sum_(self, t: torch.Tensor) -> torch.Tensor:
                _failing_collective(refs)
                return t

        call = lambda: S.GroupReducer(_Inner()).sum_(torch.ones(2))  # noqa: E731
    else:
        shards = object.__new__(S.ShardGroup)  # no process group: the collective is faked
        shards.rank, shards.world_size, shards.group = 1, 3, None
        call = lambda: shards._collective("a vote", lambda group: _failing_collective(refs))  # noqa: E731
    kept = []
    gc.disable()
    try:
        try:
            call()
        except S.ShardLost as exc:
            kept.append(exc)
        assert kept and "lost the federation" in str(kept[0])
        assert "Connection closed by peer" in str(kept[0].__cause__)  # the message stays
        assert refs[0]() is None, "the kept error still holds the failed collective's frames"
    finally:
        gc.enable()
