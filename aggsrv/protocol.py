"""Conversions between the generated `aggsrv.v1` messages and our Python types, shared by the
server and the client: wire dtypes, layouts, recipes, chunked tensor streams, timestamps."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from enum import Enum

import torch
from google.protobuf import duration_pb2, timestamp_pb2
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from aggsrv.layout import ModelLayout
from aggsrv.transport import Crc32c, Encoder, Encoding, Quantization, WireDtype, check_block
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import FilterReason, ProjectionMode, Recipe, Status, UpdateKind


def _same_names(ours: type[Enum], wire: EnumTypeWrapper, prefix: str) -> tuple[dict, dict]:
    """Our enum to the wire's and back, member by member: the proto spells each of our names as
    ``PREFIX_NAME``, so a member the wire lacks fails here, at import."""
    to_pb = {m: wire.Value(f"{prefix}_{m.name}") for m in ours}
    return to_pb, {v: k for k, v in to_pb.items()}


WIRE_TO_PB, PB_TO_WIRE = _same_names(WireDtype, tpb.WireDtype, "WIRE_DTYPE")
ENCODING_TO_PB, PB_TO_ENCODING = _same_names(Encoding, tpb.TensorEncoding, "TENSOR_ENCODING")
PB_TO_ENCODING[tpb.TENSOR_ENCODING_UNSPECIFIED] = Encoding.DENSE
QUANTIZATION_TO_PB = {
    Quantization.INT8: tpb.VALUE_QUANTIZATION_INT8,
    Quantization.INT4: tpb.VALUE_QUANTIZATION_INT4,
}
PB_TO_QUANTIZATION = {v: k for k, v in QUANTIZATION_TO_PB.items()}
KIND_TO_PB, PB_TO_KIND = _same_names(UpdateKind, pb.UpdateKind, "UPDATE_KIND")
STATUS_TO_PB, PB_TO_STATUS = _same_names(Status, pb.Outcome, "OUTCOME")
# FilterReason's numbers are the wire's (values.FilterReason), so the value travels as is.
FILTER_REASON_TO_PB = {r: int(r) for r in FilterReason}
PB_TO_FILTER_REASON = {int(r): r for r in FilterReason if r is not FilterReason.UNSPECIFIED}
PROJECTION_TO_PB, PB_TO_PROJECTION = _same_names(
    ProjectionMode, pb.ProjectionMode, "PROJECTION_MODE"
)
# FedEN's elastic-net choices travel in Recipe.extra (aggsrv.client.train: 0/1 per key) and on
# the wire in ElasticNet's enum fields; other values stay in the extra map for the client to refuse.
ELASTIC_ENUMS = {
    "elastic_centre": ("anchor", pb.ELASTIC_NET_ANCHOR_ZERO, pb.ELASTIC_NET_ANCHOR_START),
    "elastic_solver": ("solver", pb.ELASTIC_NET_SOLVER_SUBGRADIENT, pb.ELASTIC_NET_SOLVER_PROX),
}


def wire_dtype(value: int, field: str = "dtype") -> WireDtype:
    """The dtype of a header that announces tensors (UpdateHeader.dtype, initial_dtype, the
    job's and the model's dtype): UNSPECIFIED is an error there (tensor.proto), as is an enum
    value the wire does not know; ValueError names the field."""
    if value == tpb.WIRE_DTYPE_UNSPECIFIED:
        raise ValueError(
            f"{field} is WIRE_DTYPE_UNSPECIFIED: a header that announces tensors must name "
            "their wire dtype (FLOAT32, FLOAT16 or BFLOAT16)"
        )
    try:
        return PB_TO_WIRE[value]
    except KeyError:
        raise ValueError(
            f"{field} {value} is not a wire dtype: use FLOAT32, FLOAT16 or BFLOAT16"
        ) from None


def requested_dtype(value: int) -> WireDtype:
    """The dtype a download request asks for (GetJobRequest.dtype, GetModelRequest.dtype):
    UNSPECIFIED means FLOAT32, which every client decodes; ValueError for an unknown value."""
    if value == tpb.WIRE_DTYPE_UNSPECIFIED:
        return WireDtype.FLOAT32
    return wire_dtype(value)


def layout_to_pb(layout: ModelLayout) -> tpb.ModelLayout:
    """The trainable tensors (and float buffers) of a layout as a proto message."""
    norm = layout.is_norm.tolist()
    return tpb.ModelLayout(
        tensors=[
            tpb.LayoutTensor(name=n, shape=list(s), is_norm=bool(f))
            for n, s, f in zip(layout.names, layout.shapes, norm, strict=True)
        ],
        buffers=[
            tpb.LayoutTensor(name=n, shape=list(s))
            for n, s in zip(layout.buffer_names, layout.buffer_shapes, strict=True)
        ],
    )


def layout_from_pb(msg: tpb.ModelLayout) -> ModelLayout:
    """A layout from its proto description: trainable tensors with their norm flags (ORTHOFL
    leaves norm segments uncalibrated, so the flags must survive the wire) and float buffers."""
    return ModelLayout(
        [(t.name, tuple(t.shape)) for t in msg.tensors],
        [(b.name, tuple(b.shape)) for b in msg.buffers],
        norm_flags=[bool(t.is_norm) for t in msg.tensors],
    )


def recipe_to_pb(recipe: Recipe) -> pb.Recipe:
    msg = pb.Recipe(
        learning_rate=recipe.learning_rate,
        batch_size=recipe.batch_size,
        momentum=recipe.momentum,
        weight_decay=recipe.weight_decay,
        projection=pb.Projection(
            mode=PROJECTION_TO_PB[recipe.projection], only_conflicting=recipe.only_conflicting
        ),
        elastic_net=pb.ElasticNet(
            penalty_lambda=recipe.elastic_lambda, mixing_alpha=recipe.elastic_alpha
        ),
        proximal_mu=recipe.proximal_mu,
    )
    if recipe.clip_norm is not None:
        msg.clip_norm = recipe.clip_norm
    msg.update_quantizations.extend(
        QUANTIZATION_TO_PB[Quantization(q)] for q in recipe.update_quantizations
    )
    msg.quantization_block = recipe.quantization_block
    extra = dict(recipe.extra)
    for key, (field, off, on) in ELASTIC_ENUMS.items():
        if extra.get(key) in (0.0, 1.0):
            setattr(msg.elastic_net, field, on if extra.pop(key) == 1.0 else off)
    if extra.get("elastic_exclude_biases") == 1.0:
        msg.elastic_net.exclude_biases = bool(extra.pop("elastic_exclude_biases"))
    msg.extra.update(extra)
    if recipe.local_steps is not None:
        msg.local_steps = int(recipe.local_steps)
    else:
        epochs = float(recipe.local_epochs)
        if epochs.is_integer():
            msg.local_epochs = int(epochs)
        else:  # fractional epochs travel as an extra so the uint32 field stays exact
            msg.extra["local_epochs"] = epochs
    return msg


def recipe_from_pb(msg: pb.Recipe) -> Recipe:
    extra = dict(msg.extra)
    for key, (field, off, on) in ELASTIC_ENUMS.items():
        value = getattr(msg.elastic_net, field)
        if value in (off, on):
            extra[key] = 1.0 if value == on else 0.0
    if msg.elastic_net.exclude_biases:
        extra["elastic_exclude_biases"] = 1.0
    epochs: float | None = None
    if "local_epochs" in extra:
        epochs = extra.pop("local_epochs")
    elif msg.HasField("local_epochs"):
        epochs = float(msg.local_epochs)
    steps = int(msg.local_steps) if msg.HasField("local_steps") else None
    if epochs is None and steps is None:
        epochs = 1.0
    mode = PB_TO_PROJECTION.get(msg.projection.mode, ProjectionMode.NONE)
    return Recipe(
        local_epochs=epochs,
        local_steps=steps,
        learning_rate=msg.learning_rate if msg.HasField("learning_rate") else 0.01,
        batch_size=msg.batch_size if msg.HasField("batch_size") else 32,
        momentum=msg.momentum,
        weight_decay=msg.weight_decay,
        projection=mode,
        only_conflicting=msg.projection.only_conflicting,
        elastic_lambda=msg.elastic_net.penalty_lambda,
        elastic_alpha=msg.elastic_net.mixing_alpha,
        proximal_mu=msg.proximal_mu,
        extra=extra,
        clip_norm=msg.clip_norm if msg.HasField("clip_norm") else None,
        update_quantizations=tuple(
            PB_TO_QUANTIZATION[q].value for q in msg.update_quantizations if q in PB_TO_QUANTIZATION
        ),
        quantization_block=msg.quantization_block,
    )


def tensor_infos(tensors: Mapping[str, torch.Tensor]) -> list[tpb.TensorInfo]:
    return [tpb.TensorInfo(name=n, numel=t.numel()) for n, t in tensors.items()]


def chunk_stream(
    tensors: Mapping[str, torch.Tensor], dtype: WireDtype, chunk_bytes: int, message_cls: type
) -> Iterator:
    """`message_cls(chunk=...)` messages for every chunk, then `message_cls(trailer=...)`."""
    enc = Encoder(list(tensors.items()), dtype, chunk_bytes)
    for c in enc.chunks():
        # protobuf wants bytes, not a memoryview: one copy while the piece is in cache.
        yield message_cls(
            chunk=tpb.TensorChunk(tensor=c.name, offset=c.byte_offset, data=bytes(c.data))
        )
    yield message_cls(trailer=tpb.StreamTrailer(crc32c=enc.crc32c, payload_bytes=enc.nbytes))


def serialized_chunk_stream(
    tensors: Mapping[str, torch.Tensor], dtype: WireDtype, chunk_bytes: int, message_cls: type
) -> Iterator[bytes]:
    """The messages of :func:`chunk_stream`, serialized: the bytes ``SerializeToString`` would
    give, with one copy of each chunk's data instead of three (into bytes, into the message,
    out of it). A server sends these through a serializer that passes bytes on unchanged."""
    chunk_key = _key(message_cls.DESCRIPTOR.fields_by_name["chunk"].number, _LENGTH_DELIMITED)
    enc = Encoder(list(tensors.items()), dtype, chunk_bytes)
    for c in enc.chunks():
        yield _chunk_message(chunk_key, c.name, c.byte_offset, c.data)
    trailer = tpb.StreamTrailer(crc32c=enc.crc32c, payload_bytes=enc.nbytes)
    yield message_cls(trailer=trailer).SerializeToString()


_LENGTH_DELIMITED, _VARINT = 2, 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _chunk_message(chunk_key: bytes, tensor: str, offset: int, data: memoryview | bytes) -> bytes:
    """A message whose chunk field (``chunk_key``) holds TensorChunk(tensor, offset, data)."""
    name = tensor.encode("utf-8")
    n = memoryview(data).nbytes
    # TensorChunk's fields in number order, each left out at its default, as protobuf does.
    inner = b"".join((
        _CHUNK_TENSOR + _varint(len(name)) + name if name else b"",
        _CHUNK_OFFSET + _varint(offset) if offset else b"",
        _CHUNK_DATA + _varint(n),
    ))  # fmt: skip
    return b"".join((chunk_key, _varint(len(inner) + n), inner, data))


_CHUNK_FIELDS = tpb.TensorChunk.DESCRIPTOR.fields_by_name
_CHUNK_TENSOR = _key(_CHUNK_FIELDS["tensor"].number, _LENGTH_DELIMITED)
_CHUNK_OFFSET = _key(_CHUNK_FIELDS["offset"].number, _VARINT)
_CHUNK_DATA = _key(_CHUNK_FIELDS["data"].number, _LENGTH_DELIMITED)


def sparse_infos(
    infos: list[tpb.TensorInfo],
) -> dict[str, tuple[Encoding, int]]:
    """The (encoding, nnz) of each announced tensor that is not dense; ValueError if unknown."""
    out = {}
    for info in infos:
        encoding = PB_TO_ENCODING.get(info.encoding)
        if encoding is None:
            raise ValueError(f"tensor {info.name!r} has an unknown encoding {info.encoding}")
        if encoding is not Encoding.DENSE:
            out[info.name] = (encoding, int(info.nnz))
    return out


def quantized_infos(infos: list[tpb.TensorInfo]) -> dict[str, tuple[Quantization, int]]:
    """The (quantization, block size) of each announced tensor whose values are quantized;
    ValueError for an unknown quantization or a block size out of range."""
    out = {}
    for info in infos:
        if info.quantization == tpb.VALUE_QUANTIZATION_UNSPECIFIED:
            if info.block_size:
                raise ValueError(
                    f"tensor {info.name!r} has block_size {info.block_size} but no quantization"
                )
            continue
        q = PB_TO_QUANTIZATION.get(info.quantization)
        if q is None:
            raise ValueError(
                f"tensor {info.name!r} has an unknown quantization {info.quantization}"
            )
        try:
            out[info.name] = (q, check_block(int(info.block_size)))
        except ValueError as exc:
            raise ValueError(f"tensor {info.name!r}: {exc}") from None
    return out


def byte_stream(
    sections: Iterable[tuple[str, memoryview]], chunk_bytes: int, message_cls: type
) -> Iterator:
    """Chunks of named raw wire-byte sections (a sparse update, then e.g. the dense buffers'
    bytes) in order, then the trailer with the CRC-32C over all of them."""
    crc = Crc32c()
    for name, payload in sections:
        for start in range(0, payload.nbytes, chunk_bytes):
            piece = bytes(payload[start : start + chunk_bytes])
            crc.update(piece)
            yield message_cls(chunk=tpb.TensorChunk(tensor=name, offset=start, data=piece))
    yield message_cls(trailer=tpb.StreamTrailer(crc32c=crc.value, payload_bytes=crc.nbytes))


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d
