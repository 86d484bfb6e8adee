"""The per-client row caches (Fed-OGD/MIFA, FedDGIC) grow in one way: blocks of 16 that double,
capped at max_clients, keeping the rows in use; a restored cache gets its live capacity."""

import torch

from aggsrv.strategies.row_cache import ROW_BLOCK, capacity_after, with_room


def test_rows_grow_in_doubling_blocks_up_to_max_clients_and_keep_their_values() -> None:
    cache = torch.zeros(0, 3, dtype=torch.float32)
    capacities = []
    for n in range(50):
        cache = with_room(cache, n, n + 1, max_clients=50)
        cache[n] = float(n + 1)
        capacities.append(cache.shape[0])
    assert capacities == [ROW_BLOCK] * 16 + [32] * 16 + [50] * 18  # 64 capped at 50
    assert torch.equal(cache[:, 0], torch.arange(1, 51, dtype=torch.float32))
    assert cache.dtype == torch.float32 and cache.shape[1] == 3


def test_a_cache_with_room_is_returned_as_it_is() -> None:
    cache = torch.ones(16, 2, dtype=torch.float64)
    assert with_room(cache, 5, 6, max_clients=100) is cache
    grown = with_room(cache, 16, 17, max_clients=100)
    assert grown.shape == (32, 2) and grown.dtype == torch.float64
    assert torch.equal(grown[:16], cache) and not grown[16:].any()


def test_a_restored_cache_gets_the_capacity_it_grew_to_live() -> None:
    for max_clients in (5, 16, 40, 1024):
        cache = torch.zeros(0, 1)
        for n in range(min(max_clients, 100)):
            cache = with_room(cache, n, n + 1, max_clients)
            assert capacity_after(n + 1, max_clients) == cache.shape[0], (max_clients, n)
    assert capacity_after(0, 8) == 0
    assert capacity_after(12, 8) == 12  # saved with a larger max_clients: room for its rows
