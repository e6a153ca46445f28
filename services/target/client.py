"""`Verifier` over gRPC: what the coordinator's loop uses to reach the target service replicas."""

from __future__ import annotations

from typing import Sequence

from specd.contracts import EngineInfo, VerifyReply, VerifyRequest
from services.common.client import call, timeout
from services.common.convert import ENGINE_INFO_REQUEST, engine_info_from_proto, session_ref_to_proto
from services.common.replicas import Replicas
from services.common.tls import TlsFiles
from services.protogen.specd.v1 import target_pb2_grpc
from services.target import convert

WAIT_S = 60.0  # a round waits this long for some target replica to answer (a restart), then fails
ENGINE_INFO_TIMEOUT_S = 5.0  # answered off the model's thread: a busy target still answers at once


class GrpcVerifier:
    def __init__(self, addresses: str | Sequence[str], timeout_s: float = 120.0, retry_s: float = WAIT_S,
                 tls: TlsFiles | None = None):
        self.replicas = Replicas("target", addresses, target_pb2_grpc.TargetServiceStub, retry_s, tls=tls)
        self._timeout_s = timeout_s

    async def verify(self, request: VerifyRequest) -> VerifyReply:
        """K > 0: the Verify RPC; K = 0: a plain Step."""
        if request.proposal.tokens:
            msg = convert.verify_to_proto(request)
            rpc = lambda stub: call(stub.Verify(msg, timeout=timeout(self._timeout_s)))  # noqa: E731
        else:
            step = convert.step_to_proto(request)
            rpc = lambda stub: call(stub.Step(step, timeout=timeout(self._timeout_s)))  # noqa: E731
        return convert.reply_from_proto(await self.replicas.call(request.sync.instance_id, request.session_id, rpc))

    async def release(self, session_id: str) -> None:
        ref = session_ref_to_proto(session_id)
        await self.replicas.broadcast(lambda stub: stub.Release(ref, timeout=self._timeout_s))

    async def engines(self) -> list[EngineInfo | BaseException]:
        """What each replica runs (the gateway's /v1/models), asked now: or why it did not answer."""
        replies = await self.replicas.broadcast(
            lambda stub: stub.GetEngineInfo(ENGINE_INFO_REQUEST, timeout=ENGINE_INFO_TIMEOUT_S)
        )
        return [reply if isinstance(reply, BaseException) else engine_info_from_proto(reply) for reply in replies]
