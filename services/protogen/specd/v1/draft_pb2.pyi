from services.protogen.specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "sync", "k", "sampling", "min_confidence")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sync: _common_pb2.SyncPoint
    k: int
    sampling: _common_pb2.SamplingParams
    min_confidence: float
    def __init__(self, session_id: _Optional[str] = ..., sync: _Optional[_Union[_common_pb2.SyncPoint, _Mapping]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tokens", "q", "position", "instance_id", "compute_s", "queued_s")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDist]
    position: int
    instance_id: str
    compute_s: float
    queued_s: float
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.SparseDist, _Mapping]]] = ..., position: _Optional[int] = ..., instance_id: _Optional[str] = ..., compute_s: _Optional[float] = ..., queued_s: _Optional[float] = ...) -> None: ...
