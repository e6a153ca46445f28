"""`Drafter` over gRPC: what the coordinator's loop uses to reach the draft service replicas."""

from __future__ import annotations

from typing import Sequence

from specd.contracts import DraftReply, EngineInfo, ProposeRequest
from services.common.client import call, timeout
from services.common.convert import ENGINE_INFO_REQUEST, engine_info_from_proto, session_ref_to_proto
from services.common.replicas import Replicas
from services.common.tls import TlsFiles
from services.draft import convert
from services.protogen.specd.v1 import draft_pb2_grpc

ENGINE_INFO_TIMEOUT_S = 5.0  # answered off the model's thread: a busy draft still answers at once


class GrpcDrafter:
    """`retry_s` 0: one pass over the pool, then ServiceUnavailable (the loop decodes plainly
    meanwhile; waiting for a draft would only stall the session)."""

    def __init__(self, addresses: str | Sequence[str], timeout_s: float = 60.0, retry_s: float = 0.0,
                 tls: TlsFiles | None = None):
        self.replicas = Replicas("draft", addresses, draft_pb2_grpc.DraftServiceStub, retry_s, tls=tls)
        self._timeout_s = timeout_s

    async def propose(self, request: ProposeRequest) -> DraftReply:
        msg = convert.propose_to_proto(request)
        reply = await self.replicas.call(
            request.sync.instance_id, request.session_id,
            lambda stub: call(stub.Propose(msg, timeout=timeout(self._timeout_s))),
        )
        return convert.reply_from_proto(reply)

    async def release(self, session_id: str) -> None:
        ref = session_ref_to_proto(session_id)
        await self.replicas.broadcast(lambda stub: stub.Release(ref, timeout=self._timeout_s))

    async def probe(self) -> bool:
        return await self.replicas.probe()

    async def engines(self) -> list[EngineInfo | BaseException]:
        """What each replica runs (the coordinator's start-up vocabulary check), or why it did not answer."""
        replies = await self.replicas.broadcast(
            lambda stub: stub.GetEngineInfo(ENGINE_INFO_REQUEST, timeout=ENGINE_INFO_TIMEOUT_S)
        )
        return [reply if isinstance(reply, BaseException) else engine_info_from_proto(reply) for reply in replies]
