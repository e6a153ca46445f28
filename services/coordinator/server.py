"""Coordinator service: the client-facing gRPC API around the transport-free loop.

Stateless: every session lives in the store (Redis), so any replica can serve any turn.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import grpc
import redis.exceptions

from specd.contracts import ServiceUnavailable
from specd.loop import Chunk, Finished, GenerationRequest
from specd.validation import InvalidParams
from specd.session import Fenced, SessionNotFound
from services.common.client import set_request_deadline
from services.coordinator import convert, requests
from services.coordinator.auth import ApiKeys, Unauthenticated
from services.coordinator.frontend import Frontend
from services.coordinator.quotas import QuotaExceeded
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc

# Downstream failures the client can act on keep their code; anything else is ours.
PASSED_THROUGH = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Clients authenticate with `authorization: Bearer <key>` metadata when keys are configured.
    A client's deadline bounds every model-service call made for it, and a cancelled or
    expired call cancels its generation (a one-off session's caches are freed at once)."""

    def __init__(self, frontend: Frontend, keys: ApiKeys = ApiKeys.open()):
        self.frontend, self.keys = frontend, keys

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        owner = await self._owner(context)
        generation = await self._validated(request, context)
        async for event in self._events(generation, request, owner, context):
            if isinstance(event, Chunk):
                yield coordinator_pb2.GenerateResponse(token_ids=event.token_ids, text=event.text)
            else:
                stats = convert.final_stats(event, len(generation.prompt))
                yield coordinator_pb2.GenerateResponse(finish_reason=event.finish_reason, stats=stats)

    async def Complete(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CompleteResponse:
        owner = await self._owner(context)
        generation = await self._validated(request, context)
        async with contextlib.aclosing(self._events(generation, request, owner, context)) as events:
            async for event in events:
                if isinstance(event, Finished):
                    return convert.complete_response(event, len(generation.prompt))
        raise AssertionError("the loop always ends with Finished")

    async def GetSession(self, request: coordinator_pb2.SessionRequest, context: grpc.aio.ServicerContext):
        owner = await self._owner(context)
        session_id = await self._session_id(request.session_id, context)
        try:
            return convert.session_summary(await self.frontend.session(session_id, owner), request.include_tokens)
        except SessionNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))

    async def ReleaseSession(self, request: coordinator_pb2.SessionRequest, context: grpc.aio.ServicerContext):
        owner = await self._owner(context)
        session_id = await self._session_id(request.session_id, context)
        try:
            await self.frontend.release(session_id, owner)
        except SessionNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        return coordinator_pb2.ReleaseSessionResponse(released=True)

    async def _owner(self, context: grpc.aio.ServicerContext) -> str:
        try:
            return self.keys.owner(dict(context.invocation_metadata() or ()).get("authorization"))
        except Unauthenticated as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    async def _session_id(self, value: str, context: grpc.aio.ServicerContext) -> str:
        try:
            return requests.session_id(value)
        except InvalidParams as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _validated(self, request, context: grpc.aio.ServicerContext) -> GenerationRequest:
        try:
            return requests.generation_request(convert.client_request(request), self.frontend.model, self.frontend.limits)
        except InvalidParams as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _events(
        self, generation: GenerationRequest, request: coordinator_pb2.GenerateRequest, owner: str,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Chunk | Finished]:
        set_request_deadline(context.time_remaining())
        session_id = request.session_id
        try:
            async for event in self.frontend.generate(generation, session_id, owner, request.request_id):
                yield event
        except QuotaExceeded as e:
            # retry-after in seconds, as REST's header; grpc-retry-pushback-ms for gRPC's own retry policy
            context.set_trailing_metadata((("retry-after", str(e.retry_after_s)),
                                           ("grpc-retry-pushback-ms", str(e.retry_after_s * 1000))))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except grpc.aio.AioRpcError as e:
            code = e.code() if e.code() in PASSED_THROUGH else grpc.StatusCode.INTERNAL
            await context.abort(code, f"model service failed: {e.code().name}: {e.details()}")
        except InvalidParams as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ServiceUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e} (the session is kept: retry it)")
        except Fenced:
            await context.abort(grpc.StatusCode.ABORTED, f"session {session_id!r} was taken over by a newer request")
        except SessionNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"session store unreachable: {e}")


def register(servicer: CoordinatorServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
        return [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]

    return add
