"""Growth of the per-client [K, D] row caches (Fed-OGD's and MIFA's update cache, FedDGIC's
similarity rows): rows are allocated as clients first need one, in blocks that double, capped
at ``max_clients``, so a federation of a few clients does not hold ``max_clients`` rows."""

from __future__ import annotations

import torch

__all__ = ["ROW_BLOCK", "capacity_after", "with_room"]

ROW_BLOCK = 16  # the smallest capacity, and the first block


def _next_capacity(rows: int, needed: int, max_clients: int) -> int:
    return min(max(needed, 2 * rows, ROW_BLOCK), max_clients)


def with_room(cache: torch.Tensor, used: int, needed: int, max_clients: int) -> torch.Tensor:
    """``cache`` when it has ``needed`` rows, else a larger zeroed one (same dtype and device)
    holding its first ``used`` rows."""
    rows = cache.shape[0]
    if needed <= rows:
        return cache
    grown = torch.zeros(
        _next_capacity(rows, needed, max_clients), *cache.shape[1:],
        dtype=cache.dtype, device=cache.device,
    )  # fmt: skip
    grown[:used].copy_(cache[:used])
    return grown


def capacity_after(n: int, max_clients: int) -> int:
    """The capacity a cache has after ``n`` rows were added one by one (a restored cache gets
    the capacity it had live)."""
    rows = 0
    while rows < n:
        grown = _next_capacity(rows, rows + 1, max_clients)
        if grown <= rows:  # a smaller max_clients than the saved state's: room for its rows
            return n
        rows = grown
    return rows
