"""``trace:file=FILE``: replay the timing of real clients recorded by ``aggsrv serve --trace``.

The trace's clients that completed at least one job, in the order they were first handed a job,
become the simulator's clients 0, 1, 2, ... For each, the replay keeps what the client did, not
what the server made it wait for (the simulated strategy decides that again):

- **Job durations**: job ``r`` of the client takes what its ``r``-th *completed* job took, from
  the job's issue to the update's receipt (the ``t`` of the update record minus the ``t`` of
  the job record, matched within one server's ``run``). A job the
  client never answered produces no update, so it is not replayed as a job: its time is part of
  the absence after the client's previous update.
- **Absences**: the client joins when it first asked for a job it then completed (seconds after
  the trace's first record), and after its ``k``-th update it stays away until the moment,
  measured from that update's
  receipt, when it next asked for a job it then completed. The simulator's own clients ask
  again at once, so a recorded gap of a few milliseconds is a few milliseconds of absence.
  A job's ``asked`` is the client's first GetJob for it, so a strategy's wait (a client asking
  again after a timeout) is not taken for an absence.
- **Leaving**: a client is gone for good after its last update when the trace goes on for more
  than ``gone_after`` times its median job duration without it (it dropped out). Otherwise it
  is still working at the trace's end, and the replay repeats its durations and absences from
  the start, so a simulation may run longer than the recording.
- **Clients beyond the trace** (more simulated clients than recorded ones): every job's
  duration is drawn from all recorded durations (the empirical distribution, seeded by
  (seed, client, round)); they join at once and never leave.

``scale`` multiplies every recorded time (durations and absences): 0.5 replays the same
clients twice as fast. The durations are seconds as recorded; ``base_time`` does not apply, and
the trace is the profile's only component.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aggsrv.trace_format import Trace, read_trace

from .checks import positive
from .components import Component, Context
from .streams import STREAM_TRACE, job_rng


@dataclass(frozen=True)
class ClientTimeline:
    """One recorded client: when it joined, its completed jobs' durations, the absence after
    each of its updates, and whether it left for good after the last one."""

    client_id: str
    joined: float  # seconds after the trace's start
    durations: tuple[float, ...]
    absences: tuple[float, ...]  # absences[k]: after update k + 1, before its next job
    gone: bool


def client_timelines(trace: Trace, gone_after: float) -> list[ClientTimeline]:
    """The timelines of the trace's clients that completed at least one job, in the order they
    first asked for one."""
    t0 = trace.start
    answered: dict[tuple[int, str, int], float] = {}  # (run, client, job): first answer
    for u in trace.updates:
        if u.job is not None:  # answered, even if refused: the client did the job then
            answered.setdefault((u.run, u.client, u.job), u.received)
    end = max([j.issued for j in trace.jobs] + [u.received for u in trace.updates], default=t0)
    by_client: dict[str, list[tuple[float, float, float]]] = {}  # (asked, issued, received)
    for j in trace.jobs:
        received = answered.get((j.run, j.client, j.job))
        if received is not None and received >= j.issued:
            by_client.setdefault(j.client, []).append((j.asked, j.issued, received))
    timelines = []
    for client in trace.clients():
        jobs = by_client.get(client)
        if not jobs:
            continue
        durations = tuple(max(received - issued, 0.0) for _, issued, received in jobs)
        absences = tuple(
            max(nxt[0] - cur[2], 0.0) for cur, nxt in zip(jobs, jobs[1:], strict=False)
        )
        typical = float(np.median(durations))
        gone = end - jobs[-1][2] > gone_after * typical
        timelines.append(ClientTimeline(client, jobs[0][0] - t0, durations, absences, gone))
    return timelines


class TraceReplay(Component):
    """The ``trace`` profile component (see the module docstring)."""

    kind = "trace"
    keys = ("file", "scale", "gone_after")

    def __init__(self, ctx: Context, p: Mapping[str, Any]) -> None:
        where = "trace"
        path = p.get("file")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}: file=PATH (a trace written by aggsrv serve --trace)")
        self.scale = positive(where, "scale", p.get("scale", 1.0))
        self.gone_after = positive(where, "gone_after", p.get("gone_after", 3.0))
        self.seed = ctx.seed
        trace = read_trace(path)
        self.path = path
        self.timelines = client_timelines(trace, self.gone_after)
        if not self.timelines:
            raise ValueError(f"{where}: {path} holds no job that a client completed")
        self.pool = np.sort(np.concatenate([t.durations for t in self.timelines]))
        self.strategies = trace.strategies
        self._seen: dict[tuple[int, int], float] = {}  # (client, k): when update k arrived

    def _timeline(self, client: int) -> ClientTimeline | None:
        return self.timelines[client] if client < len(self.timelines) else None

    def duration(self, client: int, round_: int) -> float:
        """Seconds of job ``round_`` of ``client``."""
        line = self._timeline(client)
        if line is None:
            rng = job_rng(self.seed, client, round_, STREAM_TRACE)
            return float(self.pool[rng.integers(self.pool.size)]) * self.scale
        return line.durations[round_ % len(line.durations)] * self.scale

    def _window(self, client: int, t: float, sent: int) -> tuple[float, float] | None:
        """The client's absence [start, end) around (t, sent), or None."""
        line = self._timeline(client)
        if line is None:
            return None
        if sent == 0:
            return (-math.inf, line.joined * self.scale)
        n = len(line.durations)
        if sent >= n and line.gone:
            return (-math.inf, math.inf)
        # The simulator asks when the update arrives first: that is when the absence starts.
        at = self._seen.setdefault((client, sent), t)
        k = (sent - 1) % n
        gap = line.absences[k] if k < len(line.absences) else 0.0  # a cycle starts at once
        return (at, at + gap * self.scale)

    def online(self, client: int, t: float, sent: int) -> bool:
        window = self._window(client, t, sent)
        return window is None or not window[0] <= t < window[1]

    def next_change(self, client: int, t: float, sent: int) -> float | None:
        window = self._window(client, t, sent)
        if window is None:
            return None
        start, end = window
        if t < start:
            return start
        return end if t < end and math.isfinite(end) else None

    def gone_clients(self, num_clients: int) -> tuple[int, ...]:
        """The simulated clients (of ``num_clients``) that leave for good."""
        return tuple(i for i, t in enumerate(self.timelines[:num_clients]) if t.gone)

    def describe(self) -> dict[str, Any]:
        return {
            "file": self.path,
            "scale": self.scale,
            "gone_after": self.gone_after,
            "strategies": list(self.strategies),
            "recorded_clients": len(self.timelines),
            "recorded_jobs": int(self.pool.size),
            "median_duration": float(np.median(self.pool)),
            "gone": [i for i, t in enumerate(self.timelines) if t.gone],
        }
