"""``aggsrv serve --trace FILE``: one line per job handed out and per update answered, in the
format of :mod:`aggsrv.trace_format`, so that the simulator can replay the clients' timing.

The lines go through :class:`logging.handlers.RotatingFileHandler` (rotation by size, a flush
per line) on the event loop that served the call: a trace is diagnostics, not state, so a failed
write is reported by logging and never fails the call, and a killed server loses at most the
line it was writing.
"""

from __future__ import annotations

import logging
import logging.handlers
from collections.abc import Callable

from aggsrv import trace_format as F


class _Rotating(logging.handlers.RotatingFileHandler):
    """Every file starts with a ``start`` record, so each one reads back on its own."""

    def __init__(self, path: str, max_bytes: int, backups: int, header: Callable[[], str]):
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self.setFormatter(logging.Formatter("%(message)s"))
        self.header = header

    def doRollover(self) -> None:  # noqa: N802 - logging's name
        super().doRollover()
        if self.stream is not None:
            self.stream.write(self.header() + self.terminator)
            self.stream.flush()


class TraceWriter:
    """Appends the trace records of one server (rank 0 of a sharded one)."""

    def __init__(
        self,
        path: str,
        *,
        strategy: str,
        version: Callable[[], int],
        clock: Callable[[], float],
        max_bytes: int,
        backups: int,
    ) -> None:
        self.path = path
        self._clock = clock
        self._header = lambda: F.start_record(strategy, version(), clock())
        self._handler = _Rotating(path, max_bytes, backups, self._header)
        self._last_job: dict[str, int] = {}  # a job handed out again is recorded once
        self._write(self._header())

    def _write(self, line: str) -> None:
        self._handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))

    def job(self, client: str, job: int, base: int, asked: float, nbytes: int) -> None:
        """A job handed out now to ``client``, whose GetJob arrived at ``asked``."""
        if self._last_job.get(client) == job:
            return
        self._last_job[client] = job
        self._write(F.job_record(client, job, base, asked, self._clock(), nbytes))

    def update(
        self,
        client: str,
        job: int | None,
        base: int | None,
        started: float,
        received: float,
        version: int,
        staleness: int | None,
        nbytes: int,
        outcome: str,
    ) -> None:
        """An upload that got an answer (``outcome``: the Status name or the refusal's code)."""
        self._write(
            F.update_record(
                client, job, base, started, received, version, staleness, nbytes, outcome.lower()
            )
        )

    def close(self) -> None:
        self._handler.close()
