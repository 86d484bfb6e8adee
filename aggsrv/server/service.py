"""The `aggsrv.v1.Aggregation` gRPC service (grpc.aio) in front of the federation.

Every bad input is answered with the status that docs/wire.md "Status codes" lists for it before
anything reaches the strategy: an update is decoded into a staging slot and validated there (length,
dtype, CRC-32C, NaN/Inf, its header against the job) and only then handed to the aggregation loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

import grpc
import torch
from google.protobuf import message_factory

from aggsrv import protocol as P
from aggsrv.layout import LayoutMismatchError, ModelLayout
from aggsrv.server.auth import (
    ID_PATTERN,
    ROLE_ADMIN,
    Authenticator,
    AuthError,
    NoAuth,
    Principal,
    bearer_token,
)
from aggsrv.server.federation import DurabilityError, Federation, payload_sizes, staging_slot
from aggsrv.server.limits import RateLimiter
from aggsrv.strategies import (
    Job,
    Strategy,
    StrategyError,
    Update,
)
from aggsrv.transport import CodecError, Decoder, StagingSlot, WireDtype
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb

log = logging.getLogger(__name__)

SC = grpc.StatusCode


def strategy_code(exc: StrategyError) -> grpc.StatusCode:
    """The status a strategy's refusal is answered with: the one its class names (subclasses
    included, e.g. NonFiniteResult is an InvalidUpdate: INVALID_ARGUMENT)."""
    return SC[exc.code]


JOB_STATES = {
    "current": pb.JOB_STATE_CURRENT,
    "completed": pb.JOB_STATE_COMPLETED,
    "superseded": pb.JOB_STATE_SUPERSEDED,
    "unknown": pb.JOB_STATE_UNKNOWN,
}
UPLOAD_DTYPES = [P.WIRE_TO_PB[d] for d in WireDtype]


LABEL_BYTES = 256  # each label key and value
# The rate limiter's key suffix for GetJob calls (ids never contain a space).
JOB_BUCKET = " job"
JOB_ID = re.compile(r"[1-9][0-9]{0,18}")  # how the server writes job ids (str of an int >= 1)
SERVICE = pb.DESCRIPTOR.services_by_name["Aggregation"]
# A client that declares no receive limit has gRPC's default (ClientCapabilities).
DEFAULT_RECEIVE_BYTES = 4 << 20
# Room a chunk leaves for the rest of its message (tensor.proto: at least 64 bytes).
CHUNK_HEADROOM = 64
# The smallest receive limit a client may declare: a chunk and the stream headers must fit.
MIN_RECEIVE_BYTES = 1024
UNPARSEABLE = "the request bytes are not a valid"
UNPARSEABLE_LOG_SECONDS = 60.0


class Unparseable:
    """What the service's request deserializer hands over for bytes protobuf refused: the
    handler answers INVALID_ARGUMENT (grpc would answer UNKNOWN and log a traceback per call)."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    @property
    def details(self) -> str:
        return f"{UNPARSEABLE} {self.type_name} message (protobuf could not parse them)"


def tolerant_parser(message_cls: type) -> Callable[[bytes], object]:
    """A request deserializer that never raises: the message, or an :class:`Unparseable`."""
    name = message_cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> object:
        try:
            return message_cls.FromString(data)
        except Exception:  # DecodeError, or whatever else hostile bytes make protobuf raise
            return Unparseable(name)

    return parse


class OncePerInterval:
    """Bounds a log line per key (a peer) to one per interval; counts what it held back."""

    def __init__(self, interval: float, max_keys: int = 4096, clock=time.monotonic) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self.clock = clock
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def __call__(self, key: str) -> int | None:
        """None: stay quiet; else how many lines for `key` were held back since the last one."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval:
            self._last[key] = (last[0], last[1] + 1)
            return None
        self._last[key] = (now, 0)
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return 0 if last is None else last[1]


def peer_host(peer: str) -> str:
    """The caller's address without its port ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7"): one
    key per host, however many connections it opens."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer


class AggregationService(pb_grpc.AggregationServicer):
    """Handlers of the eight calls; state lives in :class:`Federation`."""

    def __init__(
        self,
        federation: Federation,
        authenticator: Authenticator | None = None,
        on_shutdown: Callable[[float], None] | None = None,
    ) -> None:
        self.fed = federation
        self.auth = authenticator if authenticator is not None else NoAuth()
        self.on_shutdown = on_shutdown
        cfg = federation.config
        self.rate = RateLimiter(
            cfg.rate_limit_per_second, cfg.rate_limit_burst, max_keys=4 * cfg.max_clients + 64
        )
        self._adopting = asyncio.Lock()  # one initial-model upload at a time
        self._unparseable_log = OncePerInterval(UNPARSEABLE_LOG_SECONDS)
        # The receive limit each client declared at registration (0: none declared).
        self._receive_limits: dict[str, int] = {}

    # ------------------------------------------------------------------ auth and limits

    async def _authorize(
        self, context: grpc.aio.ServicerContext, client_id: str | None = None, admin: bool = False
    ) -> Principal | None:
        """Check the call's bearer token: UNAUTHENTICATED without valid credentials,
        PERMISSION_DENIED for a token of another client or a client token on an operator call.
        Returns None when authentication is off."""
        if self.auth.mode == "none":
            return None
        try:
            principal = self.auth.authenticate(bearer_token(context.invocation_metadata()))
        except AuthError as exc:
            self.fed.metrics.auth_failures.labels(code=exc.code_name).inc()
            log.warning(
                "refused credentials: %s", exc,
                extra={"event": "auth", "outcome": exc.code_name, "peer": context.peer()},
            )  # fmt: skip
            await context.abort(SC[exc.code_name], str(exc))
        assert principal is not None
        denied = None
        if admin and principal.role != ROLE_ADMIN:
            denied = "this call needs an admin token"
        elif client_id is not None and not principal.may_act_as(client_id):
            denied = (
                f"the token is for {principal.role} {principal.subject!r}; it may not act as "
                f"client {client_id!r}"
            )
        if denied is not None:
            self.fed.metrics.auth_failures.labels(code="PERMISSION_DENIED").inc()
            log.warning(denied, extra={"event": "auth", "outcome": "PERMISSION_DENIED"})
            await context.abort(SC.PERMISSION_DENIED, denied)
        return principal

    async def _check_id(self, what: str, value: str, context: grpc.aio.ServicerContext) -> None:
        if not ID_PATTERN.fullmatch(value):
            shown = value if len(value) <= 40 else value[:40] + "..."
            await self._abort(
                context,
                SC.INVALID_ARGUMENT,
                f"{what} {shown!r} is not 1 to 128 characters of [A-Za-z0-9._:@-]",
            )

    async def _check_rate(
        self, client_id: str, context: grpc.aio.ServicerContext, bucket: str = ""
    ) -> None:
        wait = self.rate.allow(client_id + bucket)
        if wait > 0:
            self.fed.metrics.rate_limited.inc()
            what = " for GetJob" if bucket == JOB_BUCKET else ""
            await self._abort(
                context,
                SC.RESOURCE_EXHAUSTED,
                f"client {client_id!r} is over its rate limit{what} "
                f"({self.fed.config.rate_limit_per_second:g} calls/s, burst "
                f"{self.fed.config.rate_limit_burst}); retry in {wait:.2f} s",
            )

    async def _next_message(self, stream: AsyncIterator, context: grpc.aio.ServicerContext):
        """The stream's next message (None at its end); an upload that stalls longer than
        upload_idle_timeout_seconds is cut with DEADLINE_EXCEEDED, freeing its slot."""
        timeout = self.fed.config.upload_idle_timeout_seconds
        try:
            msg = await asyncio.wait_for(anext(stream, None), timeout)
        except TimeoutError:
            await self._abort(
                context,
                SC.DEADLINE_EXCEEDED,
                f"the upload sent nothing for {timeout:g} s (upload_idle_timeout_seconds); "
                "send the update again",
            )
        if isinstance(msg, Unparseable):
            await self.refuse_unparseable(msg, context)
        return msg

    async def refuse_unparseable(
        self, request: Unparseable, context: grpc.aio.ServicerContext
    ) -> None:
        """INVALID_ARGUMENT for bytes that do not parse; one log line per peer and interval, so
        a flood of them cannot fill the log."""
        await self._authorize(context)  # a caller without credentials learns nothing
        peer = peer_host(context.peer() or "unknown peer")
        held_back = self._unparseable_log(peer)
        if held_back is not None:
            log.warning(
                "unparseable %s from %s refused (INVALID_ARGUMENT)%s; further ones from this "
                "peer are logged at most once per %g s",
                request.type_name, peer,
                f", {held_back} more since the last such line" if held_back else "",
                self._unparseable_log.interval,
                extra={"event": "unparseable", "peer": peer, "outcome": "INVALID_ARGUMENT"},
            )  # fmt: skip
        await context.abort(SC.INVALID_ARGUMENT, request.details)

    # ------------------------------------------------------------------ helpers

    async def _abort(self, context: grpc.aio.ServicerContext, code: SC, message: str) -> None:
        # Refusals of updates are counted by PushUpdate (StatusResponse counts updates only).
        await context.abort(code, message)

    async def _check_open(self, context: grpc.aio.ServicerContext) -> None:
        if self.fed.failure is not None:
            await context.abort(
                SC.UNAVAILABLE, f"the server stopped taking writes: {self.fed.failure}"
            )
        if self.fed.closing:
            await context.abort(SC.UNAVAILABLE, "server is shutting down; retry elsewhere/later")

    def _shard_map(self) -> pb.ShardMap | None:
        """Where each slice is served (None: a single server, or no model yet)."""
        shards = self.fed.shards
        if shards is None or shards.shard_map is None:
            return None
        return pb.ShardMap(
            shards=[
                pb.ShardInfo(rank=r, address=shards.addresses[r], begin=b, end=e)
                for r, (b, e) in enumerate(map(shards.shard_map.slice, range(shards.world_size)))
            ]
        )

    async def _require_coordinator(self, what: str, context: grpc.aio.ServicerContext) -> None:
        shards = self.fed.shards
        if shards is not None and not shards.is_coordinator:
            await context.abort(
                SC.FAILED_PRECONDITION,
                f"this is shard {shards.rank} of {shards.world_size} of a sharded server: {what} "
                f"goes to rank 0 at {shards.addresses[0]}",
            )

    async def _require_model(self, context: grpc.aio.ServicerContext) -> None:
        if self.fed.strategy is None:
            await context.abort(
                SC.FAILED_PRECONDITION,
                "server has no model yet: the first client must register with initial weights",
            )

    async def _require_client(self, client_id: str, context: grpc.aio.ServicerContext) -> None:
        if client_id not in self.fed.clients:
            await self._abort(
                context, SC.NOT_FOUND, f"unknown client {client_id!r}: call Register first"
            )

    async def _require_hash(self, layout_hash: str, context: grpc.aio.ServicerContext) -> None:
        layout = self.fed.layout
        assert layout is not None
        if layout_hash != layout.hash:
            await self._abort(
                context,
                SC.FAILED_PRECONDITION,
                f"layout hash {layout_hash[:16]!r}... does not match the server's model "
                f"({layout.hash[:16]}...): the client's model has other tensor names or shapes",
            )

    async def _require_same_buffers(
        self, layout: ModelLayout, context: grpc.aio.ServicerContext
    ) -> None:
        """The layout hash covers the trainable tensors only; the float buffers must match too."""
        ours = self.fed.layout
        assert ours is not None
        ours = ours.whole  # a shard compares the whole model's
        mine = list(zip(ours.buffer_names, ours.buffer_shapes, strict=True))
        theirs = list(zip(layout.buffer_names, layout.buffer_shapes, strict=True))
        if mine != theirs:
            await self._abort(
                context,
                SC.FAILED_PRECONDITION,
                f"the client's float buffers ({len(theirs)} tensors, {layout.buffer_numel} "
                f"elements) differ from the server's model ({len(mine)} tensors, "
                f"{ours.buffer_numel} elements): the client runs another model architecture",
            )

    def _limits(self, chunk_bytes: int | None = None) -> pb.ServerLimits:
        """The server's limits; ``chunk_bytes`` the size negotiated with one client (None: as
        configured)."""
        cfg = self.fed.config
        strategy = self.fed.strategy
        limits = pb.ServerLimits(
            chunk_bytes=cfg.chunk_bytes if chunk_bytes is None else chunk_bytes,
            max_concurrent_uploads=cfg.max_concurrent_uploads,
            max_receive_message_bytes=cfg.max_receive_message_bytes,
            upload_dtypes=UPLOAD_DTYPES,
            lease=P.duration(cfg.lease_seconds),
            remembered_update_ids=1024,
            max_clients=cfg.max_clients,
        )
        settings = strategy.config if strategy is not None else cfg.strategy_settings()
        bound = getattr(settings, "max_staleness", None)
        if bound is not None:
            limits.max_staleness = bound
        return limits

    async def _check_receive_limit(
        self, limit: int, field: str, context: grpc.aio.ServicerContext
    ) -> None:
        if 0 < limit < MIN_RECEIVE_BYTES:
            await self._abort(
                context,
                SC.INVALID_ARGUMENT,
                f"{field} {limit} is too small: a chunk {CHUNK_HEADROOM} bytes below it and the "
                f"stream's headers must fit; declare at least {MIN_RECEIVE_BYTES} (0: gRPC's "
                "default of 4 MiB)",
            )

    def _chunk_bytes_for(self, client_id: str, requested_limit: int = 0) -> int:
        """The chunk size of what the server sends `client_id`: the configured one, kept
        CHUNK_HEADROOM bytes below the smallest receive limit the client stated (in this request
        or at registration; none: gRPC's default), in whole 4-byte elements."""
        stated = [n for n in (requested_limit, self._receive_limits.get(client_id, 0)) if n]
        limit = min(stated) if stated else DEFAULT_RECEIVE_BYTES
        return min(self.fed.config.chunk_bytes, (limit - CHUNK_HEADROOM) // 4 * 4)

    async def _decode(
        self,
        stream: AsyncIterator,
        slot: StagingSlot,
        infos: list[tpb.TensorInfo],
        expected: dict[str, int],
        dtype: WireDtype,
        context: grpc.aio.ServicerContext,
    ) -> dict[str, torch.Tensor]:
        """Read chunks then the trailer of a stream into `slot`; abort with the table's code."""
        declared = {i.name: int(i.numel) for i in infos}
        if declared != expected:
            await self._abort(
                context,
                SC.INVALID_ARGUMENT,
                f"the stream must carry exactly {expected} (name: elements), header says "
                f"{declared}",
            )
        try:
            sparse = P.sparse_infos(infos)
        except ValueError as exc:
            await self._abort(context, SC.INVALID_ARGUMENT, str(exc))
        try:
            decoder = Decoder(slot, expected, dtype, self.fed.config.chunk_bytes, sparse=sparse)
            while (msg := await self._next_message(stream, context)) is not None:
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    chunk = msg.chunk
                    decoder.feed(chunk.tensor, chunk.offset, chunk.data)
                elif kind == "trailer":
                    if await self._next_message(stream, context) is not None:
                        await self._abort(
                            context,
                            SC.INVALID_ARGUMENT,
                            "a message followed the trailer: the trailer must be the last "
                            "message of the stream",
                        )
                    self.fed.metrics.received_bytes.inc(decoder.bytes_received)
                    return decoder.finish(msg.trailer.crc32c, msg.trailer.payload_bytes)
                else:
                    await self._abort(
                        context, SC.INVALID_ARGUMENT, f"unexpected {kind!r} message in the stream"
                    )
        except CodecError as exc:
            await self._abort(context, SC[exc.grpc_code_name], str(exc))
        await self._abort(
            context, SC.DATA_LOSS, "stream ended before its trailer: the upload was cut off"
        )
        raise AssertionError("unreachable")  # abort raises

    # ------------------------------------------------------------------ Register

    async def Register(self, request_iterator, context):  # noqa: N802 - gRPC method name
        try:
            return await self._register(request_iterator, context)
        except DurabilityError as exc:
            await context.abort(SC.UNAVAILABLE, f"the server stopped taking writes: {exc}")

    async def _register(self, request_iterator, context) -> pb.RegisterResponse:
        await self._check_open(context)
        first = await self._next_message(request_iterator, context)
        if first is None or first.WhichOneof("kind") != "header":
            await self._abort(context, SC.INVALID_ARGUMENT, "Register must start with a header")
        header = first.header
        # Credentials first: without them a caller learns nothing, not even what is malformed.
        await self._authorize(context, header.client_id)
        await self._require_coordinator("Register", context)
        await self._check_id("client_id", header.client_id, context)
        await self._check_rate(header.client_id, context)
        await self._check_labels(header.labels, context)
        receive_limit = int(header.capabilities.max_receive_message_bytes)
        await self._check_receive_limit(
            receive_limit, "capabilities.max_receive_message_bytes", context
        )
        try:
            layout = P.layout_from_pb(header.layout)
        except (ValueError, LayoutMismatchError) as exc:
            await self._abort(context, SC.INVALID_ARGUMENT, f"bad layout: {exc}")
        if header.layout_hash != layout.hash:
            await self._abort(
                context,
                SC.INVALID_ARGUMENT,
                f"layout_hash {header.layout_hash!r} is not the SHA-256 of the layout sent "
                f"({layout.hash})",
            )
        fed = self.fed
        adopted = False
        if fed.strategy is None:
            adopted = await self._adopt(header, layout, request_iterator, context)
        if not adopted:
            await self._require_hash(header.layout_hash, context)
            await self._require_same_buffers(layout, context)
            await self._check_offered_weights(header, request_iterator, context)
        if header.client_id not in fed.clients and len(fed.clients) >= fed.config.max_clients:
            await self._abort(
                context,
                SC.RESOURCE_EXHAUSTED,
                f"max_clients={fed.config.max_clients} clients are registered already",
            )
        strategy = fed.strategy
        try:
            known, record = await fed.register(header.client_id, dict(header.labels))
        except StrategyError as exc:
            await self._abort(context, strategy_code(exc), str(exc))
        self._receive_limits[header.client_id] = receive_limit
        fed.touch(header.client_id)
        fed.notify()
        log.info(
            "client %s registered%s", header.client_id, " (model adopted)" if adopted else "",
            extra={"event": "register", "client_id": header.client_id, "version": fed.version,
                   "outcome": "adopted" if adopted else ("known" if known else "new")},
        )  # fmt: skip
        return pb.RegisterResponse(
            client_id=header.client_id,
            known_before=known,
            initial_model_adopted=adopted,
            model_version=fed.published_version,
            layout_hash=layout.hash,
            strategy=strategy.name,
            limits=self._limits(self._chunk_bytes_for(header.client_id)),
            lease_expires=P.timestamp(record.lease_expires),
            next_heartbeat=P.duration(fed.config.lease_seconds / 3),
            shard_map=self._shard_map(),
        )

    async def _adopt(
        self,
        header: pb.RegisterHeader,
        layout: ModelLayout,
        stream: AsyncIterator,
        context: grpc.aio.ServicerContext,
    ) -> bool:
        """Read the first model offered and make it version 0; False if another registration
        adopted one meanwhile (this one's weights are then checked like any late offer)."""
        fed = self.fed
        if not header.initial_tensors:
            await self._abort(
                context,
                SC.FAILED_PRECONDITION,
                "server has no model yet: register with initial weights (initial_tensors)",
            )
        need = 4 * (layout.numel + layout.buffer_numel)
        if need > fed.config.max_model_bytes:
            await self._abort(
                context,
                SC.RESOURCE_EXHAUSTED,
                f"the offered model needs {need} bytes, over max_model_bytes="
                f"{fed.config.max_model_bytes}",
            )
        try:
            dtype = P.wire_dtype(header.initial_dtype, "initial_dtype")
        except ValueError as exc:
            await self._abort(context, SC.INVALID_ARGUMENT, str(exc))
        async with self._adopting:  # one model-sized allocation at a time
            if fed.strategy is not None:
                return False
            decoded = await self._decode(
                stream, staging_slot(layout), list(header.initial_tensors),
                payload_sizes(layout, "weights"), dtype, context,
            )  # fmt: skip
            try:
                # On the aggregation thread: a sharded server announces the model to the shards.
                await fed.call(
                    fed.adopt, layout, decoded["weights"], decoded.get("buffers"),
                    refusals=(ValueError, OSError),
                )  # fmt: skip
            except DurabilityError as exc:
                await context.abort(SC.UNAVAILABLE, f"the server stopped taking writes: {exc}")
            except ValueError as exc:  # e.g. a negative running_var in the initial model
                await self._abort(context, SC.INVALID_ARGUMENT, f"initial model: {exc}")
            except OSError as exc:
                fed.fail(f"could not write the first checkpoint: {exc}")
                await context.abort(SC.UNAVAILABLE, fed.failure or str(exc))
            return True

    async def _check_labels(self, labels, context: grpc.aio.ServicerContext) -> None:
        limit = self.fed.config.max_labels
        if len(labels) > limit:
            await self._abort(
                context, SC.INVALID_ARGUMENT, f"{len(labels)} labels, at most {limit} allowed"
            )
        for key, value in labels.items():
            if len(key.encode()) > LABEL_BYTES or len(value.encode()) > LABEL_BYTES:
                await self._abort(
                    context,
                    SC.INVALID_ARGUMENT,
                    f"label {key[:40]!r}: keys and values are at most {LABEL_BYTES} bytes",
                )

    async def _check_offered_weights(
        self, header: pb.RegisterHeader, stream: AsyncIterator, context: grpc.aio.ServicerContext
    ) -> None:
        """A server with a model reads and discards offered weights after checking them (a
        corrupt stream is refused like any other); the staging slots bound the memory."""
        if not header.initial_tensors:
            msg = await self._next_message(stream, context)
            if msg is not None and msg.WhichOneof("kind") == "trailer":
                # The wire contract accepts an empty trailer (crc32c 0) after a bare header.
                if msg.trailer.crc32c or msg.trailer.payload_bytes:
                    await self._abort(
                        context,
                        SC.INVALID_ARGUMENT,
                        "a Register without initial_tensors may end with an empty trailer only "
                        f"(crc32c 0, payload_bytes 0), got crc32c {msg.trailer.crc32c} and "
                        f"payload_bytes {msg.trailer.payload_bytes}",
                    )
                msg = await self._next_message(stream, context)
            if msg is not None:
                await self._abort(
                    context,
                    SC.INVALID_ARGUMENT,
                    "Register sent tensor messages but its header announces no initial_tensors",
                )
            return
        try:
            dtype = P.wire_dtype(header.initial_dtype, "initial_dtype")
        except ValueError as exc:
            await self._abort(context, SC.INVALID_ARGUMENT, str(exc))
        fed = self.fed
        whole = fed.layout.whole
        if whole is not fed.layout:  # a shard's staging slots hold a slice, not a model
            async with fed.whole_model_slot() as slot:
                await self._decode(
                    stream, slot, list(header.initial_tensors), payload_sizes(whole, "weights"),
                    dtype, context,
                )  # fmt: skip
            return
        slot = await fed.acquire_slot()
        try:
            await self._decode(
                stream, slot, list(header.initial_tensors), payload_sizes(fed.layout, "weights"),
                dtype, context,
            )  # fmt: skip
        finally:
            fed.release_slot(slot)

    # ------------------------------------------------------------------ GetJob

    async def GetJob(self, request, context):  # noqa: N802
        await self._check_open(context)
        # Credentials first: without them a caller learns nothing, not even what is malformed.
        await self._authorize(context, request.client_id)
        await self._check_id("client_id", request.client_id, context)
        await self._require_model(context)
        fed = self.fed
        if not fed.follower:  # a shard waits for rank 0's registration below
            await self._require_client(request.client_id, context)
        # Each call costs a token, however long it then waits for a job (its own bucket, so
        # asking for jobs does not eat into the client's budget for pushes).
        await self._check_rate(request.client_id, context, JOB_BUCKET)
        await self._require_hash(request.layout_hash, context)
        try:
            dtype = P.requested_dtype(request.dtype)
        except ValueError as exc:
            await self._abort(context, SC.INVALID_ARGUMENT, str(exc))
        await self._check_receive_limit(
            request.max_receive_message_bytes, "max_receive_message_bytes", context
        )
        chunk_bytes = self._chunk_bytes_for(request.client_id, request.max_receive_message_bytes)
        job = None
        if request.job_id or fed.follower:
            job = await self._issued_job(request, context)
        while job is None:
            fed.touch(request.client_id)
            try:
                job = await fed.next_job(request.client_id)
            except StrategyError as exc:
                await self._abort(context, strategy_code(exc), str(exc))
            except DurabilityError as exc:
                await context.abort(SC.UNAVAILABLE, f"the server stopped taking writes: {exc}")
            if job is not None:
                break
            if fed.closing:
                await self._check_open(context)
            # Nothing yet: keep the stream open, tell the client why, wait for a change.
            yield pb.JobMessage(
                pending=pb.JobPending(
                    reason="waiting for the strategy", model_version=fed.published_version
                )
            )
            await fed.wait_for_change(fed.config.pending_interval_seconds)
        header = pb.JobHeader(
            job_id=str(job.job_id),
            client_id=job.client_id,
            base_version=job.base_version,
            layout_hash=fed.layout.hash,
            recipe=P.recipe_to_pb(job.recipe),
            dtype=P.WIRE_TO_PB[dtype],
            tensors=P.tensor_infos(job.tensors),
            update_kind=pb.UPDATE_KIND_DELTA,
            upload_dtype=P.WIRE_TO_PB[WireDtype.FLOAT32],
            send_buffers=fed.layout.whole.buffer_numel > 0,
        )
        if job.deadline is not None:
            header.deadline.CopyFrom(P.timestamp(job.deadline))
            header.time_budget.CopyFrom(P.duration(job.deadline - fed.clock()))
        tensors = await fed.job_on_host(job)  # a device model: its version's one host copy
        yield pb.JobMessage(header=header)
        fed.metrics.sent_bytes.inc(_payload_bytes(tensors, dtype))
        for msg in P.chunk_stream(tensors, dtype, chunk_bytes, pb.JobMessage):
            yield msg

    async def _issued_job(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext):
        """A shard of rank >= 1: the job rank 0 issued (request.job_id), once this shard has
        made the same call; its tensors are this shard's slices."""
        fed = self.fed
        shards = fed.shards
        if not fed.follower:
            await self._abort(
                context,
                SC.INVALID_ARGUMENT,
                "job_id is for the shards of rank >= 1 of a sharded server; this server issues "
                "the next job itself: leave job_id empty",
            )
        if not request.job_id:
            await self._require_coordinator("a new job (GetJob without job_id)", context)
        job_id = _job_number(request.job_id)
        if job_id is None:
            await self._abort(
                context, SC.INVALID_ARGUMENT, f"job_id {request.job_id[:40]!r} is not a job id"
            )
        loop = asyncio.get_running_loop()
        give_up = loop.time() + shards.order_wait
        while True:
            job, issued, state = await fed.read(_issued, fed.strategy, request.client_id, job_id)
            if fed.failure is not None:
                await self._check_open(context)
            if job is not None:
                return job
            if job_id <= issued:
                if state == "unknown":
                    await self._abort(
                        context, SC.NOT_FOUND,
                        f"job {job_id} was not issued to client {request.client_id!r}",
                    )  # fmt: skip
                await self._abort(
                    context, SC.ABORTED, f"job {job_id} is no longer open ({state}): get a new one"
                )  # fmt: skip
            left = give_up - loop.time()
            if left <= 0:
                await self._abort(
                    context,
                    SC.DEADLINE_EXCEEDED,
                    f"rank 0 has not issued job {job_id} to this shard within "
                    f"{shards.order_wait:g} s (shard_order_wait_seconds)",
                )
            await fed.wait_for_change(min(left, 1.0))

    # ------------------------------------------------------------------ PushUpdate

    async def PushUpdate(self, request_iterator, context):  # noqa: N802
        seen: dict[str, pb.UpdateHeader] = {}  # the header, once read (for the refusal's log)
        try:
            return await self._push_update(request_iterator, context, seen)
        except DurabilityError as exc:
            await context.abort(SC.UNAVAILABLE, f"the server stopped taking writes: {exc}")
        except grpc.aio.AbortError:
            code = context.code()
            # UNAVAILABLE (shutting down) says nothing about the update: the client retries it.
            if code is not None and code != SC.UNAVAILABLE:
                self.fed.reject(code.name)
                self.fed.metrics.record_update(code.name)
                self._log_refusal(seen.get("header"), code, context)
            raise

    def _log_refusal(
        self, h: pb.UpdateHeader | None, code: SC, context: grpc.aio.ServicerContext
    ) -> None:
        """One structured line per refused update; ids only when well-formed (no log injection).
        Unparseable bytes have their own line, bounded per peer (refuse_unparseable)."""
        if str(context.details() or "").startswith(UNPARSEABLE):
            return
        client_id = h.client_id if h is not None and ID_PATTERN.fullmatch(h.client_id) else None
        update_id = h.update_id if h is not None and ID_PATTERN.fullmatch(h.update_id) else None
        log.info(
            "update %s of %s refused: %s: %s", update_id, client_id, code.name,
            str(context.details() or "")[:300],
            extra={"event": "update", "client_id": client_id, "update_id": update_id,
                   "version": self.fed.version, "outcome": code.name.lower()},
        )  # fmt: skip

    async def _push_update(
        self, request_iterator, context, seen: dict[str, pb.UpdateHeader]
    ) -> pb.PushUpdateResponse:
        await self._check_open(context)
        await self._require_model(context)
        first = await self._next_message(request_iterator, context)
        if first is None or first.WhichOneof("kind") != "header":
            await self._abort(context, SC.INVALID_ARGUMENT, "PushUpdate must start with a header")
        h = first.header
        seen["header"] = h
        fed = self.fed
        # Credentials first: without them a caller learns nothing, not even what is malformed.
        await self._authorize(context, h.client_id)
        await self._check_id("client_id", h.client_id, context)
        await self._require_client(h.client_id, context)
        rank = fed.shards.rank if fed.shards is not None else 0
        if h.shard_rank != rank:
            await self._abort(
                context,
                SC.FAILED_PRECONDITION,
                f"this slice is for shard {h.shard_rank}; this server is "
                + (f"shard {rank}" if fed.shards is not None else "not sharded (shard_rank 0)"),
            )
        await self._check_rate(h.client_id, context)
        await self._require_hash(h.layout_hash, context)
        await self._check_id("update_id", h.update_id, context)
        kind = P.PB_TO_KIND.get(h.kind)
        if kind is None:
            await self._abort(context, SC.INVALID_ARGUMENT, "kind must be WEIGHTS or DELTA")
        try:
            dtype = P.wire_dtype(h.dtype, "dtype")
        except ValueError as exc:
            await self._abort(context, SC.INVALID_ARGUMENT, f"bad header: {exc}")
        job_id = _job_number(h.job_id)
        if job_id is None:
            await self._abort(
                context,
                SC.INVALID_ARGUMENT,
                f"job_id {h.job_id[:40]!r} is not a job id this server issued (the JobHeader's "
                "job_id, echoed exactly)",
            )
        fed.touch(h.client_id)
        key = (h.client_id, h.update_id)
        if key in fed.in_flight_updates:
            await self._abort(
                context, SC.ABORTED, f"update {h.update_id!r} is being uploaded on another stream"
            )
        fed.in_flight_updates.add(key)
        slot = None
        waiting = False
        try:
            slot = await fed.acquire_slot()
            fed.uploads_in_progress += 1
            views = await self._decode(
                request_iterator, slot, list(h.tensors), payload_sizes(fed.layout, "update"), dtype,
                context,
            )  # fmt: skip
            buffers = views.get("buffers")
            device = fed.strategy.device
            tensor = _on_device(views["update"], device)
            moved = None if buffers is None else _on_device(buffers, device)
            if tensor is not views["update"] or moved is not buffers:
                slot.fence(device)  # the copies may read the slot after they return
            update = Update(
                client_id=h.client_id,
                job_id=job_id,
                base_version=h.base_version,
                update_id=h.update_id,
                num_samples=int(h.num_samples),
                work_done=_work_done(h.work, fed.strategy.make_recipe().local_steps is not None),
                kind=kind,
                tensor=tensor,
                buffers=moved,
            )
            fed.updates_waiting += 1
            waiting = True
            try:
                if fed.follower:
                    staleness, outcome = await fed.apply_slice(update)
                else:
                    staleness, outcome = await fed.apply_update(update, views)
            except StrategyError as exc:
                await self._abort(context, strategy_code(exc), str(exc))
        finally:
            if waiting:
                fed.updates_waiting -= 1
            fed.in_flight_updates.discard(key)
            if slot is not None:
                fed.uploads_in_progress -= 1
                fed.release_slot(slot)
        label = "duplicate" if outcome.original is not None else outcome.status.name
        fed.metrics.record_update(label, None if outcome.original else max(0, staleness))
        log.info(
            "update %s of %s: %s at v%d (staleness %d)",
            h.update_id, h.client_id, label.lower(), outcome.version, staleness,
            extra={"event": "update", "client_id": h.client_id, "update_id": h.update_id,
                   "version": outcome.version, "outcome": label.lower(),
                   "staleness": staleness},
        )  # fmt: skip
        return pb.PushUpdateResponse(
            outcome=P.STATUS_TO_PB[outcome.status],
            version=outcome.version,
            original_outcome=P.STATUS_TO_PB.get(outcome.original, pb.OUTCOME_UNSPECIFIED),
            staleness=max(0, staleness),
            update_id=h.update_id,
        )

    # ------------------------------------------------------------------ GetModel

    async def GetModel(self, request, context):  # noqa: N802
        await self._authorize(context)
        await self._require_model(context)
        fed = self.fed
        if request.HasField("version") and fed.follower:
            await self._await_version(request.version)
        latest = fed.latest()
        if request.HasField("version"):
            if request.version > latest.version:
                await context.abort(
                    SC.OUT_OF_RANGE,
                    f"version {request.version} does not exist yet (latest {latest.version})",
                )
            snap = fed.snapshots.get(request.version)
            if snap is None:
                oldest = next(iter(fed.snapshots))
                await context.abort(
                    SC.NOT_FOUND,
                    f"version {request.version} is no longer retained (oldest {oldest})",
                )
        else:
            snap = latest
        try:
            dtype = P.requested_dtype(request.dtype)
        except ValueError as exc:
            await context.abort(SC.INVALID_ARGUMENT, str(exc))
        await self._check_receive_limit(
            request.max_receive_message_bytes, "max_receive_message_bytes", context
        )
        # client_id is not checked: naming another client can only make the chunks smaller.
        chunk_bytes = self._chunk_bytes_for(request.client_id, request.max_receive_message_bytes)
        # A device model: the version's one host copy, made off the event loop.
        tensors = await fed.on_host(snap, request.include_buffers)
        yield pb.ModelMessage(
            header=pb.ModelHeader(
                version=snap.version,
                latest_version=latest.version,
                layout_hash=fed.layout.hash,
                layout=P.layout_to_pb(fed.layout.whole),
                dtype=P.WIRE_TO_PB[dtype],
                tensors=P.tensor_infos(tensors),
                strategy=fed.strategy.name,
                created_at=P.timestamp(snap.created_at),
                shard_rank=fed.shards.rank if fed.shards is not None else 0,
            )
        )
        fed.metrics.sent_bytes.inc(_payload_bytes(tensors, dtype))
        for msg in P.chunk_stream(tensors, dtype, chunk_bytes, pb.ModelMessage):
            yield msg

    async def _await_version(self, version: int) -> None:
        """A shard of rank >= 1 asked for a version rank 0 published: wait until this shard has
        made the same calls (bounded; the caller then gets OUT_OF_RANGE)."""
        fed = self.fed
        loop = asyncio.get_running_loop()
        give_up = loop.time() + fed.shards.order_wait
        while fed.published_version < version and fed.failure is None and loop.time() < give_up:
            await fed.wait_for_change(min(1.0, give_up - loop.time()))

    # ------------------------------------------------------------------ Heartbeat, GetStatus

    async def Heartbeat(self, request, context):  # noqa: N802
        # Credentials first: without them a caller learns nothing, not even what is malformed.
        await self._authorize(context, request.client_id)
        await self._check_id("client_id", request.client_id, context)
        await self._require_client(request.client_id, context)
        fed = self.fed
        if fed.failure is not None:  # its job states may be half-changed: none is answered
            await context.abort(SC.UNAVAILABLE, f"the server stopped taking writes: {fed.failure}")
        fed.touch(request.client_id)
        record = fed.clients[request.client_id]
        resp = pb.HeartbeatResponse(
            lease_expires=P.timestamp(record.lease_expires),
            lease=P.duration(fed.config.lease_seconds),
            next_heartbeat=P.duration(fed.config.lease_seconds / 3),
            latest_version=fed.published_version,
            job_state=pb.JOB_STATE_UNSPECIFIED,
        )
        if request.job_id:
            resp.job_state = pb.JOB_STATE_UNKNOWN
            strategy = fed.strategy
            job_id = _job_number(request.job_id)
            if strategy is not None and job_id is not None:
                # On the aggregation thread: never beside a call that retires or issues jobs.
                state, deadline = await fed.read(_job_status, strategy, request.client_id, job_id)
                resp.job_state = JOB_STATES[state]
                if deadline is not None:
                    resp.job_deadline.CopyFrom(P.timestamp(deadline))
                    resp.job_time_left.CopyFrom(P.duration(deadline - fed.clock()))
        return resp

    async def GetStatus(self, request, context):  # noqa: N802
        await self._authorize(context)
        fed = self.fed
        resp = pb.StatusResponse(
            has_model=fed.strategy is not None,
            version=fed.published_version,
            strategy=fed.strategy.name if fed.strategy else fed.config.strategy,
            clients_known=len(fed.clients),
            clients_active=fed.active_clients(),
            updates_accepted=fed.counters["accepted"],
            updates_applied=fed.counters["applied"],
            updates_rejected=fed.counters["rejected"],
            updates_duplicate=fed.counters["duplicate"],
            rejected_by_code=dict(fed.rejected_by_code),
            queue_depth=fed.queue_depth(),
            uploads_in_progress=fed.uploads_in_progress,
            server_time=P.timestamp(fed.clock()),
            uptime=P.duration(fed.clock() - fed.started_at),
            durability="on" if fed.store is not None and fed.store.durable else "off",
            auth=self.auth.mode,
            wal_bytes=fed.store.wal_bytes() if fed.store is not None else 0,
        )
        if fed.last_checkpoint is not None:
            resp.last_checkpoint_version = fed.last_checkpoint[0]
            resp.last_checkpoint_time.CopyFrom(P.timestamp(fed.last_checkpoint[1]))
        if fed.last_eval is not None:
            resp.eval_version = fed.last_eval[0]
            resp.eval_metrics.update(fed.last_eval[1])
        if fed.strategy is not None:
            resp.cache_bytes = await fed.read(fed.cache_bytes)  # walks the strategy's state
        # Limits always: a client offering the initial model needs chunk_bytes before Register.
        resp.limits.CopyFrom(self._limits())
        if fed.shards is not None:
            resp.shard_rank = fed.shards.rank
            shard_map = self._shard_map()
            if shard_map is not None:
                resp.shard_map.CopyFrom(shard_map)
        if fed.strategy is not None:  # set last: the layout and the snapshots are ready
            resp.layout_hash = fed.layout.hash
            resp.numel = fed.layout.whole.numel
            resp.buffer_numel = fed.layout.whole.buffer_numel
            resp.oldest_retained_version = next(iter(fed.snapshots))
        return resp

    # ------------------------------------------------------------------ operator calls

    async def Checkpoint(self, request, context):  # noqa: N802
        await self._authorize(context, admin=True)
        fed = self.fed
        if fed.store is None:
            await context.abort(
                SC.FAILED_PRECONDITION, "the server has no state_dir: nowhere to checkpoint to"
            )
        await self._require_model(context)
        await self._check_open(context)
        try:
            info = await fed.checkpoint()
        except DurabilityError as exc:
            await context.abort(SC.UNAVAILABLE, f"the server stopped taking writes: {exc}")
        except OSError as exc:
            await context.abort(SC.INTERNAL, f"checkpoint failed: {exc}")
        log.info(
            "checkpoint on request: version %d", info.version,
            extra={"event": "checkpoint", "version": info.version, "outcome": "written"},
        )  # fmt: skip
        return pb.CheckpointResponse(
            version=info.version, path=str(info.path), bytes=info.bytes,
            took=P.duration(info.seconds),
        )  # fmt: skip

    async def Shutdown(self, request, context):  # noqa: N802
        await self._authorize(context, admin=True)
        grace = request.grace_seconds if request.grace_seconds > 0 else 5.0
        if self.on_shutdown is None:
            await context.abort(SC.UNIMPLEMENTED, "this server cannot be shut down remotely")
        log.warning("shutdown requested by an operator", extra={"event": "shutdown"})
        # After this answer is on its way: the handler must return before the server stops.
        asyncio.get_running_loop().call_later(0.05, self.on_shutdown, grace)
        return pb.ShutdownResponse(version=self.fed.published_version)


def _job_number(job_id: str) -> int | None:
    """The job a wire job id names: exactly the decimal string the server sent (no sign, spaces,
    leading zeros or non-ASCII digits, which int() would take); None for anything else."""
    return int(job_id) if JOB_ID.fullmatch(job_id) else None


def _job_status(strategy: Strategy, client_id: str, job_id: int) -> tuple[str, float | None]:
    """(aggregation thread) What Heartbeat says of a job: its state and, if it is the client's
    current job, its deadline."""
    state = strategy.job_state(client_id, job_id)
    job = strategy.outstanding_job(client_id) if state == "current" else None
    return state, job.deadline if job is not None else None


def _issued(strategy: Strategy, client_id: str, job_id: int) -> tuple[Job | None, int, str]:
    """(aggregation thread) A shard's view of a job rank 0 issued: the open job (None if not
    open here), how many jobs this shard has issued, and the job's state."""
    job = strategy.open_job(client_id, job_id)
    return job, strategy.jobs_issued, strategy.job_state(client_id, job_id)


def _work_done(work: pb.WorkDone, counts_steps: bool) -> float:
    """The work figure strategies compare with the recipe: steps or epochs, as it counts."""
    return float(work.steps) if counts_steps else float(work.epochs)


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device, non_blocking=True)


def _payload_bytes(tensors: dict[str, torch.Tensor], dtype: WireDtype) -> int:
    return sum(t.numel() for t in tensors.values()) * dtype.itemsize


def add_to_server(service: AggregationService, server: grpc.aio.Server) -> None:
    """Register the service's eight calls, as the generated add_AggregationServicer_to_server
    does, but with request deserializers that turn bytes protobuf refuses into an
    :class:`Unparseable` the handler answers with INVALID_ARGUMENT."""
    makers = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in SERVICE.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(service, method.name)
        if not method.client_streaming:  # streamed requests are checked as they are read
            behaviour = _refusing_unparseable(service, behaviour, method.server_streaming)
        handlers[method.name] = makers[method.client_streaming, method.server_streaming](
            behaviour,
            request_deserializer=tolerant_parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _refusing_unparseable(service: AggregationService, handler, streams: bool):
    """`handler` behind a check that refuses an unparseable request message."""
    if streams:

        async def stream_handler(request, context):
            if isinstance(request, Unparseable):
                await service.refuse_unparseable(request, context)
            inner = handler(request, context)
            try:
                async for msg in inner:
                    yield msg
            finally:  # a cancelled call closes the handler now, not when it is collected
                await inner.aclose()

        return stream_handler

    async def unary_handler(request, context):
        if isinstance(request, Unparseable):
            await service.refuse_unparseable(request, context)
        return await handler(request, context)

    return unary_handler
