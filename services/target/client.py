"""`Verifier` over gRPC: what the coordinator's loop uses to reach the target service."""

from __future__ import annotations

import grpc

from specd.loop import SyncPoint, VerifyReply
from specd.sampling import SamplingParams
from specd.verify import Proposal
from services.common.client import call, session_ref
from services.protogen.specd.v1 import target_pb2_grpc
from services.target import convert


class GrpcVerifier:
    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = 120.0):
        self._stub = target_pb2_grpc.TargetServiceStub(channel)
        self._timeout_s = timeout_s

    async def verify(self, session_id: str, sync: SyncPoint, proposal: Proposal, params: SamplingParams) -> VerifyReply:
        if proposal.tokens:
            request = convert.verify_request(session_id, sync, proposal, params)
            reply = self._stub.Verify(request, timeout=self._timeout_s)
        else:
            reply = self._stub.Step(convert.step_request(session_id, sync, params), timeout=self._timeout_s)
        return convert.verify_reply(await call(reply))

    async def release(self, session_id: str) -> None:
        await self._stub.Release(session_ref(session_id), timeout=self._timeout_s)
