"""Scripted in-memory model services for unit tests of the loop.

Each fake holds a session's tokens the way a real service does (sync by SyncPoint, raise
StaleSession for a prefix it lacks) and counts its calls. Next-token choice is a fixed
function of the prefix, so the "target alone" output is easy to compute.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from specd.contracts import (
    DecodeRequest,
    DraftReply,
    Proposal,
    ProposeRequest,
    ServiceUnavailable,
    StaleSession,
    SyncPoint,
    Verdict,
    VerifyReply,
    VerifyRequest,
)
from specd.policy import PolicyState
from specd.session import Fenced, Lease, SessionNotFound, SessionState

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


def target_alone(prompt: Sequence[int], n: int, rule: NextToken = target_rule) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(rule(seq))
    return seq[len(prompt) :]


@dataclass
class VirtualClock:
    """Seconds that pass only as the fakes report work (a replay's `Services.clock`): a call's
    compute plus its `rpc_s`."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeService:
    rule: NextToken
    sessions: dict[str, list[int]] = field(default_factory=dict)
    calls: int = 0
    released: list[str] = field(default_factory=list)
    instance_id: str = "fake-1"
    compute_s: float = 0.01  # reported model time per call
    wait_s: float = 0.0  # each call first waits this long (a queue or a slow network)...
    wait_is_queue: bool = True  # ...reported as queued_s (load) or not (the network)
    clock: VirtualClock | None = None  # advanced by each call's reported compute and rpc_s
    rpc_s: float = 0.0  # a call's time beyond its compute, on the virtual clock

    async def _wait(self) -> float:
        await asyncio.sleep(self.wait_s)
        return self.wait_s if self.wait_is_queue else 0.0

    def _took(self, compute_s: float) -> float:
        if self.clock is not None:
            self.clock.now += compute_s + self.rpc_s
        return compute_s

    def _sync(self, session_id: str, sync: SyncPoint) -> list[int]:
        self.calls += 1
        held = self.sessions.get(session_id, [])
        if sync.start_pos > len(held) or (sync.start_pos and sync.instance_id != self.instance_id):
            raise StaleSession(len(held))
        tokens = held[: sync.start_pos] + list(sync.tokens)
        self.sessions[session_id] = tokens
        return tokens

    def forget(self) -> None:
        """Lose every session, as a restarted service would (a new process, a new instance id)."""
        self.sessions.clear()
        self.instance_id += "'"

    async def release(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        self.released.append(session_id)


@dataclass
class FakeDrafter(FakeService):
    confidence: Callable[[Sequence[int]], float] = lambda prefix: 1.0  # the draft's probability of its next token
    catch_up_s: float = 0.0  # reported model time per token synced before drafting (a prefill)...
    rides_along: int = 0  # ...beyond this many: the round's own tokens, fed with the first draft's pass
    down: bool = False  # no replica answers: propose raises ServiceUnavailable, probe says False
    probes: int = 0

    async def propose(self, request: ProposeRequest) -> DraftReply:
        if self.down:
            self.calls += 1
            raise ServiceUnavailable("no draft replica answered")
        tokens = self._sync(request.session_id, request.sync)
        position = len(tokens)
        for _ in range(request.k):
            sure = self.confidence(tokens) >= request.min_confidence
            tokens.append(self.rule(tokens))
            if not sure:
                break
        drafted = len(tokens) - position
        proposal = Proposal(tuple(tokens[position:]), ())
        compute_s = self.compute_s * drafted + self.catch_up_s * max(0, len(request.sync.tokens) - self.rides_along)
        return DraftReply(proposal, position, self.instance_id, self._took(compute_s), await self._wait())

    async def probe(self) -> bool:
        self.probes += 1
        return not self.down


@dataclass
class FakeVerifier(FakeService):
    batch_size: int = 1  # the sessions each reply says shared its pass
    row_s: float = 0.0  # reported model time per draft verified, beyond compute_s
    confidence: Callable[[list[int]], float] | None = None  # the target's confidence after a prefix (None: not reported)

    async def verify(self, request: VerifyRequest) -> VerifyReply:
        tokens, proposal = self._sync(request.session_id, request.sync), request.proposal
        accepted, sure = 0, []
        for drafted in proposal.tokens:
            sure.append(self.confidence(tokens) if self.confidence else None)
            if drafted != self.rule(tokens):
                break
            tokens.append(drafted)
            accepted += 1
        if accepted == len(proposal.tokens):
            sure.append(self.confidence(tokens) if self.confidence else None)
        wanted = self.rule(tokens)
        tokens.append(wanted)
        return VerifyReply(Verdict(accepted, wanted), len(tokens), self.instance_id,
                           self._took(self.compute_s + self.row_s * len(proposal.tokens)), await self._wait(), self.batch_size,
                           confidence=tuple(sure) if self.confidence else ())


@dataclass
class FakeDecoder:
    """Streams plain steps from a FakeVerifier as the target service's Decode does: the next step
    runs as soon as the caller takes the last reply (one in flight), none after a stop but the one
    in flight. Counts streams opened and steps run, those run ahead included."""

    verifier: FakeVerifier
    opened: int = 0
    steps: int = 0
    fail_after: int | None = None  # a stream ends (its replica died) after this many steps

    async def decode(self, request: DecodeRequest) -> "FakeSteps":
        request.validate()
        self.opened += 1
        stream = FakeSteps(self, request)
        stream.first = await stream.step(request.step)
        stream.run_ahead(stream.first)
        return stream


@dataclass
class FakeSteps:
    decoder: FakeDecoder
    request: DecodeRequest
    first: VerifyReply | None = None
    stopped: bool = False
    ahead: asyncio.Future | None = None
    ran: int = 0

    async def step(self, request: VerifyRequest) -> VerifyReply:
        self.ran += 1
        self.decoder.steps += 1
        return await self.decoder.verifier.verify(request)

    def run_ahead(self, reply: VerifyReply) -> None:
        failed = self.decoder.fail_after is not None and self.ran >= self.decoder.fail_after
        if self.ran >= self.request.max_steps or self.stopped or failed:
            self.ahead = None
            return
        sync = SyncPoint(reply.position, (), reply.instance_id)
        self.ahead = asyncio.ensure_future(self.step(replace(self.request.step, sync=sync)))

    async def next(self) -> VerifyReply | None:
        if self.ahead is None:
            return None
        reply = await self.ahead
        self.run_ahead(reply)
        return reply

    async def stop(self) -> None:
        self.stopped = True

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.cancel()


@dataclass
class FakeStore:
    """In-memory SessionStore with the same epoch fencing as the Redis one (unit tests only)."""

    sessions: dict[str, tuple[int, SessionState]] = field(default_factory=dict)
    saves: int = 0
    learned: PolicyState | None = None  # the deployment's prior
    learned_by: dict[str, PolicyState] = field(default_factory=dict)  # each owner's own

    async def begin(self, session_id: str, create: bool, owner: str = "") -> tuple[Lease, SessionState]:
        if session_id not in self.sessions and not create:
            raise SessionNotFound(session_id)
        epoch, state = self.sessions.get(session_id, (0, SessionState(session_id, owner=owner)))
        if state.owner != owner:
            raise SessionNotFound(session_id)
        self.sessions[session_id] = (epoch + 1, state)
        return Lease(session_id, epoch + 1), state

    async def save(self, lease: Lease, state: SessionState, appended_from: int) -> None:
        epoch, stored = self.sessions[lease.session_id]
        if epoch != lease.epoch:
            raise Fenced(lease.session_id)
        assert len(stored.tokens) == appended_from and state.tokens[:appended_from] == stored.tokens
        self.sessions[lease.session_id] = (epoch, state)
        self.saves += 1

    async def delete(self, session_id: str) -> bool:
        return self.sessions.pop(session_id, None) is not None

    async def get(self, session_id: str) -> SessionState | None:
        entry = self.sessions.get(session_id)
        return entry and entry[1]

    async def prior(self, owner: str = "") -> PolicyState | None:
        return self.learned_by.get(owner) or self.learned

    async def remember(self, policy: PolicyState, owner: str = "") -> None:
        if owner:
            self.learned_by[owner] = policy
        else:
            self.learned = policy
