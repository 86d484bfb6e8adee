"""Rank 0 of a sharded federation as a client of the other shards (docs/sharding.md, "One
address"), for clients that reach rank 0 only or ignore the shard map: it forwards slice r of a
whole update to shard r, and fetches the other shards' slices of a job or version to answer a
whole GetJob or GetModel, or to evaluate the whole model (--eval).

Rank 0 calls the other shards with the caller's own ``authorization`` metadata (the shards share
the federation's secret or tokens file, so they accept what rank 0 accepted); an evaluation,
which has no caller, uses :func:`service_token`. With TLS, rank 0 checks the shards'
certificates against ``tls_client_ca`` and presents its own certificate when that is set (mutual
TLS), else against its own ``tls_cert`` chain (a certificate the shards share, or a chain that
ends in the CA that signed theirs).

All or none still holds: rank 0 orders the update only once every forwarded slice has been
written to its shard, and the shards vote on it as for slices a client sent. A forward that
fails is answered UNAVAILABLE (:class:`RelayFailed`) with nothing applied, so the client retries
with the same update id, and a retry of an update that was applied is answered DUPLICATE.
"""

from __future__ import annotations

import asyncio
import logging
import tomllib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import torch

from aggsrv import protocol as P
from aggsrv.server import auth as A
from aggsrv.server.requests import strategy_code
from aggsrv.server.shards import SliceMissing
from aggsrv.sharding import ShardMap
from aggsrv.strategies import StrategyError
from aggsrv.transport import (
    Decoder,
    Encoding,
    StagingSlot,
    WireDtype,
    choose_encoding,
    encode_sparse,
)
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb

if TYPE_CHECKING:
    from aggsrv.server.config import ServerConfig
    from aggsrv.server.shards import ShardGroup

log = logging.getLogger(__name__)
T = TypeVar("T")

# Split tensors of a job or model travel in slices; these live on rank 0 whole.
WHOLE_ON_RANK0 = ("buffers",)
Metadata = Sequence[tuple[str, str]]
# How the shards word the vote's refusal of a slice that did not arrive (shards.refusal).
SLICE_MISSING_TEXT = "did not receive its slice"
# The largest chunk rank 0 takes from a shard (a shard keeps below gRPC's default of 4 MiB).
MAX_CHUNK_BYTES = 64 << 20


class RelayFailed(Exception):
    """Rank 0 could not forward a slice to, or fetch one from, another shard."""

    def __init__(self, rank: int, address: str, what: str, code: str, details: str) -> None:
        self.rank, self.address, self.code = rank, address, code
        super().__init__(
            f"rank 0 could not {what} shard {rank} at {address}: {code}: {details[:300]}"
        )


def caller_metadata(context: grpc.aio.ServicerContext) -> list[tuple[str, str]]:
    """The caller's credentials, to present to the other shards on its behalf."""
    return [(k, v) for k, v in (context.invocation_metadata() or ()) if k == "authorization"]


def service_token(config: ServerConfig) -> str | None:
    """A credential the shards accept for rank 0's own reads (an evaluation has no caller): an
    admin token signed with the shared secret, or the tokens file's first admin token (else its
    first client token; GetModel takes any). None without authentication."""
    if config.auth == "none":
        return None
    if config.auth == "hmac":
        if not config.auth_secret_file:
            raise ValueError("a sharded server with auth = 'hmac' needs auth_secret_file")
        secret = A.load_secret(Path(config.auth_secret_file))
        return A.HmacAuthenticator(secret).issue(A.ADMIN_SUBJECT, A.ROLE_ADMIN)
    with open(config.tokens_file, "rb") as fh:
        table = tomllib.load(fh)
    admin = table.get("admin", {}).get("tokens", [])
    if admin:
        return str(admin[0])
    for tokens in table.get("clients", {}).values():
        return str(tokens if isinstance(tokens, str) else tokens[0])
    raise ValueError(f"{config.tokens_file} lists no token rank 0 could read the shards with")


def _channel_credentials(config: ServerConfig) -> grpc.ChannelCredentials | None:
    if not config.tls_cert:
        return None
    own_chain = Path(config.tls_cert).read_bytes()
    if config.tls_client_ca:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(config.tls_client_ca).read_bytes(),
            private_key=Path(config.tls_key).read_bytes(),
            certificate_chain=own_chain,
        )
    return grpc.ssl_channel_credentials(root_certificates=own_chain)


class ShardLinks:
    """Rank 0's gRPC channels to shards 1..N-1 (opened on first use, closed by :meth:`close`)."""

    def __init__(self, shards: ShardGroup, config: ServerConfig) -> None:
        self.shards = shards
        self.config = config
        self._stubs: dict[int, pb_grpc.AggregationStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    @property
    def shard_map(self) -> ShardMap:
        shard_map = self.shards.shard_map
        assert shard_map is not None, "no model yet"
        return shard_map

    @property
    def time_limit(self) -> float:
        """A bound on one call to a shard: a slice waits up to order_wait for rank 0's order,
        then at most a collective's timeout for the vote and the comparison."""
        return self.shards.order_wait + 2 * self.shards.timeout

    def stub(self, rank: int) -> pb_grpc.AggregationStub:
        stub = self._stubs.get(rank)
        if stub is None:
            limit = self.config.max_receive_message_bytes
            options = [
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", -1),
            ]
            address = self.shards.addresses[rank]
            creds = _channel_credentials(self.config)
            if creds is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                channel = grpc.aio.secure_channel(address, creds, options=options)
            self._channels.append(channel)
            stub = self._stubs[rank] = pb_grpc.AggregationStub(channel)
        return stub

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, [], {}
        for channel in channels:
            await channel.close()

    def _failed(self, rank: int, what: str, exc: BaseException) -> RelayFailed:
        if isinstance(exc, grpc.aio.AioRpcError):
            code, details = exc.code().name, exc.details() or ""
        else:
            code, details = type(exc).__name__, str(exc)
        return RelayFailed(rank, self.shards.addresses[rank], what, code, details)

    # ------------------------------------------------------------------ whole updates

    async def relay_update(
        self,
        header: pb.UpdateHeader,
        parts: Sequence[torch.Tensor],
        dtype: WireDtype,
        metadata: Metadata,
        apply: Callable[[], Awaitable[T]],
    ) -> T:
        """Forward ``parts[r]`` (r >= 1) of a whole update to shard r, then ``apply`` rank 0's
        own slice (which orders the update and joins the vote) once every slice has been
        written; what ``apply`` returns or raises, or :class:`RelayFailed`."""
        ranks = range(1, len(parts))
        written = {r: asyncio.Event() for r in ranks}
        forward = self._forward
        calls = {
            r: asyncio.ensure_future(forward(r, header, parts[r], dtype, metadata, written[r]))
            for r in ranks
        }
        try:
            await self._until_written(calls, written)
            try:
                result = await apply()
            except StrategyError as refusal:
                # Every shard answers the same refusal, unless a forwarded slice never got there
                # (a slice missing from the vote is one rank 0 did not deliver): that is why.
                await asyncio.wait(calls.values(), timeout=self.shards.slice_wait + 5.0)
                missing = isinstance(refusal, SliceMissing)
                for r, call in calls.items():
                    err = call.exception() if call.done() else None
                    if err is not None and _relay_error(err, refusal, missing):
                        raise self._failed(r, "forward its slice to", err) from refusal
                if missing:
                    raise RelayFailed(0, self.shards.addresses[0], "deliver every slice for",
                                      "ABORTED", str(refusal)) from refusal  # fmt: skip
                raise
        except BaseException:
            for call in calls.values():
                call.cancel()
            raise
        # The vote and the comparison passed: every shard reached rank 0's outcome.
        for r, call in calls.items():
            try:
                await call
            except Exception as exc:  # its answer was lost, not its slice
                log.warning("shard %d's answer to a relayed slice was lost: %s", r, exc)
        return result

    async def _until_written(
        self, calls: dict[int, asyncio.Future], written: dict[int, asyncio.Event]
    ) -> None:
        """Wait until every forwarded stream is written; RelayFailed if one fails first."""
        all_written = asyncio.ensure_future(asyncio.gather(*(e.wait() for e in written.values())))
        try:
            pending = {all_written, *calls.values()}
            while not all_written.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for r, call in calls.items():
                    if call in done and call.exception() is not None:
                        raise self._failed(r, "forward its slice to", call.exception())
        finally:
            all_written.cancel()

    async def _forward(
        self,
        rank: int,
        base: pb.UpdateHeader,
        flat: torch.Tensor,
        dtype: WireDtype,
        metadata: Metadata,
        written: asyncio.Event,
    ) -> pb.PushUpdateResponse:
        header = pb.UpdateHeader()
        header.CopyFrom(base)
        header.shard_rank = rank
        header.dtype = P.WIRE_TO_PB[dtype]
        del header.tensors[:]
        header.tensors.append(tpb.TensorInfo(name="update", numel=flat.numel()))
        chunk_bytes = self.config.chunk_bytes
        encoding, nnz = _encoding_of(flat, dtype)

        async def messages():
            yield pb.UpdateMessage(header=header)
            if encoding is Encoding.DENSE:
                stream = P.chunk_stream({"update": flat}, dtype, chunk_bytes, pb.UpdateMessage)
            else:
                payload, _ = encode_sparse(flat, dtype, encoding)
                stream = P.byte_stream([("update", payload)], chunk_bytes, pb.UpdateMessage)
            for msg in stream:
                yield msg
            written.set()

        if encoding is not Encoding.DENSE:
            header.tensors[0].encoding = P.ENCODING_TO_PB[encoding]
            header.tensors[0].nnz = nnz
        return await self.stub(rank).PushUpdate(
            messages(), timeout=self.time_limit, metadata=metadata
        )

    # ------------------------------------------------------------------ whole reads

    async def whole(
        self,
        method: str,
        request: Any,
        own: dict[str, torch.Tensor],
        metadata: Metadata,
    ) -> dict[str, torch.Tensor]:
        """Rank 0's tensors ``own`` (its slices, and "buffers" whole) made whole with the other
        shards' slices, fetched by ``method`` (GetJob with the job's id, GetModel with the
        version) in float32; RelayFailed if a shard does not answer them."""
        shard_map = self.shard_map
        others = await asyncio.gather(
            *(self._fetch(r, method, request, metadata) for r in range(1, shard_map.shards))
        )
        out = {}
        for name, t in own.items():
            if name in WHOLE_ON_RANK0:
                out[name] = t
                continue
            parts = [t.reshape(-1)]
            for r, got in enumerate(others, start=1):
                part = got.get(name)
                if part is None or part.numel() != shard_map.local_numel(r):
                    raise RelayFailed(
                        r, self.shards.addresses[r], f"read {name!r} from", "WRONG_SLICE",
                        f"it sent {'nothing' if part is None else part.numel()} elements, its "
                        f"slice holds {shard_map.local_numel(r)}",
                    )  # fmt: skip
                parts.append(part)
            out[name] = torch.cat(parts)
        return out

    async def _fetch(
        self, rank: int, method: str, request: Any, metadata: Metadata
    ) -> dict[str, torch.Tensor]:
        try:
            call = getattr(self.stub(rank), method)(
                request, timeout=self.time_limit, metadata=metadata
            )
            return await receive(call)
        except (grpc.aio.AioRpcError, ValueError, ConnectionError) as exc:
            raise self._failed(rank, f"read its slice ({method}) from", exc) from exc

    def slice_request(self, request: Any, **fields: Any) -> Any:
        """A copy of ``request`` asking a shard for its float32 slice."""
        out = type(request)()
        out.CopyFrom(request)
        out.dtype = tpb.WIRE_DTYPE_FLOAT32
        out.shard_slice = True
        out.max_receive_message_bytes = 0
        for name, value in fields.items():
            setattr(out, name, value)
        return out


async def receive(call: Any) -> dict[str, torch.Tensor]:
    """The tensors of a GetJob or GetModel stream (header, chunks, trailer; CRC checked)."""
    decoder = None
    async for msg in call:
        kind = msg.WhichOneof("kind")
        if kind == "header":
            sizes = {t.name: int(t.numel) for t in msg.header.tensors}
            slot = StagingSlot(sum(sizes.values()))
            decoder = Decoder(slot, sizes, P.wire_dtype(msg.header.dtype), MAX_CHUNK_BYTES)
        elif kind == "chunk":
            if decoder is None:
                raise ConnectionError("a chunk before the header")
            decoder.feed(msg.chunk.tensor, msg.chunk.offset, msg.chunk.data)
        elif kind == "trailer":
            if decoder is None:
                raise ConnectionError("a trailer before the header")
            views = decoder.finish(msg.trailer.crc32c, msg.trailer.payload_bytes)
            return {name: v.clone() for name, v in views.items()}
    raise ConnectionError("the stream ended before its trailer")


def _encoding_of(flat: torch.Tensor, dtype: WireDtype) -> tuple[Encoding, int]:
    """The smallest encoding of a slice in the wire ``dtype``, as the Python client picks it (a
    slice with no zero among ~1024 strided samples is dense without counting)."""
    step = max(1, flat.numel() // 1024)
    if flat.numel() == 0 or bool((flat[::step] != 0).all()):
        return Encoding.DENSE, flat.numel()
    nnz = int(torch.count_nonzero(flat))
    return choose_encoding(flat.numel(), nnz, dtype), nnz


def _relay_error(err: BaseException, refusal: StrategyError, missing: bool) -> bool:
    """Whether a forward's error ``err`` is its own (its slice never got there), not the
    refusal every shard answered."""
    if not isinstance(err, grpc.aio.AioRpcError):
        return True
    if missing:  # the vote's words for a missing slice, or a shard's own refusal of it
        return SLICE_MISSING_TEXT not in (err.details() or "")
    return err.code() != strategy_code(refusal)
