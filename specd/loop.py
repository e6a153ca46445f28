"""The coordinator's speculative decoding loop, free of any transport.

(Over 350 lines on purpose: the whole decode path, from a request to its saved rounds, reads here in one sitting.)

It talks to a `Drafter`, a `Verifier` (gRPC clients in production, scripted fakes in unit
tests) and a `SessionStore` (Redis). The committed tokens in the store are the truth; each
service's KV cache is a soft copy. A service is told what changed since the position it is
known to hold (`SyncPoint`), and is resent everything when it no longer has that prefix
(restart, eviction, another replica). A round is a pure function of the committed tokens
and the seed, so a round that failed half-way is simply run again. While no draft replica
answers, rounds are plain target steps (`DraftOutage`): output is the same, only slower.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from opentelemetry import trace

from specd.contracts import (
    DecodeRequest,
    DraftReply,
    Proposal,
    ProposeRequest,
    SamplingParams,
    ServiceUnavailable,
    StaleSession,
    SyncPoint,
    VerifyReply,
    VerifyRequest,
)
from specd import model_free
from specd.model_free import NO_DRAFT, Draft, SuffixDrafter
from specd.evolve import evolve
from specd.load import LoadSeen
from specd.outage import DraftOutage
from specd.priority import Priority, RoundGate
from specd.policy import (PLAIN, PolicyConfig, PolicyState, RoundObservation, hybrid, inherit, joined_at_load, next_k,
                          observe, sure_k)
from specd.policy.cost import batch_sessions
from specd.protocols import Decoder, Drafter, PlainSteps, SessionStore, Verifier
from specd.session import Lease, ServiceCursor, SessionState, SessionStats, Turn
from specd.stopping import Decode, StopChecker, StopRules
from specd.validation import validate_that

EMPTY_PROPOSAL = Proposal((), ())
# Under load, a speculating turn's UNDRAFTED_RUN-th round in a row without a draft opens a stream of plain
# steps, as plain mode does (a draft model whose catch-up does not pay, no copy to draft from: every round
# may choose none, and a Step call's round trip splits the target's passes). Alone, its plain steps stay
# calls: a stream's step in flight would take the place of the next round's draft.
UNDRAFTED_RUN = 2
T = TypeVar("T")
tracer = trace.get_tracer(__name__)  # the vendor-neutral API: a no-op until a service installs a provider


@dataclass(frozen=True)
class GenerationRequest:
    prompt: tuple[int, ...]  # appended to the session's committed tokens
    rules: StopRules
    params: SamplingParams
    policy: PolicyConfig = PolicyConfig()  # adaptive K and fallback, within the server's and request's bounds
    fixed_k: int | None = None  # pinned by the request: no adaptation, no fallback; 0 = plain decoding
    bos: int | None = None  # the model's start token: leads a new session unless the prompt starts with it
    drafter: str = hybrid.AUTO  # auto | model | ngram | none: who drafts (specd/policy/hybrid.py)
    max_context: int = 0  # the model's context: a turn the session would outgrow is refused (0: unchecked)


@dataclass(frozen=True)
class RoundRecord:
    k: int
    num_accepted: int
    committed_length: int
    draft_position: int | None  # None when the round drafted nothing
    target_position: int
    mode: str
    observation: RoundObservation  # what the round taught the policy (its timings)
    drafter: str = hybrid.MODEL  # who drafted: model | ngram | none


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    token_ids: tuple[int, ...]
    text: str
    stats: SessionStats
    session: SessionState


@dataclass(frozen=True)
class Services:
    drafter: Drafter | None  # None: no draft model (the model-free drafter may still draft)
    verifier: Verifier
    store: SessionStore
    outage: DraftOutage = field(default_factory=DraftOutage)
    model_free: SuffixDrafter | None = None  # drafts from the tokens at hand, in this process (None: off)
    gate: RoundGate = field(default_factory=RoundGate)  # short requests' rounds first (off by default)
    decoder: Decoder | None = None  # plain stretches as one stream of steps (None: a Step RPC a token)
    clock: Callable[[], float] = time.perf_counter  # what times the calls (a replay's is virtual)
    load: LoadSeen = field(default_factory=LoadSeen)  # the target's latest pass: the batch a turn starts in


@dataclass
class _Stretch:
    """A turn's plain steps streamed by the target (`Decoder`), which runs the next step while the
    loop handles the last: a plain token then costs no round trip of its own."""

    allowed: bool = True
    steps: PlainSteps | None = None
    last: float = 0.0  # when its last reply came: a streamed step's wall is from there
    undrafted: int = 0  # rounds in a row that chose no draft

    def close(self) -> None:
        if self.steps is not None:
            self.steps.close()
            self.steps = None


@dataclass(frozen=True)
class _Turn:
    """What a request's rounds share."""

    request: GenerationRequest
    session_id: str
    services: Services
    lease: Lease
    checker: StopChecker
    session_stats: SessionStats  # the session's counters before this request
    priority: Priority  # short requests' rounds first (specd/priority.py)
    owner: str = ""  # the session's owner: the model-free drafter's store of recent outputs is per owner
    stretch: _Stretch = field(default_factory=_Stretch)


@dataclass(frozen=True)
class _Progress:
    """A request between rounds."""

    state: SessionState  # tokens: everything committed, this turn's prompt included
    stored: int  # committed tokens the store holds
    stats: SessionStats  # this request's rounds; the session's are session_stats + these


@dataclass(frozen=True)
class RoundResult:
    """What one round did: the request's progress after it, and what it emitted."""

    progress: _Progress
    emitted: tuple[int, ...]
    text: str
    record: RoundRecord
    stored_before: int  # committed tokens the store held before this round: its save appends the rest


async def generate(
    request: GenerationRequest,
    session_id: str,
    services: Services,
    decode: Decode,
    ephemeral: bool = True,
    on_round: Callable[[RoundRecord], None] | None = None,
    owner: str = "",
    request_id: str = "",
) -> AsyncIterator[Chunk | Finished]:
    """Run one request on a session. An ephemeral session is forgotten everywhere afterwards.
    A new session records its `owner` and starts from the policy the deployment learned last.
    `request_id`: a retry of the session's latest turn with this id does not append its prompt
    again: it replies with what that turn committed and, if it had not finished, goes on with it."""
    with services.gate.request() as priority, services.load.turn():
        turn, progress, replayed = await _start_turn(request, session_id, services, decode, priority, owner,
                                                     request_id)
        try:
            if replayed:  # the same checker over the same tokens: the reply so far, as first sent
                yield Chunk(*_apply_stop_rules(turn.checker, replayed))
            async for result in _saved_rounds(turn, progress):
                progress = result.progress
                if on_round:
                    on_round(result.record)
                if result.emitted:
                    yield Chunk(result.emitted, result.text)
            if progress.stats.rounds and _teaches_the_prior(request):
                await services.store.remember(progress.state.policy, turn.owner)
            checker = turn.checker
            if services.model_free:
                services.model_free.finished(turn.owner, checker.token_ids)
            yield Finished(checker.finish_reason, tuple(checker.token_ids), checker.text, progress.stats, progress.state)
        finally:
            if ephemeral:
                await forget(session_id, services)


async def one_round(request: GenerationRequest, session_id: str, services: Services, decode: Decode) -> RoundRecord:
    """One round of a request on a session, saved, and nothing after it (start-up calibration times
    rounds one at a time: a round run ahead would be one more pass in the middle of its timings)."""
    with services.gate.request() as priority:
        turn, progress, _ = await _start_turn(request, session_id, services, decode, priority, stream=False)
        result = await run_round(turn, progress)
        await _save(turn, result)
        return result.record


async def streamed_rounds(request: GenerationRequest, session_id: str, services: Services,
                          decode: Decode) -> list[RoundRecord]:
    """A request's rounds to its end, each saved, its plain steps streamed as a turn's are (start-up
    calibration times plain decoding as the deployment runs it)."""
    with services.gate.request() as priority:
        turn, progress, _ = await _start_turn(request, session_id, services, decode, priority)
        return [result.record async for result in _saved_rounds(turn, progress)]


async def _start_turn(request: GenerationRequest, session_id: str, services: Services, decode: Decode,
                      priority: Priority, owner: str = "", request_id: str = "", stream: bool = True
                      ) -> tuple[_Turn, _Progress, tuple[int, ...]]:
    """Take the session over and open the turn: what its rounds share, the progress before them,
    and what a retried turn had already generated. `stream`: plain stretches may run as a stream."""
    lease, state = await services.store.begin(session_id, create=True, owner=owner)
    state, stored, replayed = await _open_turn(state, request, request_id, services.store)
    if request.fixed_k is None:
        load = services.load.now(services.clock())
        state = evolve(state, policy=joined_at_load(state.policy, load, request.policy))
    turn = _Turn(request, session_id, services, lease, StopChecker(request.rules, decode), state.stats, priority,
                 state.owner, _Stretch(allowed=stream))
    return turn, _Progress(state, stored, SessionStats()), replayed


async def _saved_rounds(turn: _Turn, progress: _Progress) -> AsyncIterator[RoundResult]:
    """The turn's rounds, each yielded once the store holds it (a client never receives a token a
    crash could lose). The next round runs while the last one's save is in flight: a round is a
    pure function of the committed tokens, so one begun on tokens whose save then fails is dropped
    (the services' caches are soft copies; the next sync truncates them). Each round's wall time is
    from the last round's save to its own, the round as the client waits for it; it and the save's
    own time reach the store with the next round's save."""
    if turn.checker.finish_reason:
        return
    ahead: asyncio.Task | None = None
    clock = turn.services.clock
    ready = clock()
    result = await run_round(turn, progress)
    try:
        while True:
            saving = asyncio.ensure_future(_save(turn, result))
            ahead = None if turn.checker.finish_reason else asyncio.ensure_future(run_round(turn, result.progress))
            save_s = await saving
            now = clock()
            timing = SessionStats(round_wall_s=now - ready, save_s=save_s)
            ready = now
            yield _with_stats(result, timing)  # the request's stats include its last round's timing
            if ahead is None:
                return
            result, ahead = _with_stats(await ahead, timing), None
    finally:
        if ahead is not None:  # the save failed or the client left: the round ahead is dropped
            ahead.cancel()
            await asyncio.gather(ahead, return_exceptions=True)
        turn.stretch.close()


async def _save(turn: _Turn, result: RoundResult) -> float:
    """Persist a round (fenced: fails if another coordinator took the session over); its seconds."""
    clock = turn.services.clock
    start = clock()
    await turn.services.store.save(turn.lease, result.progress.state, appended_from=result.stored_before)
    return clock() - start


def _with_stats(result: RoundResult, stats: SessionStats) -> RoundResult:
    """The round with timings added to the request's and the session's counters."""
    progress = result.progress
    state = evolve(progress.state, stats=progress.state.stats + stats)
    return evolve(result, progress=evolve(progress, state=state, stats=progress.stats + stats))


async def run_round(turn: _Turn, progress: _Progress) -> RoundResult:
    """Draft, verify, commit, roll back, learn; the caller saves. A long request's round may first
    wait for short ones' (specd/priority.py)."""
    await turn.priority.before_round(len(turn.checker.token_ids))
    return await _run_round(turn, progress)


async def _run_round(turn: _Turn, progress: _Progress) -> RoundResult:
    """The span ends before the round's tokens are emitted: a span left current across a yield
    would leak into whatever the consumer does."""
    request, services, state = turn.request, turn.services, progress.state
    with tracer.start_as_current_span("speculation.round") as span:
        remaining = request.rules.max_tokens - len(turn.checker.token_ids)
        k = min(_choose_k(request, state.policy), remaining - 1)  # a round commits at most k + 1 tokens
        # 1. draft: from the tokens at hand, by the draft model, or not at all
        free = _free_draft(turn, state, min(request.policy.max_k, remaining - 1))
        offered = _free_offered(request, services, state.policy, free, k)
        source, k = _drafter(request, state, k, free, _model_drafts(turn, progress), remaining,
                             streaming=turn.stretch.steps is not None)
        turn.stretch.undrafted = turn.stretch.undrafted + 1 if source == hybrid.NONE else 0
        drafting, outage, proposal = None, False, EMPTY_PROPOSAL
        # a stretch's step in flight is this round's, whatever it chose (the next round chooses again)
        streamed = await _streamed_step(turn.stretch, services.clock, plain=source == hybrid.NONE)
        if streamed:
            source, k = hybrid.NONE, 0
        elif source == hybrid.FREE:
            proposal = model_free.proposal(free.tokens[:k], request.params.greedy)
        elif source == hybrid.MODEL:
            drafting, outage = await _draft(turn, state, _asked_k(request, state.policy, k, remaining))
            proposal = drafting.reply.proposal if drafting else EMPTY_PROPOSAL
        k = len(proposal.tokens)  # a confidence stop may have drafted fewer
        sure = max(0, k - 1) if drafting and _min_confidence(request) > 0 else 0  # it drafted on after each
        # 2. verify
        if streamed:
            verifying = streamed
        elif k == 0 and (steps := _stretch_steps(turn, state, remaining)):
            verifying = await _open_stretch(turn, state, steps)
        else:
            verifying = await _call(services.clock, state.target, state.tokens, lambda s: services.verifier.verify(
                VerifyRequest(turn.session_id, s, proposal, request.params)
            ))
        verdict, a = verifying.reply.verdict, verifying.reply.verdict.num_accepted
        services.load.saw(max(verifying.reply.batch_size, verifying.reply.active_sessions), services.clock())
        # 3. commit what the stop rules let through
        emitted, text = _apply_stop_rules(turn.checker, verdict.committed(proposal.tokens))
        n, committed = len(state.tokens), state.tokens + emitted
        # 4. rollback: pure bookkeeping; the draft's valid prefix ends after the accepted drafts
        draft = ServiceCursor(min(n + a, len(committed)), drafting.reply.instance_id) if drafting else state.draft
        target = ServiceCursor(min(verifying.reply.position, len(committed)), verifying.reply.instance_id)
        # 5. learn: acceptance and timings feed the K / fallback policy
        observation = evolve(_observation(k, a, drafting, verifying, streamed=streamed is not None),
                              free_offered=offered, sure=sure)
        policy = state.policy
        if source == hybrid.FREE:
            policy = hybrid.observe_free(policy, observation, free.scores, request.policy)
        elif request.fixed_k is None and not outage:  # an outage's rounds say nothing of the policy
            policy = observe(policy, observation, request.policy)
        resyncs = sum(call.resynced for call in (drafting, verifying) if call)
        stats = progress.stats + SessionStats().record(
            k, a, policy.fallbacks - state.policy.fallbacks, resyncs, observation.draft_s, observation.verify_s,
            outage_rounds=int(outage), model_free=source == hybrid.FREE,
        ) + _call_times(drafting, verifying)
        span.set_attributes(_round_attributes(progress.stats.rounds, observation, len(committed), policy.mode, source))
        state = evolve(state, tokens=committed, draft=draft, target=target, policy=policy,
                        stats=turn.session_stats + stats)
    # 6. persist, then emit: the caller's (_saved_rounds)
    record = RoundRecord(k, a, len(committed), drafting and drafting.reply.position, verifying.reply.position,
                         policy.mode, observation, source)
    return RoundResult(_Progress(state, len(committed), stats), emitted, text, record, progress.stored)


async def _open_turn(
    state: SessionState, request: GenerationRequest, request_id: str, store: SessionStore
) -> tuple[SessionState, int, tuple[int, ...]]:
    """The session with this turn's prompt appended, the committed length the store holds, and
    what the turn already generated when this request retries it (nothing is appended then)."""
    if state.requests == 0:
        state = await _start_from_prior(state, store)
    stored = len(state.tokens)
    replayed = _retried_turn(state, request, request_id)
    if replayed is not None:
        return state, stored, replayed
    tokens = (*state.tokens, *_session_start(state, request))
    _check_context(len(tokens), request)
    turn = Turn(request_id, len(tokens), request_digest(request)) if request_id else None
    return evolve(state, tokens=(*tokens, *request.prompt), requests=state.requests + 1, turn=turn), stored, ()


def _session_start(state: SessionState, request: GenerationRequest) -> tuple[int, ...]:
    """The start token a new session begins with, as llama.cpp adds it to a prompt (once)."""
    needed = request.bos is not None and not state.tokens and request.prompt[:1] != (request.bos,)
    return (request.bos,) if needed else ()


async def _draft(turn: _Turn, state: SessionState, k: int) -> tuple[_Called | None, bool]:
    """The round's proposal (None: it drafts nothing), and whether that is because no draft
    replica answered (an outage: the round is a plain step)."""
    services, request = turn.services, turn.request
    if k == 0:
        return None, False
    if not services.outage.drafting(services.drafter):
        return None, True
    try:
        proposing = _call(services.clock, state.draft, state.tokens, lambda s: services.drafter.propose(
            ProposeRequest(turn.session_id, s, k, request.params, min_confidence=_min_confidence(request))))
        return await asyncio.wait_for(proposing, services.outage.timeout_s), False
    except (ServiceUnavailable, TimeoutError) as error:
        services.outage.lost(error)
        return None, True


def request_digest(request: GenerationRequest) -> str:
    """What a turn asked, for telling a retry from a different request under the same id (the
    seed is left out: an unseeded request gets a new one each time)."""
    p = request.params
    asked = (request.prompt, request.rules, p.temperature, p.top_k, p.top_p, request.fixed_k)
    return hashlib.blake2b(repr(asked).encode(), digest_size=16).hexdigest()


def _retried_turn(state: SessionState, request: GenerationRequest, request_id: str) -> tuple[int, ...] | None:
    """The tokens the session's latest turn generated, when this request retries it; else None."""
    turn = state.turn
    if not request_id or turn is None or turn.request_id != request_id:
        return None
    validate_that(turn.digest == request_digest(request),
                  f"request id {request_id!r} named a different request on this session; use a new id for a new turn")
    return state.tokens[turn.start + len(request.prompt):]


def _check_context(held: int, request: GenerationRequest) -> None:
    """Checked under the session's lease: two turns racing on one session cannot both pass on the
    length each saw before the other began."""
    asked = len(request.prompt) + request.rules.max_tokens
    validate_that(not request.max_context or held + asked <= request.max_context,
                  f"the session holds {held} tokens: with this prompt ({len(request.prompt)}) and max_tokens "
                  f"({request.rules.max_tokens}) it would outgrow the model's context of {request.max_context}; "
                  "lower max_tokens or start a new session")


def _teaches_the_prior(request: GenerationRequest) -> bool:
    """A turn whose K was pinned, or that ruled the draft model out (`drafter: none|ngram`, a
    readiness probe), measured the deployment's drafting only in part: its policy would start the
    next sessions (and pass for a learnt prior that start-up calibration then skips) on that part."""
    return request.fixed_k is None and request.drafter in (hybrid.AUTO, hybrid.MODEL)


async def _start_from_prior(state: SessionState, store: SessionStore) -> SessionState:
    prior = await store.prior(state.owner)
    return evolve(state, policy=inherit(prior) if prior else state.policy)


def _round_attributes(index: int, seen: RoundObservation, committed: int, mode: str,
                      drafter: str) -> dict[str, int | float | str]:
    return {
        "specd.drafter": drafter,
        "specd.round": index,
        "specd.k": seen.k,
        "specd.accepted": seen.accepted,
        "specd.committed_length": committed,
        "specd.mode": mode,
        "specd.draft_s": seen.draft_s,
        "specd.verify_s": seen.verify_s,
        "specd.rtt_s": seen.rtt_s,
    }


def _choose_k(request: GenerationRequest, policy: PolicyState) -> int:
    """A pinned K, or the policy's; a named draft model drafts every round (K adapts, only `auto` falls
    back to plain steps): plain mode's rounds are its probes."""
    if request.fixed_k is not None:
        return request.fixed_k
    k = next_k(policy, request.policy)
    return k if k > 0 or request.drafter != hybrid.MODEL else request.policy.probe_k


def _free_draft(turn: _Turn, state: SessionState, cap: int) -> Draft:
    """The model-free drafter's continuation of the committed tokens (nothing when it is off, not
    asked for, the request decodes plainly, or the round has no room). A session's index catches up
    on the tokens it skipped at its next draft."""
    drafter, request = turn.services.model_free, turn.request
    if drafter is None or request.drafter not in (hybrid.AUTO, hybrid.FREE) or request.fixed_k == 0 or cap <= 0:
        return NO_DRAFT
    return drafter.propose(turn.session_id, turn.owner, state.tokens, cap)


def _free_offered(request: GenerationRequest, services: Services, policy: PolicyState, free: Draft,
                  k: int) -> bool | None:
    """Would the model-free drafter take this round from the draft model at K, had it caught up
    (None where the two are not weighed)?"""
    weighed = request.drafter == hybrid.AUTO and request.fixed_k is None and None not in (services.model_free, services.drafter)
    return hybrid.free_offered(policy.estimates, request.policy, free.scores, k) if weighed else None


def _drafter(request: GenerationRequest, state: SessionState, k: int, free: Draft, model: bool,
             remaining: int, streaming: bool = False) -> tuple[str, int]:
    """Who drafts this round, and how many tokens (`model`: there is a draft model). A pinned K is
    the draft model's, unless the request asked for the model-free drafter, whose draft it then caps.
    A turn `streaming` its plain steps prices a draft with the Step calls it costs before the stream
    reopens: in plain mode the next plain round's, else UNDRAFTED_RUN (`_stretch_steps`)."""
    policy = state.policy
    if request.fixed_k is not None and request.drafter != hybrid.FREE:
        return (hybrid.MODEL, k) if k > 0 and model and request.drafter != hybrid.NONE else (hybrid.NONE, 0)
    if request.fixed_k is not None:
        free = Draft(free.tokens[:k], free.scores[:k], free.match)
        return (hybrid.FREE, len(free.tokens)) if free.tokens else (hybrid.NONE, 0)
    lag = len(state.tokens) - state.draft.position  # what the draft model would catch up on first
    calls = 1 if policy.mode == PLAIN else UNDRAFTED_RUN
    exit_s = hybrid.stream_exit_time(policy.estimates, calls) if streaming else 0.0
    return hybrid.choose(request.drafter, policy.estimates, request.policy, k if model else 0, free.scores, lag,
                         remaining, probe=policy.mode == PLAIN, exit_s=exit_s,
                         probe_credit=policy.probe_credit)


def _model_drafts(turn: _Turn, progress: _Progress) -> bool:
    """May the draft model draft this round? Not in an adaptive turn's first round: that round is the
    target's prefill of the prompt, and the draft's own prefill would stand before the first token,
    priced on the batch and timings of a deployment as it was (a new session's prior), not as the
    session finds it; from the next round on, the policy and the hybrid choice decide. A pinned K or
    `drafter: model` drafts from the first round."""
    request = turn.request
    if turn.services.drafter is None:
        return False
    return progress.stats.rounds > 0 or request.fixed_k is not None or request.drafter == hybrid.MODEL


def _asked_k(request: GenerationRequest, policy: PolicyState, k: int, remaining: int) -> int:
    """The drafts to ask the draft model for: the round's K, or in speculative mode as many as drafts it
    is sure of would pay for (`policy.sure_k`: its confidence stop ends the proposal at the first it is
    not sure of), within what the request may still make. A probe stays at its K: it measures α."""
    if request.fixed_k is not None or policy.mode == PLAIN:
        return k
    return min(sure_k(policy.estimates, request.policy, k), remaining - 1)  # >= k: so are both


def _min_confidence(request: GenerationRequest) -> float:
    """A pinned K drafts exactly K; adaptive K is a cap the draft's confidence may cut short."""
    return 0.0 if request.fixed_k is not None else request.policy.min_confidence


def _apply_stop_rules(checker: StopChecker, tokens: Sequence[int]) -> tuple[tuple[int, ...], str]:
    """Push tokens one by one; the ones after a stop condition are never committed."""
    emitted, text = [], ""
    for token in tokens:
        emitted.append(token)
        text += checker.push(token)
        if checker.finish_reason:
            break
    return tuple(emitted), text


@dataclass(frozen=True)
class _Called:
    reply: DraftReply | VerifyReply
    wall_s: float
    sent: int  # committed tokens the service had to catch up on before this round's work
    resynced: bool = False  # the service had lost the session and got everything resent

    @property
    def cold(self) -> bool:
        """More than the round's own tokens (a new prompt, a resend): its timing is a prefill, not a step."""
        return self.sent > 2

    @property
    def overhead_s(self) -> float:
        """The call's cost beyond the model: network, serialisation, the service's own work. Time
        queued behind other sessions is load, which a plain step would wait through as well."""
        return max(0.0, self.wall_s - self.reply.compute_s - self.reply.queued_s)


def _call_times(drafting: _Called | None, verifying: _Called) -> SessionStats:
    """The round's calls as the coordinator timed them (a round's parts: benchmarks/round_parts.py)."""
    return SessionStats(draft_wall_s=drafting.wall_s if drafting else 0.0, verify_wall_s=verifying.wall_s,
                        verify_queued_s=verifying.reply.queued_s)


def _observation(k: int, accepted: int, drafting: _Called | None, verifying: _Called,
                 streamed: bool = False) -> RoundObservation:
    calls = [verifying] + ([drafting] if drafting else [])
    return RoundObservation(
        streamed=streamed,
        k=k,
        accepted=accepted,
        draft_s=drafting.reply.compute_s if drafting else 0.0,
        verify_s=verifying.reply.compute_s,
        rtt_s=sum(c.overhead_s for c in calls) / len(calls),
        draft_cold=bool(drafting and drafting.cold),
        draft_sent=drafting.sent if drafting else 0,
        target_cold=verifying.cold,
        target_shared=verifying.reply.batch_size > 1,
        batch_size=verifying.reply.batch_size,
        active_sessions=verifying.reply.active_sessions,
        pass_rows=verifying.reply.pass_rows,
        wall_s=verifying.wall_s,
        confidence=verifying.reply.confidence,
    )


async def _call(clock: Callable[[], float], cursor: ServiceCursor, committed: Sequence[int],
                call: Callable[[SyncPoint], Awaitable[T]]) -> _Called:
    """Call a service with the tokens it lacks; if it lost the session, resend everything."""
    start = clock()
    sync, resynced = _sync(cursor, committed), False
    try:
        reply = await call(sync)
    except StaleSession:
        sync, resynced = _sync(ServiceCursor(), committed), True
        reply = await call(sync)
    return _Called(reply, clock() - start, len(sync.tokens), resynced)


def _stretch_steps(turn: _Turn, state: SessionState, remaining: int) -> int:
    """Plain steps to stream from this plain round on (0: one Step): when the turn decodes plainly
    for a while (speculation off, plain mode between probes, no draft model, or under load rounds
    that keep choosing no draft), up to what the request may still make; each round's own choice
    stops the stream when it would draft."""
    request, services = turn.request, turn.services
    if not turn.stretch.allowed or services.decoder is None or remaining < 2:
        return 0
    pinned_plain = request.fixed_k == 0 or request.drafter == hybrid.NONE
    undrafted = turn.stretch.undrafted >= UNDRAFTED_RUN and batch_sessions(state.policy.estimates) > 1
    adaptive_plain = request.fixed_k is None and (state.policy.mode == PLAIN or services.drafter is None or undrafted)
    return remaining if pinned_plain or adaptive_plain else 0


async def _open_stretch(turn: _Turn, state: SessionState, steps: int) -> _Called:
    """Start streaming plain steps; its first step is this round's."""
    decoder, request = turn.services.decoder, turn.request
    called = await _call(turn.services.clock, state.target, state.tokens, lambda s: decoder.decode(
        DecodeRequest(VerifyRequest(turn.session_id, s, EMPTY_PROPOSAL, request.params), steps)))
    turn.stretch.steps, turn.stretch.last = called.reply, turn.services.clock()
    return evolve(called, reply=called.reply.first)


async def _streamed_step(stretch: _Stretch, clock: Callable[[], float], plain: bool) -> _Called | None:
    """The stretch's next step (None: no stretch, or it ended); a round that would not be plain
    stops it first, and still takes the step in flight."""
    if stretch.steps is None:
        return None
    if not plain:
        await stretch.steps.stop()
    reply = await stretch.steps.next()
    if reply is None:
        stretch.close()
        return None
    now = clock()
    called, stretch.last = _Called(reply, now - stretch.last, 1), now
    return called


def _sync(cursor: ServiceCursor, committed: Sequence[int]) -> SyncPoint:
    return SyncPoint(cursor.position, tuple(committed[cursor.position :]), cursor.instance_id)


_forgetting: set[asyncio.Future] = set()  # releases still running after their request was cancelled


async def forget(session_id: str, services: Services) -> None:
    """Free both caches and the stored session. Best effort: an unreleased cache is evicted
    once idle and a stored session expires, and a failure here must not mask the outcome.
    Shielded: a request cancelled (client gone, deadline passed) is exactly the one whose
    caches must still be freed, and its own task may be cancelled again while it waits."""
    if services.model_free:
        services.model_free.release(session_id)
    releases = asyncio.gather(
        *([services.drafter.release(session_id)] if services.drafter else []),
        services.verifier.release(session_id),
        services.store.delete(session_id),
        return_exceptions=True,
    )
    _forgetting.add(releases)
    releases.add_done_callback(_forgetting.discard)
    await asyncio.shield(releases)
