from services.protogen.specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "sync", "draft_tokens", "q", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sync: _common_pb2.SyncPoint
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDist]
    sampling: _common_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., sync: _Optional[_Union[_common_pb2.SyncPoint, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.SparseDist, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "sync", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sync: _common_pb2.SyncPoint
    sampling: _common_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., sync: _Optional[_Union[_common_pb2.SyncPoint, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class DecodeMessage(_message.Message):
    __slots__ = ("start", "taken")
    START_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    start: DecodeStart
    taken: int
    def __init__(self, start: _Optional[_Union[DecodeStart, _Mapping]] = ..., taken: _Optional[int] = ...) -> None: ...

class DecodeStart(_message.Message):
    __slots__ = ("step", "max_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: StepRequest
    max_steps: int
    def __init__(self, step: _Optional[_Union[StepRequest, _Mapping]] = ..., max_steps: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token", "position", "instance_id", "compute_s", "queued_s", "batch_size", "pass_rows", "confidence", "active_sessions")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token: int
    position: int
    instance_id: str
    compute_s: float
    queued_s: float
    batch_size: int
    pass_rows: int
    confidence: _containers.RepeatedScalarFieldContainer[float]
    active_sessions: int
    def __init__(self, num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., position: _Optional[int] = ..., instance_id: _Optional[str] = ..., compute_s: _Optional[float] = ..., queued_s: _Optional[float] = ..., batch_size: _Optional[int] = ..., pass_rows: _Optional[int] = ..., confidence: _Optional[_Iterable[float]] = ..., active_sessions: _Optional[int] = ...) -> None: ...
