"""The contract between the coordinator and the model services, as every layer sees it.

One request and one reply per RPC: `ProposeRequest` -> `DraftReply` (the draft service) and
`VerifyRequest` -> `VerifyReply` (the target service; K = 0 is a plain step), and the values
they carry: `SyncPoint`, `SamplingParams`, a `Proposal` (its q rows as `SparseDist`), a
`Verdict`. A service that lost the session answers `StaleSession`; `EngineInfo` is what a
service runs, `ReplicaLoad` how busy a replica is; `ServiceUnavailable` means no replica
answered. The loop builds the requests, the gRPC converters and Ray handles carry them, the
role engines (specd/draft_engine.py, specd/target_engine.py) answer them.

Frozen dataclasses, and no torch: the coordinator imports this module, never a model.
Requests are checked at the edge that receives them (`validate()`); the messages say what to
change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specd.policy import PolicyConfig
from specd.validation import validate_that

MAX_CLIENT_ID = 128  # characters of a session or request id as a client names it
MAX_SESSION_ID = MAX_CLIENT_ID + 32  # and its key's scope before it (services/coordinator/frontend.py)
MAX_K = 32  # draft tokens per round a model service accepts
MAX_DECODE_STEPS = 1 << 16  # plain steps one Decode stream may run (a request's max_tokens is far below)
MAX_TOP_K = 1 << 20
GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily, as in vLLM: logits / 1e-300 overflow


@dataclass(frozen=True)
class SyncPoint:
    """The committed sequence is (what the service holds)[:start_pos] + tokens."""

    start_pos: int
    tokens: tuple[int, ...]
    instance_id: str = ""  # the engine instance believed to hold the prefix; "" when start_pos = 0

    @property
    def end(self) -> int:
        """n, the committed length: the service's session length once synced."""
        return self.start_pos + len(self.tokens)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or anything below GREEDY_BELOW) means greedy
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1 disables nucleus filtering
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> "SamplingParams":
        validate_that(0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100] (0 = greedy)")
        validate_that(0 <= self.top_k <= MAX_TOP_K, f"top_k must be in [0, {MAX_TOP_K}] (0 = off)")
        validate_that(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        validate_that(0 <= self.seed < 2**63, "seed must be in [0, 2^63)")
        return self


@dataclass(frozen=True)
class SparseDist:
    """One draft row q [vocab] as its top mass (specd/sparse.py encodes and decodes it)."""

    token_ids: bytes  # int32 little-endian, [n]
    probs: bytes  # float16 little-endian, [n], unnormalised

    @property
    def nbytes(self) -> int:
        return len(self.token_ids) + len(self.probs)


@dataclass(frozen=True)
class Proposal:
    tokens: tuple[int, ...]  # [K] drafted tokens
    q: tuple[SparseDist, ...]  # [K] rows the drafts were sampled from; empty when greedy


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # accepted draft tokens, 0..K
    next_token: int  # recovered token (num_accepted < K) or bonus token (num_accepted == K)

    def committed(self, draft_tokens: Sequence[int]) -> tuple[int, ...]:
        """The tokens the round commits: the accepted drafts, then the recovered/bonus token."""
        return tuple(draft_tokens[: self.num_accepted]) + (self.next_token,)


@dataclass(frozen=True)
class ProposeRequest:
    """Draft k tokens after the committed ones (fewer with a confidence stop: after a draft the
    draft gave probability < min_confidence)."""

    session_id: str
    sync: SyncPoint
    k: int
    params: SamplingParams
    min_confidence: float = 0.0

    def validate(self) -> "ProposeRequest":
        validate_session_id(self.session_id)
        validate_that(1 <= self.k <= MAX_K, f"k must be in [1, {MAX_K}]")
        PolicyConfig(min_confidence=self.min_confidence).validate()  # in [0, 1), not NaN
        self.params.validate()
        return self


@dataclass(frozen=True)
class DraftReply:
    proposal: Proposal
    position: int  # n, the committed length the draft synced to before drafting
    instance_id: str = ""
    compute_s: float = 0.0  # the drafting steps this proposal took part in
    queued_s: float = 0.0  # waited for the model (other calls' passes and steps): load, not the network


@dataclass(frozen=True)
class VerifyRequest:
    """Score the proposal's K drafts after the committed tokens in one target pass and decide;
    K = 0 is one plain decoding step (the bonus token is drawn from p)."""

    session_id: str
    sync: SyncPoint
    proposal: Proposal
    params: SamplingParams

    def validate(self) -> "VerifyRequest":
        validate_session_id(self.session_id)
        validate_that(len(self.proposal.tokens) <= MAX_K, f"at most {MAX_K} draft tokens per round")
        self.params.validate()
        return self


@dataclass(frozen=True)
class DecodeRequest:
    """Plain steps back to back, up to max_steps, each decided as `step` (K = 0) is: the next one
    feeds the token the last decided, so the target runs it while the caller handles the last."""

    step: VerifyRequest
    max_steps: int

    def validate(self) -> "DecodeRequest":
        self.step.validate()
        validate_that(not self.step.proposal.tokens, "a decode's steps are plain: no draft tokens")
        validate_that(1 <= self.max_steps <= MAX_DECODE_STEPS, f"max_steps must be in [1, {MAX_DECODE_STEPS}]")
        return self


@dataclass(frozen=True)
class VerifyReply:
    verdict: Verdict
    position: int  # the target's committed length after this round
    instance_id: str = ""
    compute_s: float = 0.0  # the pass's model time
    queued_s: float = 0.0  # waited for the model before the pass began: load, not the network
    batch_size: int = 1  # sessions whose verifications shared the pass that compute_s timed
    pass_rows: int = 0  # positions that pass fed, every session's (0: not reported)
    # the target's probability of its most likely token at each committed position (row 0 .. num_accepted),
    # what the policy reads the text's predictability from (empty: not reported)
    confidence: tuple[float, ...] = ()
    # sessions the target served in its last passes, these included: what a pass of this session's
    # holds up, whether they share it or wait for it (1: alone or not reported)
    active_sessions: int = 1


@dataclass(frozen=True)
class EngineInfo:
    """What a model service runs, the same for all its sessions (specd/numerics.py's `Choice`)."""

    instance_id: str
    numerics: str  # the weights the engine runs: gguf | none | int8
    quantize: str  # its setting: one of those, or auto
    invariant: bool  # passed the batch-invariance self-check on its host
    reason: str  # why this mode
    vocab_digest: str = ""  # sha256 of the vocabulary (specd/gguf_meta.py); "": unknown, not checked
    model: str = ""  # the model it loaded (file or directory name)
    compute: tuple[str, ...] = ()  # what it computes on: "<boot id>/cpu<n>" each, or "gpu/<uuid>" (services/common/compute.py)
    threads: int = 0  # the threads its CPU passes use


@dataclass(frozen=True)
class ReplicaLoad:
    """How busy a model-service replica is: clients place new sessions on replicas with room."""

    instance_id: str
    sessions: int  # sessions whose caches it holds
    max_sessions: int
    queued: int  # calls waiting for the model
    max_batch: int  # calls one pass takes
    draining: bool = False  # stopping: finishing its calls, refusing new ones
    cached_tokens: int = 0  # positions held in its KV caches, all sessions together

    @property
    def has_room(self) -> bool:
        """A new session would neither push out another's cache nor wait behind a full pass."""
        return not self.draining and self.sessions < self.max_sessions and self.queued <= self.max_batch


class ServiceUnavailable(Exception):
    """No replica of a model service answered (all down, stopping, or too slow for the round)."""


class StaleSession(Exception):
    """The service no longer holds the prefix we assumed (restart, eviction, other replica)."""

    def __init__(self, position: int):
        super().__init__(f"service holds {position} tokens of this session")
        self.position = position


class EngineError(Exception):
    """Base class for a model engine's errors a caller can act on (specd/engine.py raises them;
    they live here so that the services' error mapping needs no torch)."""


class SessionsFull(EngineError):
    """max_sessions are held and none has been idle long enough to evict."""


class PositionMismatch(EngineError):
    """The caller's idea of the session length is ahead of the engine's: re-sync from `position`."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position  # the session's actual length (0 for an unknown session)


class ContextTooLong(EngineError):
    """The session would exceed max_context tokens."""


def validate_session_id(session_id: str) -> str:
    validate_that(0 < len(session_id) <= MAX_SESSION_ID, f"session_id must be 1..{MAX_SESSION_ID} characters")
    return session_id
