"""The draft model's side of a round: K drafts per session, a batch of sessions at a time.

Positions: a session of committed length n decides the token at index n next. Draft token i
sits at index n + i; its uniform is keyed by that index (see `specd.sampling.uniforms`).

Concurrent sessions draft together: each drafting step is one model pass over every session
still drafting, as verification is one pass over every session verifying (specd/target_engine.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import torch

from specd import sparse
from specd.contracts import DraftReply, Proposal, ProposeRequest, SparseDist
from specd.role_engine import RoleEngine, checked_then_together
from specd.sampling import sample, top1, uniforms, warp

DRAFT_STREAM = "draft"


class DraftEngine(RoleEngine):
    def propose(self, requests: Sequence[ProposeRequest]) -> list[DraftReply | Exception]:
        """Each session's k drafts. Each request is synced and checked alone; every drafting step
        is then ONE model pass over all the sessions still drafting.

        A reply's compute_s is the batch's time for the drafting steps it took part in; waiting
        out the steps of the sessions that drafted longer is load (queued_s), like a queue."""
        start = time.perf_counter()
        replies = checked_then_together(requests, self._checked, self._draft_all)
        return _charged(replies, time.perf_counter() - start)

    def _checked(self, request: ProposeRequest) -> ProposeRequest:
        """Sync, then check everything about drafting that could fail, before any model work."""
        self.sync(request.session_id, request.sync)
        self.engine.check_forward(request.session_id, [0] * request.k)  # it grows by k: all fed but the last
        return request

    def _draft_all(self, requests: list[ProposeRequest]) -> list[DraftReply]:
        """Each session's drafts (model time not yet in the replies)."""
        return [DraftReply(proposal, request.sync.end, self.engine.instance_id)
                for request, proposal in zip(requests, self._draft(requests))]

    def _draft(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Up to request.k drafts per session after its current tokens; step i is one pass over the
        sessions still drafting. A pass holding one session is the plain one-session forward.

        Confidence stop (as transformers' assistant_confidence_threshold): a session stops after a
        draft whose probability under the draft is below min_confidence, because the target will
        most likely reject it and everything drafted after it. Lossless: where drafting stops
        depends only on the drafts already made, and every draft is verified against the q it was
        sampled from."""
        engine = self.engine
        starts = [engine.position(r.session_id) for r in requests]
        u = [uniforms(r.params.seed, DRAFT_STREAM, range(n, n + r.k)) if not r.params.greedy else []
             for r, n in zip(requests, starts)]
        tokens: list[list[int]] = [[] for _ in requests]
        rows: list[list[SparseDist]] = [[] for _ in requests]
        drafting = [j for j, r in enumerate(requests) if r.k > 0]
        while drafting:
            logits = engine.forward_many([(requests[j].session_id, tokens[j][-1:]) for j in drafting], newest_only=True)
            still = []
            for j, last in zip(drafting, logits):  # last: [1, vocab], after the newest token
                request, i = requests[j], len(tokens[j])
                token, row, q_token = self._next_draft(request, last, u[j][i] if u[j] else 0.0)
                tokens[j].append(token)
                if row is not None:
                    rows[j].append(row)
                if i + 1 < request.k and q_token >= request.min_confidence:
                    still.append(j)
            drafting = still
        # The last draft is known but not yet fed; keep it so a full acceptance needs no resync.
        for r, n, drafted in zip(requests, starts, tokens):
            if drafted:
                engine.sync(r.session_id, n + len(drafted) - 1, drafted[-1:])
        return [Proposal(tuple(t), tuple(r)) for t, r in zip(tokens, rows)]

    def _next_draft(
        self, request: ProposeRequest, last: torch.Tensor, u: float
    ) -> tuple[int, SparseDist | None, float]:
        """The draft after `last` ([1, vocab] logits), its q row when sampled, and its probability
        under the draft (1.0 when greedy and nobody asks)."""
        if request.params.greedy:
            (token,), (p_token,) = top1(last)
            return token, None, p_token if request.min_confidence else 1.0
        row = sparse.encode(warp(last, request.params)[0])
        q = sparse.decode(row, self.engine.vocab_size)  # [vocab]
        token = sample(q, u)  # from the decoded row: exactly the q the target will verify against
        return token, row, float(q[token])


def _charged(replies: list[DraftReply | Exception], batch_s: float) -> list[DraftReply | Exception]:
    """Each reply's share of the batch's time: the drafting steps it took part in (a session that
    stopped early took part in fewer of them)."""
    steps = [len(r.proposal.tokens) for r in replies if not isinstance(r, Exception)]
    most = max(steps, default=0)

    def charged(reply: DraftReply) -> DraftReply:
        compute_s = batch_s * (len(reply.proposal.tokens) / most if most else 1.0)
        return replace(reply, compute_s=compute_s, queued_s=batch_s - compute_s)

    return [r if isinstance(r, Exception) else charged(r) for r in replies]
