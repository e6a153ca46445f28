"""What the draft and target servicers share: an engine behind one worker thread, calls that
queue while it is busy going through one model pass together (each with its own span, error
and answer), and the session RPCs (GetSession, Release)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Protocol, Self, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from specd.engine import EngineConfig, ModelEngine, PositionMismatch
from specd.loop import SyncPoint
from services.common import convert
from services.common.errors import grpc_errors
from services.common.metrics import ModelMetrics
from services.common.worker import Batcher, Batching, EngineWorker, SharedCores
from services.protogen.specd.v1 import common_pb2

R = TypeVar("R")
P = TypeVar("P")  # a call prepared for the batch's pass
X = TypeVar("X")  # what the pass made of it
tracer = trace.get_tracer(__name__)


class SessionCall(Protocol):
    session_id: str
    sync: SyncPoint


C = TypeVar("C", bound=SessionCall)
Outcome = tuple[R, dict[str, Any]] | Exception  # a result and its span's attributes, or that call's error


@dataclass(frozen=True)
class Queued(Generic[C]):
    call: C
    parent: otel_context.Context  # the RPC's trace context: its model span hangs under it
    at: float = field(default_factory=time.perf_counter)  # when it was queued


@dataclass(frozen=True)
class Done(Generic[R]):
    result: R
    compute_s: float  # the whole batch's model time: what this request waited on
    queued_s: float = 0.0  # from queueing to the start of its pass (other passes, the other service's turn)
    batch_size: int = 1  # requests that shared the pass


class ModelServicer:
    batcher: Batcher  # the subclass's, from make_batcher

    def __init__(self, engine: ModelEngine, name: str, worker: EngineWorker):
        """`worker` is the thread that built `engine`, the only one that may run it (see `load`)."""
        self.engine = engine
        self.worker = worker
        self.metrics = ModelMetrics()

    @classmethod
    def load(cls, config: EngineConfig, name: str, cores: SharedCores | None = None, **kwargs) -> Self:
        """Build the engine on a new worker thread and serve it from there (services/common/worker.py),
        taking turns at the host's cores with the other services that share `cores`."""
        worker = EngineWorker(name, cores)
        return cls(worker.call(ModelEngine, config), name, worker, **kwargs)

    def make_batcher(
        self,
        prepare: Callable[[C], P],
        run: Callable[[list[P]], list[X]],
        answer: Callable[[P, X], Outcome],
        span_name: Callable[[C], str],
        batching: Batching,
    ) -> Batcher[Queued[C], Done]:
        """Calls queued while the worker is busy go through together, on the worker thread: each
        is prepared (synced, checked) alone, so its error is its own; the prepared ones go through
        `run` in one go, which can only fail them all; each gets its own answer and its own span
        under its RPC's, covering the batch's model time."""

        def outcomes(calls: list[C]) -> list[Outcome]:
            checked = [_attempt(prepare, call) for call in calls]
            ready = [c for c in checked if not isinstance(c, Exception)]
            try:
                results = iter(run(ready))
            except Exception as error:  # a pass failed: every request in it fails
                return [c if isinstance(c, Exception) else error for c in checked]
            return [c if isinstance(c, Exception) else answer(c, next(results)) for c in checked]

        def run_batch(batch: list[Queued[C]]) -> list[Done | Exception]:
            start = time.perf_counter()
            spans = [_start_span(span_name(queued.call), queued, len(batch)) for queued in batch]
            try:
                settled = outcomes([queued.call for queued in batch])
            except Exception as error:
                settled = [error] * len(batch)
            finally:
                self.metrics.engine_changed(self.engine)  # a sync may evict, even one that then fails
            compute_s = time.perf_counter() - start
            return [_settle(span, outcome, compute_s, start - q.at, len(batch))
                    for span, outcome, q in zip(spans, settled, batch)]

        return Batcher(self.worker, run_batch, key=lambda queued: queued.call.session_id, batching=batching)

    def sync_session(self, session_id: str, sync: SyncPoint) -> int:
        """Worker thread: bring the session to the committed tokens; returns its position."""
        self._check_instance(session_id, sync)
        return self.engine.sync(session_id, sync.start_pos, sync.tokens)

    def _check_instance(self, session_id: str, sync: SyncPoint) -> None:
        """A prefix held by another process (a restart, another replica) is not ours to build on,
        even when this process holds a session of that name and length."""
        if sync.start_pos > 0 and sync.instance_id != self.engine.instance_id:
            raise PositionMismatch(
                f"this is instance {self.engine.instance_id}, not {sync.instance_id!r}: resend the session",
                position=self.engine.position(session_id),
            )

    def release_session(self, session_id: str) -> None:
        """Worker thread: free the session's cache. Its passes are over: no turn waits for it."""
        self.engine.release(session_id)
        self.batcher.forget(session_id)
        self.metrics.engine_changed(self.engine)

    def info(self, session_id: str) -> common_pb2.SessionInfo:
        return common_pb2.SessionInfo(
            position=self.engine.position(session_id),
            kv_length=self.engine.kv_length(session_id),
            instance_id=self.engine.instance_id,
        )

    @grpc_errors
    async def GetSession(self, request: common_pb2.SessionRef, context: grpc.aio.ServicerContext):
        session_id = convert.session_id(request.session_id)
        return await self.worker.run(self.info, session_id)

    @grpc_errors
    async def Release(self, request: common_pb2.SessionRef, context: grpc.aio.ServicerContext):
        session_id = convert.session_id(request.session_id)

        def release() -> common_pb2.SessionInfo:
            self.release_session(session_id)
            return self.info(session_id)

        return await self.worker.run(release)

    def close(self) -> None:
        self.worker.close()


def queued(call: C) -> Queued[C]:
    """A call to submit to a `ModelServicer.make_batcher`, under the current (the RPC's) trace context."""
    return Queued(call, otel_context.get_current())


def _attempt(prepare: Callable[[C], P], call: C) -> P | Exception:
    try:
        return prepare(call)
    except Exception as error:
        return error


def _start_span(name: str, queued: Queued, batch_size: int) -> Span:
    call = queued.call
    attributes = {"specd.session_id": call.session_id, "specd.sync.start_pos": call.sync.start_pos,
                  "specd.sync.tokens": len(call.sync.tokens), "specd.batch_size": batch_size}
    return tracer.start_span(name, context=queued.parent, attributes=attributes)


def _settle(span: Span, outcome: Outcome, compute_s: float, queued_s: float, batch_size: int) -> Done | Exception:
    try:
        if isinstance(outcome, Exception):
            span.record_exception(outcome)
            span.set_status(Status(StatusCode.ERROR, f"{type(outcome).__name__}: {outcome}"))
            return outcome
        result, attributes = outcome
        span.set_attributes(attributes)
        return Done(result, compute_s, queued_s, batch_size)
    finally:
        span.end()
