"""Arrival traces: what ``aggsrv serve --trace FILE`` records, and how to read it back.

A trace is JSON lines, one compact record per job handed out and per update received, with no
model data: enough to replay when each client worked and for how long (``aggsrv simulate
--profile trace:file=FILE``) and to see who was slow or stale. Times are seconds on the server's
clock (Unix time). The records, by ``ev``:

- ``start``: the first line of every file (a server start, and each file after a rotation):
  ``format`` (this module's ``FORMAT``), ``run`` (an id of the server's life: the same in the
  files one server rotates through, new after a restart, whose job numbers may start again),
  ``strategy``, ``version`` (the global version then).
- ``job``: a job handed out: ``c`` client id, ``job`` its number, ``base`` the version it
  carries, ``asked`` when the client's GetJob arrived, ``t`` when the job was issued (later
  than ``asked`` when the strategy made the client wait), ``bytes`` the payload sent.
- ``update``: an upload that got an answer: ``c``, ``job``, ``base`` (the version the client
  trained from), ``start`` when its first message arrived, ``t`` when it was received whole,
  ``v`` the global version after it, ``s`` its staleness (``v_apply - base``; null when it was
  not folded in), ``bytes`` (the payload, once received whole and checked for CRC and
  NaN/Inf; 0 for an upload refused before that), and ``out``: ``applied``, ``buffered``,
  ``duplicate``, ``filtered``, or the lower-case gRPC status of a refusal (then ``job`` may be
  null). A refusal is recorded only once its caller proved to be the client it names.

Rotation: past ``max_bytes`` the file is renamed ``FILE.1`` (``FILE.1`` to ``FILE.2``, ...,
keeping ``backups`` old files) and a new ``FILE`` starts; :func:`read_trace` reads them oldest
first. A server killed mid-write leaves at most one partial line: the last of the file, or,
once a restarted server appended to it, the line before its ``start`` record. The reader skips
it. Records carry the index of the ``run`` they belong to, so that job numbers are matched
within one server's life.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 1
EVENTS = ("start", "job", "update")
FOLDED_IN = ("applied", "buffered")  # outcomes whose update counts toward the model


class TraceFormatError(ValueError):
    """A trace file that is not one aggsrv wrote (or of a newer format)."""


@dataclass(frozen=True)
class JobRecord:
    run: int  # which server life (start records with a new run id) it belongs to
    client: str
    job: int
    base: int
    asked: float
    issued: float
    bytes: int


@dataclass(frozen=True)
class UpdateRecord:
    run: int
    client: str
    job: int | None
    base: int | None
    started: float
    received: float
    version: int
    staleness: int | None
    bytes: int
    outcome: str

    @property
    def folded_in(self) -> bool:
        return self.outcome in FOLDED_IN


@dataclass(frozen=True)
class Trace:
    """One trace read back: every job and update record in file order, and the strategies the
    server ran (one per ``start`` record)."""

    jobs: tuple[JobRecord, ...]
    updates: tuple[UpdateRecord, ...]
    strategies: tuple[str, ...]
    skipped_lines: int  # partial last lines of a killed server

    @property
    def start(self) -> float:
        """The earliest time in the trace (the replay's time zero)."""
        times = [j.asked for j in self.jobs] + [u.started for u in self.updates]
        return min(times) if times else 0.0

    def clients(self) -> list[str]:
        """Client ids in the order of their first job (then of their first update)."""
        seen: dict[str, None] = {}
        for j in self.jobs:
            seen.setdefault(j.client)
        for u in self.updates:
            seen.setdefault(u.client)
        return list(seen)


def trace_files(path: str | Path) -> list[Path]:
    """``FILE.N`` ... ``FILE.1``, ``FILE``: the files of one trace, oldest first (those that
    exist). Raises FileNotFoundError when there is none."""
    path = Path(path)
    rotated = []
    n = 1
    while (p := path.with_name(f"{path.name}.{n}")).exists():
        rotated.append(p)
        n += 1
    files = rotated[::-1] + ([path] if path.exists() else [])
    if not files:
        raise FileNotFoundError(f"no trace at {path} (nor {path.name}.1, ...)")
    return files


def _field(rec: dict[str, Any], key: str, kind: type, where: str, optional: bool = False) -> Any:
    value = rec.get(key)
    if value is None and optional:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TraceFormatError(f"{where}: {key!r} must be {kind.__name__}, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise TraceFormatError(f"{where}: {key!r} must be finite, got {value!r}")
    return value


def _job(rec: dict[str, Any], where: str, run: int) -> JobRecord:
    return JobRecord(
        run=run,
        client=_field(rec, "c", str, where),
        job=_field(rec, "job", int, where),
        base=_field(rec, "base", int, where),
        asked=_field(rec, "asked", float, where),
        issued=_field(rec, "t", float, where),
        bytes=_field(rec, "bytes", int, where),
    )


def _update(rec: dict[str, Any], where: str, run: int) -> UpdateRecord:
    return UpdateRecord(
        run=run,
        client=_field(rec, "c", str, where),
        job=_field(rec, "job", int, where, optional=True),
        base=_field(rec, "base", int, where, optional=True),
        started=_field(rec, "start", float, where),
        received=_field(rec, "t", float, where),
        version=_field(rec, "v", int, where),
        staleness=_field(rec, "s", int, where, optional=True),
        bytes=_field(rec, "bytes", int, where),
        outcome=_field(rec, "out", str, where),
    )


def _lines(files: list[Path]) -> list[tuple[str, int, str, bool]]:
    """(file, line number, text, is the file's unterminated last line)."""
    out = []
    for f in files:
        lines = f.read_text(encoding="utf-8", errors="replace").split("\n")
        complete = lines[-1] == ""
        if complete:
            lines.pop()
        for i, line in enumerate(lines):
            out.append((str(f), i + 1, line, i == len(lines) - 1 and not complete))
    return out


def _starts_a_run(line: str) -> bool:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(rec, dict) and rec.get("ev") == "start"


def read_trace(path: str | Path) -> Trace:
    """Read the trace at ``path`` (with its rotated files). Raises TraceFormatError naming the
    file and line of a record that is not one aggsrv writes; a line cut by a kill is skipped."""
    jobs: list[JobRecord] = []
    updates: list[UpdateRecord] = []
    strategies: list[str] = []
    runs: dict[str, int] = {}
    run = -1
    skipped = 0
    lines = _lines(trace_files(path))
    for i, (name, lineno, line, cut) in enumerate(lines):
        where = f"{name}:{lineno}"
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if cut or (i + 1 < len(lines) and _starts_a_run(lines[i + 1][2])):
                skipped += 1  # a kill cut it; the next server started on the next line
                continue
            raise TraceFormatError(f"{where}: not JSON ({exc})") from None
        if not isinstance(rec, dict) or rec.get("ev") not in EVENTS:
            raise TraceFormatError(f"{where}: not a trace record (ev must be one of {EVENTS})")
        ev = rec["ev"]
        if ev == "start":
            fmt = rec.get("format")
            if fmt != FORMAT:
                raise TraceFormatError(
                    f"{where}: trace format {fmt!r}; this aggsrv reads format {FORMAT}"
                )
            run = runs.setdefault(_field(rec, "run", str, where), len(runs))
            strategies.append(_field(rec, "strategy", str, where))
        elif run < 0:
            raise TraceFormatError(f"{where}: a record before the file's start record")
        elif ev == "job":
            jobs.append(_job(rec, where, run))
        else:
            updates.append(_update(rec, where, run))
    if not strategies:
        raise TraceFormatError(f"{path}: no start record: not a trace aggsrv wrote")
    return Trace(tuple(jobs), tuple(updates), tuple(strategies), skipped)


def job_record(client: str, job: int, base: int, asked: float, issued: float, nbytes: int) -> str:
    return json.dumps(
        {"ev": "job", "t": round(issued, 6), "asked": round(asked, 6), "c": client, "job": job,
         "base": base, "bytes": nbytes},
        separators=(",", ":"),
    )  # fmt: skip


def update_record(
    client: str,
    job: int | None,
    base: int | None,
    started: float,
    received: float,
    version: int,
    staleness: int | None,
    nbytes: int,
    outcome: str,
) -> str:
    """An upload's line; ``outcome`` (a Status name or a refusal's code) is written lower case."""
    return json.dumps(
        {"ev": "update", "t": round(received, 6), "start": round(started, 6), "c": client,
         "job": job, "base": base, "v": version, "s": staleness, "bytes": nbytes,
         "out": outcome.lower()},
        separators=(",", ":"),
    )  # fmt: skip


def start_record(run: str, strategy: str, version: int, now: float) -> str:
    return json.dumps(
        {"ev": "start", "t": round(now, 6), "format": FORMAT, "run": run, "strategy": strategy,
         "version": version},
        separators=(",", ":"),
    )  # fmt: skip
