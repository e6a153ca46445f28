"""`Verifier` over gRPC: what the coordinator's loop uses to reach the target service replicas."""

from __future__ import annotations

from typing import Sequence

import grpc

from specd.contracts import DecodeRequest, EngineInfo, StaleSession, VerifyReply, VerifyRequest
from services.common.client import call, timeout
from services.common.errors import stale_session
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

    async def decode(self, request: DecodeRequest) -> "DecodeStream":
        """Plain steps streamed by the session's replica (specd.protocols.Decoder), its first reply read."""
        start = convert.decode_to_proto(request)

        async def open_on(stub) -> DecodeStream:
            stream = DecodeStream(stub.Decode(timeout=timeout(self._timeout_s)))
            await stream.start(start)
            return stream

        return await self.replicas.call(request.step.sync.instance_id, request.step.session_id, open_on)

    async def release(self, session_id: str) -> None:
        ref = session_ref_to_proto(session_id)
        await self.replicas.broadcast(lambda stub: stub.Release(ref, timeout=self._timeout_s))

    async def engines(self) -> list[EngineInfo | BaseException]:
        """What each replica runs (the gateway's /v1/models), asked now: or why it did not answer."""
        replies = await self.replicas.broadcast(
            lambda stub: stub.GetEngineInfo(ENGINE_INFO_REQUEST, timeout=ENGINE_INFO_TIMEOUT_S)
        )
        return [reply if isinstance(reply, BaseException) else engine_info_from_proto(reply) for reply in replies]


class DecodeStream:
    """A Decode call's client end (specd.protocols.PlainSteps). Each `next` first tells the target
    how many replies were taken, which lets it run one step past the one in flight."""

    def __init__(self, rpc: grpc.aio.StreamStreamCall):
        self._rpc, self._taken, self._stopped = rpc, 0, False
        self.first: VerifyReply | None = None

    @property
    def instance_id(self) -> str:
        return self.first.instance_id if self.first else ""

    async def start(self, message) -> None:
        await self._rpc.write(message)
        self.first = await self._read()
        if self.first is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "the Decode stream ended before its first step")

    async def next(self) -> VerifyReply | None:
        """The next step's reply; None once the stream ended (its steps done, stopped, or failed:
        the caller goes on with single calls, which report a lasting error themselves)."""
        try:
            if not self._stopped:
                await self._rpc.write(convert.taken_to_proto(self._taken))
            return await self._read()
        except (grpc.aio.AioRpcError, StaleSession):
            return None

    async def stop(self) -> None:
        """No steps after the one in flight: its reply still comes."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self._rpc.done_writing()
        except grpc.aio.AioRpcError:  # the call already ended: next() reads its end
            pass

    def close(self) -> None:
        self._rpc.cancel()

    async def _read(self) -> VerifyReply | None:
        try:
            message = await self._rpc.read()
        except grpc.aio.AioRpcError as error:
            if stale := stale_session(error):
                raise stale from error
            raise
        if message is grpc.aio.EOF:
            return None
        self._taken += 1
        return convert.reply_from_proto(message)
