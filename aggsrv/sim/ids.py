"""The simulated clients' ids: client ``i`` of a run is ``client-{i:03d}`` on every transport,
in traces and in attacks (a module of its own, below everything that names clients)."""

from __future__ import annotations

__all__ = ["client_id"]


def client_id(i: int) -> str:
    return f"client-{i:03d}"
