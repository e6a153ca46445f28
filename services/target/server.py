"""Target service: verifies drafts (and takes plain steps) with the large model."""

from __future__ import annotations

import grpc
from opentelemetry import trace

from specd import speculation
from services.common.errors import grpc_errors
from services.common.model_service import ModelServicer
from services.protogen.specd.v1 import target_pb2, target_pb2_grpc
from services.target import convert


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    @grpc_errors
    async def Verify(self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        return await self._verify(convert.verify_call(request))

    @grpc_errors
    async def Step(self, request: target_pb2.StepRequest, context: grpc.aio.ServicerContext):
        return await self._verify(convert.step_call(request))

    async def _verify(self, call: convert.VerifyCall) -> target_pb2.VerifyResponse:
        k = len(call.proposal.tokens)

        def verify(position: int):
            verdict = speculation.verify_proposal(self.engine, call.session_id, call.proposal, call.params)
            trace.get_current_span().set_attributes(
                {"specd.k": k, "specd.position": position, "specd.accepted": verdict.num_accepted}
            )
            return verdict, self.engine.position(call.session_id)

        span = "target.verify" if k else "target.step"
        (verdict, position), compute_s = await self.in_session(call.session_id, call.sync, verify, span)
        self.metrics.model_step("verify" if k else "step", compute_s)
        return convert.verify_response(verdict, position, self.engine.instance_id, compute_s)


def register(servicer: TargetServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return [target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name]

    return add
