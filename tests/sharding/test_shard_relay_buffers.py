"""A model with float buffers (BatchNorm statistics) on shards: the buffers live on rank 0
only, but every check that reduces over the shards is a collective, so every shard must make
the same reduce calls in the same order, buffers or not. A strategy call in which rank 0
reduces once more than the others hangs the federation (rank 0's extra all_reduce meets the
others' next collective): found by test_shard_relay's TLS case, whose model has buffers. Every
strategy checked the next buffers' finiteness with a reduce on rank 0 alone (the base's
publication, ORTHOFL's calibrated buffers, FedDGIC's and FedFG's group buffers).

Each strategy is built on rank 0's and rank 1's ShardLayout of one model with buffers, with a
reducer that counts its calls (and returns its input: the counts, not the values, are the
point), and both are driven with the same calls; rank 0's updates carry the buffers."""

from __future__ import annotations

import pytest
import torch
from strategy_cases import strategy_cases

from aggsrv.layout import ModelLayout
from aggsrv.sharding import ShardLayout, ShardMap
from aggsrv.strategies import STRATEGIES, StrategyError, Update, UpdateKind, make_strategy

CASES = strategy_cases(2)


class CountingReducer:
    def __init__(self, rank: int) -> None:
        self.rank, self.world_size, self.calls = rank, 2, 0

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return t


def _reduce_counts(name: str, rank: int, seed: int) -> list:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 30), torch.nn.BatchNorm1d(30), torch.nn.Linear(30, 5)
    )
    layout = ModelLayout.from_module(model)
    shard_map = ShardMap.even(layout.numel, 2)
    lo, hi = shard_map.slice(rank)
    initial = layout.flatten(model, dtype=torch.float32)
    reducer = CountingReducer(rank)
    extra = {"initial_buffers": layout.flatten_buffers(model)} if rank == 0 else {}
    strategy = make_strategy(
        name, layout=ShardLayout(layout, shard_map, rank), initial=initial[lo:hi].clone(),
        config=CASES[name], device="cpu", reducer=reducer, **extra,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    counts: list = []
    now = 0.0
    for client in ("c0", "c1"):
        strategy.on_register(client, now)
    for step in range(4):
        for client in ("c0", "c1"):
            now += 0.1
            delta = 0.01 * torch.randn(layout.numel, generator=gen)
            held = torch.rand(layout.buffer_numel, generator=gen) + 0.5  # running_var > 0
            job = strategy.job_for(client, now)
            counts.append(("job", reducer.calls))
            if job is None:
                continue
            update = Update(
                client_id=client, job_id=job.job_id, base_version=job.base_version,
                update_id=f"{client}-{step}", num_samples=3, work_done=1.0,
                kind=UpdateKind.DELTA, tensor=delta[lo:hi], buffers=held if rank == 0 else None,
            )  # fmt: skip
            try:
                strategy.on_update(update, now)
            except StrategyError as exc:
                counts.append(type(exc).__name__)
            counts.append(("update", reducer.calls))
        now += 1.0
        strategy.on_timer(now)
        counts.append(("timer", reducer.calls))
    return counts


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_shard_reduces_alike_with_float_buffers(name: str) -> None:
    seed = 20261129
    assert _reduce_counts(name, 0, seed) == _reduce_counts(name, 1, seed)
