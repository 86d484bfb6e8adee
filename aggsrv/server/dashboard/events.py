"""What the status page shows that only the aggregation thread sees happen: the strategy's
events (FedDGIC's grouping, its dropout flags) and the rate of publications. The federation
feeds them; the page's document (:mod:`aggsrv.server.dashboard.status`) reads them."""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["PublishRate", "StrategyEvents"]


class StrategyEvents:
    """The strategy's events the page shows (FedDGIC's last grouping, its dropout flags),
    passed on to ``then`` (the events file) when there is one. Called on the aggregation thread;
    each field is replaced whole, so the HTTP thread reads a consistent value."""

    def __init__(self, then=None) -> None:
        self.then = then
        self.groups: dict[str, Any] | None = None
        self.dropped: frozenset[str] = frozenset()

    def __call__(self, record: dict[str, Any]) -> None:
        self.quietly(record)
        if self.then is not None:
            self.then(record)

    def quietly(self, record: dict[str, Any]) -> None:
        """Keep what the page shows, without passing the event on (a replayed log's events
        are in the events file already)."""
        event = record.get("event")
        if event == "grouping":
            clients, labels = record.get("clients", []), record.get("labels", [])
            groups: dict[int, list[str]] = {}
            for client, label in zip(clients, labels, strict=False):
                groups.setdefault(int(label), []).append(client)
            self.groups = {
                "version": record.get("version"),
                "k": record.get("k"),
                "groups": [groups[g] for g in sorted(groups)],
            }
        elif event == "dropout":
            client = record.get("client")
            if record.get("dropped"):
                self.dropped = self.dropped | {client}
            else:
                self.dropped = self.dropped - {client}


class PublishRate:
    """Versions published in the last minute, however many: the running count, sampled at most
    once a second (two minutes of samples)."""

    def __init__(self) -> None:
        self.total = 0
        self._samples: deque[tuple[float, int]] = deque(maxlen=128)  # (time, total before)

    def published(self, now: float) -> None:
        if not self._samples or now - self._samples[-1][0] >= 1.0:
            self._samples.append((now, self.total))
        self.total += 1

    def last_minute(self, now: float) -> int:
        # The running count before the first sample inside the minute: what came after it is
        # the minute's (a minute with no sample had no publication).
        inside = [total for t, total in list(self._samples) if now - t <= 60.0]
        return self.total - inside[0] if inside else 0
