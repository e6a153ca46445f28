"""The coordinator's speculative decoding loop, free of any transport.

It talks to a `Drafter` and a `Verifier` (gRPC clients in production, scripted fakes in
unit tests). Each service keeps a soft copy of the session (its KV cache); the committed
tokens held here are the truth. A service is told what changed since the position it is
known to hold (`SyncPoint`), and is resent everything when it no longer has that prefix.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol, Sequence, TypeVar

from specd.sampling import SamplingParams
from specd.verify import Proposal
from specd.stopping import Decode, StopChecker, StopRules
from specd.verify import Verdict

EMPTY_PROPOSAL = Proposal((), ())
T = TypeVar("T")


@dataclass(frozen=True)
class SyncPoint:
    """The committed sequence is (what the service holds)[:start_pos] + tokens."""

    start_pos: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class DraftReply:
    proposal: Proposal
    position: int  # committed length the draft synced to before drafting


@dataclass(frozen=True)
class VerifyReply:
    verdict: Verdict
    position: int  # the target's committed length after this round


class StaleSession(Exception):
    """The service no longer holds the prefix we assumed (restart, eviction, other replica)."""

    def __init__(self, position: int):
        super().__init__(f"service holds {position} tokens of this session")
        self.position = position


class Drafter(Protocol):
    async def propose(self, session_id: str, sync: SyncPoint, k: int, params: SamplingParams) -> DraftReply: ...

    async def release(self, session_id: str) -> None: ...


class Verifier(Protocol):
    async def verify(
        self, session_id: str, sync: SyncPoint, proposal: Proposal, params: SamplingParams
    ) -> VerifyReply: ...

    async def release(self, session_id: str) -> None: ...


@dataclass(frozen=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    rules: StopRules
    params: SamplingParams
    k: int  # most draft tokens per round; 0 = plain target decoding


@dataclass
class Stats:
    rounds: int = 0  # target calls
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k_max]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per target call; includes the recovered/bonus token (as vLLM counts)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def record(self, k: int, num_accepted: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += num_accepted
        grow = k - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, grow))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass(frozen=True)
class RoundRecord:
    k: int
    num_accepted: int
    committed_length: int
    draft_position: int | None  # None when the round drafted nothing
    target_position: int


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    token_ids: tuple[int, ...]
    text: str
    stats: Stats


@dataclass
class _Cursor:
    """How much of the committed sequence a service is known to hold."""

    position: int = 0

    def sync(self, committed: Sequence[int]) -> SyncPoint:
        return SyncPoint(self.position, tuple(committed[self.position :]))


async def generate(
    request: GenerationRequest,
    session_id: str,
    drafter: Drafter,
    verifier: Verifier,
    decode: Decode,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> AsyncIterator[Chunk | Finished]:
    committed = list(request.prompt)
    draft, target = _Cursor(), _Cursor()
    checker = StopChecker(request.rules, decode)
    stats = Stats()
    try:
        while True:
            n = len(committed)
            remaining = request.rules.max_tokens - len(checker.token_ids)
            k = min(request.k, remaining - 1)  # a round commits at most k + 1 tokens
            # 1. draft
            drafted = None
            if k > 0:
                drafted = await _synced(
                    draft, committed, lambda sync: drafter.propose(session_id, sync, k, request.params)
                )
            proposal = drafted.proposal if drafted else EMPTY_PROPOSAL
            # 2. verify
            verified = await _synced(
                target, committed, lambda sync: verifier.verify(session_id, sync, proposal, request.params)
            )
            a = verified.verdict.num_accepted
            # 3. commit
            new_tokens = proposal.tokens[:a] + (verified.verdict.next_token,)
            committed.extend(new_tokens)
            # 4. rollback: pure bookkeeping, the draft's valid prefix ends after the accepted drafts
            if drafted:
                draft.position = n + a
            target.position = len(committed)
            stats.record(len(proposal.tokens), a)
            if on_round:
                on_round(RoundRecord(k, a, len(committed), drafted and drafted.position, verified.position))
            # 5. emit, applying stop conditions token by token
            emitted, text = [], ""
            for token in new_tokens:
                emitted.append(token)
                text += checker.push(token)
                if checker.finish_reason:
                    break
            if emitted:
                yield Chunk(tuple(emitted), text)
            if checker.finish_reason:
                yield Finished(checker.finish_reason, tuple(checker.token_ids), checker.text, stats)
                return
    finally:
        await _release_quietly(session_id, drafter, verifier)


async def _synced(cursor: _Cursor, committed: Sequence[int], call: Callable[[SyncPoint], Awaitable[T]]) -> T:
    """Call a service with the tokens it lacks; if it lost the session, resend everything."""
    try:
        return await call(cursor.sync(committed))
    except StaleSession:
        cursor.position = 0
        return await call(cursor.sync(committed))


async def _release_quietly(session_id: str, *services: Drafter | Verifier) -> None:
    """Free both caches. Best effort: an unreleased session is evicted once idle, and a
    failure here must not mask the request's own outcome."""
    await asyncio.gather(*(s.release(session_id) for s in services), return_exceptions=True)
