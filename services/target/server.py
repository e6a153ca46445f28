"""Target service: verifies drafts (and takes plain steps) with the large model.

Verifications that arrive while the model is busy wait and then go through ONE model pass
together (`specd.target_engine.TargetEngine.verify`): a decode-sized pass costs about the same
for one session as for eight. Each request is still synced, checked, traced and answered on its own.
"""

from __future__ import annotations

from typing import Any

import grpc

from specd.contracts import VerifyReply, VerifyRequest
from specd.engine import ModelEngine
from specd.target_engine import TargetEngine
from services.common.errors import grpc_errors
from services.common.model_service import ModelServicer
from services.common.worker import Batching, EngineWorker
from services.protogen.specd.v1 import target_pb2, target_pb2_grpc
from services.target import convert


class TargetServicer(ModelServicer[VerifyRequest, VerifyReply], target_pb2_grpc.TargetServiceServicer):
    role = "target"
    role_engine: TargetEngine

    def __init__(self, engine: ModelEngine, name: str, worker: EngineWorker, batching: Batching = Batching()):
        super().__init__(TargetEngine(engine), worker, batching)

    @grpc_errors
    async def Verify(self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        return convert.reply_to_proto(await self.verify(convert.verify_from_proto(request)))

    @grpc_errors
    async def Step(self, request: target_pb2.StepRequest, context: grpc.aio.ServicerContext):
        return convert.reply_to_proto(await self.verify(convert.step_from_proto(request)))

    async def verify(self, request: VerifyRequest) -> VerifyReply:
        """Verify (K = 0: one plain step) in the next batched pass. Transport-free: the gRPC
        methods and the Ray Serve deployment both call it."""
        return await self.submit(request)

    def _engine_batch(self, requests: list[VerifyRequest]) -> list[VerifyReply | Exception]:
        return self.role_engine.verify(requests)

    def _stage(self, request: VerifyRequest) -> str:
        return "verify" if request.proposal.tokens else "step"

    def _span_attributes(self, request: VerifyRequest, reply: VerifyReply) -> dict[str, Any]:
        verdict = reply.verdict
        return {"specd.k": len(request.proposal.tokens), "specd.position": request.sync.end,
                "specd.accepted": verdict.num_accepted}


def register(servicer: TargetServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return [target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name]

    return add
