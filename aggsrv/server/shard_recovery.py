"""Recovery of the shards of a sharded federation, each from its own state directory, when their
group forms (docs/sharding.md "Crashes and recovery"): at a start, and again after a shard was
lost and restarted.

Rank 0's log is the federation's: its records are the calls in their order, each with the sums
over the shards it made (so any shard can replay it alone) and, after every checkpoint cut, a
"cut" record of the sums the checkpoint's load makes. A shard of rank >= 1 logs only its slices
of updates ("slice" records, by the call's number). When the group forms, every shard tells the
others where it is (:class:`Position`); rank 0 recovers from its own log if it has to (it was
restarted, or a call of its was cut short), and every other shard whose state is not exactly
rank 0's loads its newest checkpoint and replays rank 0's calls after it, alone, with its own
slices. The shards whose state is rank 0's keep it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aggsrv.server import shards as S
from aggsrv.server.durability import WalRecord
from aggsrv.server.persistence import RecoveryError, StateStore, check_shard, restore
from aggsrv.sharding import decode_sums

log = logging.getLogger("aggsrv.server.federation")

# fed below is an aggsrv.server.federation.Federation (typed Any: the federation is above).


@dataclass(frozen=True)
class Position:
    """Where a shard is when the group forms."""

    has_model: bool
    seq: int  # the number of the last call it made, in rank 0's order
    key: int  # a key of what its calls did (version, jobs issued, clients)
    dirty: bool  # a call of its was cut short by a lost shard: its state may be half-changed


@dataclass
class Rank0Log:
    """Rank 0's log from its oldest checkpoint on: the calls (without their slices when sent
    to the other shards) and the sums of each checkpoint's load, by the cut's call number."""

    calls: list[WalRecord] = field(default_factory=list)
    cuts: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, store: StateStore, with_tensors: bool) -> Rank0Log:
        numbers = store.checkpoint_numbers()
        out = cls()
        for _, record in store.records(numbers[0] if numbers else 1):
            if record.kind == "cut":
                out.cuts[int(record.meta["seq"])] = record.meta["sums"]
            else:
                tensors = record.tensors if with_tensors else {}
                out.calls.append(WalRecord(record.kind, record.meta, tensors))
        return out


def position(fed: Any) -> Position:
    strategy = fed.strategy
    dirty = fed.fail_stop.dirty
    if strategy is None:
        return Position(False, 0, 0, dirty)
    seq = fed.call_number()
    return Position(True, seq, S.digest_key(S.call_digest(strategy, False)), dirty)


def sync(fed: Any, store: StateStore) -> None:
    """(aggregation thread, every shard, the group just formed) Bring every shard to rank 0's
    state: the ones that are there keep theirs, the others recover alone."""
    shards = fed.shards
    assert shards is not None
    rank = shards.rank
    if rank == 0:
        if fed.strategy is None and store.has_state() or fed.fail_stop.dirty:
            recover_alone(fed, store, Rank0Log.read(_closed(store), with_tensors=True), None)
        else:
            fed.call_log.sync_now()  # what the others may take from it is durable first
    rows: list[Position] = shards.gather_objects(position(fed))
    lead = rows[0]
    ahead = [r for r, row in enumerate(rows) if row.has_model and not lead.has_model]
    if ahead:
        raise RecoveryError(
            f"rank 0 has no model but shard {', '.join(map(str, ahead))} has one: rank 0 needs "
            "its own state directory of this run (pass --resume DIR), or start every shard "
            "afresh with empty ones"
        )
    behind = [r for r in range(1, len(rows)) if not _at(rows[r], lead)]
    sent = None
    if rank == 0 and behind:
        sent = Rank0Log.read(store, with_tensors=False)
    rank0_log: Rank0Log | None = shards.share_calls(sent)
    problem = None
    if rank in behind:
        assert rank0_log is not None
        try:
            _catch_up(fed, store, rank0_log, lead)
        except RecoveryError as exc:
            problem = str(exc)
    # Every shard hears why a shard could not recover, and stops with the same message.
    problems = [p for p in shards.gather_objects(problem) if p is not None]
    if problems:
        raise RecoveryError("; ".join(problems))
    after: list[Position] = shards.gather_objects(position(fed))
    keys = [(row.has_model, row.key) for row in after]
    if len(set(keys)) != 1:
        raise RecoveryError(
            "the shards disagree after recovery: "
            + ", ".join(f"rank {r} at call {row.seq}" for r, row in enumerate(after))
        )
    # Calls are numbered on past every number any shard has seen (a slice prepared for a call
    # rank 0 lost keeps its number to itself).
    fed.resume_numbering(max(shards.gather_objects(fed.highest_call_number())))
    fed.fail_stop.dirty = False
    if behind:
        log.info("shard %d: shards %s recovered to rank 0's call %d", rank,
                 ", ".join(map(str, behind)), lead.seq)  # fmt: skip


def _catch_up(fed: Any, store: StateStore, rank0_log: Rank0Log, lead: Position) -> None:
    """A shard of rank >= 1 behind rank 0: recover alone from its checkpoint, its slices and
    rank 0's log."""
    rank = fed.config.rank
    if not store.has_state():
        raise RecoveryError(
            f"shard {rank}'s state directory holds nothing ({store.directory}) while rank 0 "
            f"resumes at call {lead.seq}: every shard needs its own state directory of the same "
            "run (restore it from a backup), or start every shard afresh with empty ones"
        )
    slices = {int(r.meta["seq"]): r for _, r in _closed(store).records(1)
              if r.kind == "slice"}  # fmt: skip
    fed.note_call_number(max(slices, default=0))
    try:
        recover_alone(fed, store, rank0_log, slices)
    except Exception as exc:  # said to every shard, which all stop with it
        raise RecoveryError(f"shard {rank}: {exc}") from exc


def _at(row: Position, lead: Position) -> bool:
    return (row.has_model, row.seq, row.key) == (lead.has_model, lead.seq, lead.key) and not (
        row.dirty
    )


def _closed(store: StateStore) -> StateStore:
    """The store with its log closed (a shard that recovers while running: its log goes on in a
    new segment)."""
    store.close()
    return store


def recover_alone(
    fed: Any, store: StateStore, rank0_log: Rank0Log, slices: dict[int, WalRecord] | None
) -> int:
    """Load this shard's newest checkpoint that rank 0 cut (its "cut" record is in rank 0's log)
    and replay rank 0's calls after it, with their logged sums, each update with this shard's
    own slice (``slices``, by call number; None on rank 0, whose records hold its slices); the
    number of calls replayed."""
    t0 = time.perf_counter()
    cfg = fed.config
    numbers = store.checkpoint_numbers()
    payload, number, seq = None, 0, -1
    for number in reversed(numbers):
        payload = store.load(number)
        check_shard(payload.get("shard"), cfg.rank, cfg.shards)
        seq = int(payload["shard"]["seq"])
        if seq in rank0_log.cuts:
            break
        payload = None
    if payload is None:
        raise RecoveryError(
            f"shard {cfg.rank} has no checkpoint that rank 0's log knows of (checkpoints "
            f"{numbers or 'none'} in {store.directory}): the shards' state directories are not "
            "of the same run"
        )
    with fed.sums.replaying(decode_sums(rank0_log.cuts[seq])):
        restore(fed, payload)
    strategy = fed.strategy
    sink = strategy.event_sink
    strategy.event_sink = getattr(sink, "quietly", None)
    privacy = strategy.privacy
    if privacy is not None:  # republished versions carry fresh noise: charged again
        privacy.begin_recovery()
    replayed = updates = 0
    last = seq
    try:
        for record in rank0_log.calls:
            number_of_call = int(record.meta.get("seq", 0))
            if number_of_call <= seq:
                continue
            if slices is not None and record.kind == "update":
                prepared = slices.get(number_of_call)
                if prepared is None:
                    raise RecoveryError(
                        f"rank 0 applied update {record.meta['update_id']!r} (call "
                        f"{number_of_call}) but shard {cfg.rank} has no slice of it in its log"
                    )
                record = WalRecord(record.kind, record.meta, prepared.tensors)
            try:
                fed.replay(record)
            except RecoveryError:
                raise
            except Exception as exc:
                raise RecoveryError(
                    f"replaying rank 0's call {number_of_call} ({record.kind}) on shard "
                    f"{cfg.rank} diverged from the log: {exc}"
                ) from exc
            replayed += 1
            updates += record.kind == "update"
            last = number_of_call
    finally:
        strategy.event_sink = sink
        if privacy is not None:
            privacy.end_recovery()
    fed.note_call_number(last, made=True)
    fed.publish_recovered()
    store.reopen(number)
    fed.checkpoints.resumed(int(payload["state"]["version"]), float(payload["created_at"]),
                            updates)  # fmt: skip
    log.info(
        "shard %d resumed from checkpoint %d (call %d): version %d after replaying %d of rank "
        "0's calls in %.2f s", cfg.rank, number, seq, fed.version, replayed,
        time.perf_counter() - t0,
    )  # fmt: skip
    return replayed
