from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SyncPoint(_message.Message):
    __slots__ = ("start_pos", "tokens", "instance_id")
    START_POS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    start_pos: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    def __init__(self, start_pos: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class SparseDist(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    probs: bytes
    def __init__(self, token_ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("position", "kv_length", "instance_id")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    KV_LENGTH_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    position: int
    kv_length: int
    instance_id: str
    def __init__(self, position: _Optional[int] = ..., kv_length: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class EngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("instance_id", "numerics", "quantize", "invariant", "reason", "vocab_digest", "model", "compute", "threads")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    INVARIANT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VOCAB_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    numerics: str
    quantize: str
    invariant: bool
    reason: str
    vocab_digest: str
    model: str
    compute: _containers.RepeatedScalarFieldContainer[str]
    threads: int
    def __init__(self, instance_id: _Optional[str] = ..., numerics: _Optional[str] = ..., quantize: _Optional[str] = ..., invariant: _Optional[bool] = ..., reason: _Optional[str] = ..., vocab_digest: _Optional[str] = ..., model: _Optional[str] = ..., compute: _Optional[_Iterable[str]] = ..., threads: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("instance_id", "sessions", "max_sessions", "queued", "max_batch", "draining", "cached_tokens")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    sessions: int
    max_sessions: int
    queued: int
    max_batch: int
    draining: bool
    cached_tokens: int
    def __init__(self, instance_id: _Optional[str] = ..., sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., queued: _Optional[int] = ..., max_batch: _Optional[int] = ..., draining: _Optional[bool] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
