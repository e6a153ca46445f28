"""Draft service: proposes K tokens per round from the small model."""

from __future__ import annotations

import grpc
from opentelemetry import trace

from specd import speculation
from services.common.errors import grpc_errors
from services.common.model_service import ModelServicer
from services.draft import convert
from services.protogen.specd.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    @grpc_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext):
        call = convert.propose_call(request)

        def draft(position: int):
            trace.get_current_span().set_attributes({"specd.k": call.k, "specd.position": position})
            return speculation.propose(self.engine, call.session_id, call.k, call.params), position

        (proposal, position), compute_s = await self.in_session(call.session_id, call.sync, draft, "draft.propose")
        self.metrics.model_step("propose", compute_s)
        return convert.propose_response(proposal, position, self.engine.instance_id, compute_s)


def register(servicer: DraftServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name]

    return add
