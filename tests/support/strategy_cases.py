"""One small working config per registered strategy, for tests that run every strategy (tests/
is not a package: import as `from strategy_cases import strategy_cases`)."""

from __future__ import annotations

from typing import Any


def strategy_cases(clients: int) -> dict[str, dict[str, Any]]:
    """Configs that make each strategy aggregate within a few updates of ``clients`` clients
    (FedDGIC and FedFG wait for all of them before their grouping rounds)."""
    return {
        "fedavg": {"mode": "sync", "min_clients": 3, "round_timeout": 0.5},
        "fedasync": {"alpha": 0.6},
        "fedbuff": {"buffer_size": 2},
        "fedprox": {"mu": 0.1},
        "fedogd": {"epoch_timeout": 0.5},
        "mifa": {"epoch_timeout": 0.5},
        "feden": {"participation": 1.0, "local_epochs": 1.0, "learning_rate": 0.05},
        "orthofl": {},
        "ca2fl": {},
        "fedhist": {"buffer_size": 3, "history": 2, "learning_rate": 0.1},
        "twafl": {"buffer_size": 3, "learning_rate": 0.1},
        "fedfg": {"min_available": clients, "fixed_groups": 2, "similarity_rounds": 2},
        "feddgic": {"min_available": clients, "similarity_rounds": 2},
    }
