"""The draft model's side of a round: K drafts per session, a batch of sessions at a time, and
(pipelining) drafting ahead while the target verifies.

Positions: a session of committed length n decides the token at index n next. Draft token i
sits at index n + i; its uniform is keyed by that index (see `specd.sampling.uniforms`).

Concurrent sessions draft together: each drafting step is one model pass over every session
still drafting, as verification is one pass over every session verifying (specd/target_engine.py).

Drafting ahead: while the target verifies a proposal, the draft may go on drafting past it,
betting on full acceptance with its own guess of the bonus token. Drafts are a pure function of
the committed prefix, the params and those position-keyed uniforms, so a draft made ahead is
exactly the draft the next round would make alone (in a batch, up to the rounding of a
several-session pass: either is a valid draft, the target verifies the q it was sampled from);
the next round takes the ones that still extend the committed tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from specd import sparse
from specd.contracts import DraftReply, Proposal, ProposeRequest, SparseDist, SyncPoint
from specd.engine import ModelEngine
from specd.role_engine import RoleEngine, checked_then_together
from specd.sampling import sample, uniforms, warp

DRAFT_STREAM = "draft"


@dataclass
class _Ahead:
    """What a session drafted past the proposal `request` asked for: how many drafts, and when
    sampled, the q row of each by position."""

    request: ProposeRequest  # its params and lookahead
    rows: dict[int, SparseDist] = field(default_factory=dict)
    drafted: int = 0


class DraftEngine(RoleEngine):
    def __init__(self, engine: ModelEngine):
        super().__init__(engine)
        # Sessions drafting (or done drafting) ahead. A proposal takes its session's entry, so a
        # drafting step that finds another request's entry knows a newer call came first.
        self._ahead: dict[str, _Ahead] = {}

    def propose(self, requests: Sequence[ProposeRequest]) -> list[DraftReply | Exception]:
        """Each session's k drafts, those it made ahead first. Each request is synced and checked
        alone; every drafting step is then ONE model pass over all the sessions still drafting.

        A reply's compute_s is the batch's time for the drafting steps it took part in; waiting
        out the steps of the sessions that drafted longer is load (queued_s), like a queue."""
        start = time.perf_counter()
        replies = checked_then_together(requests, self._take_held, self._draft_rest)
        for request, reply in zip(requests, replies):
            if request.lookahead and not isinstance(reply, Exception):
                self._bet(request)
        return _charged(replies, time.perf_counter() - start)

    def draft_ahead(self, request: ProposeRequest) -> bool:
        """One more draft past the session's newest token, for a proposal made with lookahead;
        False when there is none to make: its lookahead is drafted, or a newer call settled the bet."""
        ahead = self._ahead.get(request.session_id)
        # `is`: a retry of the call is an equal request, and a newer one
        if ahead is None or ahead.request is not request or ahead.drafted == request.lookahead:
            return False
        n = self.engine.position(request.session_id)
        [proposal] = self._draft([replace(request, k=1, min_confidence=0.0)])
        if proposal.q:
            ahead.rows[n] = proposal.q[0]
        ahead.drafted += 1
        return True

    def sync(self, session_id: str, sync: SyncPoint) -> int:
        """Drafts made ahead that still extend the committed tokens stay; anything else syncs."""
        if not self._held_ahead(session_id, sync):
            return super().sync(session_id, sync)
        self.check_instance(session_id, sync)
        return sync.end

    def release(self, session_id: str) -> None:
        """The drafts made ahead go with the cache."""
        self._ahead.pop(session_id, None)
        super().release(session_id)

    def _held_ahead(self, session_id: str, sync: SyncPoint) -> int:
        """How many drafted-ahead tokens the session holds past the committed sequence: 0 unless
        that sequence is a strict prefix of what it holds."""
        known = self.engine.tokens(session_id)
        if sync.start_pos > len(known) or known[sync.start_pos : sync.end] != tuple(sync.tokens):
            return 0
        return max(0, len(known) - sync.end)

    def _bet(self, request: ProposeRequest) -> None:
        """The session may draft ahead past this proposal (`draft_ahead`)."""
        if len(self._ahead) >= self.engine.config.max_sessions:  # sessions evicted without a Release
            for gone in [s for s in self._ahead if not self.engine.position(s)]:
                del self._ahead[gone]
        self._ahead[request.session_id] = _Ahead(request)

    def _take_held(self, request: ProposeRequest) -> tuple[ProposeRequest, Proposal]:
        """Sync, then take the drafts made ahead that the request can use (they still extend the
        committed tokens and were drafted with the same params), leaving the session just past
        them; then check everything about drafting the rest that could fail, before any model work."""
        n = self.sync(request.session_id, request.sync)
        ahead = self._ahead.pop(request.session_id, None)
        held = self.engine.tokens(request.session_id)[n : n + request.k]
        usable = ahead is not None and ahead.request.params == request.params
        if usable and not request.params.greedy:
            usable = all(pos in ahead.rows for pos in range(n, n + len(held)))
        reused = len(held) if usable else 0
        self.engine.truncate(request.session_id, n + reused)
        # it grows by that many: all fed but the last
        self.engine.check_forward(request.session_id, [0] * (request.k - reused))
        rows = tuple(ahead.rows[pos] for pos in range(n, n + reused)) if reused and not request.params.greedy else ()
        return request, Proposal(held[:reused], rows)

    def _draft_rest(self, drafting: list[tuple[ProposeRequest, Proposal]]) -> list[DraftReply]:
        """Each session's drafts after the ones it holds (model time not yet in the replies)."""
        fresh = self._draft([replace(request, k=request.k - len(held.tokens)) for request, held in drafting])
        # A sibling stands beside the proposal's first draft: one made ahead has none.
        return [DraftReply(Proposal(held.tokens + new.tokens, held.q + new.q, None if held.tokens else new.sibling),
                           request.sync.end, self.engine.instance_id, reused=len(held.tokens))
                for (request, held), new in zip(drafting, fresh)]

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
        siblings: list[int | None] = [None for _ in requests]
        drafting = [j for j, r in enumerate(requests) if r.k > 0]
        while drafting:
            logits = engine.forward_many([(requests[j].session_id, tokens[j][-1:]) for j in drafting], newest_only=True)
            still = []
            for j, last in zip(drafting, logits):  # last: [1, vocab], after the newest token
                request, i = requests[j], len(tokens[j])
                token, row, q_token = self._next_draft(request, last, u[j][i] if u[j] else 0.0)
                if i == 0 and request.params.greedy:
                    siblings[j] = _runner_up(last[0], token)
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
        return [Proposal(tuple(t), tuple(r), sibling) for t, r, sibling in zip(tokens, rows, siblings)]

    def _next_draft(
        self, request: ProposeRequest, last: torch.Tensor, u: float
    ) -> tuple[int, SparseDist | None, float]:
        """The draft after `last` ([1, vocab] logits), its q row when sampled, and its probability
        under the draft (1.0 when greedy and nobody asks)."""
        if request.params.greedy:
            token = int(last.argmax())
            return token, None, float(torch.softmax(last[0], -1)[token]) if request.min_confidence else 1.0
        row = sparse.encode(warp(last, request.params)[0])
        q = sparse.decode(row, self.engine.vocab_size)  # [vocab]
        token = sample(q, u)  # from the decoded row: exactly the q the target will verify against
        return token, row, float(q[token])


def _runner_up(logits: torch.Tensor, token: int) -> int:
    """The best token but `token` (logits: [vocab]). Not simply topk's second: on a tie at the top
    topk may list the argmax second, and a sibling equal to its draft is refused."""
    first, second = logits.topk(2).indices.tolist()
    return second if first == token else first


def _charged(replies: list[DraftReply | Exception], batch_s: float) -> list[DraftReply | Exception]:
    """Each reply's share of the batch's time: the drafting steps it took part in (a session that
    stopped early, or held drafts made ahead, took part in fewer of them)."""
    steps = [len(r.proposal.tokens) - r.reused for r in replies if not isinstance(r, Exception)]
    most = max(steps, default=0)

    def charged(reply: DraftReply) -> DraftReply:
        compute_s = batch_s * ((len(reply.proposal.tokens) - reply.reused) / most if most else 1.0)
        return replace(reply, compute_s=compute_s, queued_s=batch_s - compute_s)

    return [r if isinstance(r, Exception) else charged(r) for r in replies]
