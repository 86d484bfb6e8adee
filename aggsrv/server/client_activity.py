"""Who is slow, who left: the per-client timing behind the operator's metrics.

For each registered client the server keeps the job it holds (number, base version, when it was
issued) and when it last called, and it keeps the turnaround (job issue to update receipt) of
the last ``window`` updates. From those, at scrape time:

- **states**: ``dropped_out`` (no call for ``dropout_jobs`` typical turnarounds and at least
  ``dropout_floor`` seconds, or its lease ran out), ``straggling`` (holds a job for more than
  ``straggler_factor`` typical turnarounds and at least ``straggler_floor`` seconds),
  ``active`` (holds a younger job) and ``idle`` (seen recently, holds no job). The typical
  turnaround is the median of the window; before the first update nobody straggles or drops out
  except by lease.
- **lag**: for each client holding a job, the global version minus the job's base version.
- **slowest**: the ``n`` clients holding their job longest, with its age.
- **update rates**: each client's updates per minute over its last ``RATE_WINDOW`` updates.
- **silences**: for each registered client, the seconds since it last called (its "last seen").

Everything is keyed by client id, so it is bounded by ``max_clients``; the metrics built on it
(``aggsrv.server.metrics``) are bounded sets (counts by state, histograms, a top-N), never one
series per client. Updated on the event loop; read on the metrics thread from copies.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

STATES = ("active", "idle", "straggling", "dropped_out")
RATE_WINDOW = 8  # a client's update rate is taken over its last this many updates


@dataclass
class _Held:
    job_id: int
    base_version: int
    issued: float


class ClientActivity:
    def __init__(
        self,
        window: int = 512,
        straggler_factor: float = 2.0,
        dropout_jobs: float = 5.0,
        straggler_floor: float = 1.0,
        dropout_floor: float = 30.0,
    ) -> None:
        self.straggler_factor = straggler_factor
        self.dropout_jobs = dropout_jobs
        # Where turnarounds take milliseconds, a few milliseconds of silence say nothing.
        self.straggler_floor = straggler_floor
        self.dropout_floor = dropout_floor
        self._held: dict[str, _Held] = {}
        self._seen: dict[str, float] = {}
        self._turnarounds: deque[float] = deque(maxlen=window)
        self._arrivals: dict[str, deque[float]] = {}  # each client's last RATE_WINDOW updates

    def seen(self, client: str, now: float) -> None:
        self._seen[client] = now

    def job_issued(self, client: str, job_id: int, base_version: int, now: float) -> None:
        held = self._held.get(client)
        if held is None or held.job_id != job_id:  # the same job again keeps its issue time
            self._held[client] = _Held(job_id, base_version, now)
        self._seen[client] = now

    def update_received(self, client: str, job_id: int, now: float) -> float | None:
        """The job's turnaround, if ``client`` held job ``job_id`` (it no longer does)."""
        self._seen[client] = now
        arrivals = self._arrivals.get(client)
        if arrivals is None:
            arrivals = self._arrivals[client] = deque(maxlen=RATE_WINDOW)
        arrivals.append(now)
        held = self._held.get(client)
        if held is None or held.job_id != job_id:
            return None
        del self._held[client]
        took = max(0.0, now - held.issued)
        self._turnarounds.append(took)
        return took

    def typical_turnaround(self) -> float | None:
        recent = list(self._turnarounds)  # one C call: no append can interleave (scrape thread)
        return statistics.median(recent) if recent else None

    def states(self, now: float, clients: Iterable[tuple[str, float]]) -> dict[str, int]:
        """Counts by state of ``clients``: (client id, lease expiry) pairs."""
        counts = dict.fromkeys(STATES, 0)
        typical = self.typical_turnaround()
        for client, lease_expires in clients:
            counts[self._state(client, lease_expires, now, typical)] += 1
        return counts

    def _state(self, client: str, lease_expires: float, now: float, typical: float | None) -> str:
        last = self._seen.get(client)
        silent = now - last if last is not None else 0.0
        dropout_after = math.inf if typical is None else max(
            self.dropout_jobs * typical, self.dropout_floor
        )  # fmt: skip
        if lease_expires < now or silent > dropout_after:
            return "dropped_out"
        held = self._held.get(client)
        if held is None:
            return "idle"
        straggling_after = math.inf if typical is None else max(
            self.straggler_factor * typical, self.straggler_floor
        )  # fmt: skip
        return "straggling" if now - held.issued > straggling_after else "active"

    def lags(self, version: int) -> list[int]:
        """Global version minus the base of each held job."""
        return [max(0, version - h.base_version) for h in list(self._held.values())]

    def update_rates(self) -> list[float]:
        """Updates per minute of each client with two or more, over its last ``RATE_WINDOW``."""
        rates = []
        for arrivals in list(self._arrivals.values()):
            times = list(arrivals)
            if len(times) >= 2 and times[-1] > times[0]:
                rates.append((len(times) - 1) * 60.0 / (times[-1] - times[0]))
        return rates

    def silences(self, now: float, clients: Iterable[str]) -> list[float]:
        """Seconds since each of ``clients`` last called (0 for one never seen since it
        registered here: a restarted server has not heard from it yet, but it has not gone)."""
        seen = self._seen
        return [max(0.0, now - seen.get(c, now)) for c in clients]

    def slowest(self, now: float, n: int) -> list[tuple[str, float]]:
        """The ``n`` clients holding a job longest: (client id, seconds), longest first."""
        ages = ((now - h.issued, c) for c, h in list(self._held.items()))
        return [(c, age) for age, c in heapq.nlargest(n, ages)]
