"""Shards of one federation run as threads of one process, for strategy tests on a sharded
layout without torch.distributed (tests/ is not a package: import as
`from thread_shards import ThreadReducer, run_shards`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class ThreadReducer:
    """The sum over shards run as threads of one process (a barrier per call), in rank order."""

    def __init__(self, parts: list, barrier: threading.Barrier, rank: int) -> None:
        self.parts, self.barrier, self.rank = parts, barrier, rank
        self.world_size = len(parts)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        self.parts[self.rank] = t.to(torch.float64).clone()
        self.barrier.wait()
        total = self.parts[0].clone()
        for p in self.parts[1:]:
            total += p
        self.barrier.wait()  # every shard read the parts before the next call writes them
        return t.copy_(total)


def reducers(shards: int) -> list[ThreadReducer]:
    """One reducer per rank, sharing their parts and barrier."""
    parts: list = [None] * shards
    barrier = threading.Barrier(shards)
    return [ThreadReducer(parts, barrier, r) for r in range(shards)]


def run_shards(shard: Callable[[int], None], shards: int, timeout: float = 60.0) -> None:
    """Run ``shard(rank)`` for every rank at once, each on its own thread."""
    threads = [threading.Thread(target=shard, args=(r,)) for r in range(shards)]
    # One intra-op thread: the shards' OpenMP workers spinning at the barriers starve each
    # other on a small machine (seconds instead of milliseconds).
    intra = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout)
    finally:
        torch.set_num_threads(intra)
