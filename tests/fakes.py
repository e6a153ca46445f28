"""Scripted in-memory model services for unit tests of the loop.

Each fake holds a session's tokens the way a real service does (sync by SyncPoint, raise
StaleSession for a prefix it lacks) and counts its calls. Next-token choice is a fixed
function of the prefix, so the "target alone" output is easy to compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from specd.loop import DraftReply, StaleSession, SyncPoint, VerifyReply
from specd.sampling import SamplingParams
from specd.verify import Proposal
from specd.verify import Verdict

NextToken = Callable[[Sequence[int]], int]
VOCAB = 50


def target_rule(prefix: Sequence[int]) -> int:
    return (sum(prefix) * 7 + len(prefix) * 3) % VOCAB


def draft_rule(agreement_every: int) -> NextToken:
    """Agrees with the target except at lengths divisible by `agreement_every`."""

    def rule(prefix: Sequence[int]) -> int:
        wanted = target_rule(prefix)
        return (wanted + 1) % VOCAB if len(prefix) % agreement_every == 0 else wanted

    return rule


def target_alone(prompt: Sequence[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(target_rule(seq))
    return seq[len(prompt) :]


@dataclass
class FakeService:
    rule: NextToken
    sessions: dict[str, list[int]] = field(default_factory=dict)
    calls: int = 0
    released: list[str] = field(default_factory=list)

    def _sync(self, session_id: str, sync: SyncPoint) -> list[int]:
        self.calls += 1
        held = self.sessions.get(session_id, [])
        if sync.start_pos > len(held):
            raise StaleSession(len(held))
        tokens = held[: sync.start_pos] + list(sync.tokens)
        self.sessions[session_id] = tokens
        return tokens

    def forget(self) -> None:
        """Lose every session, as a restarted service would."""
        self.sessions.clear()

    async def release(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        self.released.append(session_id)


class FakeDrafter(FakeService):
    async def propose(self, session_id: str, sync: SyncPoint, k: int, params: SamplingParams) -> DraftReply:
        tokens = self._sync(session_id, sync)
        position = len(tokens)
        for _ in range(k):
            tokens.append(self.rule(tokens))
        return DraftReply(Proposal(tuple(tokens[position:]), ()), position)


class FakeVerifier(FakeService):
    async def verify(self, session_id: str, sync: SyncPoint, proposal: Proposal, params: SamplingParams) -> VerifyReply:
        tokens = self._sync(session_id, sync)
        accepted = 0
        for drafted in proposal.tokens:
            if drafted != self.rule(tokens):
                break
            tokens.append(drafted)
            accepted += 1
        tokens.append(self.rule(tokens))
        return VerifyReply(Verdict(accepted, tokens[-1]), len(tokens))
