"""Rank 0's view of every shard of a sharded federation: each shard's slice, published version,
whether it takes writes (and why not), its durability and when it last answered, for
GetStatus's ``shards`` (``aggsrv status``) and the status page.

Rank 0 asks the other shards when it is asked itself: GetStatus with ``shard_probe`` set, to all
of them at once on the event loop, each within :data:`PROBE_TIMEOUT` seconds. Nothing of it
runs on the aggregation thread or the shards' process group, so a shard that died or hangs
costs the asker that timeout at most and never delays an update; it is then shown unreachable,
with the error, its last answer kept. Answers are reused for :data:`REUSE_SECONDS`, so any
number of status pages and operators ask each shard about once a second at most.

Credentials: with ``--auth hmac`` (one secret shared by the shards) rank 0 signs a short-lived
client token of its own; with ``--auth tokens`` it passes on the token of the GetStatus call it
answers, and for the status page, which has none, a token of the tokens file
(aggsrv.server.relay's ``service_token``). TLS as the relay's: the shards' certificates are
checked against ``tls_client_ca`` with rank 0's own presented when that is set, else against
rank 0's ``tls_cert`` chain.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from aggsrv import protocol as P
from aggsrv.server.auth import ROLE_CLIENT, Authenticator, HmacAuthenticator
from aggsrv.server.relay import _channel_credentials, service_token
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from aggsrv.server.federation import Federation

PROBE_TIMEOUT = 2.0  # seconds a shard has to answer rank 0's GetStatus
REUSE_SECONDS = 1.0  # how long the shards' answers are shown before they are asked again
PROBE_SUBJECT = "aggsrv-shard-status"  # the subject of the token rank 0 signs for its probes
PROBE_TOKEN_SECONDS = 60.0


class ShardWatch:
    """The rows of :attr:`StatusResponse.shards`, kept by rank 0 (event loop)."""

    def __init__(self, federation: Federation, authenticator: Authenticator) -> None:
        self.fed = federation
        self.auth = authenticator
        self._answers: dict[int, pb.ShardStatus] = {}  # the shards of rank >= 1, as last heard
        self._asked_at = -float("inf")  # monotonic time the last round of probes ended
        self._asking: asyncio.Future | None = None
        self.last: list[pb.ShardStatus] = []  # the last rows made (read by the page's thread)

    @property
    def active(self) -> bool:
        """Whether this server is rank 0 of a sharded federation that knows its shards."""
        shards = self.fed.shards
        return shards is not None and shards.is_coordinator and len(shards.addresses) > 1

    async def rows(self, token: str | None = None) -> list[pb.ShardStatus]:
        """Every shard's row, rank 0 first ([] unless :attr:`active`); the other shards are
        asked first unless they were less than :data:`REUSE_SECONDS` ago. ``token``: the
        credentials of the call being answered (passed on under ``--auth tokens``)."""
        if not self.active:
            return []
        due = time.monotonic() - self._asked_at >= REUSE_SECONDS
        if self._asking is None or (self._asking.done() and due):
            self._asking = asyncio.ensure_future(self._ask_all(token))
        # Shielded: a caller that gives up (a cancelled GetStatus) leaves the round to finish.
        await asyncio.shield(self._asking)
        rows = [self._own_row(), *(self._row_of(r) for r in range(1, self.fed.shards.world_size))]
        self._add_slices(rows)
        self.last = rows
        return rows

    def rows_from_thread(self) -> list[pb.ShardStatus]:
        """:meth:`rows` for a thread that is not the event loop (the status page's); the last
        rows made when the loop does not answer in time."""
        loop = self.fed.fail_stop.loop
        if not self.active or loop is None or loop.is_closed():
            return list(self.last)
        future = asyncio.run_coroutine_threadsafe(self.rows(), loop)
        try:
            return future.result(PROBE_TIMEOUT + 1.0)
        except Exception:  # the loop is stopping or busy: what was last seen
            future.cancel()
            return list(self.last)

    async def _ask_all(self, token: str | None) -> None:
        shards = self.fed.shards
        assert shards is not None
        ranks = range(1, shards.world_size)
        try:
            token = self._token(token)
        except (OSError, ValueError) as exc:  # a tokens file that cannot be read: shown
            for r in ranks:
                row = self._answers.setdefault(
                    r, pb.ShardStatus(rank=r, address=shards.addresses[r])
                )
                _unreachable(row, f"rank 0 has no token to ask with: {exc}")
        else:
            await asyncio.gather(*(self._ask(r, shards.addresses[r], token) for r in ranks))
        self._asked_at = time.monotonic()

    def _token(self, forwarded: str | None) -> str | None:
        if isinstance(self.auth, HmacAuthenticator):
            return self.auth.issue(PROBE_SUBJECT, ROLE_CLIENT, ttl_seconds=PROBE_TOKEN_SECONDS)
        if self.auth.mode == "none":
            return None
        return forwarded or service_token(self.fed.config)

    async def _ask(self, rank: int, address: str, token: str | None) -> None:
        """Ask shard ``rank`` for its status and keep its answer, or why there was none."""
        row = self._answers.setdefault(rank, pb.ShardStatus(rank=rank))
        row.address = address  # as the shards last exchanged them (a shard may rejoin elsewhere)
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        try:
            async with self._channel(address) as channel:
                resp = await pb_grpc.AggregationStub(channel).GetStatus(
                    pb.GetStatusRequest(shard_probe=True), timeout=PROBE_TIMEOUT,
                    metadata=metadata,
                )  # fmt: skip
        except grpc.aio.AioRpcError as exc:
            _unreachable(row, f"{exc.code().name}: {exc.details()}")
            return
        except Exception as exc:  # e.g. TLS files that cannot be read: shown, not raised
            _unreachable(row, f"{type(exc).__name__}: {exc}")
            return
        if resp.shard_rank != rank:
            _unreachable(row, f"{address} answers as shard {resp.shard_rank}, not {rank}")
            return
        row.reachable = True
        row.error = ""
        _fill(row, resp.version, resp.failure, resp.durability, resp.wal_bytes)
        row.ClearField("last_checkpoint_version")
        row.ClearField("last_checkpoint_time")
        if resp.HasField("last_checkpoint_version"):
            row.last_checkpoint_version = resp.last_checkpoint_version
            row.last_checkpoint_time.CopyFrom(resp.last_checkpoint_time)
        row.last_heard.CopyFrom(P.timestamp(self.fed.clock()))

    def _channel(self, address: str) -> grpc.aio.Channel:
        """A fresh channel for one round of probes: status is asked rarely, and a kept channel
        to a shard that restarted would wait out gRPC's reconnection backoff."""
        creds = _channel_credentials(self.fed.config)
        if creds is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, creds)

    def _own_row(self) -> pb.ShardStatus:
        fed = self.fed
        assert fed.shards is not None
        row = pb.ShardStatus(rank=0, address=fed.shards.addresses[0], reachable=True)
        store = fed.store
        _fill(
            row, fed.published_version, fed.failure or "",
            "on" if store is not None and store.durable else "off",
            store.wal_bytes() if store is not None else 0,
        )  # fmt: skip
        last = fed.checkpoints.last_checkpoint
        if last is not None:
            row.last_checkpoint_version = last[0]
            row.last_checkpoint_time.CopyFrom(P.timestamp(last[1]))
        row.last_heard.CopyFrom(P.timestamp(fed.clock()))
        return row

    def _row_of(self, rank: int) -> pb.ShardStatus:
        row = pb.ShardStatus()
        answer = self._answers.get(rank)
        if answer is not None:
            row.CopyFrom(answer)
        else:  # a round that gave up before this shard's probe ended
            assert self.fed.shards is not None
            row.rank, row.address = rank, self.fed.shards.addresses[rank]
            row.error = "not asked yet"
        return row

    def _add_slices(self, rows: list[pb.ShardStatus]) -> None:
        shard_map = self.fed.shards.shard_map if self.fed.shards is not None else None
        if shard_map is None:
            return  # no model yet: no slices
        for row in rows:
            row.begin, row.end = shard_map.slice(row.rank)


def _fill(row: pb.ShardStatus, version: int, failure: str, durability: str, wal: int) -> None:
    row.version = version
    row.failure = failure
    row.takes_writes = not failure
    row.durability = durability
    row.wal_bytes = wal


def _unreachable(row: pb.ShardStatus, error: str) -> None:
    """No answer: the shard cannot be said to take writes; what it last said is kept."""
    row.reachable = False
    row.error = error
    row.takes_writes = False


def shard_row_json(row: pb.ShardStatus) -> dict:
    """A row as the status page's JSON has it (times in Unix seconds, null when unset)."""
    checkpoint = None
    if row.HasField("last_checkpoint_version"):
        checkpoint = {
            "version": row.last_checkpoint_version,
            "time": _seconds(row.last_checkpoint_time),
        }
    return {
        "rank": row.rank,
        "address": row.address,
        "begin": row.begin,
        "end": row.end,
        "reachable": row.reachable,
        "error": row.error,
        "version": row.version,
        "takes_writes": row.takes_writes,
        "failure": row.failure,
        "durability": row.durability,
        "wal_bytes": row.wal_bytes,
        "last_checkpoint": checkpoint,
        "last_heard": _seconds(row.last_heard) if row.HasField("last_heard") else None,
    }


def _seconds(ts: Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9
