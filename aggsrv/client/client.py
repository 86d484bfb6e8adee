"""The Python client of the Aggregation service: register, fetch a job, push an update, pull the
model, heartbeat. Synchronous (a training loop is synchronous anyway); retries UNAVAILABLE with
exponential backoff, reusing the update id so a retried push is applied at most once.

A sharded server (docs/sharding.md) answers Register with its shard map; the client then splits
every update by it and streams the slices to all shards at once, and assembles jobs and models
from all shards' slices. Everything else goes to rank 0, the address given. With
``direct_to_shards=False`` the client talks to rank 0 only, which forwards the slices of each
update and assembles jobs and models itself (for a client that cannot reach the other shards)."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from aggsrv import protocol as P
from aggsrv.client.channel import open_channel, read_token
from aggsrv.client.clipping import clip_update
from aggsrv.client.compression import Compression, Compressor, Section
from aggsrv.layout import ModelLayout
from aggsrv.sharding import ShardMap
from aggsrv.transport import (
    Decoder,
    Encoding,
    StagingSlot,
    WireDtype,
    choose_encoding,
    encode_sparse,
    to_wire,
    wire_view,
)
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import FilterReason, PendingReason, Recipe, Status, UpdateKind

log = logging.getLogger(__name__)
T = TypeVar("T")
MIB = 1 << 20
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class ClientJob:
    """A job as the client sees it: where to start from and what to run."""

    job_id: str
    base_version: int
    deadline: float | None  # unix seconds on the server's clock
    recipe: Recipe
    # flat float32 tensors: "weights", and "buffers" (float buffers to load) when the model has
    # any, "basis" for Fed-OGD
    tensors: Mapping[str, torch.Tensor]

    @property
    def weights(self) -> torch.Tensor:
        return self.tensors["weights"]

    @property
    def buffers(self) -> torch.Tensor | None:
        """The float buffers (BatchNorm statistics) to train from, None without any."""
        return self.tensors.get("buffers")


@dataclass(frozen=True)
class Pending:
    """A GetJob stream's word that there is no job yet (the stream stays open)."""

    reason: PendingReason  # why, for programs (UNSPECIFIED from a server older than the field)
    text: str  # why, for people
    model_version: int


@dataclass(frozen=True)
class PushResult:
    """The server's answer to an update.

    ``status`` FILTERED (or DUPLICATE with ``original`` FILTERED): the server's update filter
    left the update out; ``reason`` says why and ``message`` explains it. The job is consumed:
    fetch a new one (docs/wire.md "Filtered updates"). ``clipped``: the update was clipped by
    the filter before it was folded in."""

    status: Status
    version: int
    staleness: int
    update_id: str
    original: Status | None = None
    reason: FilterReason | None = None
    message: str = ""
    clipped: bool = False
    payload_bytes: int = 0  # what the upload carried (every shard's stream), headers excluded


def _counted(
    make: Callable[[], Iterator[pb.UpdateMessage]], sent: list[int], r: int
) -> Callable[[], Iterator[pb.UpdateMessage]]:
    """``make``'s stream, noting the payload bytes its trailer declares in ``sent[r]``."""

    def messages() -> Iterator[pb.UpdateMessage]:
        for msg in make():
            if msg.HasField("trailer"):
                sent[r] = int(msg.trailer.payload_bytes)
            yield msg

    return messages


class Client:
    """One federated client talking to one server."""

    def __init__(
        self,
        address: str,
        client_id: str,
        *,
        timeout: float = 60.0,
        retries: int = 5,
        backoff: float = 0.2,
        upload_dtype: WireDtype | str = WireDtype.FLOAT32,
        download_dtype: WireDtype | str = WireDtype.FLOAT32,
        max_message_bytes: int = 4 * MIB,
        token: str | None = None,
        token_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls: bool | None = None,
        direct_to_shards: bool = True,
        compression: Compression | None = None,
    ) -> None:
        """``token``/``token_file``: the bearer token the server issued for this client id.
        ``tls_ca``: the CA that signed the server's certificate (TLS on; ``tls=True`` uses the
        system roots); ``tls_cert``/``tls_key``: this client's certificate for mutual TLS.
        ``direct_to_shards``: on a sharded server, stream each update's slices to every shard
        and assemble jobs and models from them (the default); False: talk to rank 0 only, which
        relays (twice rank 0's ingress per update, and one more hop: docs/sharding.md).
        ``compression``: how DELTA updates are compressed where the job's recipe allows it,
        with error feedback (docs/compression.md)."""
        self.compression = compression
        self._compressor: Compressor | None = None
        self.address = address
        self.client_id = client_id
        self.direct_to_shards = direct_to_shards
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.upload_dtype = WireDtype.parse(upload_dtype)
        self.download_dtype = WireDtype.parse(download_dtype)
        # The channel's limit both ways: the server keeps its chunks 64 bytes below it (told at
        # registration and in every download request), and so do our uploads.
        # (gRPC spells "no limit" -1; its messages cannot exceed 2**31 - 1 bytes anyway.)
        self.max_message_bytes = int(max_message_bytes) if max_message_bytes > 0 else 2**31 - 1
        token = read_token(token, token_file)

        def connect(to: str) -> tuple[grpc.Channel, pb_grpc.AggregationStub]:
            channel, stubs_on = open_channel(
                to,
                options=[
                    ("grpc.max_receive_message_length", max_message_bytes),
                    ("grpc.max_send_message_length", max_message_bytes),
                ],
                token=token,
                tls_ca=tls_ca,
                tls_cert=tls_cert,
                tls_key=tls_key,
                tls=tls,
            )
            return channel, pb_grpc.AggregationStub(stubs_on)

        self._connect = connect
        self._channel, self._stub = connect(address)
        # A sharded server: the map, and one stub per shard (rank 0's is self._stub).
        self.shard_map: ShardMap | None = None
        self._shard_stubs: list[pb_grpc.AggregationStub] = []
        self._shard_channels: list[grpc.Channel] = []
        self._pool: ThreadPoolExecutor | None = None
        self.layout: ModelLayout | None = None
        self.chunk_bytes = self._fit_chunk(MIB)
        self.strategy: str | None = None
        self.last_model_layout: ModelLayout | None = None  # from the latest get_model header

    # ------------------------------------------------------------------ plumbing

    def admin_call(self, method: str, request: Any) -> Any:
        """An operator call (Checkpoint, Shutdown): needs an admin token when auth is on."""
        return getattr(self._stub, method)(request, timeout=self.timeout)

    def close(self) -> None:
        for channel in self._shard_channels:
            channel.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._channel.close()

    def _use_shards(self, shard_map: pb.ShardMap, layout: ModelLayout | None = None) -> None:
        """Connect to every shard of a sharded server (RegisterResponse.shard_map); nothing
        when this client talks to rank 0 only."""
        shards = sorted(shard_map.shards, key=lambda s: s.rank)
        if len(shards) < 2 or not self.direct_to_shards:
            return
        layout = layout or self._require_layout()
        bounds = [int(s.begin) for s in shards] + [int(shards[-1].end)]
        ranks = [int(s.rank) for s in shards]
        contiguous = all(int(a.end) == int(b.begin) for a, b in itertools.pairwise(shards))
        if ranks != list(range(len(shards))) or not contiguous or bounds[-1] != layout.numel:
            raise ConnectionError(
                f"the server's shard map does not cover the model's {layout.numel} elements "
                f"with ranks 0..{len(shards) - 1}: {shard_map}"
            )
        if self.shard_map is not None and tuple(bounds) == self.shard_map.bounds:
            return  # a re-registration: same shards
        for channel in self._shard_channels:
            channel.close()
        self.shard_map = ShardMap(tuple(bounds))
        self._shard_channels = []
        self._shard_stubs = [self._stub]
        for s in shards[1:]:
            channel, stub = self._connect(s.address)
            self._shard_channels.append(channel)
            self._shard_stubs.append(stub)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(shards), thread_name_prefix="aggsrv-shard")
        log.info("sharded server: %d shards at %s", len(shards), [s.address for s in shards])

    def _slices(self, method: str, request: Any) -> list[dict[str, torch.Tensor]]:
        """The tensors of the streaming call ``method`` (GetJob, GetModel) on shards 1..N-1,
        called at once, in rank order."""
        assert self._pool is not None

        def fetch(stub: pb_grpc.AggregationStub) -> dict[str, torch.Tensor]:
            def one() -> dict[str, torch.Tensor]:
                stream = getattr(stub, method)(request, timeout=self.timeout)
                return self._receive(stream, "header")[1]

            return self._retry(f"{method} (a shard's slice)", one)

        futures = [self._pool.submit(fetch, stub) for stub in self._shard_stubs[1:]]
        return [f.result() for f in futures]

    def _join(
        self, first: dict[str, torch.Tensor], others: list[dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """Whole tensors from every shard's slices ("buffers" lives on rank 0 whole)."""
        m = self.shard_map
        assert m is not None
        out = {}
        for name, t in first.items():
            if name == "buffers":
                out[name] = t
                continue
            parts = [t] + [o.get(name) for o in others]
            for r, part in enumerate(parts):
                if part is None or part.numel() != m.local_numel(r):
                    got = "nothing" if part is None else f"{part.numel()} elements"
                    raise ConnectionError(
                        f"shard {r} sent {got} of {name!r}, its slice holds {m.local_numel(r)}"
                    )
            out[name] = torch.cat(parts)
        return out

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Call `fn`, retrying UNAVAILABLE (and CANCELLED: this client never cancels its own
        calls, so it is a server stopping mid-call) with exponential backoff. Every call is
        safe to repeat: a push keeps its update id."""
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or attempt == self.retries:
                    raise
                log.warning(
                    "%s: server unavailable (%s), retrying in %.1fs", what, exc.details(), delay
                )
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _fit_chunk(self, chunk_bytes: int) -> int:
        """A chunk size the channel can send: at most ``chunk_bytes``, 64 bytes below our own
        message limit, in whole 4-byte elements."""
        return max(4, min(int(chunk_bytes), (self.max_message_bytes - 64) // 4 * 4))

    def _require_layout(self) -> ModelLayout:
        if self.layout is None:
            raise RuntimeError("call register() first")
        return self.layout

    def _receive(
        self,
        stream: Iterator,
        header_field: str,
        on_pending: Callable[[Pending], None] | None = None,
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """Read a header, chunks and a trailer into fresh float32 tensors (CRC checked)."""
        header = None
        decoder = None
        for msg in stream:
            kind = msg.WhichOneof("kind")
            if kind == "pending":
                if on_pending is not None:
                    on_pending(pending_of(msg.pending))
                continue
            if kind == "header":
                header = getattr(msg, header_field)
                sizes = {t.name: int(t.numel) for t in header.tensors}
                slot = StagingSlot(sum(sizes.values()))
                dtype = P.wire_dtype(header.dtype)
                # Our own limit plus headroom: the server picks the chunk size it negotiated.
                decoder = Decoder(slot, sizes, dtype, 64 * MIB)
            elif kind == "chunk":
                assert decoder is not None, "chunk before header"
                decoder.feed(msg.chunk.tensor, msg.chunk.offset, msg.chunk.data)
            elif kind == "trailer":
                assert decoder is not None, "trailer before header"
                views = decoder.finish(msg.trailer.crc32c, msg.trailer.payload_bytes)
                out = {name: v.clone() for name, v in views.items()}
                # Read the call's end too: a stream left open holds one of the connection's
                # concurrent streams until the server's status arrives.
                for _ in stream:
                    raise ConnectionError(f"a message followed the {header_field}'s trailer")
                return header, out
        raise ConnectionError("stream ended before its trailer")

    # ------------------------------------------------------------------ calls

    def status(self) -> pb.StatusResponse:
        return self._retry(
            "status", lambda: self._stub.GetStatus(pb.GetStatusRequest(), timeout=self.timeout)
        )

    def register(
        self,
        model: torch.nn.Module | None = None,
        *,
        layout: ModelLayout | None = None,
        initial: torch.Tensor | None = None,
        initial_buffers: torch.Tensor | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> pb.RegisterResponse:
        """Register with a model (or a layout plus flat initial weights and, when the layout has
        float buffers, ``initial_buffers``).

        The initial model travels only if the server has no model yet (checked with GetStatus
        first), and is adopted only by an empty server.
        """
        if model is not None:
            layout = ModelLayout.from_module(model)
            initial = layout.flatten(model, dtype=torch.float32)
            if layout.buffer_numel:
                initial_buffers = layout.flatten_buffers(model, dtype=torch.float32)
        if layout is None:
            raise ValueError("register needs a model or a layout")
        if initial is not None and layout.buffer_numel and initial_buffers is None:
            raise ValueError(
                f"the layout has {layout.buffer_numel} float buffer elements (BatchNorm "
                "statistics): pass initial_buffers with the initial weights"
            )
        self.layout = layout
        header = register_header(self.client_id, layout, self.max_message_bytes, labels)
        status = self.status()
        offer = initial is not None and not status.has_model
        if offer and status.limits.chunk_bytes:
            # The weights travel in the server's chunks, as far as our channel sends them.
            self.chunk_bytes = self._fit_chunk(status.limits.chunk_bytes)
        offered = {"weights": initial}
        if layout.buffer_numel:
            offered["buffers"] = initial_buffers

        def messages() -> Iterator[pb.RegisterRequest]:
            h = pb.RegisterHeader()
            h.CopyFrom(header)
            if offer:
                h.initial_dtype = P.WIRE_TO_PB[WireDtype.FLOAT32]
                h.initial_tensors.extend(P.tensor_infos(offered))
            yield pb.RegisterRequest(header=h)
            if offer:
                yield from P.chunk_stream(
                    offered, WireDtype.FLOAT32, self.chunk_bytes, pb.RegisterRequest
                )

        resp = self._retry(
            "register", lambda: self._stub.Register(messages(), timeout=self.timeout)
        )
        self.chunk_bytes = self._fit_chunk(resp.limits.chunk_bytes or MIB)
        self.strategy = resp.strategy
        self._use_shards(resp.shard_map)
        return resp

    def get_job(
        self, timeout: float | None = None, on_pending: Callable[[Pending], None] | None = None
    ) -> ClientJob:
        """Wait for the next job (the server keeps the stream open while it has none, and says
        why now and then: ``on_pending`` gets each :class:`Pending`)."""
        layout = self._require_layout()
        request = pb.GetJobRequest(
            client_id=self.client_id,
            layout_hash=layout.hash,
            dtype=P.WIRE_TO_PB[self.download_dtype],
            max_receive_message_bytes=self.max_message_bytes,
            shard_slice=self.shard_map is not None,
        )

        def call() -> tuple[Any, dict[str, torch.Tensor]]:
            stream = self._stub.GetJob(request, timeout=timeout or self.timeout)
            return self._receive(stream, "header", on_pending)

        header, tensors = self._retry("get_job", call)
        if self.shard_map is not None:
            slice_request = pb.GetJobRequest()
            slice_request.CopyFrom(request)
            slice_request.job_id = header.job_id
            tensors = self._join(tensors, self._slices("GetJob", slice_request))
        deadline = header.deadline.ToNanoseconds() / 1e9 if header.HasField("deadline") else None
        return ClientJob(
            job_id=header.job_id,
            base_version=int(header.base_version),
            deadline=deadline,
            recipe=P.recipe_from_pb(header.recipe),
            tensors=tensors,
        )

    def push(
        self,
        job: ClientJob,
        tensor: torch.Tensor,
        *,
        kind: UpdateKind = UpdateKind.DELTA,
        num_samples: int = 0,
        steps: int = 0,
        epochs: float = 0.0,
        complete: bool = True,
        update_id: str | None = None,
        encoding: Encoding | str = "auto",
        buffers: torch.Tensor | None = None,
    ) -> PushResult:
        """Stream one update (the flat [D] delta or final weights); retries keep the update id.

        ``encoding``: "dense", "coo", "bitmap", or "auto" (by the share of non-zero elements:
        sparse updates such as FedEN's proximal ones travel in a fraction of the bytes; always
        dense when the recipe sets ``clip_norm``, since a sparse upload's size depends on its
        values).
        ``buffers``: the client's flat [B] float buffers after training (absolute values), which
        every update of a model with float buffers must carry. When the job's recipe sets
        ``clip_norm`` (differential privacy's client-side clipping) the delta is scaled down to
        it here (:func:`aggsrv.client.clipping.clip_update`).
        """
        layout = self._require_layout()
        if tensor.numel() != layout.numel:
            raise ValueError(f"update has {tensor.numel()} elements, the layout {layout.numel}")
        if job.recipe.clip_norm is not None:
            if encoding == "auto":  # a sparse upload's size would tell how many values are 0
                encoding = "dense"
            flat = tensor.detach().reshape(-1)
            tensor = clip_update(flat, kind, job.weights.reshape(-1), job.recipe.clip_norm,
                                 self.upload_dtype.torch_dtype)  # fmt: skip
        if layout.buffer_numel and (buffers is None or buffers.numel() != layout.buffer_numel):
            got = "none" if buffers is None else f"{buffers.numel()} elements"
            raise ValueError(
                f"the model has {layout.buffer_numel} float buffer elements (BatchNorm "
                f"statistics): pass them as buffers= (got {got})"
            )
        if not layout.buffer_numel and buffers is not None:
            raise ValueError("buffers= given but the model has no float buffers")
        update_id = update_id or uuid.uuid4().hex
        header = pb.UpdateHeader(
            client_id=self.client_id,
            job_id=job.job_id,
            base_version=job.base_version,
            update_id=update_id,
            num_samples=num_samples,
            work=pb.WorkDone(steps=steps, epochs=epochs, complete=complete),
            kind=P.KIND_TO_PB[kind],
            dtype=P.WIRE_TO_PB[self.upload_dtype],
            layout_hash=layout.hash,
        )
        flat = tensor.detach().reshape(-1)
        extra = {} if buffers is None else {"buffers": buffers.detach().reshape(-1)}
        # A sharded server takes slice r on shard r, the float buffers on rank 0.
        compressor = self._compressor_for(kind, job)
        sections = None
        if compressor is not None:
            bounds = [0, flat.numel()] if self.shard_map is None else list(self.shard_map.bounds)
            recipe = job.recipe
            sections = compressor.compress(
                flat, bounds, recipe.update_quantizations, recipe.quantization_block,
                self.upload_dtype,
            )  # fmt: skip
        if sections is not None:
            streams = [
                self._section_stream(header, section, extra if r == 0 else {}, r)
                for r, section in enumerate(sections)
            ]
        else:
            parts = [flat] if self.shard_map is None else self.shard_map.split(flat)
            streams = [
                self._update_stream(header, part, extra if r == 0 else {}, encoding, r)
                for r, part in enumerate(parts)
            ]
        sent = [0] * len(streams)
        streams = [_counted(make, sent, r) for r, make in enumerate(streams)]
        try:
            resp = self._retry("push", lambda: self._push_streams(streams))
        except BaseException:
            if compressor is not None:
                compressor.discard()
            raise
        if compressor is not None:
            compressor.commit()
        return PushResult(
            status=P.PB_TO_STATUS[resp.outcome],
            version=int(resp.version),
            staleness=int(resp.staleness),
            update_id=resp.update_id,
            original=P.PB_TO_STATUS.get(resp.original_outcome),
            reason=P.PB_TO_FILTER_REASON.get(resp.filter_reason),
            message=resp.message,
            clipped=resp.clipped,
            payload_bytes=sum(sent),
        )

    def _push_streams(
        self, streams: list[Callable[[], Iterator[pb.UpdateMessage]]]
    ) -> pb.PushUpdateResponse:
        """Send one update's stream to each shard at once; the shards' common answer. Rank 0
        orders the update: when it refuses, the other shards' streams are cancelled."""
        if len(streams) == 1:
            return self._stub.PushUpdate(streams[0](), timeout=self.timeout)
        calls = [
            stub.PushUpdate.future(stream(), timeout=self.timeout)
            for stub, stream in zip(self._shard_stubs, streams, strict=True)
        ]
        try:
            first = calls[0].result()
        except grpc.RpcError:
            for call in calls[1:]:
                call.cancel()
            raise
        answers = [first] + [call.result() for call in calls[1:]]
        for r, other in enumerate(answers[1:], start=1):
            if (other.outcome, other.version) != (first.outcome, first.version):
                raise ConnectionError(
                    f"shard {r} answered {pb.Outcome.Name(other.outcome)} at v{other.version}, "
                    f"rank 0 {pb.Outcome.Name(first.outcome)} at v{first.version}: the shards "
                    "disagree (report this as a bug)"
                )
        return first

    def _compressor_for(self, kind: UpdateKind, job: ClientJob) -> Compressor | None:
        """The compression state for this update: DELTA updates only, and not under
        differential privacy's client-side clipping (the recipe then offers none)."""
        if self.compression is None or kind is not UpdateKind.DELTA:
            return None
        if job.recipe.clip_norm is not None:
            return None
        numel = self._require_layout().numel
        if self._compressor is None or self._compressor.numel != numel:
            self._compressor = Compressor(self.compression, numel)
        return self._compressor

    def _section_stream(
        self,
        base: pb.UpdateHeader,
        section: Section,
        extra: dict[str, torch.Tensor],
        shard_rank: int,
    ) -> Callable[[], Iterator[pb.UpdateMessage]]:
        """The messages of one compressed update (or slice) under the header ``base``."""
        header = pb.UpdateHeader()
        header.CopyFrom(base)
        header.shard_rank = shard_rank
        info = tpb.TensorInfo(name="update", numel=section.numel, nnz=section.nnz)
        info.encoding = P.ENCODING_TO_PB[section.encoding]
        if section.quantization is not None:
            info.quantization = P.QUANTIZATION_TO_PB[section.quantization]
            info.block_size = section.block
        header.tensors.append(info)
        for name, t in extra.items():
            header.tensors.append(tpb.TensorInfo(name=name, numel=t.numel()))

        def messages() -> Iterator[pb.UpdateMessage]:
            yield pb.UpdateMessage(header=header)
            sections = [("update", section.payload)]
            for name, t in extra.items():
                sections.append((name, wire_view(to_wire(t, self.upload_dtype))))
            yield from P.byte_stream(sections, self.chunk_bytes, pb.UpdateMessage)

        return messages

    def _update_stream(
        self,
        base: pb.UpdateHeader,
        flat: torch.Tensor,
        extra: dict[str, torch.Tensor],
        encoding: Encoding | str,
        shard_rank: int,
    ) -> Callable[[], Iterator[pb.UpdateMessage]]:
        """The messages of one update (or of shard ``shard_rank``'s slice of it) under the
        header ``base``, as a fresh iterator per attempt."""
        header = pb.UpdateHeader()
        header.CopyFrom(base)
        header.shard_rank = shard_rank
        header.tensors.append(tpb.TensorInfo(name="update", numel=flat.numel()))
        for name, t in extra.items():
            header.tensors.append(tpb.TensorInfo(name=name, numel=t.numel()))
        if encoding == "auto":
            # A dense update (no zeros among ~1024 strided samples) skips the counting pass.
            step = max(1, flat.numel() // 1024)
            if flat.numel() == 0 or bool((flat[::step] != 0).all()):
                enc = Encoding.DENSE
            else:
                nnz = int(torch.count_nonzero(flat))
                enc = choose_encoding(flat.numel(), nnz, self.upload_dtype)
        else:
            enc = Encoding.parse(encoding)
        payload = None
        if enc is not Encoding.DENSE:
            payload, nnz = encode_sparse(flat, self.upload_dtype, enc)
            header.tensors[0].encoding = P.ENCODING_TO_PB[enc]
            header.tensors[0].nnz = nnz

        def messages() -> Iterator[pb.UpdateMessage]:
            yield pb.UpdateMessage(header=header)
            if payload is not None:
                sections = [("update", payload)]
                for name, t in extra.items():
                    sections.append((name, wire_view(to_wire(t, self.upload_dtype))))
                yield from P.byte_stream(sections, self.chunk_bytes, pb.UpdateMessage)
                return
            yield from P.chunk_stream(
                {"update": flat, **extra}, self.upload_dtype, self.chunk_bytes, pb.UpdateMessage
            )

        return messages

    def get_model(
        self, version: int | None = None, *, include_buffers: bool = False
    ) -> tuple[int, torch.Tensor] | tuple[int, torch.Tensor, torch.Tensor | None]:
        """(version, flat float32 weights) of the latest or a retained version; with
        ``include_buffers`` (version, weights, float buffers or None without any)."""
        request = pb.GetModelRequest(
            dtype=P.WIRE_TO_PB[self.download_dtype],
            client_id=self.client_id,
            include_buffers=include_buffers,
            max_receive_message_bytes=self.max_message_bytes,
            # Reading every shard: rank 0's slice only, even before this client knows the map
            # (a reader that never registered learns it below, from GetStatus).
            shard_slice=self.direct_to_shards,
        )
        if version is not None:
            request.version = version

        def call() -> tuple[Any, dict[str, torch.Tensor]]:
            return self._receive(self._stub.GetModel(request, timeout=self.timeout), "header")

        header, tensors = self._retry("get_model", call)
        whole = P.layout_from_pb(header.layout)
        if self.shard_map is None and tensors["weights"].numel() != whole.numel:
            # Rank 0 sent its slice only: a reader that never registered, or a server older
            # than GetModelRequest.shard_slice.
            self._use_shards(self.status().shard_map, whole)
            if self.shard_map is None:
                raise ConnectionError(
                    f"rank 0 sent {tensors['weights'].numel()} of the model's {whole.numel} "
                    "elements: a server that does not relay needs direct_to_shards=True"
                )
        if self.shard_map is not None:
            slice_request = pb.GetModelRequest()
            slice_request.CopyFrom(request)
            slice_request.version = header.version
            slice_request.include_buffers = False  # rank 0 holds them
            tensors = self._join(tensors, self._slices("GetModel", slice_request))
        self.last_model_layout = whole
        if include_buffers:
            return int(header.version), tensors["weights"], tensors.get("buffers")
        return int(header.version), tensors["weights"]

    def heartbeat(self, job_id: str = "") -> pb.HeartbeatResponse:
        request = pb.HeartbeatRequest(client_id=self.client_id, job_id=job_id)
        return self._retry("heartbeat", lambda: self._stub.Heartbeat(request, timeout=self.timeout))


def register_header(
    client_id: str,
    layout: ModelLayout,
    max_receive_message_bytes: int,
    labels: Mapping[str, str] | None = None,
) -> pb.RegisterHeader:
    """The RegisterHeader this client sends: every wire dtype and update kind, proximal
    training, and the largest message its channel receives."""
    return pb.RegisterHeader(
        client_id=client_id,
        layout=P.layout_to_pb(layout),
        layout_hash=layout.hash,
        capabilities=pb.ClientCapabilities(
            upload_dtypes=[P.WIRE_TO_PB[d] for d in WireDtype],
            download_dtypes=[P.WIRE_TO_PB[d] for d in WireDtype],
            update_kinds=[pb.UPDATE_KIND_WEIGHTS, pb.UPDATE_KIND_DELTA],
            proximal=True,
            max_receive_message_bytes=max_receive_message_bytes,
        ),
        labels=dict(labels or {}),
    )


def pending_of(msg: pb.JobPending) -> Pending:
    """A JobPending message as a :class:`Pending` (a reason this client does not know, from a
    newer server, reads as UNSPECIFIED)."""
    try:
        reason = PendingReason(msg.code)
    except ValueError:
        reason = PendingReason.UNSPECIFIED
    return Pending(reason, msg.reason, int(msg.model_version))
