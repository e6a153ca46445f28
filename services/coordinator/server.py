"""Coordinator service: the client-facing gRPC API around the transport-free loop."""

from __future__ import annotations

import uuid
from typing import AsyncIterator

import grpc

from specd.loop import Chunk, Drafter, Finished, GenerationRequest, Verifier, generate
from specd.sampling import InvalidParams
from services.coordinator import convert
from services.coordinator.model_info import ModelInfo
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc

# Downstream failures the client can act on keep their code; anything else is ours.
PASSED_THROUGH = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, drafter: Drafter, verifier: Verifier, model: ModelInfo, limits: convert.Limits):
        self.drafter, self.verifier, self.model, self.limits = drafter, verifier, model, limits

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        generation = await self._validated(request, context)
        async for event in self._events(generation, context):
            if isinstance(event, Chunk):
                yield coordinator_pb2.GenerateResponse(token_ids=event.token_ids, text=event.text)
            else:
                stats = convert.stats_to_proto(event.stats, len(generation.prompt), len(event.token_ids))
                yield coordinator_pb2.GenerateResponse(finish_reason=event.finish_reason, stats=stats)

    async def Complete(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CompleteResponse:
        generation = await self._validated(request, context)
        async for event in self._events(generation, context):
            if isinstance(event, Finished):
                return convert.complete_response(event, len(generation.prompt))
        raise AssertionError("the loop always ends with Finished")

    async def _validated(self, request, context: grpc.aio.ServicerContext) -> GenerationRequest:
        try:
            return convert.generation_request(request, self.model, self.limits)
        except InvalidParams as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _events(self, generation: GenerationRequest, context) -> AsyncIterator[Chunk | Finished]:
        session_id = uuid.uuid4().hex
        try:
            async for event in generate(generation, session_id, self.drafter, self.verifier, self.model.decode):
                yield event
        except grpc.aio.AioRpcError as e:
            code = e.code() if e.code() in PASSED_THROUGH else grpc.StatusCode.INTERNAL
            await context.abort(code, f"model service failed: {e.code().name}: {e.details()}")


def register(servicer: CoordinatorServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
        return [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]

    return add
