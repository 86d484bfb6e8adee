"""A shard of rank >= 1 of a sharded federation (docs/sharding.md): its receiving thread takes
the calls rank 0 announces, in rank 0's order, and makes each on the aggregation thread with
:meth:`Federation.replay` (the same records a restarted server replays from its log); an
update's data is the shard's own slice, held until rank 0 orders it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from aggsrv.layout import ModelLayout
from aggsrv.server import shards as S
from aggsrv.server.durability import WalRecord
from aggsrv.server.fail_stop import AggregationFailed, DurabilityError, FailStop
from aggsrv.server.publication import Publication
from aggsrv.server.replication import Replication
from aggsrv.strategies import (
    InvalidUpdate,
    Outcome,
    ShardsDisagree,
    Strategy,
    StrategyError,
    Update,
)

log = logging.getLogger("aggsrv.server.federation")


def _header_mismatch(update: Update, meta: dict[str, Any]) -> str:
    """How a shard's copy of an update's header differs from rank 0's ("" when it does not)."""
    ours = {
        "job_id": update.job_id,
        "base_version": update.base_version,
        "num_samples": update.num_samples,
        "work_done": update.work_done,
        "kind": update.kind.name,
    }
    theirs = {k: meta[k] for k in ours}
    return ", ".join(f"{k}: {ours[k]!r} here, {theirs[k]!r} there" for k in ours
                     if ours[k] != theirs[k])  # fmt: skip


@dataclass
class _Reply:
    """The answer to the slice a shard of rank >= 1 took for the update it is following."""

    staged: S.StagedSlice
    seq: int
    result: Any = None
    error: BaseException | None = None


class ShardFollower:
    """A shard of rank >= 1: make the calls rank 0 announces, in its order."""

    def __init__(
        self,
        strategy: Callable[[], Strategy | None],
        fail_stop: FailStop,
        submit: Callable[..., Future],
        replication: Replication,
        publication: Publication,
        replay: Callable[[WalRecord], None],
        adopt_slice: Callable[[ModelLayout, torch.Tensor], None],
        count: Callable[[Outcome], None],
        prepare: Callable[[Update, dict[str, Any], Any], None],
        cut: Callable[[dict[str, Any]], None],
    ) -> None:
        """``strategy``: the federation's, as it is now; ``submit``: queues a
        call on the aggregation thread; ``replay``: makes a logged call; ``adopt_slice``: serves
        this shard's slice of the whole model rank 0 shared; ``count``: counts an outcome
        reached here; ``prepare``: makes this shard's slice of an update durable before it
        votes (given the slice's upload log); ``cut``: checkpoints this shard at the call
        rank 0 ordered it."""
        self.shards: S.ShardGroup | None = None  # set by the server before it serves
        self._strategy = strategy
        self._fail_stop = fail_stop
        self._submit = submit
        self._replication = replication
        self._publication = publication
        self._replay = replay
        self._adopt_slice = adopt_slice
        self._count = count
        self._prepare = prepare
        self._cut = cut
        self._reply: _Reply | None = None  # the slice being followed (aggregation thread)
        # Rank 0's decisions are durable up to this call; answers to applied slices wait for it.
        self.rank0_durable = 0
        self.applied_seq = 0  # the last call made here, in rank 0's numbering
        self._parked: list[_Reply] = []
        self._parked_lock = threading.Lock()
        self.on_coordinator_stop: Callable[[], None] | None = None  # the server's: it stops

    def follow(self) -> None:
        """The receiving thread of a shard of rank >= 1: take the calls rank 0 announces, in its
        order, and make each on the aggregation thread (where reads of the strategy queue too),
        until rank 0 announces "stop", a collective fails or the shards diverge."""
        shards = self.shards
        loop = self._fail_stop.loop
        assert shards is not None and loop is not None
        while True:
            try:
                kind, meta, durable = shards.receive()
            except S.ShardLost as exc:
                self._fail_stop.fail(str(exc), lost_shard=True)
                return
            advanced = durable > self.rank0_durable
            self.rank0_durable = max(self.rank0_durable, durable)
            if advanced:
                self._release()
            if kind == "stop":
                log.info("rank 0 stopped the federation")
                if self.on_coordinator_stop is not None:
                    loop.call_soon_threadsafe(self.on_coordinator_stop)
                return
            if kind in ("noop", "durable"):
                if advanced:
                    loop.call_soon_threadsafe(self._followed)
                continue
            try:
                self._submit(self._follow_step, kind, meta).result()
            except DurabilityError:  # fail() said why
                return
            except RuntimeError:  # the server stopped (its aggregation thread with it)
                return
            loop.call_soon_threadsafe(self._followed)

    def _followed(self) -> None:
        """After a followed call (event loop): publish a new version, wake waiting handlers
        (a slice of a job waits for the job to exist here)."""
        publication = self._publication
        if self._fail_stop.failure is None:
            publication.publish(self.rank0_durable)
        publication.notify()

    def _follow_step(self, kind: str, meta: dict[str, Any]) -> None:
        """(aggregation thread of a shard of rank >= 1) Make one call rank 0 made, compare what
        it did with the other shards, then answer the slice of an update."""
        fail_stop = self._fail_stop
        self._reply = None
        self._release()
        seq = int(meta.get("seq", 0))
        try:
            if seq:
                self.applied_seq = seq  # a checkpoint this call cuts says so
            refused = self._follow_call(kind, meta)
            if seq:
                self._publication.record_at(seq)  # published once rank 0's record is durable
            self._replication.agree(kind, meta, refused)
        except S.ShardLost as exc:  # in a sum over the shards: the call may be half made
            fail_stop.dirty = True
            fail_stop.fail(str(exc), lost_shard=True)
            self._answer_slice(AggregationFailed(fail_stop.failure))
            raise AggregationFailed(fail_stop.failure) from exc
        except DurabilityError as exc:  # a lost shard, shards that diverged: fail() said why
            self._answer_slice(exc)
            raise
        except ShardsDisagree as exc:
            error = fail_stop.stop_on_divergence(exc, (kind, meta))
            self._answer_slice(error)
            raise error from exc
        except Exception as exc:  # a bug: this shard's state may now differ from rank 0's
            shards = self.shards
            assert shards is not None
            error = fail_stop.stop_on_unexpected(exc, f"shard {shards.rank} following a {kind}")
            self._answer_slice(error)
            # Rank 0 may be waiting in a collective this shard will never join: leaving the
            # group ends its wait now rather than at shard_timeout_seconds.
            shards.close()
            raise error from exc
        reply = self._reply
        if reply is not None and reply.error is None:
            self._reply = None
            with self._parked_lock:  # answered once rank 0's decision is durable
                self._parked.append(reply)
        else:
            self._answer_slice()  # a refusal: nothing to wait for
        self._publication.settle()

    def _answer_slice(self, error: BaseException | None = None) -> None:
        reply, self._reply = self._reply, None
        if reply is not None:
            reply.staged.resolve(reply.result, error=error or reply.error)

    def _release(self) -> None:
        """Answer the applied slices whose call rank 0 has made durable (any thread)."""
        durable = self.rank0_durable
        with self._parked_lock:
            ready = [r for r in self._parked if r.seq <= durable]
            self._parked = [r for r in self._parked if r.seq > durable]
        for reply in ready:
            reply.staged.resolve(reply.result)

    def fail_parked(self, error: BaseException) -> None:
        """The federation stopped taking writes: the parked answers are not known durable."""
        with self._parked_lock:
            parked, self._parked = self._parked, []
        for reply in parked:
            reply.staged.resolve(error=error)

    def _follow_call(self, kind: str, meta: dict[str, Any]) -> bool:
        """Make the call rank 0 announced; whether it was refused here."""
        if kind == "adopt":
            whole = ModelLayout.from_dict(meta["layout"])
            shards = self.shards
            assert shards is not None
            weights = self._fail_stop.collective(shards.share_model, None, whole.numel)
            self._adopt_slice(whole, weights)
            return False
        assert self._strategy() is not None, f"a {kind} call before the model"
        if kind == "checkpoint":
            self._cut(meta)
            return False
        if kind == "update":  # its data is this shard's own slice, and the shards vote
            return self._follow_update(meta, float(meta["now"]))
        try:  # the same records a restarted server replays from its log
            self._replay(WalRecord(kind, meta))
        except StrategyError:
            return True
        return False

    def _follow_update(self, meta: dict[str, Any], now: float) -> bool:
        """Follow an update on this shard's slice; whether it was refused here. The answer to
        the slice waits in :attr:`_reply` until the shards agree on the outcome."""
        shards = self.shards
        strategy = self._strategy()
        assert shards is not None and strategy is not None
        staged = shards.staged.take((meta["client"], meta["update_id"]), shards.slice_wait)
        verdict, own, update = S.SLICE_MISSING, None, None
        if staged is not None:
            self._reply = _Reply(staged, int(meta.get("seq", 0)))
            update = staged.update
            mismatch = _header_mismatch(update, meta)
            if mismatch:
                verdict = S.SLICE_INVALID
                own = InvalidUpdate(
                    f"the header of the slice sent to shard {shards.rank} differs from the one "
                    f"sent to rank 0 ({mismatch}); no shard applied the update"
                )
            else:
                verdict, own = S.slice_verdict(strategy, update)
            if verdict == S.SLICE_OK:
                # Durable before the vote: once rank 0 decides to apply it, a crash of this shard
                # cannot lose its part of the update.
                self._prepare(update, meta, staged.upload_log)
        votes = self._fail_stop.collective(shards.vote, verdict)
        if max(votes):
            if self._reply is not None:
                self._reply.error = S.refusal(
                    votes, shards.rank, own, meta["update_id"], shards.slice_wait
                )
            return True
        assert self._reply is not None and update is not None
        try:
            outcome = strategy.on_update(update, now)
        except StrategyError as exc:
            self._reply.error = exc
            return True
        # Answered as rank 0 answers: the staleness the strategy recorded, else the version gap.
        s = outcome.staleness
        if s is None:
            s = strategy.version - update.base_version
        self._count(outcome)
        self._reply.result = (s, outcome)
        return False

    async def apply_slice(self, update: Update, upload_log: Any = None) -> tuple[int, Outcome]:
        """A shard of rank >= 1: hold this slice until rank 0 orders its update, then answer
        the outcome every shard reached (or the refusal); (staleness, outcome). ``upload_log``:
        where the slice was logged as it arrived (aggsrv.server.upload_log)."""
        shards = self.shards
        assert shards is not None
        loop = asyncio.get_running_loop()
        key = (update.client_id, update.update_id)
        staged = S.StagedSlice(update, loop.create_future(), loop, upload_log)
        if not shards.staged.put(key, staged):
            raise S.SliceMissing(f"update {update.update_id!r} is being uploaded already")
        try:
            return await asyncio.wait_for(asyncio.shield(staged.done), shards.order_wait)
        except TimeoutError:
            if shards.staged.withdraw(key, staged):
                raise S.SliceMissing(
                    f"rank 0 did not order update {update.update_id!r} within "
                    f"{shards.order_wait:g} s (shard_order_wait_seconds): its slice for rank 0 "
                    "did not arrive or was refused there; send the update again"
                ) from None
            return await staged.done
        except asyncio.CancelledError:
            # The caller went away; the slot under this slice is freed after we return, so the
            # aggregation thread must be done with it first.
            if not shards.staged.withdraw(key, staged):
                with contextlib.suppress(Exception):
                    await asyncio.shield(staged.done)
            raise
