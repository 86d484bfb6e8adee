"""The checks every request passes before a handler acts on it (aggsrv.server.service): the
caller's credentials and rate, ids and labels, the model and the client it names, the layout
hash, receive limits, and the decoding of an uploaded tensor stream into a staging slot. Each
refusal aborts the call with a status code and a message that says what to change.

A mixin of :class:`~aggsrv.server.service.AggregationService`, whose ``__init__`` sets the
state it uses (``fed``, ``auth``, ``rate``, ...).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import torch

from aggsrv import protocol as P
from aggsrv.layout import ModelLayout
from aggsrv.server.auth import (
    ID_PATTERN,
    ROLE_ADMIN,
    AuthError,
    Principal,
    bearer_token,
)
from aggsrv.server.disclosure import class_reason
from aggsrv.server.federation import payload_sizes
from aggsrv.strategies import StrategyError
from aggsrv.transport import CodecError, Decoder, DeviceCrossing, StagingSlot, WireDtype
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import tensor_pb2 as tpb

log = logging.getLogger("aggsrv.server.service")


SC = grpc.StatusCode
UPLOAD_DTYPES = [P.WIRE_TO_PB[d] for d in WireDtype]
LABEL_BYTES = 256  # each label key and value
# The rate limiter's key suffix for GetJob calls (ids never contain a space).
JOB_BUCKET = " job"
JOB_ID = re.compile(r"[1-9][0-9]{0,18}")  # how the server writes job ids (str of an int >= 1)
# A client that declares no receive limit has gRPC's default (ClientCapabilities).
DEFAULT_RECEIVE_BYTES = 4 << 20
# Room a chunk leaves for the rest of its message (tensor.proto: at least 64 bytes).
CHUNK_HEADROOM = 64
# The smallest receive limit a client may declare: a chunk and the stream headers must fit.
MIN_RECEIVE_BYTES = 1024
UNPARSEABLE = "the request bytes are not a valid"
UNPARSEABLE_LOG_SECONDS = 60.0


# Why the current call was refused: a word from a fixed set (the check that failed, or the
# refusing exception's class), never the caller's text, so a metric label stays bounded. Each
# gRPC call runs in its own task, with its own copy of this variable.
REFUSAL_REASON: contextvars.ContextVar[str] = contextvars.ContextVar("refusal", default="request")
# PushUpdate's count of a refusal, (code, reason) -> None: called by _abort before the status
# goes out, so a client that reads the status after its refusal finds it counted.
COUNT_REFUSAL: contextvars.ContextVar[Any] = contextvars.ContextVar("count_refusal", default=None)


def reason_of(exc: BaseException) -> str:
    """A refusing exception's class as a reason: NonFiniteResult -> non_finite_result (each
    one classified public or data-dependent in aggsrv.server.disclosure)."""
    return class_reason(type(exc))


def strategy_code(exc: StrategyError) -> grpc.StatusCode:
    """The status a strategy's refusal is answered with: the one its class names (subclasses
    included, e.g. NonFiniteResult is an InvalidUpdate: INVALID_ARGUMENT)."""
    return SC[exc.code]


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


def _job_number(job_id: str) -> int | None:
    """The job a wire job id names: exactly the decimal string the server sent (no sign, spaces,
    leading zeros or non-ASCII digits, which int() would take); None for anything else."""
    return int(job_id) if JOB_ID.fullmatch(job_id) else None


class RequestChecks:
    """The checks of a request; each aborts the call when the request fails it."""

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
            REFUSAL_REASON.set("credentials")
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
            REFUSAL_REASON.set("permission")
            await context.abort(SC.PERMISSION_DENIED, denied)
        return principal

    async def _check_id(self, what: str, value: str, context: grpc.aio.ServicerContext) -> None:
        if not ID_PATTERN.fullmatch(value):
            shown = value if len(value) <= 40 else value[:40] + "..."
            await self._abort(
                context,
                SC.INVALID_ARGUMENT,
                f"{what} {shown!r} is not 1 to 128 characters of [A-Za-z0-9._:@-]",
                reason="bad_id",
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
                reason="rate_limited",
            )

    async def _next_message(self, stream: AsyncIterator, context: grpc.aio.ServicerContext):
        """The stream's next message (None at its end); an upload that stalls longer than
        upload_idle_timeout_seconds is cut with DEADLINE_EXCEEDED, freeing its slot."""
        timeout = self.fed.config.upload_idle_timeout_seconds
        try:
            # asyncio.timeout, not wait_for: wait_for wraps every message in a new task.
            async with asyncio.timeout(timeout):
                msg = await anext(stream, None)
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

    async def _abort(
        self, context: grpc.aio.ServicerContext, code: SC, message: str, reason: str = "request"
    ) -> None:
        # Refusals of updates are counted by PushUpdate (StatusResponse counts updates only),
        # by code and REFUSAL_REASON.
        REFUSAL_REASON.set(reason)
        count = COUNT_REFUSAL.get()
        if count is not None:
            count(code, reason)
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
                context,
                SC.NOT_FOUND,
                f"unknown client {client_id!r}: call Register first",
                reason="unknown_client",
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
                reason="layout_mismatch",
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
        settings = strategy.config if strategy is not None else cfg.strategy_settings
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
        stats: dict[str, float] | None = None,
        reference: Any = None,
        exact_norm: bool = False,
        refuse_non_finite: bool = True,
        upload_log: Any = None,
        quantizable: tuple[str, ...] = (),
        keep_quantized: bool = False,
        crossing: DeviceCrossing | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read chunks then the trailer of a stream into `slot`; abort with the table's code.
        ``upload_log`` (aggsrv.server.upload_log.UploadLog): where the decoded bytes are logged
        as they arrive. ``quantizable``: the quantizations the "update" tensor may be sent in
        (the job's recipe's); any other quantized tensor is refused. ``keep_quantized``: such
        a tensor is checked but left as codes (``stats["quantized"]``, a QuantizedValues; its
        view is then not written), for a strategy that folds codes in.
        ``stats`` receives the main tensor's ``norm`` (from the NaN/Inf check's pass) and, given
        a ``reference`` (a RecentChange), the ``cosine`` to its direction from the same pass.
        ``refuse_non_finite`` False: NaN/Inf in the main tensor are left for the strategy
        (differential privacy takes such an update as clipped to zero). ``crossing``: the
        landed bytes are copied to the device as they arrive, and ``stats["on_device"]`` gets
        the device tensors of the returned views."""
        declared = {i.name: int(i.numel) for i in infos}
        if declared != expected:
            await self._abort(
                context,
                SC.INVALID_ARGUMENT,
                f"the stream must carry exactly {expected} (name: elements), header says "
                f"{declared}",
                reason="tensor_sizes",
            )
        try:
            sparse = P.sparse_infos(infos)
            quantized = P.quantized_infos(infos)
        except ValueError as exc:
            await self._abort(context, SC.INVALID_ARGUMENT, str(exc))
        for name, (q, _) in quantized.items():
            if name != "update" or q.value not in quantizable:
                offered = ", ".join(quantizable) or "none"
                await self._abort(
                    context,
                    SC.INVALID_ARGUMENT,
                    f"tensor {name!r} is quantized ({q.value}); this server takes quantized "
                    f"values only in an update's \"update\" tensor, in the recipe's "
                    f"update_quantizations ({offered})",
                    reason="bad_header",
                )
        try:
            decoder = Decoder(
                slot, expected, dtype, self.fed.config.chunk_bytes, sparse=sparse,
                reference=reference, exact_norm=exact_norm, refuse_non_finite=refuse_non_finite,
                quantized=quantized, keep_quantized=keep_quantized,
            )  # fmt: skip
            if crossing is not None:
                crossing.begin()
            while (msg := await self._next_message(stream, context)) is not None:
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    chunk = msg.chunk
                    decoder.feed(chunk.tensor, chunk.offset, chunk.data)
                    if upload_log is not None or crossing is not None:
                        decoded = decoder.decoded()
                        if upload_log is not None:
                            upload_log.progress(decoded)
                        if crossing is not None:
                            crossing.progress(decoded)
                elif kind == "trailer":
                    if await self._next_message(stream, context) is not None:
                        await self._abort(
                            context,
                            SC.INVALID_ARGUMENT,
                            "a message followed the trailer: the trailer must be the last "
                            "message of the stream",
                        )
                    self.fed.metrics.received_bytes.inc(decoder.bytes_received)
                    views = decoder.finish(msg.trailer.crc32c, msg.trailer.payload_bytes)
                    if upload_log is not None:
                        upload_log.finish(views, decoder.sections())
                    if stats is not None and decoder.norm is not None:
                        stats["norm"] = decoder.norm
                        stats["norm_exact"] = decoder.norm_exact
                    if stats is not None and decoder.cosine is not None:
                        stats["cosine"] = decoder.cosine
                    if stats is not None and "update" in decoder.quantized:
                        stats["quantized"] = decoder.quantized["update"]
                    if crossing is not None:
                        if decoder.quantized:
                            # Codes kept as codes are folded where they are (on the CPU): the
                            # view the crossing would copy was never written.
                            crossing.abandon()
                        else:
                            on_device = crossing.finish(views, decoder.decoded())
                            if stats is not None:
                                stats["on_device"] = on_device
                        crossing = None
                    return views
                else:
                    await self._abort(
                        context, SC.INVALID_ARGUMENT, f"unexpected {kind!r} message in the stream"
                    )
            await self._abort(
                context, SC.DATA_LOSS, "stream ended before its trailer: the upload was cut off",
                reason="cut_off",
            )  # fmt: skip
        except CodecError as exc:
            await self._abort(context, SC[exc.grpc_code_name], str(exc), reason=reason_of(exc))
        except torch.OutOfMemoryError:
            await self._abort(
                context, SC.RESOURCE_EXHAUSTED,
                "no device memory for the upload now: retry later (each upload in flight "
                "holds one model's size on the device)",
                reason="device_memory",
            )  # fmt: skip
        finally:
            if crossing is not None:  # refused or cut off: the copies queued are not used
                crossing.abandon()
        raise AssertionError("unreachable")  # abort raises

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
