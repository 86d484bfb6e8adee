"""The `aggsrv.v1.Aggregation` gRPC service (grpc.aio) in front of the federation: the handlers
of its calls (the checks they make first are in aggsrv.server.requests).

Every bad input is answered with the status that docs/wire.md "Status codes" lists for it before
anything reaches the strategy: an update is decoded into a staging slot and validated there (length,
dtype, CRC-32C, NaN/Inf, its header against the job) and only then handed to the aggregation loop.
Under differential privacy a NaN/Inf delta is the exception: the strategy clips it to zero, and
GetStatus shows what depends on updates' values to admin tokens only (aggsrv.server.disclosure).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import torch
from google.protobuf import message_factory

from aggsrv import protocol as P
from aggsrv.layout import LayoutMismatchError, ModelLayout
from aggsrv.server.auth import (
    ID_PATTERN,
    ROLE_ADMIN,
    Authenticator,
    NoAuth,
    bearer_token,
)
from aggsrv.server.federation import DurabilityError, Federation, payload_sizes, staging_slot
from aggsrv.server.limits import RateLimiter
from aggsrv.server.relay import RelayFailed, ShardLinks, caller_metadata
from aggsrv.server.requests import (
    COUNT_REFUSAL,
    JOB_BUCKET,
    REFUSAL_REASON,
    SC,
    UNPARSEABLE,
    UNPARSEABLE_LOG_SECONDS,
    OncePerInterval,
    RequestChecks,
    Unparseable,
    _job_number,
    reason_of,
    strategy_code,
    tolerant_parser,
)
from aggsrv.server.shard_status import PROBE_TIMEOUT, ShardWatch
from aggsrv.server.versions import LeaseHandoff, Snapshot
from aggsrv.strategies import (
    Job,
    Status,
    Strategy,
    StrategyError,
    Update,
    UpdateKind,
)
from aggsrv.strategies.buffers import NO_LEASE, Lease
from aggsrv.transport import WireDtype
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import QuantizedValues

log = logging.getLogger(__name__)


JOB_STATES = {
    "current": pb.JOB_STATE_CURRENT,
    "completed": pb.JOB_STATE_COMPLETED,
    "superseded": pb.JOB_STATE_SUPERSEDED,
    "unknown": pb.JOB_STATE_UNKNOWN,
}

# Outcomes whose update was folded into the model: the trace gives their staleness.
FOLDED_IN = (Status.APPLIED, Status.BUFFERED)

SERVICE = pb.DESCRIPTOR.services_by_name["Aggregation"]


class AggregationService(RequestChecks, pb_grpc.AggregationServicer):
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
        self._links: ShardLinks | None = None  # rank 0's channels to the other shards
        self.shard_watch = ShardWatch(federation, self.auth)  # rank 0's view of the shards

    # ------------------------------------------------------------------ auth and limits

    # ------------------------------------------------------------------ helpers

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
        fed.publication.notify()
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
                fed.fail_stop.fail(f"could not write the first checkpoint: {exc}")
                await context.abort(SC.UNAVAILABLE, fed.failure or str(exc))
            return True

    # ------------------------------------------------------------------ GetJob

    async def GetJob(self, request, context):  # noqa: N802
        asked = self.fed.clock()
        await self._check_open(context)
        # Credentials first: without them a caller learns nothing, not even what is malformed.
        await self._authorize(context, request.client_id)
        await self._check_id("client_id", request.client_id, context)
        await self._require_model(context)
        fed = self.fed
        if not fed.follower:  # a shard waits for rank 0's registration below
            await self._require_client(request.client_id, context)
            if fed.trace is not None:
                fed.trace.asking(request.client_id, asked)
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
        job = lease = None
        if request.job_id or fed.follower:
            job, lease = await self._issued_job(request, context)
        while job is None:
            fed.touch(request.client_id)
            change = fed.publication.watch()  # before the look: a change after it wakes us
            try:
                job, why, lease = await fed.next_job(request.client_id)
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
                    reason=why.text, model_version=fed.published_version, code=int(why)
                )
            )
            await fed.publication.wait_for_change(change, fed.config.pending_interval_seconds)
        if not fed.follower:
            fed.activity.job_issued(job.client_id, job.job_id, job.base_version, fed.clock())
        if fed.trace is not None and not fed.follower:
            sent = _payload_bytes(job.tensors, dtype)
            fed.trace.job(job.client_id, job.job_id, job.base_version, asked, sent)
        # The job's tensors stay leased until the stream ends: its buffers are not reused while
        # it reads them, even if the job is superseded or ends meanwhile.
        try:
            whole = self._whole_on_rank0() and not request.shard_slice
            async for msg in self._job_stream(job, dtype, chunk_bytes, context if whole else None):
                yield msg
        finally:
            lease.release()

    async def _job_stream(
        self, job: Job, dtype: WireDtype, chunk_bytes: int, whole_for: Any = None
    ):
        """The job's messages; with ``whole_for`` (the call's context) rank 0 sends the whole
        job, the other shards' slices fetched for the caller."""
        fed = self.fed
        header = pb.JobHeader(
            job_id=str(job.job_id),
            client_id=job.client_id,
            base_version=job.base_version,
            layout_hash=fed.layout.hash,
            recipe=P.recipe_to_pb(
                dataclasses.replace(
                    job.recipe,
                    update_quantizations=fed.update_quantizations(),
                    quantization_block=fed.config.quantization_block,
                )
            ),
            dtype=P.WIRE_TO_PB[dtype],
            tensors=P.tensor_infos(job.tensors),
            update_kind=pb.UPDATE_KIND_DELTA,
            upload_dtype=P.WIRE_TO_PB[WireDtype.FLOAT32],
            send_buffers=fed.layout.whole.buffer_numel > 0,
        )
        if job.deadline is not None:
            header.deadline.CopyFrom(P.timestamp(job.deadline))
            header.time_budget.CopyFrom(P.duration(job.deadline - fed.clock()))
        tensors = await fed.versions.job_on_host(job)  # a device model: its version's one host copy
        if whole_for is not None:
            request = pb.GetJobRequest(client_id=job.client_id, layout_hash=fed.layout.hash)
            tensors = await self._whole("GetJob", request, tensors, whole_for,
                                        job_id=str(job.job_id))  # fmt: skip
            del header.tensors[:]
            header.tensors.extend(P.tensor_infos(tensors))
        yield pb.JobMessage(header=header)
        fed.metrics.sent_bytes.inc(_payload_bytes(tensors, dtype))
        for msg in P.serialized_chunk_stream(tensors, dtype, chunk_bytes, pb.JobMessage):
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
            change = fed.publication.watch()
            handoff = LeaseHandoff()
            try:
                job, issued, state, lease = await fed.read(
                    _issued, fed.strategy, request.client_id, job_id, handoff
                )
            except BaseException:  # cancelled: nothing will stream the job
                handoff.abandon()
                raise
            if fed.failure is not None:
                lease.release()
                await self._check_open(context)
            if job is not None:
                return job, lease
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
            await fed.publication.wait_for_change(change, min(left, 1.0))

    # ------------------------------------------------------------------ PushUpdate

    async def PushUpdate(self, request_iterator, context):  # noqa: N802
        # The header once read (for the refusal's log), when the upload started and ended.
        seen: dict[str, Any] = {"started": self.fed.clock()}
        counted = False

        def count(code: SC, reason: str) -> None:
            nonlocal counted
            # UNAVAILABLE (shutting down) says nothing about the update: the client retries it.
            if code != SC.UNAVAILABLE and not counted:
                counted = True
                self.fed.reject(code.name, reason)
                self.fed.metrics.record_refusal(code.name, reason)

        COUNT_REFUSAL.set(count)  # this call's task only
        try:
            return await self._push_update(request_iterator, context, seen)
        except DurabilityError as exc:
            await context.abort(SC.UNAVAILABLE, f"the server stopped taking writes: {exc}")
        except grpc.aio.AbortError:
            code = context.code()
            if code is not None and code != SC.UNAVAILABLE:
                count(code, REFUSAL_REASON.get())  # aborted without _abort: counted here
                self._log_refusal(seen.get("header"), code, context)
                self._trace_refusal(seen, code)
            raise

    def _trace_refusal(self, seen: dict[str, Any], code: SC) -> None:
        """The trace line of a refused upload, once its caller proved to be the registered
        client it names: the trace takes no line from a caller it has not checked."""
        fed, h = self.fed, seen.get("header")
        if fed.trace is None or fed.follower or h is None or not seen.get("authorized"):
            return
        fed.trace.update(
            h.client_id, _job_number(h.job_id), h.base_version, seen["started"],
            seen.get("received", fed.clock()), fed.published_version, None,
            seen.get("bytes", 0), code.name,
        )  # fmt: skip

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
        self, request_iterator, context, seen: dict[str, Any]
    ) -> pb.PushUpdateResponse:
        await self._check_open(context)
        await self._require_model(context)
        first = await self._next_message(request_iterator, context)
        if first is None or first.WhichOneof("kind") != "header":
            await self._abort(
                context, SC.INVALID_ARGUMENT, "PushUpdate must start with a header",
                reason="bad_header",
            )  # fmt: skip
        h = first.header
        seen["header"] = h
        fed = self.fed
        # Credentials first: without them a caller learns nothing, not even what is malformed.
        await self._authorize(context, h.client_id)
        await self._check_id("client_id", h.client_id, context)
        await self._require_client(h.client_id, context)
        seen["authorized"] = True  # from here on a refusal is the client's: traced
        rank = fed.shards.rank if fed.shards is not None else 0
        if h.shard_rank != rank:
            await self._abort(
                context,
                SC.FAILED_PRECONDITION,
                f"this slice is for shard {h.shard_rank}; this server is "
                + (f"shard {rank}" if fed.shards is not None else "not sharded (shard_rank 0)"),
                reason="wrong_shard",
            )
        await self._check_rate(h.client_id, context)
        await self._require_hash(h.layout_hash, context)
        await self._check_id("update_id", h.update_id, context)
        kind = P.PB_TO_KIND.get(h.kind)
        if kind is None:
            await self._abort(
                context, SC.INVALID_ARGUMENT, "kind must be WEIGHTS or DELTA", reason="bad_header"
            )
        try:
            dtype = P.wire_dtype(h.dtype, "dtype")
        except ValueError as exc:
            await self._abort(
                context, SC.INVALID_ARGUMENT, f"bad header: {exc}", reason="bad_header"
            )
        job_id = _job_number(h.job_id)
        if job_id is None:
            await self._abort(
                context,
                SC.INVALID_ARGUMENT,
                f"job_id {h.job_id[:40]!r} is not a job id this server issued (the JobHeader's "
                "job_id, echoed exactly)",
                reason="unknown_job",
            )
        fed.touch(h.client_id)
        key = (h.client_id, h.update_id)
        if key in fed.in_flight_updates:
            await self._abort(
                context, SC.ABORTED, f"update {h.update_id!r} is being uploaded on another stream",
                reason="in_flight",
            )  # fmt: skip
        if await self._relays(h, context):  # a whole update to rank 0: it forwards the slices
            return await self._relay_update(h, key, kind, dtype, job_id, request_iterator,
                                            context, seen)  # fmt: skip
        fed.in_flight_updates.add(key)
        private = fed.private  # differential privacy (the strategy's dp_ keys)
        slot = None
        waiting = False
        upload_log = None
        try:
            slot = await fed.acquire_slot()
            fed.uploads_in_progress += 1
            # Logged as it arrives, when there is a log.
            upload_log = fed.call_log.upload_log(
                fed.config.wal_part_bytes, fed.checkpoints.unclaimed_bytes_limit()
            )
            views = await self._decode(
                request_iterator, slot, list(h.tensors), payload_sizes(fed.layout, "update"), dtype,
                context, stats=seen,
                # Under DP the update's health (norm, cosine) is not watched: see below.
                reference=fed.direction if kind is UpdateKind.DELTA and not private else None,
                exact_norm=private and kind is UpdateKind.DELTA,
                # Under DP a NaN/Inf delta is not refused (a refusal would tell everyone): the
                # strategy takes it as clipped to zero.
                refuse_non_finite=not private, upload_log=upload_log,
                quantizable=fed.update_quantizations(),
                # Codes the strategy folds in stay codes, where the log records them as such.
                keep_quantized=fed.folds_quantized(kind)
                and (upload_log is not None or fed.call_log.wal is None),
                # The update crosses to a device cache while the rest of it arrives.
                crossing=fed.crossing_for(slot),
            )  # fmt: skip
            self._note_received(h.client_id, job_id, views, dtype, seen)
            buffers = views.get("buffers")
            device = fed.strategy.device
            on_device = seen.pop("on_device", None)
            if on_device is not None:  # crossed already; the crossing fenced the slot
                tensor, moved = on_device["update"], on_device.get("buffers")
            else:
                tensor = _on_device(views["update"], device)
                moved = None if buffers is None else _on_device(buffers, device)
                if tensor is not views["update"] or moved is not buffers:
                    slot.fence(device)  # the copies may read the slot after they return
            # The decoder's float64 norm of a DELTA (what clipping under DP reads).
            norm = seen["norm"] if seen.get("norm_exact") else None
            update = self._update_of(
                h, kind, job_id, tensor, moved, norm, seen.get("quantized"),
                # The decoder refused NaN/Inf in its pass (not under DP): proven finite.
                finite=not private,
            )  # fmt: skip
            fed.updates_waiting += 1
            waiting = True
            try:
                if fed.follower:
                    staleness, outcome = await fed.shard_follower.apply_slice(update, upload_log)
                else:
                    staleness, outcome = await fed.apply_update(update, views, upload_log)
            except StrategyError as exc:
                await self._abort(context, strategy_code(exc), str(exc), reason=reason_of(exc))
            if "quantized" in seen and outcome.original is None:
                seen["norm"] = seen["quantized"].norm  # noted by the strategy's fold, or read here
        finally:
            if waiting:
                fed.updates_waiting -= 1
            fed.in_flight_updates.discard(key)
            if slot is not None:
                fed.uploads_in_progress -= 1
                if upload_log is not None:
                    await upload_log.settle()  # its writers read the slot
                    fed.call_log.settled(upload_log)
                    # What it logged counts toward a checkpoint, applied or not.
                    fed.checkpoints.checkpoint_if_due()
                fed.release_slot(slot)
        return self._answer_update(h, kind, job_id, staleness, outcome, seen)

    def _answer_update(
        self,
        h: pb.UpdateHeader,
        kind: UpdateKind,
        job_id: int,
        staleness: int,
        outcome: Any,
        seen: dict[str, Any],
    ) -> pb.PushUpdateResponse:
        """The metrics, trace and log line of an update the shards reached an outcome on, and
        the client's answer."""
        fed = self.fed
        private = fed.private
        label = "duplicate" if outcome.original is not None else outcome.status.name
        # Each update's norm and cosine describe its values: not watched under differential
        # privacy (they would reach the unauthenticated metrics port and the log's warnings).
        watched = not private
        if watched and "norm" in seen and outcome.original is None and kind is UpdateKind.DELTA:
            fed.metrics.update_norm.observe(seen["norm"])
            if "cosine" in seen:
                fed.metrics.update_cosine.observe(seen["cosine"])
                if fed.update_cosines.observe(seen["cosine"]):
                    fed.metrics.update_cosine_outliers.inc()
                    log.warning(
                        "update %s of %s: its cosine %.3f to the model's recent change lies "
                        "far from the recent updates' (an outlier: look at this client)",
                        h.update_id, h.client_id, seen["cosine"],
                        extra={"event": "update_cosine_outlier", "client_id": h.client_id,
                               "update_id": h.update_id, "cosine": seen["cosine"]},
                    )  # fmt: skip
            if fed.update_norms.observe(seen["norm"]):
                fed.metrics.update_norm_outliers.inc()
                log.warning(
                    "update %s of %s: its norm %.4g lies far from the recent updates' (an "
                    "outlier: look at this client)", h.update_id, h.client_id, seen["norm"],
                    extra={"event": "update_norm_outlier", "client_id": h.client_id,
                           "update_id": h.update_id, "norm": seen["norm"]},
                )  # fmt: skip
        filtered = outcome.status is Status.FILTERED
        fed.metrics.record_update(
            label,
            None if outcome.original or filtered else max(0, staleness),
            filter_reason=outcome.reason.name if filtered and outcome.reason else None,
            clipped=outcome.clipped,
        )
        if filtered:
            log.warning(
                "update %s of %s filtered: %s", h.update_id, h.client_id, outcome.detail,
                extra={"event": "update_filtered", "client_id": h.client_id,
                       "update_id": h.update_id, "reason": label.lower()},
            )  # fmt: skip
        if fed.trace is not None and not fed.follower:
            folded = outcome.original is None and outcome.status in FOLDED_IN
            fed.trace.update(
                h.client_id, job_id, h.base_version, seen["started"], seen["received"],
                outcome.version, max(0, staleness) if folded else None, seen["bytes"], label,
            )  # fmt: skip
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
            message=outcome.detail,
            filter_reason=P.FILTER_REASON_TO_PB.get(outcome.reason, pb.FILTER_REASON_UNSPECIFIED),
            clipped=outcome.clipped,
        )

    # ------------------------------------------------------------------ rank 0 relays

    async def close(self) -> None:
        """Close rank 0's channels to the other shards (after the gRPC server stopped)."""
        links, self._links = self._links, None
        if links is not None:
            await links.close()

    def _shard_links(self) -> ShardLinks:
        """Rank 0's channels to the other shards (aggsrv.server.relay), opened on first use."""
        if self._links is None:
            assert self.fed.shards is not None
            self._links = ShardLinks(self.fed.shards, self.fed.config)
        return self._links

    def _whole_on_rank0(self) -> bool:
        """Rank 0 of a sharded federation with a model: it may relay and assemble."""
        shards = self.fed.shards
        return (
            shards is not None
            and shards.is_coordinator
            and shards.world_size > 1
            and shards.shard_map is not None
        )

    async def _relays(self, h: pb.UpdateHeader, context: grpc.aio.ServicerContext) -> bool:
        """The wire rule: an update to rank 0 (shard_rank 0) whose "update" holds the whole
        model's D elements, not rank 0's slice, is relayed (rank 0's slice is never the whole
        model on N >= 2 shards); any other length is refused here, naming both."""
        if not self._whole_on_rank0():
            return False
        declared = {i.name: int(i.numel) for i in h.tensors}.get("update")
        whole, own = self.fed.layout.whole.numel, self.fed.layout.numel
        if declared not in (whole, own):
            await self._abort(
                context, SC.INVALID_ARGUMENT,
                f"rank 0 of {self.fed.shards.world_size} shards takes an \"update\" of the whole "
                f"model's {whole} elements (it forwards the other shards' slices) or of its own "
                f"slice's {own}; the header says {declared}", reason="tensor_sizes",
            )  # fmt: skip
        return declared == whole != own

    async def _relay_update(
        self,
        h: pb.UpdateHeader,
        key: tuple[str, str],
        kind: UpdateKind,
        dtype: WireDtype,
        job_id: int,
        stream: AsyncIterator,
        context: grpc.aio.ServicerContext,
        seen: dict[str, Any],
    ) -> pb.PushUpdateResponse:
        """Rank 0 takes a whole update: it forwards slice r to shard r and applies its own, and
        answers the outcome every shard reached (the shards vote as for a client's slices). A
        forward that fails is UNAVAILABLE with nothing applied: the client retries, same id."""
        fed = self.fed
        links = self._shard_links()
        fed.in_flight_updates.add(key)
        private = fed.private
        try:
            async with fed.whole_model_slot() as slot:
                fed.uploads_in_progress += 1
                try:
                    views = await self._decode(
                        stream, slot, list(h.tensors), payload_sizes(fed.layout.whole, "update"),
                        dtype, context, stats=seen, refuse_non_finite=not private,
                        quantizable=fed.update_quantizations(),
                    )  # fmt: skip
                    self._note_received(h.client_id, job_id, views, dtype, seen)
                    parts = links.shard_map.split(views["update"])
                    update = self._rank0_update(h, kind, job_id, parts[0], views.get("buffers"))
                    wire = {"update": parts[0], **{k: v for k, v in views.items() if k != "update"}}
                    fed.updates_waiting += 1
                    try:
                        staleness, outcome = await links.relay_update(
                            h, parts, _forward_dtype(h, dtype), caller_metadata(context),
                            lambda: fed.apply_update(update, wire),
                        )  # fmt: skip
                    except StrategyError as exc:
                        await self._abort(
                            context, strategy_code(exc), str(exc), reason=reason_of(exc)
                        )
                    except RelayFailed as exc:
                        await self._abort(
                            context, SC.UNAVAILABLE,
                            f"{exc}; no shard applied update {h.update_id!r}: send it again "
                            "(the same update_id)", reason="relay_failed",
                        )  # fmt: skip
                    finally:
                        fed.updates_waiting -= 1
                finally:
                    fed.uploads_in_progress -= 1
        finally:
            fed.in_flight_updates.discard(key)
        return self._answer_update(h, kind, job_id, staleness, outcome, seen)

    def _rank0_update(
        self,
        h: pb.UpdateHeader,
        kind: UpdateKind,
        job_id: int,
        own: torch.Tensor,
        buffers: torch.Tensor | None,
    ) -> Update:
        """Rank 0's slice of a relayed update, as the direct path builds it from its own upload
        (under differential privacy, with the float64 norm of its slice the decoder would
        have taken)."""
        fed = self.fed
        device = fed.strategy.device
        norm = None
        if fed.private and kind is UpdateKind.DELTA and own.numel():
            from aggsrv.fused_dots import squares

            squared = squares(own.contiguous().numpy())
            norm = math.sqrt(squared) if math.isfinite(squared) else None
        moved = None if buffers is None else _on_device(buffers, device)
        # The relay's decoder refused NaN/Inf in the whole upload (not under DP).
        return self._update_of(
            h, kind, job_id, _on_device(own, device), moved, norm, finite=not fed.private
        )

    def _note_received(
        self, client_id: str, job_id: int, views: dict[str, Any], dtype: Any, seen: dict[str, Any]
    ) -> None:
        """An upload arrived whole: when and how many bytes (``seen``), and the job's turnaround."""
        fed = self.fed
        seen["received"] = fed.clock()
        seen["bytes"] = _payload_bytes(views, dtype)
        took = fed.activity.update_received(client_id, job_id, seen["received"])
        if took is not None:
            fed.metrics.job_turnaround.observe(took)

    def _update_of(
        self,
        h: pb.UpdateHeader,
        kind: UpdateKind,
        job_id: int,
        tensor: torch.Tensor,
        buffers: torch.Tensor | None,
        norm: float | None,
        quantized: QuantizedValues | None = None,
        *,
        finite: bool = False,
    ) -> Update:
        """The update an upload's header describes, with its tensors on the strategy's device
        (``quantized``: its values still as the wire's codes, for a strategy that folds them)."""
        local_steps = self.fed.strategy.make_recipe().local_steps
        return Update(
            client_id=h.client_id,
            job_id=job_id,
            base_version=h.base_version,
            update_id=h.update_id,
            num_samples=int(h.num_samples),
            work_done=_work_done(h.work, local_steps is not None),
            kind=kind,
            tensor=tensor,
            buffers=buffers,
            norm=norm,
            quantized=quantized,
            finite=finite,
        )

    async def _whole(
        self,
        method: str,
        request: Any,
        own: dict[str, torch.Tensor],
        context: grpc.aio.ServicerContext,
        **ask: Any,
    ) -> dict[str, torch.Tensor]:
        """Rank 0's tensors ``own`` made whole with the other shards' slices (GetJob or GetModel
        ``method`` with the fields ``ask``); UNAVAILABLE when a shard does not answer."""
        links = self._shard_links()
        try:
            return await links.whole(
                method, links.slice_request(request, **ask), own, caller_metadata(context)
            )
        except RelayFailed as exc:
            await context.abort(SC.UNAVAILABLE, f"{exc}; ask again, or ask every shard")
            raise AssertionError("unreachable") from exc

    # ------------------------------------------------------------------ GetModel

    async def GetModel(self, request, context):  # noqa: N802
        await self._authorize(context)
        await self._require_model(context)
        fed = self.fed
        if request.HasField("version") and fed.follower:
            await self._await_version(request.version)
        latest = fed.versions.latest()
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
        # Taken with no suspension since the snapshot was found retained (its own lease held),
        # and held until the stream ends: the version's buffer is not reused while it is read.
        lease = fed.versions.lease_snapshot(snap)
        try:
            whole = self._whole_on_rank0() and not request.shard_slice
            async for msg in self._model_stream(
                snap, latest.version, request, dtype, chunk_bytes, context if whole else None
            ):
                yield msg
        finally:
            lease.release()

    async def _model_stream(
        self,
        snap: Snapshot,
        latest: int,
        request,
        dtype: WireDtype,
        chunk_bytes: int,
        whole_for: Any = None,
    ):
        """The version's messages; with ``whole_for`` (the call's context) rank 0 sends the
        whole model, the other shards' slices of the version fetched for the caller."""
        fed = self.fed
        # A device model: the version's one host copy, made off the event loop.
        tensors = await fed.versions.on_host(snap, request.include_buffers)
        if whole_for is not None:
            tensors = await self._whole("GetModel", request, tensors, whole_for,
                                        version=snap.version, include_buffers=False)  # fmt: skip
        yield pb.ModelMessage(
            header=pb.ModelHeader(
                version=snap.version,
                latest_version=latest,
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
        for msg in P.serialized_chunk_stream(tensors, dtype, chunk_bytes, pb.ModelMessage):
            yield msg

    async def _await_version(self, version: int) -> None:
        """A shard of rank >= 1 asked for a version rank 0 published: wait until this shard has
        made the same calls (bounded; the caller then gets OUT_OF_RANGE)."""
        fed = self.fed
        loop = asyncio.get_running_loop()
        give_up = loop.time() + fed.shards.order_wait
        while True:
            change = fed.publication.watch()
            left = give_up - loop.time()
            if fed.published_version >= version or fed.failure is not None or left <= 0:
                return
            await fed.publication.wait_for_change(change, min(1.0, left))

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
        principal = await self._authorize(context)
        fed = self.fed
        shard_rows = None  # rank 0 asks the other shards meanwhile (aggsrv.server.shard_status)
        if self.shard_watch.active and not request.shard_probe:
            token = bearer_token(context.invocation_metadata())
            shard_rows = asyncio.ensure_future(self.shard_watch.rows(token))
        # Under differential privacy what depends on updates' values is an admin's to read
        # (aggsrv.server.disclosure); without authentication nobody is an admin.
        full = not fed.private or (principal is not None and principal.role == ROLE_ADMIN)
        filters = fed.strategy.update_filters if fed.strategy is not None and full else None
        rejected, by_code, _ = fed.refusal_counts(full)
        resp = pb.StatusResponse(
            has_model=fed.strategy is not None,
            version=fed.published_version,
            strategy=fed.strategy.name if fed.strategy else fed.config.strategy,
            clients_known=len(fed.clients),
            clients_active=fed.active_clients(),
            updates_accepted=fed.counters["accepted"],
            updates_applied=fed.counters["applied"],
            updates_rejected=rejected,
            updates_duplicate=fed.counters["duplicate"],
            rejected_by_code=by_code,
            filtered_by_reason=dict(filters.filtered) if filters is not None else {},
            updates_clipped=filters.clipped if filters is not None else 0,
            data_withheld=not full,
            queue_depth=fed.queue_depth(),
            uploads_in_progress=fed.uploads_in_progress,
            server_time=P.timestamp(fed.clock()),
            uptime=P.duration(fed.clock() - fed.started_at),
            durability="on" if fed.store is not None and fed.store.durable else "off",
            auth=self.auth.mode,
            wal_bytes=fed.store.wal_bytes() if fed.store is not None else 0,
            failure=fed.failure or "",
        )
        last_checkpoint = fed.checkpoints.last_checkpoint
        if last_checkpoint is not None:
            resp.last_checkpoint_version = last_checkpoint[0]
            resp.last_checkpoint_time.CopyFrom(P.timestamp(last_checkpoint[1]))
        if fed.last_eval is not None:
            resp.eval_version = fed.last_eval[0]
            resp.eval_metrics.update(fed.last_eval[1])
        spent = fed.privacy_now()
        if spent is not None:
            if not full:
                spent["updates_clipped"] = 0
            target = spent.pop("target_epsilon")
            resp.privacy.CopyFrom(pb.PrivacyStatus(**spent))
            if target is not None:
                resp.privacy.target_epsilon = target
        if fed.strategy is not None and not request.shard_probe:
            # Walks the strategy's state on the aggregation thread, which a hung shard can hold
            # in a collective for shard_timeout_seconds: a shard's status answers anyway (0).
            wait = PROBE_TIMEOUT if fed.shards is not None else None
            try:
                resp.cache_bytes = await asyncio.wait_for(fed.read(fed.cache_bytes), wait)
            except TimeoutError:
                log.warning("GetStatus: the aggregation thread is busy; cache_bytes left 0")
        rows = fed.row_cache()
        if rows.dtype:
            resp.cache_dtype = rows.dtype
            resp.cache_rows = rows.rows
            resp.cache_row_bytes = rows.bytes_per_row
        # Limits always: a client offering the initial model needs chunk_bytes before Register.
        resp.limits.CopyFrom(self._limits())
        if fed.shards is not None:
            resp.shard_rank = fed.shards.rank
            shard_map = self._shard_map()
            if shard_map is not None:
                resp.shard_map.CopyFrom(shard_map)
            if shard_rows is not None:
                resp.shards.extend(await shard_rows)
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


def _forward_dtype(h: pb.UpdateHeader, dtype: WireDtype) -> WireDtype:
    """The wire dtype rank 0 forwards a relayed update's slices in: the upload's, unless its
    values were quantized (their decoded binary32 values do not fit a half type exactly)."""
    quantized = any(t.quantization != tpb.VALUE_QUANTIZATION_UNSPECIFIED for t in h.tensors)
    return WireDtype.FLOAT32 if quantized else dtype


def _job_status(strategy: Strategy, client_id: str, job_id: int) -> tuple[str, float | None]:
    """(aggregation thread) What Heartbeat says of a job: its state and, if it is the client's
    current job, its deadline."""
    state = strategy.job_state(client_id, job_id)
    job = strategy.outstanding_job(client_id) if state == "current" else None
    return state, job.deadline if job is not None else None


def _issued(
    strategy: Strategy, client_id: str, job_id: int, handoff: LeaseHandoff
) -> tuple[Job | None, int, str, Lease]:
    """(aggregation thread) A shard's view of a job rank 0 issued: the open job (None if not
    open here), how many jobs this shard has issued, the job's state, and a lease on the job's
    tensors for its stream."""
    job = strategy.open_job(client_id, job_id)
    lease = handoff.take(strategy, *job.tensors.values()) if job is not None else NO_LEASE
    return job, strategy.jobs_issued, strategy.job_state(client_id, job_id), lease


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
            response_serializer=_serializer(response_cls),
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _serializer(message_cls: type) -> Callable[[object], bytes]:
    """SerializeToString, except for messages a handler serialized itself (bytes: the chunks
    of a job or model, protocol.serialized_chunk_stream), which go out as they are."""
    serialize = message_cls.SerializeToString

    def to_bytes(message: object) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return to_bytes


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
