"""`Drafter` over gRPC: what the coordinator's loop uses to reach the draft service replicas."""

from __future__ import annotations

from typing import Sequence

from specd.loop import DraftReply, SyncPoint
from specd.sampling import SamplingParams
from services.common.client import call, session_ref, timeout
from services.common.replicas import Replicas
from services.draft import convert
from services.protogen.specd.v1 import draft_pb2_grpc


class GrpcDrafter:
    def __init__(self, addresses: Sequence[str], timeout_s: float = 60.0, retry_s: float = 60.0):
        self.replicas = Replicas(addresses, draft_pb2_grpc.DraftServiceStub, retry_s)
        self._timeout_s = timeout_s

    async def propose(
        self, session_id: str, sync: SyncPoint, k: int, params: SamplingParams, lookahead: int = 0,
        min_confidence: float = 0.0,
    ) -> DraftReply:
        request = convert.propose_request(session_id, sync, k, params, lookahead, min_confidence)
        reply = await self.replicas.call(
            sync.instance_id, session_id, lambda stub: call(stub.Propose(request, timeout=timeout(self._timeout_s)))
        )
        return convert.draft_reply(reply)

    async def release(self, session_id: str) -> None:
        await self.replicas.broadcast(lambda stub: stub.Release(session_ref(session_id), timeout=self._timeout_s))
