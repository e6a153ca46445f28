"""A session as the coordinator keeps it in the store: committed tokens are the truth,
everything else (where each service's cache stands, policy state, stats) is bookkeeping.

`SessionStore` is the port the loop talks to; Redis implements it in
services/coordinator/store.py. Every writer holds a lease: `begin` bumps the session's epoch
and returns it, and `save` succeeds only while that epoch is current, so two coordinators can
never both advance one session (the later `begin` fences the earlier writer out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.policy import PolicyState


@dataclass(frozen=True)
class ServiceCursor:
    """How much of the committed sequence one model service is known to hold, and which process."""

    position: int = 0
    instance_id: str = ""  # the engine instance that holds it; "" = nothing known


@dataclass(frozen=True)
class SessionStats:
    """Counters for one request or, summed, for a whole session."""

    rounds: int = 0  # target calls
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()  # [i]: rounds whose draft i was accepted
    drafted_per_position: tuple[int, ...] = ()  # [i]: rounds that drafted at least i + 1 tokens
    fallbacks: int = 0  # switches from speculative to plain decoding
    resyncs: int = 0  # a service had lost the session (restart, eviction, other replica) and got it resent
    judged: int = 0  # drafts the target judged: the accepted ones plus the first rejected (α = accepted / judged)
    draft_compute_s: float = 0.0  # model time the draft service reported
    verify_compute_s: float = 0.0  # model time the target service reported (plain steps included)
    round_wall_s: float = 0.0  # the coordinator's wall time for its rounds, store saves included
    outage_rounds: int = 0  # plain rounds because no draft replica answered (specd/loop.py: DraftOutage)
    model_free_drafted: int = 0  # of `drafted`, drafted by the model-free drafter (specd/model_free.py)
    model_free_accepted: int = 0  # of `accepted`, those
    # A round's parts (benchmarks/round_parts.py): the calls' wall times as the coordinator saw them,
    # the target's time queued behind other work, and the store's save.
    draft_wall_s: float = 0.0
    verify_wall_s: float = 0.0
    verify_queued_s: float = 0.0
    save_s: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per target call; includes the recovered/bonus token (as vLLM counts)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def record(
        self,
        k: int,
        accepted: int,
        fallbacks: int = 0,
        resyncs: int = 0,
        draft_s: float = 0.0,
        verify_s: float = 0.0,
        outage_rounds: int = 0,
        model_free: bool = False,
    ) -> "SessionStats":
        judged = accepted + (1 if accepted < k else 0)
        return self + SessionStats(
            1, k, accepted, (1,) * accepted, (1,) * k, fallbacks, resyncs, judged, draft_s, verify_s,
            outage_rounds=outage_rounds, model_free_drafted=k if model_free else 0,
            model_free_accepted=accepted if model_free else 0,
        )

    def __add__(self, other: "SessionStats") -> "SessionStats":
        return SessionStats(
            self.rounds + other.rounds,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
            _add_counts(self.accepted_per_position, other.accepted_per_position),
            _add_counts(self.drafted_per_position, other.drafted_per_position),
            self.fallbacks + other.fallbacks,
            self.resyncs + other.resyncs,
            self.judged + other.judged,
            self.draft_compute_s + other.draft_compute_s,
            self.verify_compute_s + other.verify_compute_s,
            self.round_wall_s + other.round_wall_s,
            self.outage_rounds + other.outage_rounds,
            self.model_free_drafted + other.model_free_drafted,
            self.model_free_accepted + other.model_free_accepted,
            self.draft_wall_s + other.draft_wall_s,
            self.verify_wall_s + other.verify_wall_s,
            self.verify_queued_s + other.verify_queued_s,
            self.save_s + other.save_s,
        )


def _add_counts(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not b or not a:  # a round's timings alone, added several times a round
        return a or b
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return tuple(x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer))


@dataclass(frozen=True)
class Turn:
    """A session's latest turn, kept so that a client's retry of it (same request id) returns it
    or goes on with it instead of appending its prompt again."""

    request_id: str
    start: int  # committed length before its prompt
    digest: str  # of what it asked (specd.loop.request_digest): a retry must ask the same


@dataclass(frozen=True)
class SessionState:
    session_id: str
    tokens: tuple[int, ...] = ()  # committed: prompts and generations of every turn so far
    draft: ServiceCursor = ServiceCursor()
    target: ServiceCursor = ServiceCursor()
    policy: PolicyState = field(default_factory=PolicyState)
    stats: SessionStats = SessionStats()
    requests: int = 0
    owner: str = ""  # who may use the session (the API key's id at the REST edge)
    turn: Turn | None = None  # the latest turn a client named with a request id


@dataclass(frozen=True)
class Lease:
    session_id: str
    epoch: int  # fencing token: valid while no later `begin` happened


class SessionNotFound(KeyError):
    pass


class Fenced(RuntimeError):
    """Another coordinator began serving this session; this writer must stop."""
