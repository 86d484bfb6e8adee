"""`aggsrv serve` with timing probes, for bench/test_bench_shard_commit.py.

Run: `python bench/shard_commit_probe.py EVENTS.json serve ARGS...` (the arguments of
`python -m aggsrv.cli serve`). Before the server starts, the steps of the sharded commit are
wrapped so that each one appends (step, start, end, details) to a list, written as JSON to
EVENTS.json when the server exits (SIGTERM, an operator's Shutdown, rank 0's stop; a shard
of rank >= 1 leaves with ``os._exit``, which writes them first):

- every ``os.fdatasync`` and ``os.fsync`` of the process (the write-ahead log syncs with
  fdatasync, checkpoints and directories with fsync), with the file's name: the fsync count is
  the syscalls themselves, not a server counter;
- ``WriteAheadLog.append`` (the record's kind, bytes; "part" records are an upload's bytes,
  written by a writer thread while it arrives);
- rank 0: ``ShardGroup.announce`` (kind, call number), ``ShardGroup.vote``,
  ``Federation.apply_update``, ``CallLog.make_durable``, ``Replication.announce_durable``;
- a shard of rank >= 1: ``ShardGroup.receive`` (kind, call number, how far rank 0 is durable),
  ``ShardGroup.vote``, ``Federation._prepare_slice`` (the slice record: append + fsync),
  ``StagedSlice.resolve`` (the answer to the client's slice released), ``apply_slice``.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine),
so the benchmark lays each process's steps against the client's calls. Every candidate of the
benchmark (with and without durability) runs under this wrapper, so the probes' own cost, a few
microseconds per step, is in the baseline too.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

EVENTS: list[list[Any]] = []


def _name_of(fd: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return "?"


def _timed_sync(step: str, real: Any) -> Any:
    def sync(fd: int) -> None:
        t0 = time.monotonic()
        real(fd)
        t1 = time.monotonic()
        EVENTS.append([step, t0, t1, _name_of(fd)])

    return sync


def _wrap(cls: Any, attr: str, step: str, details: Any = None) -> None:
    """Time ``cls.attr`` (a plain method); ``details(args, kwargs, result)`` adds what it
    did. An older tree without it (AGGSRV_BENCH_BEFORE) is left as it is."""
    real = getattr(cls, attr, None)
    if real is None:
        return

    @functools.wraps(real)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        result = real(*args, **kwargs)
        t1 = time.monotonic()
        EVENTS.append([step, t0, t1, details(args, kwargs, result) if details else None])
        return result

    setattr(cls, attr, timed)


def _wrap_async(cls: Any, attr: str, step: str) -> None:
    real = getattr(cls, attr, None)
    if real is None:
        return

    @functools.wraps(real)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        try:
            return await real(*args, **kwargs)
        finally:
            EVENTS.append([step, t0, time.monotonic(), None])

    setattr(cls, attr, timed)


def install() -> None:
    from aggsrv.server import durability, shards
    from aggsrv.server.call_log import CallLog
    from aggsrv.server.federation import Federation
    from aggsrv.server.replication import Replication
    from aggsrv.server.shard_follower import ShardFollower

    os.fdatasync = _timed_sync("fdatasync", os.fdatasync)
    os.fsync = _timed_sync("fsync", os.fsync)

    wal = durability.WriteAheadLog
    real_append = wal.append

    def append(self: Any, kind: str, meta: Any, tensors: Any = None, **how: Any) -> int | None:
        t0 = time.monotonic()
        nbytes = sum(b.nbytes if isinstance(b, memoryview) else len(b)
                     for b in durability._encode(kind, meta, tensors))  # fmt: skip
        lsn = real_append(self, kind, meta, tensors, **how)
        EVENTS.append(["append", t0, time.monotonic(), [kind, nbytes if lsn is not None else 0]])
        return lsn

    wal.append = append
    group = shards.ShardGroup
    _wrap(group, "announce", "announce", lambda a, k, r: [a[1], a[2].get("seq")])
    _wrap(
        group,
        "receive",
        "receive",
        lambda a, k, r: [r[0], r[1].get("seq"), r[2] if len(r) > 2 else None],
    )
    _wrap(group, "vote", "vote")
    _wrap(Federation, "_prepare_slice", "prepare", lambda a, k, r: [a[2].get("seq")])
    _wrap(Replication, "announce_durable", "announce_durable")
    _wrap(shards.StagedSlice, "resolve", "resolve", lambda a, k, r: [k.get("error") is None])
    _wrap_async(Federation, "apply_update", "apply_update")
    _wrap_async(CallLog, "make_durable", "make_durable")
    _wrap_async(ShardFollower, "apply_slice", "apply_slice")


def _dump(path: str) -> None:
    with open(path, "w") as f:
        json.dump(EVENTS, f)


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    install()
    real_exit = os._exit

    def exit_now(code: int) -> None:  # a shard of rank >= 1 leaves with os._exit
        _dump(out)
        real_exit(code)

    os._exit = exit_now
    from aggsrv.cli import main as cli_main

    try:
        return cli_main(argv)
    finally:
        _dump(out)


if __name__ == "__main__":
    sys.exit(main())
