"""The decoding loop's ports: what it needs of a draft pool, a target pool and a session store.
gRPC clients, Ray handles and the Redis store implement them in production, scripted fakes in tests;
they live apart from the loop so that those modules, and the loop's helpers, import them without
importing the loop."""

from __future__ import annotations

from typing import Protocol

from specd.contracts import DecodeRequest, DraftReply, ProposeRequest, VerifyReply, VerifyRequest
from specd.policy import PolicyState
from specd.session import Lease, SessionState


class Drafter(Protocol):
    async def propose(self, request: ProposeRequest) -> DraftReply: ...

    async def release(self, session_id: str) -> None: ...

    async def probe(self) -> bool:
        """Does some replica take calls now?"""


class Verifier(Protocol):
    async def verify(self, request: VerifyRequest) -> VerifyReply: ...

    async def release(self, session_id: str) -> None: ...


class PlainSteps(Protocol):
    """Plain target steps run back to back (a `Decoder`'s): each reply as a Step's would be."""

    first: VerifyReply  # the first step's

    async def next(self) -> VerifyReply | None:
        """The next step's reply; None once the run ended (its steps done, stopped, or failed)."""

    async def stop(self) -> None:
        """No steps after the one in flight, whose reply still comes."""

    def close(self) -> None:
        """Abandon the run: steps it took past the committed tokens stay in the target's soft cache."""


class Decoder(Protocol):
    async def decode(self, request: DecodeRequest) -> PlainSteps:
        """Start the steps, the first one's reply read (StaleSession as `Verifier.verify`)."""


class SessionStore(Protocol):
    async def begin(self, session_id: str, create: bool, owner: str = "") -> tuple[Lease, SessionState]:
        """Take the session over (bump its epoch), in one step with checking that `owner` created it
        (another's: SessionNotFound). Unknown id: a fresh state owned by `owner` if `create`, else
        SessionNotFound."""
        ...

    async def save(self, lease: Lease, state: SessionState, appended_from: int) -> None:
        """Atomically write `state` if the lease is current (else Fenced). `appended_from` is the committed
        length the store already holds: only state.tokens[appended_from:] need be written."""
        ...

    async def delete(self, session_id: str) -> bool: ...

    async def get(self, session_id: str) -> SessionState | None:
        """Read without taking the session over (no epoch bump)."""
        ...

    async def prior(self, owner: str = "") -> PolicyState | None:
        """The policy a new session of `owner` starts from: what that owner's sessions learned last,
        else the deployment's (its start-up calibration, or the keyless owner's sessions)."""
        ...

    async def remember(self, policy: PolicyState, owner: str = "") -> None:
        """Keep `policy` as `owner`'s prior: one tenant's traffic never sets another's start."""
        ...
