"""One round's model work on each side: the draft proposes, the target verifies.

These functions sit between a `ModelEngine` and the pure math. Services (gRPC today, a
Ray Serve deployment later) call them; they know nothing about transports.

Positions: a session of committed length n decides the token at index n next. Draft
token i sits at index n + i; the recovered token at the first rejected index; the bonus
token at n + K. Uniforms are keyed by those indices (see `specd.sampling.uniforms`).

Drafting ahead (pipelining): while the target verifies a proposal, the draft may go on
drafting past it, betting on full acceptance with its own guess of the bonus token. Drafts
are a pure function of the committed prefix, the params and those position-keyed uniforms,
so a draft made ahead is exactly the draft the next round would make alone (in a batch, up to
the rounding of a several-session pass: either is a valid draft, the target verifies the q it
was sampled from); the next round takes the ones that still extend the committed tokens
(`held_ahead`, `prepare_draft`).

Concurrent sessions draft together (`draft_batch`): each drafting step is one model pass over
every session still drafting, as verification is one pass over every session verifying.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specd import sparse
from specd.sampling import SamplingParams, sample, uniforms, warp
from specd.verify import Proposal, Verdict, verify, verify_greedy

if TYPE_CHECKING:
    from specd.engine import ModelEngine

DRAFT_STREAM, ACCEPT_STREAM, SAMPLE_STREAM = "draft", "accept", "sample"


def propose(
    engine: "ModelEngine", session_id: str, K: int, params: SamplingParams, min_confidence: float = 0.0
) -> Proposal:
    """Draft up to K tokens after the session's current tokens (already synced to the committed
    ones); drafting stops early after a token the draft gave probability < min_confidence."""
    return _draft(engine, [_DraftRequest(session_id, K, params, min_confidence)])[0]


@dataclass
class Ahead:
    """What a session drafted past its last proposal: the params it drafted with and, when
    sampled, the q row of each draft by position."""

    params: SamplingParams
    rows: dict[int, sparse.SparseDist]


def draft_ahead(engine: "ModelEngine", session_id: str, ahead: Ahead) -> None:
    """Draft one more token past the session's end (its last draft is the newest token)."""
    n = engine.position(session_id)
    proposal = propose(engine, session_id, 1, ahead.params)
    if proposal.q:
        ahead.rows[n] = proposal.q[0]


def held_ahead(engine: "ModelEngine", session_id: str, start_pos: int, tokens: Sequence[int]) -> int:
    """How many drafted-ahead tokens the session holds past the committed sequence
    known[:start_pos] + tokens: 0 unless that sequence is a strict prefix of what it holds."""
    known = engine.tokens(session_id)
    end = start_pos + len(tokens)
    if start_pos > len(known) or known[start_pos:end] != tuple(tokens):
        return 0
    return max(0, len(known) - end)


@dataclass(frozen=True)
class DraftCall:
    """One session's share of a batched proposal: K drafts after its committed length."""

    session_id: str
    position: int  # n, the committed length; the session may hold drafts made ahead past it
    K: int
    params: SamplingParams
    ahead: Ahead | None = None  # what the session drafted ahead after its last proposal
    min_confidence: float = 0.0  # stop drafting after a token the draft gave a lower probability


@dataclass(frozen=True)
class Drafting:
    """One session's share of a batched proposal, checked: in a batch it can only fail with the batch."""

    call: DraftCall
    held: Proposal  # the drafts made ahead that it reuses


def prepare_draft(engine: "ModelEngine", call: DraftCall) -> Drafting:
    """Take the drafts made ahead that the call can use (they still extend the committed tokens and
    were drafted with the same params), leaving the session just past them; then check everything
    about drafting the rest that could fail, before any model work."""
    n, ahead = call.position, call.ahead
    held = engine.tokens(call.session_id)[n : n + call.K]
    usable = ahead is not None and ahead.params == call.params
    if usable and not call.params.greedy:
        usable = all(pos in ahead.rows for pos in range(n, n + len(held)))
    reused = len(held) if usable else 0
    engine.truncate(call.session_id, n + reused)
    engine.check_forward(call.session_id, [0] * (call.K - reused))  # it grows by that many: all fed but the last
    rows = tuple(ahead.rows[pos] for pos in range(n, n + reused)) if reused and not call.params.greedy else ()
    return Drafting(call, Proposal(held[:reused], rows))


def draft_batch(engine: "ModelEngine", draftings: Sequence[Drafting]) -> list[tuple[Proposal, int]]:
    """Each session's K drafts, the ones made ahead first; (proposal, reused) per session. Every
    drafting step is ONE model pass over all the sessions still drafting."""
    fresh = _draft(engine, [
        _DraftRequest(d.call.session_id, d.call.K - len(d.held.tokens), d.call.params, d.call.min_confidence)
        for d in draftings
    ])
    # A sibling stands beside the proposal's first draft: one made ahead has none.
    return [(Proposal(d.held.tokens + new.tokens, d.held.q + new.q, None if d.held.tokens else new.sibling),
             len(d.held.tokens)) for d, new in zip(draftings, fresh)]


def propose_after(engine: "ModelEngine", call: DraftCall) -> tuple[Proposal, int]:
    """One session's `draft_batch`."""
    return draft_batch(engine, [prepare_draft(engine, call)])[0]


@dataclass(frozen=True)
class _DraftRequest:
    session_id: str
    K: int  # at most this many drafts
    params: SamplingParams
    min_confidence: float = 0.0


def _draft(engine: "ModelEngine", requests: Sequence[_DraftRequest]) -> list[Proposal]:
    """Up to K drafts per session after its current tokens; step i is one pass over the sessions
    still drafting. A pass holding one session is the plain one-session forward.

    Confidence stop (as transformers' assistant_confidence_threshold): a session stops after a
    draft whose probability under the draft is below min_confidence, because the target will most
    likely reject it and everything drafted after it. Lossless: where drafting stops depends only
    on the drafts already made, and every draft is verified against the q it was sampled from."""
    starts = [engine.position(r.session_id) for r in requests]
    u = [uniforms(r.params.seed, DRAFT_STREAM, range(n, n + r.K)) if not r.params.greedy else []
         for r, n in zip(requests, starts)]
    tokens: list[list[int]] = [[] for _ in requests]
    rows: list[list[sparse.SparseDist]] = [[] for _ in requests]
    siblings: list[int | None] = [None for _ in requests]
    drafting = [j for j, r in enumerate(requests) if r.K > 0]
    while drafting:
        logits = engine.forward_many([(requests[j].session_id, tokens[j][-1:]) for j in drafting], newest_only=True)
        still = []
        for j, last in zip(drafting, logits):  # last: [1, vocab], after the newest token
            request, i = requests[j], len(tokens[j])
            token, row, q_token = _next_draft(engine, request, last, u[j][i] if u[j] else 0.0)
            if i == 0 and request.params.greedy:
                siblings[j] = _runner_up(last[0], token)
            tokens[j].append(token)
            if row is not None:
                rows[j].append(row)
            if i + 1 < request.K and q_token >= request.min_confidence:
                still.append(j)
        drafting = still
    # The last draft is known but not yet fed; keep it so a full acceptance needs no resync.
    for r, n, drafted in zip(requests, starts, tokens):
        if drafted:
            engine.sync(r.session_id, n + len(drafted) - 1, drafted[-1:])
    return [Proposal(tuple(t), tuple(r), sibling) for t, r, sibling in zip(tokens, rows, siblings)]


def _runner_up(logits: torch.Tensor, token: int) -> int:
    """The best token but `token` (logits: [vocab]). Not simply topk's second: on a tie at the top
    topk may list the argmax second, and a sibling equal to its draft is refused."""
    first, second = logits.topk(2).indices.tolist()
    return second if first == token else first


def _next_draft(
    engine: "ModelEngine", request: _DraftRequest, last: torch.Tensor, u: float
) -> tuple[int, sparse.SparseDist | None, float]:
    """The draft after `last` ([1, vocab] logits), its q row when sampled, and its probability
    under the draft (1.0 when greedy and nobody asks)."""
    if request.params.greedy:
        token = int(last.argmax())
        return token, None, float(torch.softmax(last[0], -1)[token]) if request.min_confidence else 1.0
    row = sparse.encode(warp(last, request.params)[0])
    q = sparse.decode(row, engine.vocab_size)  # [vocab]
    token = sample(q, u)  # from the decoded row: exactly the q the target will verify against
    return token, row, float(q[token])


@dataclass(frozen=True)
class Verification:
    """One session's verification, checked: in a batch it can only fail with the batch."""

    session_id: str
    proposal: Proposal
    params: SamplingParams
    position: int  # n, the committed length before the round
    q: torch.Tensor | None  # [K, vocab] draft rows; None when greedy


def prepare_verification(
    engine: "ModelEngine", session_id: str, proposal: Proposal, params: SamplingParams
) -> Verification:
    """Check everything about one request that could fail it (before any model work)."""
    if proposal.sibling is not None:
        if not params.greedy:
            raise ValueError("a sibling is for greedy verification only")
        engine.check_sibling(proposal.tokens, proposal.sibling)
    q = None if params.greedy else _dense_q(proposal, engine.vocab_size)  # [K, vocab]
    engine.check_forward(session_id, proposal.tokens)
    return Verification(session_id, proposal, params, engine.position(session_id), q)


def verify_batch(engine: "ModelEngine", verifications: Sequence[Verification]) -> list[Verdict]:
    """Score every session's drafts in ONE target forward, decide each session alone, and leave each
    at its new committed length. Sessions may differ in length, K (0 is a plain step) and params.
    Siblings take the rows the pass pads to anyway (`ModelEngine.spare_rows`), in batch order."""
    requests = [(v.session_id, v.proposal.tokens) for v in verifications]
    spare = engine.spare_rows(requests)
    siblings = []
    for v in verifications:
        scored = v.proposal.sibling is not None and spare > 0
        spare -= scored
        siblings.append(v.proposal.sibling if scored else None)
    logits = engine.forward_many(requests, siblings=siblings)  # each [K+1 (+1 with a sibling), vocab]
    return [_decide(engine, v, rows, sibling) for v, rows, sibling in zip(verifications, logits, siblings)]


def verify_proposal(
    engine: "ModelEngine",
    session_id: str,
    proposal: Proposal,
    params: SamplingParams,
) -> Verdict:
    """Score all K drafts in one target forward, decide, and leave the session at the new committed length.

    With K = 0 this is one plain decoding step (the bonus token is drawn from p).
    """
    return verify_batch(engine, [prepare_verification(engine, session_id, proposal, params)])[0]


def _decide(engine: "ModelEngine", v: Verification, logits: torch.Tensor, sibling: int | None) -> Verdict:
    """The pure verify math on one session's rows (logits: [K+1, vocab], then the sibling's row
    when it was scored), then its rollback."""
    n, K = v.position, len(v.proposal.tokens)
    if v.q is None:
        verdict = verify_greedy(v.proposal.tokens, logits, sibling)
    else:
        p = warp(logits, v.params)  # [K+1, vocab]
        u_accept = uniforms(v.params.seed, ACCEPT_STREAM, range(n, n + K))
        u_sample = uniforms(v.params.seed, SAMPLE_STREAM, range(n, n + K + 1))
        verdict = verify(v.proposal.tokens, v.q, p, u_accept, u_sample)
    # Rollback is bookkeeping: keep the accepted prefix, append the recovered/bonus token.
    engine.sync(v.session_id, n, verdict.committed(v.proposal.tokens))
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
