"""What the draft and target servicers share: a role engine (specd/role_engine.py) behind one
worker thread, to which the calls that queue while it is busy go as one batch (each with its own
span, error and answer), the session RPCs (GetSession, Release), and what the engine runs
(GetEngineInfo, and the metric specd:engine_numerics_info)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from specd.contracts import DraftReply, EngineInfo, ProposeRequest, ReplicaLoad, VerifyReply, VerifyRequest
from specd.engine import EngineConfig, ModelEngine
from specd.role_engine import RoleEngine
from services.common import compute, convert
from services.common.errors import Draining, grpc_errors
from services.common.metrics import ModelMetrics
from services.common.worker import Batcher, Batching, EngineWorker, SharedCores
from services.protogen.specd.v1 import common_pb2

Request = TypeVar("Request", ProposeRequest, VerifyRequest)
Reply = TypeVar("Reply", DraftReply, VerifyReply)
tracer = trace.get_tracer(__name__)


@dataclass(frozen=True)
class Queued(Generic[Request]):
    request: Request
    parent: otel_context.Context  # the RPC's trace context: its model span hangs under it
    at: float = field(default_factory=time.perf_counter)  # when it was queued


class ModelServicer(Generic[Request, Reply]):
    role: str  # "draft" or "target": its spans are named "<role>.<stage>"

    def __init__(self, role_engine: RoleEngine, worker: EngineWorker, batching: Batching):
        """`worker` is the thread that built the engine, the only one that may run it (see `load`)."""
        self.role_engine = role_engine
        self.engine = role_engine.engine
        self.worker = worker
        self.compute_units = compute.units(self.engine.config.device)
        self.threads = worker.call(compute.threads)  # torch's count is per thread: the engine's
        self.metrics = ModelMetrics()
        self.metrics.engine_loaded(self.engine_info())
        self.batcher = Batcher(worker, self._run_batch, key=lambda queued: queued.request.session_id, batching=batching)
        self.draining = False

    @classmethod
    def load(cls, config: EngineConfig, name: str, cores: SharedCores | None = None, **kwargs) -> Self:
        """Build the engine on a new worker thread and serve it from there (services/common/worker.py),
        taking turns at the host's cores with the other services that share `cores`."""
        worker = EngineWorker(name, cores)
        return cls(worker.call(ModelEngine, config), name, worker, **kwargs)

    async def submit(self, request: Request) -> Reply:
        """The request's reply from the next batch, under the current (the RPC's) trace context."""
        if self.draining:
            raise Draining(f"{self.role} {self.engine.instance_id} is stopping: its sessions move to another replica")
        return await self.batcher.submit(Queued(request, otel_context.get_current()))

    async def drain(self, grace_s: float) -> None:
        """Stopping: refuse new calls (clients move their sessions on) and finish those queued or
        running, for at most `grace_s`."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while not self.batcher.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def replica_load(self) -> ReplicaLoad:
        """How busy it is, as of its last pass (the caches are read on the worker thread only)."""
        m = self.metrics
        return ReplicaLoad(self.engine.instance_id, m.cached_sessions, self.engine.config.max_sessions,
                           self.batcher.waiting, self.batcher.batching.max_batch, self.draining, m.cached_tokens)

    # -- what each role fills in ------------------------------------------------------------------

    def _engine_batch(self, requests: list[Request]) -> list[Reply | Exception]:
        """Worker thread: the role engine's batch call (a reply or that request's error each)."""
        raise NotImplementedError

    def _stage(self, request: Request) -> str:
        """The request's model work by name: its span's "<role>.<stage>" and its metric's rpc label."""
        raise NotImplementedError

    def _span_attributes(self, request: Request, reply: Reply) -> dict[str, Any]:
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------------

    def _run_batch(self, batch: list[Queued[Request]]) -> list[Reply | Exception]:
        """Worker thread: the calls queued while the worker was busy, in one engine call; each gets
        its own span under its RPC's, covering the batch's model time, and its own answer, with the
        time it waited for the batch added to its queued_s."""
        start = time.perf_counter()
        spans = [self._start_span(queued, len(batch)) for queued in batch]
        try:
            replies = self._engine_batch([queued.request for queued in batch])
        except Exception as error:
            replies = [error] * len(batch)
        finally:
            self.metrics.engine_changed(self.engine)  # a sync may evict, even one that then fails
        pass_s = time.perf_counter() - start
        return [self._settle(span, queued, reply, start - queued.at, pass_s)
                for span, queued, reply in zip(spans, batch, replies, strict=True)]

    def _start_span(self, queued: Queued[Request], batch_size: int) -> Span:
        request = queued.request
        attributes = {"specd.session_id": request.session_id, "specd.sync.start_pos": request.sync.start_pos,
                      "specd.sync.tokens": len(request.sync.tokens), "specd.batch_size": batch_size}
        return tracer.start_span(f"{self.role}.{self._stage(request)}", context=queued.parent, attributes=attributes)

    def _settle(
        self, span: Span, queued: Queued[Request], reply: Reply | Exception, waited_s: float, pass_s: float
    ) -> Reply | Exception:
        try:
            if isinstance(reply, Exception):
                span.record_exception(reply)
                span.set_status(Status(StatusCode.ERROR, f"{type(reply).__name__}: {reply}"))
                return reply
            span.set_attributes(self._span_attributes(queued.request, reply))
            self.metrics.model_step(self._stage(queued.request), pass_s)
            return replace(reply, queued_s=reply.queued_s + waited_s)
        finally:
            span.end()

    def release_session(self, session_id: str) -> None:
        """Worker thread: free the session's cache. Its passes are over: no turn waits for it."""
        self.role_engine.release(session_id)
        self.batcher.forget(session_id)
        self.metrics.engine_changed(self.engine)

    def info(self, session_id: str) -> common_pb2.SessionInfo:
        return convert.session_info_to_proto(
            self.engine.position(session_id), self.engine.kv_length(session_id), self.engine.instance_id
        )

    def engine_info(self) -> EngineInfo:
        """What this service runs. Fixed when the engine is built: any thread may read it."""
        choice = self.engine.numerics
        # vocab_digest: the GGUF engine's (specd/gguf_meta.py); an HF directory's engine may have none
        return EngineInfo(self.engine.instance_id, choice.mode, self.engine.config.quantize, choice.invariant,
                          choice.reason, getattr(self.engine, "vocab_digest", "") or "",
                          Path(self.engine.config.model_dir).name, compute=self.compute_units, threads=self.threads)

    @grpc_errors
    async def GetEngineInfo(self, request: common_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext):
        return convert.engine_info_to_proto(self.engine_info())

    @grpc_errors
    async def GetLoad(self, request: common_pb2.LoadRequest, context: grpc.aio.ServicerContext):
        return convert.load_to_proto(self.replica_load())

    @grpc_errors
    async def GetSession(self, request: common_pb2.SessionRef, context: grpc.aio.ServicerContext):
        return await self.worker.run(self.info, convert.session_id_from_proto(request))

    @grpc_errors
    async def Release(self, request: common_pb2.SessionRef, context: grpc.aio.ServicerContext):
        session_id = convert.session_id_from_proto(request)

        def release() -> common_pb2.SessionInfo:
            self.release_session(session_id)
            return self.info(session_id)

        return await self.worker.run(release)

    def close(self) -> None:
        self.worker.close()
