"""``aggsrv serve --trace FILE``: one line per job handed out and per update answered, in the
format of :mod:`aggsrv.trace_format`, so that the simulator can replay the clients' timing.

The lines go through :class:`logging.handlers.RotatingFileHandler` (rotation by size, a flush
per line) on the event loop that served the call. The file is opened when the server starts, so
a path that cannot be written fails the start, not a call. After that the trace is diagnostics,
not state: a failed write logs a warning (at most once a minute) and never fails the call, and a
killed server loses at most the line it was writing.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from aggsrv import trace_format as F

log = logging.getLogger(__name__)

WARN_EVERY = 60.0  # seconds between two warnings about failed trace writes


class _Rotating(logging.handlers.RotatingFileHandler):
    """Every file starts with a ``start`` record, so each one reads back on its own."""

    def __init__(self, path: str, max_bytes: int, backups: int, header: Callable[[], str]):
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self.setFormatter(logging.Formatter("%(message)s"))
        self.header = header
        self._warned_at = -WARN_EVERY

    def doRollover(self) -> None:  # noqa: N802 - logging's name
        super().doRollover()
        if self.stream is not None:
            self.stream.write(self.header() + self.terminator)
            self.stream.flush()

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning("could not write the arrival trace %s (the call went on)",
                        self.baseFilename, exc_info=True)  # fmt: skip


def _end_cut_line(path: str) -> None:
    """A server killed mid-line left a line without its newline: end it, so that the records
    appended now start on a line of their own (the reader skips the cut one)."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except FileNotFoundError:
        pass


class TraceWriter:
    """Appends the trace records of one server (rank 0 of a sharded one), or of a simulation."""

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
        if backups < 1:
            raise ValueError(f"trace_backups must be >= 1 (the file rotates), got {backups}")
        self.path = path
        self._clock = clock
        run = uuid.uuid4().hex[:12]  # this writer's life: job numbers are unique within it
        self._header = lambda: F.start_record(run, strategy, version(), clock())
        _end_cut_line(path)
        self._handler = _Rotating(path, max_bytes, backups, self._header)
        self._closed = False
        self._last_job: dict[str, int] = {}  # a job handed out again is recorded once
        self._asked: dict[str, float] = {}  # a client's first GetJob since its last job
        self._write(self._header())

    def _write(self, line: str) -> None:
        if not self._closed:
            self._handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))

    def asking(self, client: str, now: float) -> None:
        """``client`` asks for a job: the earliest ask before it gets one is the job's
        ``asked`` (a client whose GetJob timed out while the strategy made it wait asks again;
        that wait is the strategy's, not the client's absence)."""
        self._asked.setdefault(client, now)

    def job(self, client: str, job: int, base: int, asked: float, nbytes: int) -> None:
        """A job handed out now to ``client``, whose GetJob arrived at ``asked``."""
        asked = min(asked, self._asked.pop(client, asked))
        if self._last_job.get(client) == job:
            return
        self._last_job[client] = job
        self._write(F.job_record(client, job, base, asked, self._clock(), nbytes))

    def update(self, *fields: Any) -> None:
        """An upload that got an answer: the fields of :func:`aggsrv.trace_format.update_record`
        in its order (``outcome``: the Status name or the refusal's code)."""
        self._write(F.update_record(*fields))

    def close(self) -> None:
        self._closed = True
        self._handler.close()
