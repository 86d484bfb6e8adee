from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WireDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WIRE_DTYPE_UNSPECIFIED: _ClassVar[WireDtype]
    WIRE_DTYPE_FLOAT32: _ClassVar[WireDtype]
    WIRE_DTYPE_FLOAT16: _ClassVar[WireDtype]
    WIRE_DTYPE_BFLOAT16: _ClassVar[WireDtype]

class ValueQuantization(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_QUANTIZATION_UNSPECIFIED: _ClassVar[ValueQuantization]
    VALUE_QUANTIZATION_INT8: _ClassVar[ValueQuantization]
    VALUE_QUANTIZATION_INT4: _ClassVar[ValueQuantization]

class TensorEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_ENCODING_UNSPECIFIED: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_COO: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_BITMAP: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_DENSE: _ClassVar[TensorEncoding]
WIRE_DTYPE_UNSPECIFIED: WireDtype
WIRE_DTYPE_FLOAT32: WireDtype
WIRE_DTYPE_FLOAT16: WireDtype
WIRE_DTYPE_BFLOAT16: WireDtype
VALUE_QUANTIZATION_UNSPECIFIED: ValueQuantization
VALUE_QUANTIZATION_INT8: ValueQuantization
VALUE_QUANTIZATION_INT4: ValueQuantization
TENSOR_ENCODING_UNSPECIFIED: TensorEncoding
TENSOR_ENCODING_COO: TensorEncoding
TENSOR_ENCODING_BITMAP: TensorEncoding
TENSOR_ENCODING_DENSE: TensorEncoding

class LayoutTensor(_message.Message):
    __slots__ = ("name", "shape", "is_norm")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    IS_NORM_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    is_norm: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., is_norm: _Optional[bool] = ...) -> None: ...

class ModelLayout(_message.Message):
    __slots__ = ("tensors", "buffers")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[LayoutTensor]
    buffers: _containers.RepeatedCompositeFieldContainer[LayoutTensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[LayoutTensor, _Mapping]]] = ..., buffers: _Optional[_Iterable[_Union[LayoutTensor, _Mapping]]] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "numel", "encoding", "nnz", "quantization", "block_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    numel: int
    encoding: TensorEncoding
    nnz: int
    quantization: ValueQuantization
    block_size: int
    def __init__(self, name: _Optional[str] = ..., numel: _Optional[int] = ..., encoding: _Optional[_Union[TensorEncoding, str]] = ..., nnz: _Optional[int] = ..., quantization: _Optional[_Union[ValueQuantization, str]] = ..., block_size: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("tensor", "offset", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    offset: int
    data: bytes
    def __init__(self, tensor: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StreamTrailer(_message.Message):
    __slots__ = ("crc32c", "payload_bytes")
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    crc32c: int
    payload_bytes: int
    def __init__(self, crc32c: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...
