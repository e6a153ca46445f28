"""What every client edge (gRPC today, REST too) shares: sessions with owners, quotas, and the loop.

Edges validate and convert; the frontend runs a request on a session within its key's quotas
(services/coordinator/quotas.py). Session ids are per key: a key's id `chat` is stored as
`<key's tag>/chat`, so one key can neither see, probe nor take another's ids (the keyless
owner's ids are stored as given). Downstream errors (a model service's gRPC status, the store's
connection) are translated here, once, into `DownstreamFailed`; each edge maps domain errors to codes.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import uuid
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import AsyncIterator, Iterator

import grpc
import redis.exceptions
from opentelemetry import trace

from specd import calibration
from specd.audit import Auditor
from specd.contracts import EngineInfo, ServiceUnavailable
from specd.loop import Chunk, Finished, GenerationRequest, Services, generate
from specd.policy import PolicyState
from specd.session import SessionNotFound, SessionState
from services.common.metrics import CoordinatorMetrics
from services.coordinator.model_info import ModelInfo
from services.coordinator.quotas import Quotas, owner_tag
from services.coordinator.requests import Limits, policy_config

tracer = trace.get_tracer(__name__)
log = logging.getLogger(__name__)


class Failure(enum.Enum):
    """How a client may act on a downstream failure."""

    UNAVAILABLE = "unavailable"  # no model replica or store answered: retry, the session is kept
    EXHAUSTED = "exhausted"  # a model service is at capacity: retry later
    DEADLINE = "deadline"  # the client's deadline passed while a model service worked
    INTERNAL = "internal"  # a model service failed in a way a retry does not mend


class DownstreamFailed(Exception):
    def __init__(self, failure: Failure, message: str):
        super().__init__(message)
        self.failure = failure


# A model service's gRPC status, as the client may act on it; any other status is INTERNAL.
_GRPC_FAILURES = {grpc.StatusCode.UNAVAILABLE: Failure.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED:
                  Failure.EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED: Failure.DEADLINE}


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Model-service and store errors as `DownstreamFailed`: a stable message and an error id for the
    client; the detail (addresses, internal ids, Redis's words) only in the log, under that id."""
    try:
        yield
    except ServiceUnavailable as e:
        raise _failed(Failure.UNAVAILABLE, "no model replica answered; the session is kept: retry it", e) from e
    except grpc.aio.AioRpcError as e:
        failure = _GRPC_FAILURES.get(e.code(), Failure.INTERNAL)
        raise _failed(failure, f"a model service failed ({e.code().name})", e) from e
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        raise _failed(Failure.UNAVAILABLE, "the session store is unreachable; retry it", e) from e


def _failed(failure: Failure, message: str, cause: BaseException) -> DownstreamFailed:
    error_id = uuid.uuid4().hex[:16]
    log.warning("error %s: %s: %s", error_id, message, cause)
    return DownstreamFailed(failure, f"{message} (error id {error_id})")


def scoped(session_id: str, owner: str) -> str:
    """The stored id of `owner`'s session `session_id`."""
    return f"{owner_tag(owner)}/{session_id}" if owner else session_id


class Frontend:
    def __init__(self, services: Services, model: ModelInfo, limits: Limits, audit_rate: float = 0.0,
                 quotas: Quotas | None = None):
        self.services, self.model, self.limits, self.quotas = services, model, limits, quotas
        self.metrics = CoordinatorMetrics()  # every edge's requests; served by the process (/metrics)
        self.auditor = Auditor(services, audit_rate, on_outcome=self.metrics.audited)  # specd/audit.py

    async def knock(self, owner: str) -> None:
        """QuotaExceeded before a request is read, when `owner` is over its rate or its requests in flight."""
        if self.quotas:
            with translated():
                await self.quotas.knock(owner)

    async def generate(
        self, request: GenerationRequest, session_id: str = "", owner: str = "", request_id: str = ""
    ) -> AsyncIterator[Chunk | Finished]:
        """Run a request; with a session id it continues (or starts) that session, else a one-off.
        `request_id` names a session's turn: sent again, the turn is not appended twice (specd.loop)."""
        # aclosing: a consumer that leaves closes this generator, and the inner one must close now too.
        with translated():
            async with contextlib.aclosing(self._generate(request, session_id, owner, request_id)) as events:
                async for event in events:
                    yield event

    async def _generate(
        self, request: GenerationRequest, session_id: str, owner: str, request_id: str
    ) -> AsyncIterator[Chunk | Finished]:
        stored = scoped(session_id, owner) if session_id else ""
        if session_id:  # the context is checked under the session's lease (specd.loop), a retry's turn not twice
            await self._owned_or_absent(stored, session_id, owner)
        named = stored or uuid.uuid4().hex
        admitted = (self.quotas.admit(owner, len(request.prompt), request.rules.max_tokens, stored)
                    if self.quotas else contextlib.nullcontext())
        async with admitted as ticket:
            events = generate(request, named, self.services, self.model.decode, not session_id, owner=owner,
                              request_id=request_id if session_id else "")
            # aclosing: a client that goes away closes this generator, and the loop's must close with
            # it now (freeing a one-off session's caches), not whenever it is garbage-collected.
            async with contextlib.aclosing(events):
                with self.metrics.request(len(request.prompt)) as tracked, _traced(named, request) as span:
                    async for event in events:
                        if isinstance(event, Finished):
                            tracked.finished(event)
                            span.set_attributes(_outcome(event))
                            self.auditor.offer(named, request, event)  # in the background: the client never waits
                        else:
                            tracked.chunk(event.token_ids)
                            if ticket:
                                ticket.generated += len(event.token_ids)
                        yield event

    async def seed_prior(self) -> PolicyState | None:
        """Start-up calibration (specd/calibration.py) when the deployment has no prior yet."""
        config = policy_config(self.limits, self.limits.max_k)
        return await calibration.seed_prior(self.services, self.model.decode, config)

    async def session(self, session_id: str, owner: str = "") -> SessionState:
        """`owner`'s session `session_id` (as the client names it)."""
        with translated():
            state = await self.services.store.get(scoped(session_id, owner))
        if state is None or state.owner != owner:
            raise SessionNotFound(f"no session {session_id!r} (released, expired, or not yours)")
        return replace(state, session_id=session_id)

    async def release(self, session_id: str, owner: str = "") -> None:
        await self.session(session_id, owner)
        stored = scoped(session_id, owner)
        with translated():
            await self.services.store.delete(stored)
            if self.services.drafter:
                await self.services.drafter.release(stored)
            await self.services.verifier.release(stored)
            if self.quotas:
                await self.quotas.forget_session(owner, stored)

    async def engines(self) -> list[EngineInfo | str]:
        """What each target replica runs, or why it did not answer (a status name, not an address)."""
        answers = await self.services.verifier.engines()
        return [a if isinstance(a, EngineInfo) else _why(a) for a in answers]

    async def _owned_or_absent(self, stored: str, session_id: str, owner: str) -> None:
        """Not found if another key owns the session (before any quota or lease is spent on it)."""
        state = await self.services.store.get(stored)
        if state is not None and state.owner != owner:
            raise SessionNotFound(f"no session {session_id!r} (released, expired, or not yours)")


def _why(error: BaseException) -> str:
    return error.code().name if isinstance(error, grpc.aio.AioRpcError) else type(error).__name__


def _traced(session_id: str, request: GenerationRequest) -> AbstractContextManager[trace.Span]:
    """The request's span: the loop's rounds (and their RPCs) become its children."""
    asked = {"specd.session_id": session_id, "specd.prompt_tokens": len(request.prompt),
             "specd.max_tokens": request.rules.max_tokens}
    return tracer.start_as_current_span("coordinator.generate", attributes=asked)


def _outcome(finished: Finished) -> dict[str, int | str]:
    return {
        "specd.completion_tokens": len(finished.token_ids),
        "specd.finish_reason": finished.finish_reason,
        "specd.rounds": finished.stats.rounds,
        "specd.accepted": finished.stats.accepted,
    }
