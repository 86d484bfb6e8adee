"""The shards of one sharded federation (docs/sharding.md "The server processes"): the
torch.distributed group they talk through, the replicated log of strategy calls that rank 0
orders, the all-or-none vote on an update, and the slices a shard holds until rank 0 orders them.

Every collective of a shard runs on its aggregation thread, in the order of the calls: rank 0
announces a call (``announce``) right before making it, the other shards receive it
(``receive``) and make the same call, and the strategy's own ``all_reduce``s inside that call
then line up on every shard because they come from the same code on the same state. One gloo
group carries both (NCCL would need its own group for CUDA partial sums; that is not done yet).
After each strategy call the shards compare what it did (``compare``): one that differs has
diverged from rank 0, and every shard stops taking writes.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aggsrv.server.rendezvous import Rendezvous, leave_group
from aggsrv.sharding import ShardMap, TorchReducer
from aggsrv.strategies import InvalidUpdate, StrategyError

log = logging.getLogger(__name__)

# A shard's verdict on its slice of an update; the vote refuses with the largest.
SLICE_OK = 0
SLICE_MISSING = 1  # never arrived (the stream to this shard was cut, or is late): ABORTED
SLICE_INVALID = 2  # its numbers are refused (e.g. a negative running_var): INVALID_ARGUMENT

# The calls rank 0 orders; "adopt" carries the first model, "checkpoint" cuts every shard's
# state at the same call, "noop" keeps the group alive, "durable" only says how far rank 0's
# decisions are durable (every announce says it too).
CALL_KINDS = ("adopt", "register", "job", "update", "timer", "checkpoint", "noop", "durable",
              "stop")  # fmt: skip
# The strategy calls whose result the shards compare afterwards (docs/sharding.md).
COMPARED_KINDS = ("register", "job", "update", "timer")
# What a shard tells the others a call did: refused (1) or not (0), then its counts after it.
DIGEST_FIELDS = ("refused", "version", "jobs issued", "clients")


class ShardLost(RuntimeError):
    """A collective failed or timed out: another shard died, hangs, or cannot be reached."""


def _without_frames(exc: BaseException) -> BaseException:
    """torch's error of a failed collective, without its traceback. Its frames hold the process
    group, and the server keeps a ShardLost a while (a future, a handler's abort): the group
    would outlive leaving it, its connections open, and a shard waiting on this one in a
    collective would wait out the timeout instead of failing at once."""
    return exc.with_traceback(None)


class SliceMissing(StrategyError):
    """A shard never received its slice of an update rank 0 ordered; no shard applied it."""

    code = "ABORTED"  # push the update again, same update id
    reason = "slice_missing"


class GroupReducer:
    """The strategy's sum over the shards, a shard lost meanwhile raised as :class:`ShardLost`
    (the federation then waits for it, as for a shard lost in a vote)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        try:
            return self._inner.sum_(t)
        except ShardLost:
            raise
        except RuntimeError as exc:
            raise ShardLost(
                f"shard {self.rank} of {self.world_size} lost the federation during a sum over "
                f"the shards: {str(exc)[:300]}"
            ) from _without_frames(exc)


@dataclass
class StagedSlice:
    """One shard's slice of an update, waiting for rank 0 to order the update."""

    update: Any  # aggsrv.strategies.Update with this shard's [end - begin] tensor
    done: Any  # asyncio.Future resolved with (staleness, outcome) or the refusal
    loop: Any
    upload_log: Any = None  # aggsrv.server.upload_log.UploadLog: where it was logged, if it was
    taken: bool = field(default=False)

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.done.done():
                return
            if error is not None:
                self.done.set_exception(error)
            else:
                self.done.set_result(result)

        self.loop.call_soon_threadsafe(settle)


class StagedSlices:
    """Slices that arrived on this shard, by (client, update id), until the aggregation thread
    takes them (rank 0 ordered the update) or their upload gives up waiting (withdraw)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slices: dict[tuple[str, str], StagedSlice] = {}

    def put(self, key: tuple[str, str], staged: StagedSlice) -> bool:
        with self._cond:
            if key in self._slices:
                return False
            self._slices[key] = staged
            self._cond.notify_all()
            return True

    def take(self, key: tuple[str, str], timeout: float) -> StagedSlice | None:
        """The slice for ``key``, waiting up to ``timeout`` seconds for it to arrive."""
        with self._cond:
            self._cond.wait_for(lambda: key in self._slices, timeout)
            staged = self._slices.pop(key, None)
            if staged is not None:
                staged.taken = True
            return staged

    def withdraw(self, key: tuple[str, str], staged: StagedSlice) -> bool:
        """Remove a slice nobody took yet; False when the aggregation thread already has it."""
        with self._cond:
            if self._slices.get(key) is staged and not staged.taken:
                del self._slices[key]
                return True
            return False

    def fail_all(self, error: BaseException) -> None:
        """Refuse every slice still waiting (the federation stopped taking writes)."""
        with self._cond:
            waiting = list(self._slices.values())
            self._slices.clear()
        for staged in waiting:
            staged.resolve(error=error)

    def __len__(self) -> int:
        with self._cond:
            return len(self._slices)


class ShardGroup:
    """This process's place among the shards, and the collectives between them."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        timeout: float,
        slice_wait: float,
        order_wait: float,
        heartbeat: float,
        group: Any = None,
        owned: bool = False,
    ) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.slice_wait = slice_wait  # how long an ordered update waits for this shard's slice
        self.order_wait = order_wait  # how long a slice waits for rank 0 to order its update
        self.heartbeat = heartbeat
        self.group = group
        self.owned = owned  # this object created the process group (close destroys it)
        self.reducer = GroupReducer(TorchReducer(group))
        self.addresses: list[str] = []
        self.shard_map: ShardMap | None = None
        self.staged = StagedSlices()
        self.last_announce = time.monotonic()
        # Where the shards meet again after a loss (None: torchrun's, or a group made outside).
        self.rendezvous: Rendezvous | None = None

    @classmethod
    def connect(cls, config: Any) -> ShardGroup:
        """Join the federation's process group: at ``config.dist_url`` (rank 0's store, where
        the shards meet again after a loss: aggsrv.server.rendezvous), or torchrun's env://
        (torchrun restarts every shard after a loss)."""
        import torch.distributed as dist

        init = config.dist_url or "env://"
        if init == "env://" and "MASTER_ADDR" not in os.environ:
            raise ValueError(
                "a sharded server needs --dist-url tcp://HOST:PORT (rank 0's rendezvous address), "
                "or torchrun's MASTER_ADDR and MASTER_PORT"
            )
        log.info(
            "shard %d of %d: joining the process group at %s", config.rank, config.shards, init
        )
        rendezvous = None
        if init.startswith("tcp://"):
            rendezvous = Rendezvous(init, config.rank, config.shards, config.shard_timeout_seconds)
            rendezvous.join(stop=lambda: False)
        else:
            dist.init_process_group(
                "gloo",
                init_method=init,
                rank=config.rank,
                world_size=config.shards,
                timeout=datetime.timedelta(seconds=config.shard_timeout_seconds),
            )
        group = cls.of(config, owned=True)
        group.rendezvous = rendezvous
        return group

    def reform(self, stop: Any) -> int:
        """After a lost shard: leave the broken group and join the next forming of it (blocks
        until every shard is back, retrying; ``stop()`` gives up); its epoch."""
        rendezvous = self.rendezvous
        assert rendezvous is not None
        leave_group()
        epoch = rendezvous.join(stop)
        self.last_announce = time.monotonic()
        return epoch

    @classmethod
    def of(cls, config: Any, group: Any = None, owned: bool = False) -> ShardGroup:
        """The shard ``config`` describes, in a process group that exists already (``group``,
        None: the default group), e.g. one that serves several federations one after another."""
        return cls(
            config.rank,
            config.shards,
            timeout=config.shard_timeout_seconds,
            slice_wait=config.shard_slice_wait_seconds,
            order_wait=config.shard_order_wait_seconds,
            heartbeat=config.shard_heartbeat_seconds,
            group=group,
            owned=owned,
        )

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _collective(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as exc:
            raise ShardLost(
                f"shard {self.rank} of {self.world_size} lost the federation during {what}: "
                f"{str(exc)[:300]}"
            ) from _without_frames(exc)

    # ------------------------------------------------------------------ setup

    def exchange_addresses(self, mine: str) -> list[str]:
        """Every shard's gRPC address, in rank order (a collective: all shards at startup)."""
        self.addresses = [str(a) for a in self.gather_objects(mine, "the address exchange")]
        return self.addresses

    def agree(self, value: str, what: str) -> None:
        """Check that every shard holds the same ``value`` (e.g. the strategy's name)."""
        out = self.gather_objects(value, f"checking {what}")
        if len(set(out)) != 1:
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(out))
            raise ValueError(f"the shards were started with different {what} ({shown})")

    def gather_objects(self, value: Any, what: str = "recovery") -> list[Any]:
        """Every shard's ``value`` (picklable), in rank order (a collective)."""
        out: list[Any] = [None] * self.world_size
        self._collective(what, self._dist.all_gather_object, out, value)
        return out

    def share_calls(self, calls: Any) -> Any:
        """Rank 0's log (aggsrv.server.shard_recovery.Rank0Log, without its slices), sent to
        every shard (recovery; the others pass None)."""
        box: list[Any] = [calls]
        self._collective("sending rank 0's log", self._dist.broadcast_object_list, box, 0)
        return box[0]

    # ------------------------------------------------------------------ the replicated log

    def announce(self, kind: str, meta: dict[str, Any], durable: int = 0) -> None:
        """Rank 0: tell every shard the call it is about to make (aggregation thread), and how
        far its decisions are durable (``durable``: the number of the last durable call)."""
        assert kind in CALL_KINDS, kind
        self._collective(
            f"a {kind} call", self._dist.broadcast_object_list, [(kind, meta, durable)], 0
        )
        self.last_announce = time.monotonic()

    def receive(self) -> tuple[str, dict[str, Any], int]:
        """Shards of rank >= 1: the next call rank 0 made and how far rank 0's decisions are
        durable (blocks, up to the group's timeout; rank 0 sends a keep-alive every
        ``heartbeat`` seconds when idle)."""
        box: list[Any] = [None]
        self._collective("waiting for rank 0's next call", self._dist.broadcast_object_list,
                         box, 0)  # fmt: skip
        kind, meta, durable = box[0]
        return kind, meta, int(durable)

    def share_model(self, weights: torch.Tensor | None, numel: int) -> torch.Tensor:
        """Rank 0 sends the first model's [D] weights to every shard (after an "adopt" call)."""
        buf = weights.contiguous() if weights is not None else torch.empty(numel)
        self._collective("sending the first model", self._dist.broadcast, buf, 0)
        return buf

    def vote(self, verdict: int) -> list[int]:
        """Every shard's verdict on its slice of the update being applied, in rank order."""
        votes = torch.zeros(self.world_size, dtype=torch.int64)
        votes[self.rank] = verdict
        self._collective("the vote on an update", self._dist.all_reduce, votes)
        return votes.tolist()

    def compare(self, digest: Sequence[int]) -> list[list[int]] | None:
        """None when every shard's digest of the call just made (:func:`call_digest`) equals
        rank 0's, else every shard's digest, in rank order. One all_reduce of one int64 per
        shard (a key of its digest; gloo takes longer for each element more); the digests
        themselves travel, in a second one, only when the keys differ (on every shard)."""
        keys = torch.zeros(self.world_size, dtype=torch.int64)
        keys[self.rank] = digest_key(digest)
        self._collective("comparing the shards' results of a call", self._dist.all_reduce, keys)
        if len(set(keys.tolist())) == 1:
            return None
        rows = torch.zeros(self.world_size, len(digest), dtype=torch.int64)
        rows[self.rank] = torch.tensor(list(digest), dtype=torch.int64)
        self._collective("gathering the shards' results of a call", self._dist.all_reduce, rows)
        return rows.tolist()

    def close(self) -> None:
        """Leave the group; the other shards' pending collectives then fail at once."""
        if self.owned:
            leave_group()


def slice_verdict(strategy: Any, update: Any) -> tuple[int, StrategyError | None]:
    """This shard's verdict on its slice (the decoder already checked length, CRC and
    finiteness): the strategy's data checks on it."""
    try:
        strategy.check_data(update)
    except InvalidUpdate as exc:
        return SLICE_INVALID, exc
    return SLICE_OK, None


def refusal(
    votes: Sequence[int], rank: int, own: StrategyError | None, update_id: str, wait: float
) -> StrategyError:
    """The error every shard answers when the vote refused an update."""
    worst = max(votes)
    if own is not None and votes[rank] == worst:
        return own
    who = ", ".join(str(r) for r, v in enumerate(votes) if v == worst)
    if worst == SLICE_INVALID:
        return InvalidUpdate(
            f"shard {who} refused its slice of update {update_id!r} (its float buffers or "
            "numbers are invalid); no shard applied it"
        )
    return SliceMissing(
        f"shard {who} did not receive its slice of update {update_id!r} within {wait:g} s of "
        "rank 0 ordering it (the stream to it was cut or is late); no shard applied it: send "
        "the update again"
    )


def call_digest(strategy: Any, refused: bool) -> list[int]:
    """What a call did on this shard, as the shards compare it (DIGEST_FIELDS): the same calls
    on the same state give the same digest on every shard."""
    return [int(refused), strategy.version, strategy.jobs_issued, len(strategy.clients)]


def digest_key(digest: Sequence[int]) -> int:
    """A 56-bit key of a digest, the same on every machine (not Python's hash())."""
    packed = struct.pack(f"<{len(digest)}q", *digest)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=7).digest(), "little")


def divergence(rows: Sequence[Sequence[int]]) -> str:
    """How the shards' digests of a call differ from rank 0's ("" when they all agree)."""

    def said(row: Sequence[int]) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in zip(DIGEST_FIELDS[1:], row[1:], strict=True))
        return f"{'refused' if row[0] else 'made'} it ({counts})"

    first = list(rows[0])
    others = [r for r, row in enumerate(rows) if list(row) != first]
    if not others:
        return ""
    return f"rank 0 {said(first)}, " + ", ".join(f"rank {r} {said(rows[r])}" for r in others)


def describe_call(kind: str, meta: dict[str, Any]) -> str:
    """A call rank 0 ordered, named for the log (ids are well-formed: rank 0 checked them)."""
    if kind == "update":
        return f"update {meta.get('update_id')!r} of client {meta.get('client')!r}"
    if kind in ("register", "job"):
        return f"a {kind} call of client {meta.get('client')!r}"
    return f"a {kind} call"
