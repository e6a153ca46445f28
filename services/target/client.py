"""`Verifier` over gRPC: what the coordinator's loop uses to reach the target service replicas."""

from __future__ import annotations

from typing import Sequence

from specd.loop import SyncPoint, VerifyReply
from specd.sampling import SamplingParams
from specd.verify import Proposal
from services.common.client import call, session_ref, timeout
from services.common.replicas import Replicas
from services.protogen.specd.v1 import target_pb2_grpc
from services.target import convert


class GrpcVerifier:
    def __init__(self, addresses: Sequence[str], timeout_s: float = 120.0, retry_s: float = 60.0):
        self.replicas = Replicas(addresses, target_pb2_grpc.TargetServiceStub, retry_s)
        self._timeout_s = timeout_s

    async def verify(self, session_id: str, sync: SyncPoint, proposal: Proposal, params: SamplingParams) -> VerifyReply:
        if proposal.tokens:
            request = convert.verify_request(session_id, sync, proposal, params)
            rpc = lambda stub: call(stub.Verify(request, timeout=timeout(self._timeout_s)))  # noqa: E731
        else:
            step = convert.step_request(session_id, sync, params)
            rpc = lambda stub: call(stub.Step(step, timeout=timeout(self._timeout_s)))  # noqa: E731
        return convert.verify_reply(await self.replicas.call(sync.instance_id, session_id, rpc))

    async def release(self, session_id: str) -> None:
        await self.replicas.broadcast(lambda stub: stub.Release(session_ref(session_id), timeout=self._timeout_s))
