"""One round's model work on each side: the draft proposes, the target verifies.

These functions sit between a `ModelEngine` and the pure math. Services (gRPC today, a
Ray Serve deployment later) call them; they know nothing about transports.

Positions: a session of committed length n decides the token at index n next. Draft
token i sits at index n + i; the recovered token at the first rejected index; the bonus
token at n + K. Uniforms are keyed by those indices (see `specd.sampling.uniforms`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specd import sparse
from specd.sampling import SamplingParams, sample, uniforms, warp
from specd.verify import Proposal, Verdict, verify, verify_greedy

if TYPE_CHECKING:
    from specd.engine import ModelEngine

DRAFT_STREAM, ACCEPT_STREAM, SAMPLE_STREAM = "draft", "accept", "sample"


def propose(engine: "ModelEngine", session_id: str, K: int, params: SamplingParams) -> Proposal:
    """Draft K tokens after the session's current tokens (already synced to the committed ones)."""
    n = engine.position(session_id)
    u = uniforms(params.seed, DRAFT_STREAM, range(n, n + K)) if not params.greedy else []
    tokens: list[int] = []
    rows: list[sparse.SparseDist] = []
    for i in range(K):
        logits = engine.forward(session_id, tokens[-1:])[-1:]  # [1, vocab]
        if params.greedy:
            tokens.append(int(logits.argmax()))
            continue
        row = sparse.encode(warp(logits, params)[0])
        # Sample from the decoded row: it is exactly the q the target will verify against.
        tokens.append(sample(sparse.decode(row, engine.vocab_size), u[i]))
        rows.append(row)
    # The last draft is known but not yet fed; keep it so a full acceptance needs no resync.
    if tokens:
        engine.sync(session_id, n + K - 1, tokens[-1:])
    return Proposal(tuple(tokens), tuple(rows))


def verify_proposal(
    engine: "ModelEngine",
    session_id: str,
    proposal: Proposal,
    params: SamplingParams,
) -> Verdict:
    """Score all K drafts in one target forward, decide, and leave the session at the new committed length.

    With K = 0 this is one plain decoding step (the bonus token is drawn from p).
    """
    n = engine.position(session_id)
    K = len(proposal.tokens)
    q = None if params.greedy else _dense_q(proposal, engine.vocab_size)  # [K, vocab]; checked before any work
    logits = engine.forward(session_id, proposal.tokens)  # [K+1, vocab]
    if q is None:
        verdict = verify_greedy(proposal.tokens, logits)
    else:
        p = warp(logits, params)  # [K+1, vocab]
        u_accept = uniforms(params.seed, ACCEPT_STREAM, range(n, n + K))
        u_sample = uniforms(params.seed, SAMPLE_STREAM, range(n, n + K + 1))
        verdict = verify(proposal.tokens, q, p, u_accept, u_sample)
    # Rollback is bookkeeping: keep the accepted prefix, append the recovered/bonus token.
    engine.sync(session_id, n + verdict.num_accepted, [verdict.next_token])
    return verdict


def _dense_q(proposal: Proposal, vocab_size: int) -> torch.Tensor:
    if not proposal.tokens:
        return torch.empty(0, vocab_size, dtype=torch.float64)
    if len(proposal.q) != len(proposal.tokens):
        raise ValueError("a sampled proposal needs one draft distribution per draft token")
    q = torch.stack([sparse.decode(row, vocab_size) for row in proposal.q])  # [K, vocab]
    drafted = torch.tensor(proposal.tokens)  # [K]
    # A draft token the draft could not have sampled would break the accept test's premise.
    if bool((q.gather(1, drafted[:, None]) <= 0).any()):
        raise ValueError("each draft token must have positive probability in its draft distribution")
    return q
