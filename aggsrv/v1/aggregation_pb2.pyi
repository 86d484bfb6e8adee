import datetime

from aggsrv.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_KIND_UNSPECIFIED: _ClassVar[UpdateKind]
    UPDATE_KIND_WEIGHTS: _ClassVar[UpdateKind]
    UPDATE_KIND_DELTA: _ClassVar[UpdateKind]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_APPLIED: _ClassVar[Outcome]
    OUTCOME_BUFFERED: _ClassVar[Outcome]
    OUTCOME_DUPLICATE: _ClassVar[Outcome]
    OUTCOME_FILTERED: _ClassVar[Outcome]

class FilterReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILTER_REASON_UNSPECIFIED: _ClassVar[FilterReason]
    FILTER_REASON_NORM_OUTLIER: _ClassVar[FilterReason]

class ProjectionMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROJECTION_MODE_UNSPECIFIED: _ClassVar[ProjectionMode]
    PROJECTION_MODE_NONE: _ClassVar[ProjectionMode]
    PROJECTION_MODE_WHOLE: _ClassVar[ProjectionMode]
    PROJECTION_MODE_LAYERWISE: _ClassVar[ProjectionMode]

class ElasticNetAnchor(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ELASTIC_NET_ANCHOR_UNSPECIFIED: _ClassVar[ElasticNetAnchor]
    ELASTIC_NET_ANCHOR_ZERO: _ClassVar[ElasticNetAnchor]
    ELASTIC_NET_ANCHOR_START: _ClassVar[ElasticNetAnchor]

class ElasticNetSolver(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ELASTIC_NET_SOLVER_UNSPECIFIED: _ClassVar[ElasticNetSolver]
    ELASTIC_NET_SOLVER_SUBGRADIENT: _ClassVar[ElasticNetSolver]
    ELASTIC_NET_SOLVER_PROX: _ClassVar[ElasticNetSolver]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_CURRENT: _ClassVar[JobState]
    JOB_STATE_SUPERSEDED: _ClassVar[JobState]
    JOB_STATE_COMPLETED: _ClassVar[JobState]
    JOB_STATE_UNKNOWN: _ClassVar[JobState]

class PendingReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PENDING_REASON_UNSPECIFIED: _ClassVar[PendingReason]
    PENDING_REASON_NO_ROUND_OPEN: _ClassVar[PendingReason]
    PENDING_REASON_NOT_SELECTED: _ClassVar[PendingReason]
    PENDING_REASON_ALREADY_REPORTED: _ClassVar[PendingReason]
    PENDING_REASON_UPDATE_BUFFERED: _ClassVar[PendingReason]
UPDATE_KIND_UNSPECIFIED: UpdateKind
UPDATE_KIND_WEIGHTS: UpdateKind
UPDATE_KIND_DELTA: UpdateKind
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_APPLIED: Outcome
OUTCOME_BUFFERED: Outcome
OUTCOME_DUPLICATE: Outcome
OUTCOME_FILTERED: Outcome
FILTER_REASON_UNSPECIFIED: FilterReason
FILTER_REASON_NORM_OUTLIER: FilterReason
PROJECTION_MODE_UNSPECIFIED: ProjectionMode
PROJECTION_MODE_NONE: ProjectionMode
PROJECTION_MODE_WHOLE: ProjectionMode
PROJECTION_MODE_LAYERWISE: ProjectionMode
ELASTIC_NET_ANCHOR_UNSPECIFIED: ElasticNetAnchor
ELASTIC_NET_ANCHOR_ZERO: ElasticNetAnchor
ELASTIC_NET_ANCHOR_START: ElasticNetAnchor
ELASTIC_NET_SOLVER_UNSPECIFIED: ElasticNetSolver
ELASTIC_NET_SOLVER_SUBGRADIENT: ElasticNetSolver
ELASTIC_NET_SOLVER_PROX: ElasticNetSolver
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_CURRENT: JobState
JOB_STATE_SUPERSEDED: JobState
JOB_STATE_COMPLETED: JobState
JOB_STATE_UNKNOWN: JobState
PENDING_REASON_UNSPECIFIED: PendingReason
PENDING_REASON_NO_ROUND_OPEN: PendingReason
PENDING_REASON_NOT_SELECTED: PendingReason
PENDING_REASON_ALREADY_REPORTED: PendingReason
PENDING_REASON_UPDATE_BUFFERED: PendingReason

class ClientCapabilities(_message.Message):
    __slots__ = ("upload_dtypes", "download_dtypes", "update_kinds", "projection_modes", "elastic_net", "proximal", "partial_work", "max_receive_message_bytes", "extensions")
    UPLOAD_DTYPES_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_DTYPES_FIELD_NUMBER: _ClassVar[int]
    UPDATE_KINDS_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_MODES_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_NET_FIELD_NUMBER: _ClassVar[int]
    PROXIMAL_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_WORK_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    upload_dtypes: _containers.RepeatedScalarFieldContainer[_tensor_pb2.WireDtype]
    download_dtypes: _containers.RepeatedScalarFieldContainer[_tensor_pb2.WireDtype]
    update_kinds: _containers.RepeatedScalarFieldContainer[UpdateKind]
    projection_modes: _containers.RepeatedScalarFieldContainer[ProjectionMode]
    elastic_net: bool
    proximal: bool
    partial_work: bool
    max_receive_message_bytes: int
    extensions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, upload_dtypes: _Optional[_Iterable[_Union[_tensor_pb2.WireDtype, str]]] = ..., download_dtypes: _Optional[_Iterable[_Union[_tensor_pb2.WireDtype, str]]] = ..., update_kinds: _Optional[_Iterable[_Union[UpdateKind, str]]] = ..., projection_modes: _Optional[_Iterable[_Union[ProjectionMode, str]]] = ..., elastic_net: _Optional[bool] = ..., proximal: _Optional[bool] = ..., partial_work: _Optional[bool] = ..., max_receive_message_bytes: _Optional[int] = ..., extensions: _Optional[_Iterable[str]] = ...) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("chunk_bytes", "max_staleness", "max_concurrent_uploads", "max_receive_message_bytes", "upload_dtypes", "lease", "remembered_update_ids", "max_clients")
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_UPLOADS_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_DTYPES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REMEMBERED_UPDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    chunk_bytes: int
    max_staleness: int
    max_concurrent_uploads: int
    max_receive_message_bytes: int
    upload_dtypes: _containers.RepeatedScalarFieldContainer[_tensor_pb2.WireDtype]
    lease: _duration_pb2.Duration
    remembered_update_ids: int
    max_clients: int
    def __init__(self, chunk_bytes: _Optional[int] = ..., max_staleness: _Optional[int] = ..., max_concurrent_uploads: _Optional[int] = ..., max_receive_message_bytes: _Optional[int] = ..., upload_dtypes: _Optional[_Iterable[_Union[_tensor_pb2.WireDtype, str]]] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., remembered_update_ids: _Optional[int] = ..., max_clients: _Optional[int] = ...) -> None: ...

class WorkDone(_message.Message):
    __slots__ = ("steps", "epochs", "examples", "compute_seconds", "complete", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    epochs: float
    examples: int
    compute_seconds: float
    complete: bool
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, steps: _Optional[int] = ..., epochs: _Optional[float] = ..., examples: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., complete: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Projection(_message.Message):
    __slots__ = ("mode", "only_conflicting", "basis_tensor", "basis_norm_sq", "eps")
    MODE_FIELD_NUMBER: _ClassVar[int]
    ONLY_CONFLICTING_FIELD_NUMBER: _ClassVar[int]
    BASIS_TENSOR_FIELD_NUMBER: _ClassVar[int]
    BASIS_NORM_SQ_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    mode: ProjectionMode
    only_conflicting: bool
    basis_tensor: str
    basis_norm_sq: float
    eps: float
    def __init__(self, mode: _Optional[_Union[ProjectionMode, str]] = ..., only_conflicting: _Optional[bool] = ..., basis_tensor: _Optional[str] = ..., basis_norm_sq: _Optional[float] = ..., eps: _Optional[float] = ...) -> None: ...

class ElasticNet(_message.Message):
    __slots__ = ("penalty_lambda", "mixing_alpha", "anchor", "solver", "exclude_biases")
    PENALTY_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    MIXING_ALPHA_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    SOLVER_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_BIASES_FIELD_NUMBER: _ClassVar[int]
    penalty_lambda: float
    mixing_alpha: float
    anchor: ElasticNetAnchor
    solver: ElasticNetSolver
    exclude_biases: bool
    def __init__(self, penalty_lambda: _Optional[float] = ..., mixing_alpha: _Optional[float] = ..., anchor: _Optional[_Union[ElasticNetAnchor, str]] = ..., solver: _Optional[_Union[ElasticNetSolver, str]] = ..., exclude_biases: _Optional[bool] = ...) -> None: ...

class Recipe(_message.Message):
    __slots__ = ("local_epochs", "local_steps", "learning_rate", "batch_size", "momentum", "weight_decay", "projection", "elastic_net", "proximal_mu", "partial_work", "seed", "optimizer", "clip_norm", "extra", "update_quantizations", "quantization_block")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_NET_FIELD_NUMBER: _ClassVar[int]
    PROXIMAL_MU_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_WORK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    UPDATE_QUANTIZATIONS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_BLOCK_FIELD_NUMBER: _ClassVar[int]
    local_epochs: int
    local_steps: int
    learning_rate: float
    batch_size: int
    momentum: float
    weight_decay: float
    projection: Projection
    elastic_net: ElasticNet
    proximal_mu: float
    partial_work: bool
    seed: int
    optimizer: str
    clip_norm: float
    extra: _containers.ScalarMap[str, float]
    update_quantizations: _containers.RepeatedScalarFieldContainer[_tensor_pb2.ValueQuantization]
    quantization_block: int
    def __init__(self, local_epochs: _Optional[int] = ..., local_steps: _Optional[int] = ..., learning_rate: _Optional[float] = ..., batch_size: _Optional[int] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., projection: _Optional[_Union[Projection, _Mapping]] = ..., elastic_net: _Optional[_Union[ElasticNet, _Mapping]] = ..., proximal_mu: _Optional[float] = ..., partial_work: _Optional[bool] = ..., seed: _Optional[int] = ..., optimizer: _Optional[str] = ..., clip_norm: _Optional[float] = ..., extra: _Optional[_Mapping[str, float]] = ..., update_quantizations: _Optional[_Iterable[_Union[_tensor_pb2.ValueQuantization, str]]] = ..., quantization_block: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: RegisterHeader
    chunk: _tensor_pb2.TensorChunk
    trailer: _tensor_pb2.StreamTrailer
    def __init__(self, header: _Optional[_Union[RegisterHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., trailer: _Optional[_Union[_tensor_pb2.StreamTrailer, _Mapping]] = ...) -> None: ...

class RegisterHeader(_message.Message):
    __slots__ = ("client_id", "layout", "layout_hash", "capabilities", "initial_dtype", "initial_tensors", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    INITIAL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_TENSORS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    layout: _tensor_pb2.ModelLayout
    layout_hash: str
    capabilities: ClientCapabilities
    initial_dtype: _tensor_pb2.WireDtype
    initial_tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorInfo]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, client_id: _Optional[str] = ..., layout: _Optional[_Union[_tensor_pb2.ModelLayout, _Mapping]] = ..., layout_hash: _Optional[str] = ..., capabilities: _Optional[_Union[ClientCapabilities, _Mapping]] = ..., initial_dtype: _Optional[_Union[_tensor_pb2.WireDtype, str]] = ..., initial_tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorInfo, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("client_id", "known_before", "initial_model_adopted", "model_version", "layout_hash", "strategy", "limits", "lease_expires", "next_heartbeat", "shard_map")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_BEFORE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_MODEL_ADOPTED_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_FIELD_NUMBER: _ClassVar[int]
    NEXT_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    known_before: bool
    initial_model_adopted: bool
    model_version: int
    layout_hash: str
    strategy: str
    limits: ServerLimits
    lease_expires: _timestamp_pb2.Timestamp
    next_heartbeat: _duration_pb2.Duration
    shard_map: ShardMap
    def __init__(self, client_id: _Optional[str] = ..., known_before: _Optional[bool] = ..., initial_model_adopted: _Optional[bool] = ..., model_version: _Optional[int] = ..., layout_hash: _Optional[str] = ..., strategy: _Optional[str] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., lease_expires: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., next_heartbeat: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ...) -> None: ...

class ShardMap(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("rank", "address", "begin", "end")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    begin: int
    end: int
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("client_id", "layout_hash", "dtype", "job_id", "max_receive_message_bytes", "shard_slice")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_SLICE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    layout_hash: str
    dtype: _tensor_pb2.WireDtype
    job_id: str
    max_receive_message_bytes: int
    shard_slice: bool
    def __init__(self, client_id: _Optional[str] = ..., layout_hash: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.WireDtype, str]] = ..., job_id: _Optional[str] = ..., max_receive_message_bytes: _Optional[int] = ..., shard_slice: _Optional[bool] = ...) -> None: ...

class JobMessage(_message.Message):
    __slots__ = ("pending", "header", "chunk", "trailer")
    PENDING_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    pending: JobPending
    header: JobHeader
    chunk: _tensor_pb2.TensorChunk
    trailer: _tensor_pb2.StreamTrailer
    def __init__(self, pending: _Optional[_Union[JobPending, _Mapping]] = ..., header: _Optional[_Union[JobHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., trailer: _Optional[_Union[_tensor_pb2.StreamTrailer, _Mapping]] = ...) -> None: ...

class JobPending(_message.Message):
    __slots__ = ("reason", "model_version", "code")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    model_version: int
    code: PendingReason
    def __init__(self, reason: _Optional[str] = ..., model_version: _Optional[int] = ..., code: _Optional[_Union[PendingReason, str]] = ...) -> None: ...

class JobHeader(_message.Message):
    __slots__ = ("job_id", "client_id", "base_version", "layout_hash", "round", "deadline", "time_budget", "recipe", "dtype", "tensors", "update_kind", "upload_dtype", "send_buffers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TIME_BUDGET_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_KIND_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEND_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    client_id: str
    base_version: int
    layout_hash: str
    round: int
    deadline: _timestamp_pb2.Timestamp
    time_budget: _duration_pb2.Duration
    recipe: Recipe
    dtype: _tensor_pb2.WireDtype
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorInfo]
    update_kind: UpdateKind
    upload_dtype: _tensor_pb2.WireDtype
    send_buffers: bool
    def __init__(self, job_id: _Optional[str] = ..., client_id: _Optional[str] = ..., base_version: _Optional[int] = ..., layout_hash: _Optional[str] = ..., round: _Optional[int] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., time_budget: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., recipe: _Optional[_Union[Recipe, _Mapping]] = ..., dtype: _Optional[_Union[_tensor_pb2.WireDtype, str]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorInfo, _Mapping]]] = ..., update_kind: _Optional[_Union[UpdateKind, str]] = ..., upload_dtype: _Optional[_Union[_tensor_pb2.WireDtype, str]] = ..., send_buffers: _Optional[bool] = ...) -> None: ...

class UpdateMessage(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    chunk: _tensor_pb2.TensorChunk
    trailer: _tensor_pb2.StreamTrailer
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., trailer: _Optional[_Union[_tensor_pb2.StreamTrailer, _Mapping]] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("client_id", "job_id", "base_version", "update_id", "num_samples", "work", "kind", "dtype", "layout_hash", "tensors", "shard_rank")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANK_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    job_id: str
    base_version: int
    update_id: str
    num_samples: int
    work: WorkDone
    kind: UpdateKind
    dtype: _tensor_pb2.WireDtype
    layout_hash: str
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorInfo]
    shard_rank: int
    def __init__(self, client_id: _Optional[str] = ..., job_id: _Optional[str] = ..., base_version: _Optional[int] = ..., update_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., work: _Optional[_Union[WorkDone, _Mapping]] = ..., kind: _Optional[_Union[UpdateKind, str]] = ..., dtype: _Optional[_Union[_tensor_pb2.WireDtype, str]] = ..., layout_hash: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorInfo, _Mapping]]] = ..., shard_rank: _Optional[int] = ...) -> None: ...

class PushUpdateResponse(_message.Message):
    __slots__ = ("outcome", "version", "original_outcome", "staleness", "update_id", "message", "filter_reason", "clipped")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FILTER_REASON_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    version: int
    original_outcome: Outcome
    staleness: int
    update_id: str
    message: str
    filter_reason: FilterReason
    clipped: bool
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., version: _Optional[int] = ..., original_outcome: _Optional[_Union[Outcome, str]] = ..., staleness: _Optional[int] = ..., update_id: _Optional[str] = ..., message: _Optional[str] = ..., filter_reason: _Optional[_Union[FilterReason, str]] = ..., clipped: _Optional[bool] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("version", "dtype", "include_buffers", "client_id", "max_receive_message_bytes", "shard_slice")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_SLICE_FIELD_NUMBER: _ClassVar[int]
    version: int
    dtype: _tensor_pb2.WireDtype
    include_buffers: bool
    client_id: str
    max_receive_message_bytes: int
    shard_slice: bool
    def __init__(self, version: _Optional[int] = ..., dtype: _Optional[_Union[_tensor_pb2.WireDtype, str]] = ..., include_buffers: _Optional[bool] = ..., client_id: _Optional[str] = ..., max_receive_message_bytes: _Optional[int] = ..., shard_slice: _Optional[bool] = ...) -> None: ...

class ModelMessage(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: ModelHeader
    chunk: _tensor_pb2.TensorChunk
    trailer: _tensor_pb2.StreamTrailer
    def __init__(self, header: _Optional[_Union[ModelHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., trailer: _Optional[_Union[_tensor_pb2.StreamTrailer, _Mapping]] = ...) -> None: ...

class ModelHeader(_message.Message):
    __slots__ = ("version", "latest_version", "layout_hash", "layout", "dtype", "tensors", "strategy", "created_at", "shard_rank")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANK_FIELD_NUMBER: _ClassVar[int]
    version: int
    latest_version: int
    layout_hash: str
    layout: _tensor_pb2.ModelLayout
    dtype: _tensor_pb2.WireDtype
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorInfo]
    strategy: str
    created_at: _timestamp_pb2.Timestamp
    shard_rank: int
    def __init__(self, version: _Optional[int] = ..., latest_version: _Optional[int] = ..., layout_hash: _Optional[str] = ..., layout: _Optional[_Union[_tensor_pb2.ModelLayout, _Mapping]] = ..., dtype: _Optional[_Union[_tensor_pb2.WireDtype, str]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorInfo, _Mapping]]] = ..., strategy: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., shard_rank: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("client_id", "job_id", "progress")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    job_id: str
    progress: WorkDone
    def __init__(self, client_id: _Optional[str] = ..., job_id: _Optional[str] = ..., progress: _Optional[_Union[WorkDone, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_expires", "lease", "next_heartbeat", "latest_version", "job_state", "job_deadline", "job_time_left")
    LEASE_EXPIRES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    NEXT_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    JOB_TIME_LEFT_FIELD_NUMBER: _ClassVar[int]
    lease_expires: _timestamp_pb2.Timestamp
    lease: _duration_pb2.Duration
    next_heartbeat: _duration_pb2.Duration
    latest_version: int
    job_state: JobState
    job_deadline: _timestamp_pb2.Timestamp
    job_time_left: _duration_pb2.Duration
    def __init__(self, lease_expires: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., next_heartbeat: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., latest_version: _Optional[int] = ..., job_state: _Optional[_Union[JobState, str]] = ..., job_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., job_time_left: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("shard_probe",)
    SHARD_PROBE_FIELD_NUMBER: _ClassVar[int]
    shard_probe: bool
    def __init__(self, shard_probe: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("has_model", "version", "oldest_retained_version", "strategy", "round", "layout_hash", "numel", "buffer_numel", "clients_known", "clients_active", "updates_accepted", "updates_applied", "updates_rejected", "updates_duplicate", "rejected_by_code", "queue_depth", "uploads_in_progress", "limits", "server_time", "uptime", "durability", "auth", "last_checkpoint_version", "last_checkpoint_time", "wal_bytes", "eval_version", "eval_metrics", "cache_bytes", "shard_rank", "shard_map", "filtered_by_reason", "updates_clipped", "privacy", "data_withheld", "failure", "shards", "cache_dtype", "cache_rows", "cache_row_bytes")
    class RejectedByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EvalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class FilteredByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HAS_MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OLDEST_RETAINED_VERSION_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    BUFFER_NUMEL_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_KNOWN_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    UPDATES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    UPLOADS_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    UPTIME_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_TIME_FIELD_NUMBER: _ClassVar[int]
    WAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANK_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    FILTERED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    UPDATES_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    DATA_WITHHELD_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHE_ROWS_FIELD_NUMBER: _ClassVar[int]
    CACHE_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    has_model: bool
    version: int
    oldest_retained_version: int
    strategy: str
    round: int
    layout_hash: str
    numel: int
    buffer_numel: int
    clients_known: int
    clients_active: int
    updates_accepted: int
    updates_applied: int
    updates_rejected: int
    updates_duplicate: int
    rejected_by_code: _containers.ScalarMap[str, int]
    queue_depth: int
    uploads_in_progress: int
    limits: ServerLimits
    server_time: _timestamp_pb2.Timestamp
    uptime: _duration_pb2.Duration
    durability: str
    auth: str
    last_checkpoint_version: int
    last_checkpoint_time: _timestamp_pb2.Timestamp
    wal_bytes: int
    eval_version: int
    eval_metrics: _containers.ScalarMap[str, float]
    cache_bytes: int
    shard_rank: int
    shard_map: ShardMap
    filtered_by_reason: _containers.ScalarMap[str, int]
    updates_clipped: int
    privacy: PrivacyStatus
    data_withheld: bool
    failure: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    cache_dtype: str
    cache_rows: int
    cache_row_bytes: int
    def __init__(self, has_model: _Optional[bool] = ..., version: _Optional[int] = ..., oldest_retained_version: _Optional[int] = ..., strategy: _Optional[str] = ..., round: _Optional[int] = ..., layout_hash: _Optional[str] = ..., numel: _Optional[int] = ..., buffer_numel: _Optional[int] = ..., clients_known: _Optional[int] = ..., clients_active: _Optional[int] = ..., updates_accepted: _Optional[int] = ..., updates_applied: _Optional[int] = ..., updates_rejected: _Optional[int] = ..., updates_duplicate: _Optional[int] = ..., rejected_by_code: _Optional[_Mapping[str, int]] = ..., queue_depth: _Optional[int] = ..., uploads_in_progress: _Optional[int] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., server_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., uptime: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., durability: _Optional[str] = ..., auth: _Optional[str] = ..., last_checkpoint_version: _Optional[int] = ..., last_checkpoint_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., wal_bytes: _Optional[int] = ..., eval_version: _Optional[int] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ..., cache_bytes: _Optional[int] = ..., shard_rank: _Optional[int] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ..., filtered_by_reason: _Optional[_Mapping[str, int]] = ..., updates_clipped: _Optional[int] = ..., privacy: _Optional[_Union[PrivacyStatus, _Mapping]] = ..., data_withheld: _Optional[bool] = ..., failure: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ..., cache_dtype: _Optional[str] = ..., cache_rows: _Optional[int] = ..., cache_row_bytes: _Optional[int] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("rank", "address", "begin", "end", "reachable", "error", "version", "takes_writes", "failure", "durability", "wal_bytes", "last_checkpoint_version", "last_checkpoint_time", "last_heard")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TAKES_WRITES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    WAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARD_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    begin: int
    end: int
    reachable: bool
    error: str
    version: int
    takes_writes: bool
    failure: str
    durability: str
    wal_bytes: int
    last_checkpoint_version: int
    last_checkpoint_time: _timestamp_pb2.Timestamp
    last_heard: _timestamp_pb2.Timestamp
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., version: _Optional[int] = ..., takes_writes: _Optional[bool] = ..., failure: _Optional[str] = ..., durability: _Optional[str] = ..., wal_bytes: _Optional[int] = ..., last_checkpoint_version: _Optional[int] = ..., last_checkpoint_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_heard: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PrivacyStatus(_message.Message):
    __slots__ = ("epsilon", "delta", "clip_norm", "noise_multiplier", "releases", "target_epsilon", "budget_spent", "updates_clipped")
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    TARGET_EPSILON_FIELD_NUMBER: _ClassVar[int]
    BUDGET_SPENT_FIELD_NUMBER: _ClassVar[int]
    UPDATES_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    epsilon: float
    delta: float
    clip_norm: float
    noise_multiplier: float
    releases: int
    target_epsilon: float
    budget_spent: bool
    updates_clipped: int
    def __init__(self, epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., clip_norm: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., releases: _Optional[int] = ..., target_epsilon: _Optional[float] = ..., budget_spent: _Optional[bool] = ..., updates_clipped: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("version", "path", "bytes", "took")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOOK_FIELD_NUMBER: _ClassVar[int]
    version: int
    path: str
    bytes: int
    took: _duration_pb2.Duration
    def __init__(self, version: _Optional[int] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., took: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("grace_seconds",)
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    def __init__(self, grace_seconds: _Optional[float] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
