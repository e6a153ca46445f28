"""The target model's side of a round: verify each session's K drafts (K = 0: a plain step),
a batch of sessions in one model pass.

Positions: a session of committed length n decides the token at index n next. Draft token i
sits at index n + i; the recovered token at the first rejected index; the bonus token at n + K.
Uniforms are keyed by those indices (see `specd.sampling.uniforms`), so a retried round decides
the same. The pure decision is specd/verify.py's.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import torch

from specd import sparse
from specd.contracts import Proposal, VerifyReply, VerifyRequest
from specd.role_engine import RoleEngine, checked_then_together
from specd.sampling import top1, uniforms, warp
from specd.verify import verify, verify_greedy
from specd.validation import InvalidParams

ACCEPT_STREAM, SAMPLE_STREAM = "accept", "sample"


class TargetEngine(RoleEngine):
    def verify(self, requests: Sequence[VerifyRequest]) -> list[VerifyReply | Exception]:
        """Score every session's drafts in ONE target forward, decide each session alone, and leave
        each at its new committed length. Sessions may differ in length, K and params; each is
        synced and checked alone first. compute_s is the batch's time, shared by batch_size, for the
        pass_rows positions it fed."""
        start = time.perf_counter()
        replies = checked_then_together(requests, self._check, self._verify_together)
        compute_s = time.perf_counter() - start
        rows = self.engine.last_pass_rows
        return [r if isinstance(r, Exception) else replace(r, compute_s=compute_s, batch_size=len(requests),
                                                           pass_rows=rows)
                for r in replies]

    def _check(self, request: VerifyRequest) -> tuple[VerifyRequest, torch.Tensor | None]:
        """Sync, then check everything about the request that could fail it, before any model work;
        the request and its draft rows q ([K, vocab]; None when greedy)."""
        self.sync(request.session_id, request.sync)
        proposal = request.proposal
        q = None if request.params.greedy else _dense_q(proposal, self.engine.vocab_size)  # [K, vocab]
        self.engine.check_forward(request.session_id, proposal.tokens)
        return request, q

    def _verify_together(self, checked: list[tuple[VerifyRequest, torch.Tensor | None]]) -> list[VerifyReply]:
        """One pass for all (model time not yet in the replies)."""
        passes = [(request.session_id, request.proposal.tokens) for request, _ in checked]
        logits = self.engine.forward_many(passes)  # each [K+1, vocab]
        return [self._decide(request, q, rows) for (request, q), rows in zip(checked, logits)]

    def _decide(self, request: VerifyRequest, q: torch.Tensor | None, logits: torch.Tensor) -> VerifyReply:
        """The pure verify math on one session's rows (logits: [K+1, vocab]), then its rollback."""
        n, drafts, params = request.sync.end, request.proposal.tokens, request.params
        K = len(drafts)
        if q is None:
            tokens, top_p = top1(logits)
            verdict = verify_greedy(drafts, tokens)
            sure = tuple(top_p[: verdict.num_accepted + 1])
        else:
            p = warp(logits, params)  # [K+1, vocab]
            u_accept = uniforms(params.seed, ACCEPT_STREAM, range(n, n + K))
            u_sample = uniforms(params.seed, SAMPLE_STREAM, range(n, n + K + 1))
            verdict = verify(drafts, q, p, u_accept, u_sample)
            sure = tuple(p[: verdict.num_accepted + 1].amax(-1).tolist())
        # Rollback is bookkeeping: keep the accepted prefix, append the recovered/bonus token.
        position = self.engine.sync(request.session_id, n, verdict.committed(drafts))
        return VerifyReply(verdict, position, self.engine.instance_id, confidence=sure)


def _dense_q(proposal: Proposal, vocab_size: int) -> torch.Tensor:
    if not proposal.tokens:
        return torch.empty(0, vocab_size, dtype=torch.float64)
    if len(proposal.q) != len(proposal.tokens):
        raise InvalidParams("a sampled proposal needs one draft distribution per draft token")
    q = torch.stack([sparse.decode(row, vocab_size) for row in proposal.q])  # [K, vocab]
    drafted = torch.tensor(proposal.tokens)  # [K]
    # A draft token the draft could not have sampled would break the accept test's premise.
    if bool((q.gather(1, drafted[:, None]) <= 0).any()):
        raise InvalidParams("each draft token must have positive probability in its draft distribution")
    return q
