"""Target service: verifies drafts (and takes plain steps) with the large model.

Verifications that arrive while the model is busy wait and then go through ONE model pass
together (`specd.speculation.verify_batch`): a decode-sized pass costs about the same for one
session as for eight. Each request is still synced, checked, traced and answered on its own.
"""

from __future__ import annotations

from functools import partial

import grpc

from specd import speculation
from specd.engine import ModelEngine
from specd.loop import VerifyReply
from specd.verify import Verdict
from services.common.errors import grpc_errors
from services.common.model_service import ModelServicer, Outcome, queued
from services.common.worker import Batching, EngineWorker
from services.protogen.specd.v1 import target_pb2, target_pb2_grpc
from services.target import convert


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: ModelEngine, name: str, worker: EngineWorker, batching: Batching = Batching()):
        super().__init__(engine, name, worker)
        self.batcher = self.make_batcher(
            self._prepare, partial(speculation.verify_batch, engine), self._answer, _span_name, batching
        )

    @grpc_errors
    async def Verify(self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        return await self._verify(convert.verify_call(request))

    @grpc_errors
    async def Step(self, request: target_pb2.StepRequest, context: grpc.aio.ServicerContext):
        return await self._verify(convert.step_call(request))

    async def _verify(self, call: convert.VerifyCall) -> target_pb2.VerifyResponse:
        reply = await self.verify(call)
        return convert.verify_response(reply)

    async def verify(self, call: convert.VerifyCall) -> VerifyReply:
        """Verify (K = 0: one plain step) in the next batched pass. Transport-free: the gRPC
        methods and the Ray Serve deployment both call it."""
        done = await self.batcher.submit(queued(call))
        self.metrics.model_step("verify" if call.proposal.tokens else "step", done.compute_s)
        verdict, position = done.result
        return VerifyReply(verdict, position, self.engine.instance_id, done.compute_s, done.queued_s, done.batch_size)

    def _prepare(self, call: convert.VerifyCall) -> speculation.Verification:
        self.sync_session(call.session_id, call.sync)
        return speculation.prepare_verification(self.engine, call.session_id, call.proposal, call.params)

    def _answer(self, verification: speculation.Verification, verdict: Verdict) -> Outcome[tuple[Verdict, int]]:
        attributes = {"specd.k": len(verification.proposal.tokens), "specd.position": verification.position,
                      "specd.accepted": verdict.num_accepted, "specd.sibling_won": verdict.after_sibling is not None}
        return (verdict, self.engine.position(verification.session_id)), attributes


def _span_name(call: convert.VerifyCall) -> str:
    return "target.verify" if call.proposal.tokens else "target.step"


def register(servicer: TargetServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return [target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name]

    return add
