"""Checkpoints and recovery of a federation in its state directory.

The directory holds numbered checkpoints and numbered write-ahead-log segments
(:mod:`aggsrv.server.durability`). Checkpoint N is the whole federation (layout, the strategy's
``state_dict`` with its caches, the client registry, counters) as it was when segment N was
opened, so recovery loads the newest checkpoint N and replays the records of segments >= N.

Numbering: the first checkpoint is taken when the model is adopted (version 0) and is number 1;
each later checkpoint rotates the log to a new segment and takes that segment's number. A
resumed server opens the segment after the last one it found, so a torn tail (a record a crash
cut short: never acknowledged) is never appended to.

This module stores and loads; the federation replays (``Federation.recover``). Recovery replays
on the federation's aggregation thread, where the live calls ran (the same
kernels with the same thread settings, so the same bits), at thousands of updates a second
(bench/README.md "Resume time"); what it replays counts toward the next checkpoint, so a server
killed again and again before each threshold still checkpoints.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aggsrv import protocol as P
from aggsrv.server import durability as D
from aggsrv.strategies import make_strategy, strategy_settings
from aggsrv.v1 import tensor_pb2 as tpb

log = logging.getLogger(__name__)
# ``fed`` below is an aggsrv.server.federation.Federation, typed Any: the federation is above
# this module (it replays the log), and this module never imports it.

# The checkpoint format: /2 adds "shard" (a sharded federation's shard: rank, shard count, the
# slices' bounds and the number of the last call in rank 0's order); /1 files still load.
FORMAT = "aggsrv-checkpoint/2"
FORMATS_READ = ("aggsrv-checkpoint/1", FORMAT)
# Federation.counters restored from a checkpoint (and kept up by replaying the log).
DURABLE_COUNTERS = ("accepted", "applied", "buffered", "filtered")


class RecoveryError(RuntimeError):
    """The state directory cannot be resumed (named checkpoint, record and reason)."""


@dataclass(frozen=True)
class CheckpointInfo:
    number: int
    version: int
    path: Path
    bytes: int
    seconds: float


class StateStore:
    """One federation's state directory: where checkpoints go and, when durable, the log."""

    def __init__(self, directory: str | os.PathLike, durable: bool, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.durable = durable
        self.keep = keep
        self.wal: D.WriteAheadLog | None = None
        self.segment = 0  # the current log segment (the number the next checkpoint gets - 1)
        # Log bytes since the newest checkpoint = carried (replayed at resume, written by an
        # earlier run) + what this run's log wrote after the LSN of the last cut.
        self._carried = 0
        self._cut_lsn = 0
        self.checkpoint_bytes = 0  # the newest checkpoint's size

    # ------------------------------------------------------------------ inspection

    def has_state(self) -> bool:
        """Whether an earlier run left checkpoints or log segments here."""
        if not self.directory.is_dir():
            return False
        return bool(D.list_checkpoints(self.directory) or D.list_segments(self.directory))

    def wal_bytes(self) -> int:
        """Bytes in the log since the newest checkpoint (records replayed at resume included)."""
        return self.log_bytes()

    def log_bytes(self) -> int:
        """Bytes in the log since the newest checkpoint (records replayed at resume included)."""
        if self.wal is None:
            return 0
        return self._carried + self.wal.written_lsn - self._cut_lsn

    # ------------------------------------------------------------------ writing

    def begin(self, fed: Any) -> tuple[CheckpointInfo, dict[str, Any]]:
        """The first checkpoint of a fresh federation (its model just adopted), then the log;
        the checkpoint written and its payload."""
        self.directory.mkdir(parents=True, exist_ok=True)
        number = max([n for n, _ in D.list_segments(self.directory)], default=0) + 1
        payload = snapshot(fed)
        info = self.write(number, payload)
        self._open_log(number)
        return info, payload

    def _open_log(self, number: int) -> None:
        self.segment = number
        if self.durable:
            self.wal = D.WriteAheadLog(self.directory, number)
            self._cut_lsn = 0

    def cut(self, fed: Any, number: int | None = None) -> tuple[int, dict[str, Any]]:
        """On the aggregation thread: the federation's state and a fresh log segment for what
        follows it (numbered ``number``, default the next). Returns (checkpoint number,
        payload); :meth:`write` stores it later."""
        number = max(number or 0, self.segment + 1)
        payload = snapshot(fed)
        if self.wal is not None:
            self.wal.rotate(number)
            self._carried, self._cut_lsn = 0, self.wal.written_lsn
        self.segment = number
        return number, payload

    def write(self, number: int, payload: dict[str, Any]) -> CheckpointInfo:
        """Write a checkpoint atomically, then drop what the kept checkpoints no longer need."""
        t0 = time.perf_counter()
        path = D.write_checkpoint(self.directory, number, payload)
        self.checkpoint_bytes = path.stat().st_size
        D.prune(self.directory, self.keep)
        info = CheckpointInfo(
            number, int(payload["state"]["version"]), path, path.stat().st_size,
            time.perf_counter() - t0,
        )  # fmt: skip
        log.info(
            "checkpoint %d: version %d, %.1f MB in %.2f s -> %s",
            number, info.version, info.bytes / 1e6, info.seconds, path,
        )  # fmt: skip
        return info

    def close(self) -> None:
        if self.wal is not None:
            self.wal.close()
            self.wal = None

    # ------------------------------------------------------------------ recovery

    def load_latest(self) -> tuple[int, Path, dict[str, Any]]:
        """The newest checkpoint: (number, path, payload). Recovery loads it, then replays the
        records of :meth:`records` (the federation does both: aggsrv.server.federation)."""
        found = D.latest_checkpoint(self.directory)
        if found is None:
            raise RecoveryError(f"{self.directory} holds no checkpoint to resume from")
        number, path = found
        try:
            payload = D.load_checkpoint(path)
        except ValueError as exc:
            raise RecoveryError(f"checkpoint {path} cannot be read: {exc}") from exc
        self.checkpoint_bytes = path.stat().st_size
        return number, path, payload

    def load(self, number: int) -> dict[str, Any]:
        """Checkpoint ``number``'s payload (RecoveryError when it is missing or damaged)."""
        path = D.checkpoint_path(self.directory, number)
        try:
            payload = D.load_checkpoint(path)
        except (OSError, ValueError) as exc:
            raise RecoveryError(f"checkpoint {path} cannot be read: {exc}") from exc
        self.checkpoint_bytes = path.stat().st_size
        return payload

    def checkpoint_numbers(self) -> list[int]:
        """The numbers of the checkpoints here, oldest first."""
        return [n for n, _ in D.list_checkpoints(self.directory)]

    def records(self, number: int) -> Iterator[tuple[int, D.WalRecord]]:
        """(segment, record) of every record logged after checkpoint ``number``, in order;
        RecoveryError for a record that cannot be read whole."""
        try:
            yield from D.iter_records(self.directory, number)
        except D.WalDamaged as exc:
            raise RecoveryError(f"the write-ahead log cannot be replayed: {exc}") from exc

    def reopen(self, number: int) -> None:
        """After the records after checkpoint ``number`` were replayed: the next records go to a
        new segment, and the replayed ones count toward the next checkpoint."""
        segments = D.list_segments(self.directory)
        last = max([n for n, _ in segments], default=number)
        self._open_log(max(last, number) + 1)
        self._carried = sum(p.stat().st_size for n, p in segments if n >= number)


# ---------------------------------------------------------------------- payload


def snapshot(fed: Any) -> dict[str, Any]:
    """The federation as a checkpoint payload (tensors cloned: a point-in-time copy)."""
    strategy = fed.strategy
    assert strategy is not None and fed.layout is not None
    return {
        "format": FORMAT,
        "created_at": fed.clock(),
        "layout": P.layout_to_pb(fed.layout.whole).SerializeToString().hex(),  # a shard: whole
        "strategy": strategy.name,
        # The table as written, not the typed settings: what every state dir already holds.
        "strategy_config": dict(fed.config.strategy_config),
        "state": strategy.state_dict(),
        "clients": [
            [r.client_id, r.registered_at, dict(r.labels)] for r in list(fed.clients.values())
        ],
        "counters": dict(fed.counters),
        "rejected_by_code": dict(fed.rejected_by_code),
        "shard": fed.shard_state(),
    }


def restore(fed: Any, payload: dict[str, Any]) -> None:
    """Rebuild the federation from a checkpoint payload."""
    if payload.get("format") not in FORMATS_READ:
        raise RecoveryError(
            f"not an aggsrv checkpoint this version reads (format {payload.get('format')!r}; "
            f"it reads {', '.join(FORMATS_READ)}): a newer aggsrv wrote it; resume it with that "
            "version, or start a new state directory from its model (docs/compatibility.md)"
        )
    cfg = fed.config
    check_shard(payload.get("shard"), cfg.rank, cfg.shards)
    if payload["strategy"] != strategy_name(cfg.strategy):
        raise RecoveryError(
            f"the checkpoint is for strategy {payload['strategy']!r} but the server is configured "
            f"for {cfg.strategy!r}: resume with the same strategy"
        )
    settings = cfg.strategy_settings
    if payload["strategy_config"] != dict(cfg.strategy_config):
        log.warning(
            "resuming with the checkpoint's strategy_config %s (the configured %s is ignored)",
            payload["strategy_config"], dict(cfg.strategy_config),
        )  # fmt: skip
        settings = strategy_settings(cfg.strategy, payload["strategy_config"])
    layout = P.layout_from_pb(tpb.ModelLayout.FromString(bytes.fromhex(payload["layout"])))
    state = payload["state"]
    served, reducer = fed.served_layout(layout)  # a shard's: its slice
    # Placeholders of the right shapes: load_state_dict sets the model and the statistics.
    strategy = make_strategy(
        cfg.strategy,
        layout=served,
        initial=state["model"],
        initial_buffers=torch.ones(served.buffer_numel) if served.buffer_numel else None,
        config=settings,
        device=fed.device,
        max_clients=cfg.max_clients,
        reducer=reducer,
    )
    strategy.load_state_dict(state)
    fed.install(served, strategy)
    fed.clients.clear()  # a shard that rejoins: the registry is the checkpoint's, then replayed
    for client_id, registered_at, labels in payload["clients"]:
        fed.restore_client(client_id, registered_at, labels)
    # Accepted and applied updates are in the log, so their counts survive any restart. Answers
    # that changed nothing (DUPLICATE, refusals) are not logged: those counters count since
    # this start (docs/operations.md), and an older checkpoint's values are not brought back.
    for name in DURABLE_COUNTERS:  # a shard that rejoins had counted on meanwhile
        fed.counters[name] = int(payload["counters"].get(name, 0))


def strategy_name(name: str) -> str:
    from aggsrv.strategies import strategy_class

    return strategy_class(name).name


def check_shard(shard: dict[str, Any] | None, rank: int, shards: int) -> None:
    """Refuse a checkpoint written by another shard, or by a federation of another shard count
    (RecoveryError that says what would resume it)."""
    if shard is None:
        if shards > 1:
            raise RecoveryError(
                "this state directory was written by a single server; a sharded federation "
                f"(--shards {shards}) cannot resume it: resume it with one server (no --shards), "
                "or start the sharded federation from an empty state directory with the model "
                "as --model-init"
            )
        return
    theirs, their_rank = int(shard["shards"]), int(shard["rank"])
    if theirs != shards or their_rank != rank:
        raise RecoveryError(
            f"this state directory holds shard {their_rank} of a federation of {theirs} shards, "
            f"but this server is started as shard {rank} of {shards}: resume it with --shards "
            f"{theirs} --rank {their_rank} (the slices cannot be re-cut), or start from an empty "
            "state directory"
        )
