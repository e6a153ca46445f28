"""Pipelined drafting: the draft drafts ahead while the target verifies, and the next round takes
the drafts that still extend the committed tokens.

Lossless by construction: a draft is a function of the committed prefix, the params and
position-keyed uniforms, so a draft made ahead is the draft the next round would make. With the
tiny pair in float64: greedy output equals the target alone, and sampled output equals the
synchronous loop's for the same seed, token for token.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from specd.contracts import ProposeRequest, SamplingParams, SyncPoint
from specd.draft_engine import DraftEngine
from specd.engine import EngineConfig, ModelEngine
from specd.policy import (
    PIPELINE_RETRY,
    PIPELINE_TRIAL,
    Estimates,
    PolicyConfig,
    PolicyState,
    RoundObservation,
    lookahead,
    observe,
    pipelining_pays,
    round_time,
)
from services.coordinator.requests import Limits
from services.draft.server import DraftServicer
from services.protogen.specd.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.conftest import greedy_reference

PROMPT = [3, 17, 250, 42, 99, 7, 7, 128, 64, 5, 200]
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=7)
K = 3


@pytest.fixture(scope="module")
def draft(tiny_pair) -> DraftEngine:
    return DraftEngine(ModelEngine(EngineConfig(tiny_pair[0], dtype="float64")))


def proposed(draft: DraftEngine, request: ProposeRequest):
    [reply] = draft.propose([request])
    assert not isinstance(reply, Exception), reply
    return reply


def fresh_proposal(draft: DraftEngine, committed: list[int], k: int, params: SamplingParams):
    draft.release("fresh")
    return proposed(draft, ProposeRequest("fresh", SyncPoint(0, tuple(committed)), k, params)).proposal


def propose_and_draft_ahead(draft: DraftEngine, params: SamplingParams, session: str = "s"):
    draft.release(session)
    request = ProposeRequest(session, SyncPoint(0, tuple(PROMPT)), K, params, lookahead=K + 1)
    first = proposed(draft, request).proposal
    for _ in range(K + 1):  # the bonus guess, then the next round's K
        assert draft.draft_ahead(request)
    assert not draft.draft_ahead(request)  # its lookahead is drafted
    return first


def next_round(draft: DraftEngine, bonus: int, params: SamplingParams, session: str = "s"):
    """The round after a full acceptance of K drafts whose bonus token was `bonus`."""
    sync = SyncPoint(len(PROMPT) + K, (bonus,), draft.engine.instance_id)
    return proposed(draft, ProposeRequest(session, sync, K, params))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_drafts_made_ahead_are_the_drafts_the_next_round_would_make(draft, params):
    first = propose_and_draft_ahead(draft, params)
    n = len(PROMPT) + K
    guess = draft.engine.tokens("s")[n]  # the draft's own guess of the bonus token
    committed = PROMPT + list(first.tokens) + [guess]
    reply = next_round(draft, guess, params)  # full acceptance, the guess was right
    assert reply.reused == K and reply.position == len(committed)
    # no sibling stands beside a held draft
    assert reply.proposal == replace(fresh_proposal(draft, committed, K, params), sibling=None)
    assert len(reply.proposal.q) == (0 if params.greedy else K)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_lost_bet_drafts_afresh(draft, params):
    first = propose_and_draft_ahead(draft, params)
    n = len(PROMPT) + K
    wrong_bonus = (draft.engine.tokens("s")[n] + 1) % 256
    committed = PROMPT + list(first.tokens) + [wrong_bonus]
    reply = next_round(draft, wrong_bonus, params)
    assert reply.reused == 0 and reply.proposal == fresh_proposal(draft, committed, K, params)


def test_drafts_made_with_other_params_are_not_reused(draft):
    first = propose_and_draft_ahead(draft, SAMPLED)
    n = len(PROMPT) + K
    guess = draft.engine.tokens("s")[n]
    committed = PROMPT + list(first.tokens) + [guess]
    other = SamplingParams(temperature=0.8, top_k=20, seed=8)
    reply = next_round(draft, guess, other)
    assert reply.reused == 0 and reply.proposal == fresh_proposal(draft, committed, K, other)


def test_a_newer_call_settles_the_bet(draft):
    """A proposal for the session ends the drafting ahead of the one before it."""
    draft.release("s")
    request = ProposeRequest("s", SyncPoint(0, tuple(PROMPT)), K, GREEDY, lookahead=K + 1)
    proposed(draft, request)
    assert draft.draft_ahead(request)
    newer = ProposeRequest("s", SyncPoint(0, tuple(PROMPT)), K, GREEDY, lookahead=K + 1)
    proposed(draft, newer)
    assert not draft.draft_ahead(request) and draft.draft_ahead(newer)


# --- the cost model -------------------------------------------------------------------------


def measured(pipelined_ratio: float = 1.0, pipelined_rounds: int = 0) -> Estimates:
    """The real pair's CPU timings: draft 0.08 s/token, verify(K) = 0.43·(1 + 0.33·K) s."""
    return Estimates(
        alpha=0.9, draft_step_s=0.08, verify_s=((0, 0.43), (4, 0.43 * 2.32)), rtt_s=0.001, observations=10,
        pipelined_ratio=pipelined_ratio, pipelined_rounds=pipelined_rounds,
    )


def test_auto_pipelining_tries_then_keeps_it_only_where_rounds_got_faster():
    auto = PolicyConfig(pipeline="auto")
    assert pipelining_pays(measured(), auto)  # not measured yet: try it
    assert pipelining_pays(measured(0.8, PIPELINE_TRIAL), auto)  # separate devices: rounds 20 % faster
    assert not pipelining_pays(measured(1.2, PIPELINE_TRIAL), auto)  # shared cores: slower
    assert not pipelining_pays(measured(0.99, PIPELINE_TRIAL), auto)  # within noise: not worth the draft's work
    assert not pipelining_pays(Estimates(), auto)  # nothing measured: no trial before calibration
    assert pipelining_pays(Estimates(), PolicyConfig(pipeline="on"))
    assert not pipelining_pays(measured(), PolicyConfig())  # off by default
    state = PolicyState(estimates=measured())
    assert lookahead(state, 4, auto) == 5 and lookahead(state, 0, auto) == 0


@pytest.mark.parametrize("slowdown, keeps", [(1.3, False), (0.75, True)])
def test_auto_pipelining_learns_from_the_wall_time_of_pipelined_rounds(slowdown, keeps):
    """Pipelined rounds that take `slowdown` times the predicted synchronous round; their
    contended verify times must not leak into verify(K)."""
    auto = PolicyConfig(pipeline="auto")
    state = PolicyState(estimates=measured(), drafted_last_round=True)
    predicted = round_time(state.estimates, 4)
    for _ in range(PIPELINE_TRIAL + 2):
        verify_s = slowdown * predicted - 4 * 0.08 - 2 * 0.001
        obs = RoundObservation(4, 4, 4 * 0.08, verify_s, 0.001, drafted_ahead=lookahead(state, 4, auto) > 0)
        state = observe(state, obs, auto)
    assert state.estimates.pipelined_ratio == pytest.approx(slowdown)
    assert (lookahead(state, 4, auto) > 0) == keeps
    if keeps:  # every round pipelined: verify(4) is still the uncontended measurement
        assert state.estimates.pipelined_rounds == PIPELINE_TRIAL + 2
        assert dict(state.estimates.verify_s)[4] == pytest.approx(0.43 * 2.32)
    else:  # the trial, then synchronous rounds
        assert state.estimates.pipelined_rounds == PIPELINE_TRIAL


def test_releasing_a_session_drops_the_drafts_it_made_ahead(tiny_pair):
    """gRPC Release and the Ray deployment's release both end in `release_session`."""
    servicer = DraftServicer.load(EngineConfig(tiny_pair[0]), "draft")

    async def main():
        await servicer.propose(ProposeRequest("s", SyncPoint(0, tuple(PROMPT)), K, GREEDY, lookahead=K + 1))
        await asyncio.gather(*servicer._drafting)
        held = "s" in servicer.role_engine._ahead
        await servicer.worker.run(servicer.release_session, "s")
        return held

    try:
        assert asyncio.run(main())
        assert "s" not in servicer.role_engine._ahead and servicer.engine.position("s") == 0
    finally:
        servicer.close()


def test_auto_pipelining_tries_again_after_a_wait_that_doubles_with_each_failed_trial():
    """A verdict against pipelining is re-checked: a trial taken under a burst of load, or before
    the services moved apart, must not switch it off for the deployment's lifetime."""
    auto = PolicyConfig(pipeline="auto")
    state = PolicyState(estimates=measured(), drafted_last_round=True)
    predicted = round_time(state.estimates, 4)
    trials, waits, since = 0, [], 0
    for _ in range(PIPELINE_TRIAL * 3 + PIPELINE_RETRY * 3):
        ahead = lookahead(state, 4, auto) > 0
        trials += ahead and state.estimates.pipelined_rounds == 0
        if ahead and since:
            waits.append(since)
        since = 0 if ahead else since + 1
        verify_s = (1.3 if ahead else 1.0) * predicted - 4 * 0.08 - 2 * 0.001  # pipelined rounds: 30 % slower
        state = observe(state, RoundObservation(4, 4, 4 * 0.08, verify_s, 0.001, drafted_ahead=ahead), auto)
    assert trials == 3 and waits == [PIPELINE_RETRY, 2 * PIPELINE_RETRY]
    assert dict(state.estimates.verify_s)[4] == pytest.approx(0.43 * 2.32)  # synchronous rounds kept it


# --- through the real services --------------------------------------------------------------


@pytest.fixture(scope="module")
def clusters(tiny_pair, redis_url):
    """The same tiny pair served with pipelining on and off."""
    running = {mode: Cluster(*tiny_pair, redis_url, limits=Limits(pipeline=mode)) for mode in ("on", "off")}
    yield running
    for c in running.values():
        c.close()


def complete(cluster: Cluster, prompt: str, **fields) -> coordinator_pb2.CompleteResponse:
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=24, ignore_eos=True, **fields)
        return cluster.coordinator(channel).Complete(request, timeout=60)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_pipelined_greedy_output_is_the_targets(clusters, tiny_pair, k):
    reference = greedy_reference(tiny_pair[1])
    reused = 0
    for prompt in ("def add(a, b):", "Once upon a time", "x = [1, 2, 3]\nfor"):
        reply = complete(clusters["on"], prompt, num_draft_tokens=k)
        assert list(reply.token_ids) == reference(clusters["on"].model.encode(prompt), 24)
        reused += reply.stats.reused_drafts
    assert reused > 0  # bets were won and their drafts used
    assert complete(clusters["off"], "def add(a, b):", num_draft_tokens=k).stats.reused_drafts == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pipelined_sampling_equals_the_synchronous_loop_for_a_seed(clusters, seed):
    def sampled(mode: str):
        return complete(clusters[mode], "Once upon a time", num_draft_tokens=2, temperature=0.9, seed=seed)

    pipelined, synchronous = sampled("on"), sampled("off")
    assert list(pipelined.token_ids) == list(synchronous.token_ids)
    assert pipelined.stats.accepted_tokens == synchronous.stats.accepted_tokens
