"""Draft service: proposes K tokens per round from the small model.

Proposals that arrive while the model is busy wait and then draft together
(`specd.draft_engine.DraftEngine.propose`): each drafting step is one model pass over every
session still drafting. Each request is still synced, checked, traced and answered on its own.
"""

from __future__ import annotations

from typing import Any

import grpc

from specd.contracts import DraftReply, ProposeRequest
from specd.draft_engine import DraftEngine
from specd.engine import ModelEngine
from services.common.errors import grpc_errors
from services.common.model_service import ModelServicer
from services.common.worker import Batching, EngineWorker
from services.draft import convert
from services.protogen.specd.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(ModelServicer[ProposeRequest, DraftReply], draft_pb2_grpc.DraftServiceServicer):
    role = "draft"
    role_engine: DraftEngine

    def __init__(self, engine: ModelEngine, name: str, worker: EngineWorker, batching: Batching = Batching()):
        super().__init__(DraftEngine(engine), worker, batching)

    @grpc_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext):
        reply = await self.propose(convert.propose_from_proto(request))
        return convert.reply_to_proto(reply)

    async def propose(self, request: ProposeRequest) -> DraftReply:
        """Draft k in the next batch. Transport-free: the gRPC method and the Ray Serve deployment
        both call it."""
        return await self.submit(request)

    def _engine_batch(self, requests: list[ProposeRequest]) -> list[DraftReply | Exception]:
        return self.role_engine.propose(requests)

    def _stage(self, request: ProposeRequest) -> str:
        return "propose"

    def _span_attributes(self, request: ProposeRequest, reply: DraftReply) -> dict[str, Any]:
        return {"specd.k": request.k, "specd.drafted": len(reply.proposal.tokens), "specd.position": reply.position}


def register(servicer: DraftServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name]

    return add
