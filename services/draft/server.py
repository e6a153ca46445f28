"""Draft service: proposes K tokens per round from the small model, and (pipelining) drafts
ahead while the target verifies.

Proposals that arrive while the model is busy wait and then draft together
(`specd.speculation.draft_batch`): each drafting step is one model pass over every session
still drafting. Each request is still synced, checked, traced and answered on its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from functools import partial

import grpc

from specd import speculation
from specd.loop import DraftReply, SyncPoint
from specd.verify import Proposal
from services.common.errors import grpc_errors
from services.common.model_service import ModelServicer, Outcome, queued
from services.common.worker import Batching, EngineWorker
from services.draft import convert
from services.protogen.specd.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

# the proposal, drafts reused from drafting ahead, the committed length, its share of the batch's steps
Drafted = tuple[Proposal, int, int, float]


class DraftServicer(ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, engine, name: str, worker: EngineWorker, batching: Batching = Batching()):
        super().__init__(engine, name, worker)
        self.batcher = self.make_batcher(
            self._prepare, partial(_draft_batch, engine), _answer, lambda call: "draft.propose", batching
        )
        # Sessions drafting (or done drafting) ahead. Only the worker thread pops an entry for a
        # Propose, so a drafting step that finds its entry gone knows a newer call came first.
        self._ahead: dict[str, speculation.Ahead] = {}
        self._drafting: set[asyncio.Task] = set()

    @grpc_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext):
        reply = await self.propose(convert.propose_call(request))
        return convert.propose_response(reply)

    async def propose(self, call: convert.ProposeCall) -> DraftReply:
        """Sync, draft K (taking drafts made ahead first), then start drafting ahead if asked.
        Transport-free: the gRPC method and the Ray Serve deployment both call it."""
        done = await self.batcher.submit(queued(call))
        self.metrics.model_step("propose", done.compute_s)
        if call.lookahead:
            self._start_drafting_ahead(call)
        proposal, reused, position, share = done.result
        # A session is charged the drafting steps it took part in; waiting out the steps of the
        # sessions that drafted longer is load, like the queue before the pass.
        compute_s = done.compute_s * share
        queued_s = done.queued_s + done.compute_s - compute_s
        return DraftReply(proposal, position, self.engine.instance_id, compute_s, reused, queued_s)

    def _prepare(self, call: convert.ProposeCall) -> speculation.Drafting:
        position = self.sync_session(call.session_id, call.sync)
        ahead = self._ahead.pop(call.session_id, None)
        draft = speculation.DraftCall(call.session_id, position, call.k, call.params, ahead, call.min_confidence)
        return speculation.prepare_draft(self.engine, draft)

    def sync_session(self, session_id: str, sync: SyncPoint) -> int:
        """Drafts made ahead that still extend the committed tokens stay; anything else syncs."""
        if not speculation.held_ahead(self.engine, session_id, sync.start_pos, sync.tokens):
            return super().sync_session(session_id, sync)
        self._check_instance(session_id, sync)
        return sync.start_pos + len(sync.tokens)

    def release_session(self, session_id: str) -> None:
        """Worker thread: the drafts made ahead go with the cache (gRPC Release and Ray's release)."""
        self._ahead.pop(session_id, None)
        super().release_session(session_id)

    def _start_drafting_ahead(self, call: convert.ProposeCall) -> None:
        if len(self._ahead) >= self.engine.config.max_sessions:  # sessions evicted without a Release
            for gone in [s for s in self._ahead if not self.engine.position(s)]:
                del self._ahead[gone]
        ahead = self._ahead[call.session_id] = speculation.Ahead(call.params, {})
        # A fresh context: the drafting outlives the request, its spans belong to no request.
        task = asyncio.create_task(self._draft_ahead(call, ahead), context=contextvars.Context())
        self._drafting.add(task)
        task.add_done_callback(self._drafting.discard)

    async def _draft_ahead(self, call: convert.ProposeCall, ahead: speculation.Ahead) -> None:
        """One token per worker turn, so a newer call waits one draft step at most."""

        def step() -> bool:
            if self._ahead.get(call.session_id) is not ahead:  # a newer call: the bet is settled
                return False
            start = time.perf_counter()
            speculation.draft_ahead(self.engine, call.session_id, ahead)
            self.metrics.model_step("lookahead", time.perf_counter() - start)
            return True

        try:
            for _ in range(call.lookahead):
                if not await self.worker.run(step):
                    return
        except Exception as error:  # e.g. the context is full: the next round drafts for itself
            log.debug("drafting ahead stopped for %s: %s", call.session_id, error)


def _draft_batch(engine, draftings: list[speculation.Drafting]) -> list[tuple[Proposal, int, float]]:
    """`draft_batch`, with each session's share of the batch's drafting steps (a session that
    stopped early took part in fewer of them)."""
    drafted = speculation.draft_batch(engine, draftings)
    steps = [len(proposal.tokens) - reused for proposal, reused in drafted]
    most = max(steps, default=0)
    return [(proposal, reused, own / most if most else 1.0) for (proposal, reused), own in zip(drafted, steps)]


def _answer(drafting: speculation.Drafting, drafted: tuple[Proposal, int, float]) -> Outcome[Drafted]:
    call, (proposal, reused, share) = drafting.call, drafted
    attributes = {"specd.k": call.K, "specd.drafted": len(proposal.tokens), "specd.position": call.position,
                  "specd.reused": reused}
    return (proposal, reused, call.position, share), attributes


def register(servicer: DraftServicer):
    def add(server: grpc.aio.Server) -> list[str]:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name]

    return add
