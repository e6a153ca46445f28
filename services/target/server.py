"""Target service: verifies drafts (and takes plain steps) with the large model.

Verifications that arrive while the model is busy wait and then go through ONE model pass
together (`specd.speculation.verify_batch`): a decode-sized pass costs about the same for one
session as for eight. Each request is still synced, checked, traced and answered on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from specd import speculation
from specd.engine import ModelEngine
from specd.verify import Verdict
from services.common.errors import grpc_errors
from services.common.model_service import ModelServicer, span_attributes
from services.common.worker import DEFAULT_MAX_BATCH, Batcher, EngineWorker
from services.protogen.specd.v1 import target_pb2, target_pb2_grpc
from services.target import convert

tracer = trace.get_tracer(__name__)


@dataclass(frozen=True)
class _Queued:
    call: convert.VerifyCall
    parent: otel_context.Context  # the RPC's trace context: its model span hangs under it


@dataclass(frozen=True)
class _Verified:
    verdict: Verdict
    position: int
    compute_s: float  # the whole batch's model time: what this request waited on


_Checked = tuple[speculation.Verification, Verdict] | Exception


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: ModelEngine, name: str, worker: EngineWorker, max_batch: int = DEFAULT_MAX_BATCH):
        super().__init__(engine, name, worker)
        self.batcher = Batcher(self.worker, self._verify_batch, key=lambda q: q.call.session_id, max_batch=max_batch)

    @grpc_errors
    async def Verify(self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        return await self._verify(convert.verify_call(request))

    @grpc_errors
    async def Step(self, request: target_pb2.StepRequest, context: grpc.aio.ServicerContext):
        return await self._verify(convert.step_call(request))

    async def _verify(self, call: convert.VerifyCall) -> target_pb2.VerifyResponse:
        done = await self.batcher.submit(_Queued(call, otel_context.get_current()))
        self.metrics.model_step("verify" if call.proposal.tokens else "step", done.compute_s)
        return convert.verify_response(done.verdict, done.position, self.engine.instance_id, done.compute_s)

    def _verify_batch(self, batch: list[_Queued]) -> list[_Verified | Exception]:
        """Worker thread: one span per request, covering the batch's model time."""
        start = time.perf_counter()
        spans = [_start_span(queued, len(batch)) for queued in batch]
        try:
            outcomes = self._run([queued.call for queued in batch])
        except Exception as error:
            outcomes = [error] * len(batch)
        finally:
            self.metrics.engine_changed(self.engine)  # a sync may evict, even one that then fails
        compute_s = time.perf_counter() - start
        return [self._settle(span, outcome, compute_s) for span, outcome in zip(spans, outcomes)]

    def _run(self, calls: list[convert.VerifyCall]) -> list[_Checked]:
        """Sync and check each request alone (its error is its own), then verify the rest in one pass."""
        outcomes = [self._prepare(call) for call in calls]
        ready = [o for o in outcomes if isinstance(o, speculation.Verification)]
        try:
            verdicts = iter(speculation.verify_batch(self.engine, ready))
        except Exception as error:  # the pass itself failed: every request in it fails
            return [error if isinstance(o, speculation.Verification) else o for o in outcomes]
        return [(o, next(verdicts)) if isinstance(o, speculation.Verification) else o for o in outcomes]

    def _prepare(self, call: convert.VerifyCall) -> speculation.Verification | Exception:
        try:
            self.sync_session(call.session_id, call.sync)
            return speculation.prepare_verification(self.engine, call.session_id, call.proposal, call.params)
        except Exception as error:
            return error

    def _settle(self, span: Span, outcome: _Checked, compute_s: float) -> _Verified | Exception:
        try:
            if isinstance(outcome, Exception):
                span.record_exception(outcome)
                span.set_status(Status(StatusCode.ERROR, f"{type(outcome).__name__}: {outcome}"))
                return outcome
            verification, verdict = outcome
            span.set_attributes({"specd.k": len(verification.proposal.tokens), "specd.position": verification.position,
                                 "specd.accepted": verdict.num_accepted})
            return _Verified(verdict, self.engine.position(verification.session_id), compute_s)
        finally:
            span.end()


def _start_span(queued: _Queued, batch_size: int) -> Span:
    call = queued.call
    name = "target.verify" if call.proposal.tokens else "target.step"
    attributes = {**span_attributes(call.session_id, call.sync), "specd.batch_size": batch_size}
    return tracer.start_span(name, context=queued.parent, attributes=attributes)


def register(servicer: TargetServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return [target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name]

    return add
