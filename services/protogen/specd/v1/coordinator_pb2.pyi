from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionRequest(_message.Message):
    __slots__ = ("session_id", "include_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    include_tokens: bool
    def __init__(self, session_id: _Optional[str] = ..., include_tokens: _Optional[bool] = ...) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("session_id", "length", "mode", "k", "alpha", "stats", "requests", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    mode: str
    k: int
    alpha: float
    stats: GenerationStats
    requests: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ..., mode: _Optional[str] = ..., k: _Optional[int] = ..., alpha: _Optional[float] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., requests: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseSessionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "max_tokens", "stop", "temperature", "top_k", "top_p", "seed", "num_draft_tokens", "ignore_eos", "session_id", "speculation", "max_draft_tokens", "request_id", "drafter")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    num_draft_tokens: int
    ignore_eos: bool
    session_id: str
    speculation: bool
    max_draft_tokens: int
    request_id: str
    drafter: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., session_id: _Optional[str] = ..., speculation: _Optional[bool] = ..., max_draft_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., drafter: _Optional[str] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "rounds", "drafted_tokens", "accepted_tokens", "mean_acceptance_length", "accepted_per_position", "drafted_per_position", "fallbacks", "mode", "resyncs", "judged_tokens", "draft_compute_s", "verify_compute_s", "round_wall_s", "outage_rounds", "model_free_drafted_tokens", "model_free_accepted_tokens", "draft_wall_s", "verify_wall_s", "verify_queued_s", "save_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    JUDGED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_WALL_S_FIELD_NUMBER: _ClassVar[int]
    OUTAGE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FREE_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FREE_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WALL_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_WALL_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    SAVE_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    fallbacks: int
    mode: str
    resyncs: int
    judged_tokens: int
    draft_compute_s: float
    verify_compute_s: float
    round_wall_s: float
    outage_rounds: int
    model_free_drafted_tokens: int
    model_free_accepted_tokens: int
    draft_wall_s: float
    verify_wall_s: float
    verify_queued_s: float
    save_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., fallbacks: _Optional[int] = ..., mode: _Optional[str] = ..., resyncs: _Optional[int] = ..., judged_tokens: _Optional[int] = ..., draft_compute_s: _Optional[float] = ..., verify_compute_s: _Optional[float] = ..., round_wall_s: _Optional[float] = ..., outage_rounds: _Optional[int] = ..., model_free_drafted_tokens: _Optional[int] = ..., model_free_accepted_tokens: _Optional[int] = ..., draft_wall_s: _Optional[float] = ..., verify_wall_s: _Optional[float] = ..., verify_queued_s: _Optional[float] = ..., save_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerationStats
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...
