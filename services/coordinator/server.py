"""Coordinator service: the client-facing gRPC API around the transport-free loop.

Stateless: every session lives in the store (Redis), so any replica can serve any turn.
"""

from __future__ import annotations

from typing import AsyncIterator

import grpc
import redis.exceptions

from specd.loop import Chunk, Finished, GenerationRequest
from specd.validation import InvalidParams
from specd.session import Fenced, SessionNotFound
from services.coordinator import convert
from services.coordinator.frontend import Frontend
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc

# Downstream failures the client can act on keep their code; anything else is ours.
PASSED_THROUGH = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        generation = await self._validated(request, context)
        async for event in self._events(generation, request.session_id, context):
            if isinstance(event, Chunk):
                yield coordinator_pb2.GenerateResponse(token_ids=event.token_ids, text=event.text)
            else:
                stats = convert.final_stats(event, len(generation.prompt))
                yield coordinator_pb2.GenerateResponse(finish_reason=event.finish_reason, stats=stats)

    async def Complete(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CompleteResponse:
        generation = await self._validated(request, context)
        async for event in self._events(generation, request.session_id, context):
            if isinstance(event, Finished):
                return convert.complete_response(event, len(generation.prompt))
        raise AssertionError("the loop always ends with Finished")

    async def GetSession(self, request: coordinator_pb2.SessionRequest, context: grpc.aio.ServicerContext):
        session_id = await self._session_id(request.session_id, context)
        try:
            return convert.session_summary(await self.frontend.session(session_id))
        except SessionNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))

    async def ReleaseSession(self, request: coordinator_pb2.SessionRequest, context: grpc.aio.ServicerContext):
        session_id = await self._session_id(request.session_id, context)
        try:
            await self.frontend.release(session_id)
        except SessionNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        return coordinator_pb2.ReleaseSessionResponse(released=True)

    async def _session_id(self, value: str, context: grpc.aio.ServicerContext) -> str:
        try:
            return convert.session_id(value)
        except InvalidParams as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _validated(self, request, context: grpc.aio.ServicerContext) -> GenerationRequest:
        try:
            return convert.generation_request(request, self.frontend.model, self.frontend.limits)
        except InvalidParams as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _events(self, generation: GenerationRequest, session_id: str, context) -> AsyncIterator[Chunk | Finished]:
        try:
            async for event in self.frontend.generate(generation, session_id):
                yield event
        except grpc.aio.AioRpcError as e:
            code = e.code() if e.code() in PASSED_THROUGH else grpc.StatusCode.INTERNAL
            await context.abort(code, f"model service failed: {e.code().name}: {e.details()}")
        except Fenced:
            await context.abort(grpc.StatusCode.ABORTED, f"session {session_id!r} was taken over by a newer request")
        except SessionNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        except redis.exceptions.ConnectionError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"session store unreachable: {e}")


def register(servicer: CoordinatorServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
        return [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]

    return add
