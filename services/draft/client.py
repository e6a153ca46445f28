"""`Drafter` over gRPC: what the coordinator's loop uses to reach the draft service."""

from __future__ import annotations

import grpc

from specd.loop import DraftReply, SyncPoint
from specd.sampling import SamplingParams
from services.common.client import call, session_ref
from services.draft import convert
from services.protogen.specd.v1 import draft_pb2_grpc


class GrpcDrafter:
    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = 60.0):
        self._stub = draft_pb2_grpc.DraftServiceStub(channel)
        self._timeout_s = timeout_s

    async def propose(self, session_id: str, sync: SyncPoint, k: int, params: SamplingParams) -> DraftReply:
        request = convert.propose_request(session_id, sync, k, params)
        return convert.draft_reply(await call(self._stub.Propose(request, timeout=self._timeout_s)))

    async def release(self, session_id: str) -> None:
        await self._stub.Release(session_ref(session_id), timeout=self._timeout_s)
