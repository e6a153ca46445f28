"""What the draft and target servicers share: an engine behind one worker thread, and the
session RPCs (GetSession, Release)."""

from __future__ import annotations

import time
from typing import Callable, Self, TypeVar

import grpc
from opentelemetry import trace

from specd.engine import EngineConfig, ModelEngine, PositionMismatch
from specd.loop import SyncPoint
from services.common import convert
from services.common.errors import grpc_errors
from services.common.metrics import ModelMetrics
from services.common.worker import EngineWorker
from services.protogen.specd.v1 import common_pb2

T = TypeVar("T")
tracer = trace.get_tracer(__name__)


def span_attributes(session_id: str, sync: SyncPoint) -> dict[str, str | int]:
    return {"specd.session_id": session_id, "specd.sync.start_pos": sync.start_pos,
            "specd.sync.tokens": len(sync.tokens)}


class ModelServicer:
    def __init__(self, engine: ModelEngine, name: str, worker: EngineWorker):
        """`worker` is the thread that built `engine`, the only one that may run it (see `load`)."""
        self.engine = engine
        self.worker = worker
        self.metrics = ModelMetrics()

    @classmethod
    def load(cls, config: EngineConfig, name: str, **kwargs) -> Self:
        """Build the engine on a new worker thread and serve it from there (services/common/worker.py)."""
        worker = EngineWorker(name)
        return cls(worker.call(ModelEngine, config), name, worker, **kwargs)

    async def in_session(
        self, session_id: str, sync: SyncPoint, work: Callable[[int], T], span: str
    ) -> tuple[T, float]:
        """On the worker thread: bring the session to the committed tokens, then `work(position)`.

        Returns the result and the seconds spent, so callers can tell model time from overhead.
        The span covers exactly that model time (the RPC's server span also counts the queue);
        `work` may add attributes to it (`trace.get_current_span()`).
        """

        def call() -> tuple[T, float]:
            with tracer.start_as_current_span(span, attributes=span_attributes(session_id, sync)):
                start = time.perf_counter()
                try:
                    result = work(self.sync_session(session_id, sync))
                finally:
                    self.metrics.engine_changed(self.engine)  # a sync may evict, even one that then fails
                return result, time.perf_counter() - start

        return await self.worker.run(call)

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
            self.engine.release(session_id)
            self.metrics.engine_changed(self.engine)
            return self.info(session_id)

        return await self.worker.run(release)

    def close(self) -> None:
        self.worker.close()
