"""Coordinator service: the client-facing gRPC API around the transport-free loop.

Stateless: every session lives in the store (Redis), so any replica can serve any turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc

from specd.loop import Chunk, Finished, GenerationRequest
from specd.validation import InvalidParams
from specd.session import Fenced, SessionNotFound
from services.common.client import set_request_deadline
from services.coordinator import convert, requests
from services.coordinator.auth import ApiKeys, Unauthenticated
from services.coordinator.frontend import DownstreamFailed, Failure, Frontend
from services.coordinator.quotas import QuotaExceeded
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc

FAILURE_CODES = {Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE, Failure.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 Failure.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED, Failure.INTERNAL: grpc.StatusCode.INTERNAL}


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Clients authenticate with `authorization: Bearer <key>` metadata when keys are configured.
    A client's deadline bounds every model-service call made for it, and a cancelled or
    expired call cancels its generation (a one-off session's caches are freed at once)."""

    def __init__(self, frontend: Frontend, keys: ApiKeys = ApiKeys.open()):
        self.frontend, self.keys = frontend, keys

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """Each write may wait `stream_stall_s` on a client that does not read (gRPC's flow control
        holds it); past that the stream ends and its generation closes, as the REST edge's. An async
        generator that yields nothing: its writes are context.write's, which the stall limit can time,
        and a server interceptor (tracing's) iterates the handler."""
        owner = await self._owner(context)
        generation = await self._validated(request, owner, context)
        stall_s = self.frontend.limits.stream_stall_s
        async with contextlib.aclosing(self._events(generation, request, owner, context)) as events:
            async for event in events:
                try:
                    async with asyncio.timeout(stall_s):
                        await context.write(convert.stream_response(event, len(generation.prompt)))
                except TimeoutError:
                    break
            else:
                return
        # the generation is closed by now: its quota slot and caches are back before the client hears
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the client read nothing for {stall_s:g} s: "
                                                               "the stream ended")
        yield  # never reached: abort raises; the yield makes this an async generator

    async def Complete(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CompleteResponse:
        owner = await self._owner(context)
        generation = await self._validated(request, owner, context)
        async with contextlib.aclosing(self._events(generation, request, owner, context)) as events:
            async for event in events:
                if isinstance(event, Finished):
                    return convert.complete_response(event, len(generation.prompt))
        raise AssertionError("the loop always ends with Finished")

    async def GetSession(self, request: coordinator_pb2.SessionRequest, context: grpc.aio.ServicerContext):
        owner = await self._owner(context)
        async with _statuses(context, request.session_id):
            session = await self.frontend.session(requests.session_id(request.session_id), owner)
            return convert.session_summary(session, request.include_tokens)

    async def ReleaseSession(self, request: coordinator_pb2.SessionRequest, context: grpc.aio.ServicerContext):
        owner = await self._owner(context)
        async with _statuses(context, request.session_id):
            await self.frontend.release(requests.session_id(request.session_id), owner)
        return convert.released()

    async def _owner(self, context: grpc.aio.ServicerContext) -> str:
        try:
            return self.keys.owner(dict(context.invocation_metadata() or ()).get("authorization"))
        except Unauthenticated as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    async def _validated(self, request, owner: str, context: grpc.aio.ServicerContext) -> GenerationRequest:
        async with _statuses(context, request.session_id):
            await self.frontend.knock(owner)  # before the tokeniser's work, as the REST edge before the body
            return await asyncio.to_thread(requests.generation_request, convert.client_request(request),
                                           self.frontend.model, self.frontend.limits)  # tokenising: off the event loop

    async def _events(
        self, generation: GenerationRequest, request: coordinator_pb2.GenerateRequest, owner: str,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Chunk | Finished]:
        set_request_deadline(context.time_remaining())
        events = self.frontend.generate(generation, request.session_id, owner, request.request_id)
        async with _statuses(context, request.session_id), contextlib.aclosing(events):
            async for event in events:
                yield event


@contextlib.asynccontextmanager
async def _statuses(context: grpc.aio.ServicerContext, session_id: str) -> AsyncIterator[None]:
    """The frontend's domain errors as gRPC statuses."""
    try:
        yield
    except QuotaExceeded as e:
        # retry-after in seconds, as REST's header; grpc-retry-pushback-ms for gRPC's own retry policy
        context.set_trailing_metadata((("retry-after", str(e.retry_after_s)),
                                       ("grpc-retry-pushback-ms", str(e.retry_after_s * 1000))))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except InvalidParams as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except SessionNotFound as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
    except Fenced:
        await context.abort(grpc.StatusCode.ABORTED, f"session {session_id!r} was taken over by a newer request")
    except DownstreamFailed as e:
        await context.abort(FAILURE_CODES[e.failure], str(e))


def register(servicer: CoordinatorServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
        return [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]

    return add
