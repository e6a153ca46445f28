"""Target service: verifies drafts (and takes plain steps) with the large model.

Verifications that arrive while the model is busy wait and then go through ONE model pass
together (`specd.target_engine.TargetEngine.verify`): a decode-sized pass costs about the same
for one session as for eight. Each request is still synced, checked, traced and answered on its own.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, AsyncIterator

import grpc

from specd.contracts import DecodeRequest, SyncPoint, VerifyReply, VerifyRequest
from specd.engine import ModelEngine
from specd.target_engine import TargetEngine
from services.common.errors import grpc_errors
from services.common.model_service import ModelServicer
from services.common.worker import Batching, EngineWorker
from services.protogen.specd.v1 import target_pb2, target_pb2_grpc
from services.target import convert


AHEAD = 2  # steps a Decode stream runs past the replies its client took: one in flight while it handles the last


class Credit:
    """A Decode stream's flow control, from its client's messages: the replies it has taken, and
    whether it asked to stop. A client that stops reading holds the stream AHEAD steps on."""

    def __init__(self):
        self.taken, self.stopped = 0, False
        self._changed = asyncio.Event()

    def take(self, taken: int) -> None:
        self.taken = max(self.taken, taken)
        self._changed.set()

    def stop(self) -> None:
        self.stopped = True
        self._changed.set()

    async def allows(self, step: int) -> bool:
        """May the stream's step `step` (from 0) run? It waits while that would run more than AHEAD
        past the replies taken; never once the client asked to stop."""
        while not self.stopped and step >= self.taken + AHEAD:
            self._changed.clear()
            await self._changed.wait()
        return not self.stopped


class TargetServicer(ModelServicer[VerifyRequest, VerifyReply], target_pb2_grpc.TargetServiceServicer):
    role = "target"
    role_engine: TargetEngine

    def __init__(self, engine: ModelEngine, name: str, worker: EngineWorker, batching: Batching = Batching()):
        super().__init__(TargetEngine(engine), worker, batching)

    @grpc_errors
    async def Verify(self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        return convert.reply_to_proto(await self.verify(convert.verify_from_proto(request)))

    @grpc_errors
    async def Step(self, request: target_pb2.StepRequest, context: grpc.aio.ServicerContext):
        return convert.reply_to_proto(await self.verify(convert.step_from_proto(request)))

    @grpc_errors
    async def Decode(self, request_iterator, context: grpc.aio.ServicerContext):
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None:
            return
        request, credit = convert.decode_from_proto(first), Credit()
        listening = asyncio.ensure_future(_listen(messages, credit))
        try:
            async for reply in self.decode(request, credit):
                yield convert.reply_to_proto(reply)
        finally:
            listening.cancel()

    async def decode(self, request: DecodeRequest, credit: Credit) -> AsyncIterator[VerifyReply]:
        """Plain steps, each in the next batched pass as a Step would be, the next one queued as
        soon as the last is decided (its token is the only one it feeds), while `credit` allows."""
        step = request.step
        for done in range(request.max_steps):
            if not await credit.allows(done):
                return
            reply = await self.submit(step)
            yield reply
            step = replace(step, sync=SyncPoint(reply.position, (), reply.instance_id))

    async def verify(self, request: VerifyRequest) -> VerifyReply:
        """Verify (K = 0: one plain step) in the next batched pass. Transport-free: the gRPC
        methods and the Ray Serve deployment both call it."""
        return await self.submit(request)

    def _engine_batch(self, requests: list[VerifyRequest]) -> list[VerifyReply | Exception]:
        replies = self.role_engine.verify(requests)
        active = self.batcher.held_up()  # this turn's sessions among them, and those queued behind it
        return [r if isinstance(r, Exception) else replace(r, active_sessions=active) for r in replies]

    def _stage(self, request: VerifyRequest) -> str:
        return "verify" if request.proposal.tokens else "step"

    def _span_attributes(self, request: VerifyRequest, reply: VerifyReply) -> dict[str, Any]:
        verdict = reply.verdict
        return {"specd.k": len(request.proposal.tokens), "specd.position": request.sync.end,
                "specd.accepted": verdict.num_accepted}


async def _listen(messages: AsyncIterator, credit: Credit) -> None:
    """A Decode stream's client messages after its start: the replies it took; their end (or any
    other message) stops the stream after the step in flight."""
    try:
        async for message in messages:
            if message.WhichOneof("kind") != "taken":
                break
            credit.take(message.taken)
    except Exception:  # the call ended under it: the stream stops all the same
        pass
    finally:
        credit.stop()


def register(servicer: TargetServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return [target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name]

    return add
