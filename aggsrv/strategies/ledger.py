"""The update ledger: the outcome of each client's recent update ids, so a replay is answered
DUPLICATE instead of being applied twice."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from aggsrv.values import Outcome

__all__ = ["LEDGER_SIZE", "UpdateLedger"]

LEDGER_SIZE = 1024


class UpdateLedger:
    """Outcomes of the last ``size`` accepted update ids of each client, for replay detection."""

    def __init__(self, size: int = LEDGER_SIZE) -> None:
        """Remember ``size`` update ids per client (docs/design.md: 1,024)."""
        if size < 1:
            raise ValueError(f"ledger size must be >= 1, got {size}")
        self.size = size
        self._seen: dict[str, OrderedDict[str, Outcome]] = {}

    def lookup(self, client_id: str, update_id: str) -> Outcome | None:
        """The original outcome of a replayed update id, or None for a new one."""
        seen = self._seen.get(client_id)
        return None if seen is None else seen.get(update_id)

    def record(self, client_id: str, update_id: str, outcome: Outcome) -> None:
        """Remember an accepted update's outcome, forgetting the client's oldest beyond size."""
        seen = self._seen.setdefault(client_id, OrderedDict())
        seen[update_id] = outcome
        while len(seen) > self.size:
            seen.popitem(last=False)

    def __len__(self) -> int:
        """Number of remembered update ids over all clients."""
        return sum(len(s) for s in self._seen.values())

    def state_dict(self) -> dict[str, Any]:
        """Plain values, oldest first per client."""
        return {
            "size": self.size,
            "seen": {c: [[u, *o.to_tuple()] for u, o in s.items()] for c, s in self._seen.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.size = int(state["size"])
        self._seen = {
            c: OrderedDict((str(e[0]), Outcome.from_tuple(e[1:])) for e in entries)
            for c, entries in state["seen"].items()
        }
