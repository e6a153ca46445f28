"""Drafting without a model: the hybrid choice of a round's drafter (specd/policy/hybrid.py) and the
loop with the model-free drafter (specd/model_free.py) against scripted fakes that count calls."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from specd.contracts import SamplingParams
from specd.loop import Finished, GenerationRequest, RoundRecord, Services, generate
from specd.model_free import SuffixDrafter
from specd.policy import Estimates, PolicyConfig, PolicyState, RoundObservation, hybrid, inherit, observe
from specd.policy.base import PROBE_SHARE, PROBE_START
from specd.loop import UNDRAFTED_RUN
from specd.policy import cost
from specd.policy.cost import verify_time
from specd.policy.learning import learn_offer
from specd.stopping import StopRules
from tests.fakes import FakeDrafter, FakeStore, FakeVerifier, target_alone, target_rule

PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)
CONFIG = PolicyConfig()
# measured: a plain step 30 ms, each extra verification row 4 ms, a draft step 15 ms, 2 ms a call
MEASURED = Estimates(alpha=0.6, draft_step_s=0.015, verify_s=tuple((k, 0.03 + 0.004 * k) for k in range(9)),
                     rtt_s=0.002, observations=20)


def repeating(prefix) -> int:
    """A target that repeats the prompt over and over: text the session has seen predicts it."""
    return prefix[len(prefix) % len(PROMPT)]


def counting(prefix) -> int:
    """A target whose text never repeats (within the vocabulary): nothing in a session predicts it."""
    return 10 + len(prefix)


def useless(prefix) -> int:
    return (repeating(prefix) + 1) % 50


def run(request: GenerationRequest, drafter: FakeDrafter, verifier: FakeVerifier, model_free: SuffixDrafter | None,
        session: str = "s", owner: str = "alice", records: list | None = None) -> Finished:
    services = Services(drafter, verifier, FakeStore(), model_free=model_free)

    async def collect():
        return [e async for e in generate(request, session, services, lambda ids: "", True,
                                          records.append if records is not None else None, owner)]

    return asyncio.run(collect())[-1]


def request(drafter: str = hybrid.AUTO, max_tokens: int = 40, prompt=PROMPT, k: int | None = None) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), StopRules(max_tokens, (), frozenset()), SamplingParams(), fixed_k=k,
                             drafter=drafter)


# -- the choice ------------------------------------------------------------------------------------


def test_the_draft_models_catch_up_is_priced_over_what_is_left_of_the_request():
    """A draft model that lacks a 300-token prompt first runs a pass over it (about 0.6 s here): worth
    it for 400 more tokens at α = 0.9, not for 20; a model-free draft at hand then wins even when
    unsure. Caught up (the round's own tokens only), the choice is the one without a lag."""
    good = replace(MEASURED, alpha=0.9)
    assert hybrid.choose(hybrid.AUTO, good, CONFIG, 4, [], lag=300, remaining=400) == (hybrid.MODEL, 4)
    assert hybrid.choose(hybrid.AUTO, good, CONFIG, 4, [], lag=300, remaining=20) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.AUTO, good, CONFIG, 4, [0.2], lag=300, remaining=20) == (hybrid.FREE, 1)
    assert hybrid.choose(hybrid.AUTO, good, CONFIG, 4, [0.2], lag=2, remaining=20) == (hybrid.MODEL, 4)
    assert hybrid.choose(hybrid.MODEL, good, CONFIG, 4, [], lag=300, remaining=20) == (hybrid.MODEL, 4)  # asked for


def test_where_the_model_free_drafter_takes_rounds_the_catch_up_is_shared_by_fewer():
    """A 40-token lag (rounds the model-free drafter took) with 45 tokens to go: worth catching up when
    the model then drafts the rest, not when the model-free drafter would take every other round (the
    catch-up then serves the half of them that the draft model drafts)."""
    good = replace(MEASURED, alpha=0.9)
    offering = replace(good, free_offer_tokens=8.0, offered_tokens=16.0)
    assert offering.free_offer_rate == 0.5
    assert hybrid.choose(hybrid.AUTO, good, CONFIG, 4, [], lag=40, remaining=45) == (hybrid.MODEL, 4)
    assert hybrid.choose(hybrid.AUTO, offering, CONFIG, 4, [], lag=40, remaining=45) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.AUTO, offering, CONFIG, 4, [], lag=2, remaining=45) == (hybrid.MODEL, 4)  # caught up
    catch_up = hybrid.catch_up_time(good, CONFIG, 40)
    round_s = 1 / hybrid.model_rate(good, CONFIG, 4, 2, 45)
    e = hybrid.expected_tokens(0.9, 4)
    assert 1 / hybrid.model_rate(offering, CONFIG, 4, 40, 45) == pytest.approx(
        round_s + hybrid.CATCH_UP_RISK * catch_up * e / (45 * 0.5) / e)


def test_a_wake_must_repay_more_than_its_catch_ups_time():
    """A catch-up is paid before the tokens that repay it, which α and P only predict: a wake over a
    200-token lag that would pay at the catch-up's time alone, but not at CATCH_UP_RISK times it, is
    declined; the same text wakes the draft model over a short lag."""
    good = replace(MEASURED, alpha=0.85, free_offer_tokens=4.0, offered_tokens=10.0)
    e = hybrid.expected_tokens(0.85, 4)
    at_its_time = e / (cost.round_time(good, CONFIG, 4) + hybrid.catch_up_time(good, CONFIG, 200) * e / (300 * 0.6))
    assert at_its_time > 1 / cost.plain_time(good)
    assert hybrid.choose(hybrid.AUTO, good, CONFIG, 4, [], lag=200, remaining=300) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.AUTO, good, CONFIG, 4, [], lag=20, remaining=300) == (hybrid.MODEL, 4)


def test_a_cold_draft_call_teaches_what_a_catch_up_costs_a_token_and_waking_the_draft_model_is_priced_by_it():
    guessed = hybrid.catch_up_time(MEASURED, CONFIG, 200)  # nothing timed: the step grown as the target's pass grows
    cold = RoundObservation(k=4, accepted=4, draft_s=4 * 0.015 + 200 * 0.004, verify_s=0.046, rtt_s=0.002,
                            draft_cold=True, draft_sent=200)
    state = observe(PolicyState(estimates=MEASURED, drafted_last_round=True), cold, CONFIG)
    assert state.estimates.catch_up_s == pytest.approx(0.004) and state.estimates.draft_step_s == MEASURED.draft_step_s
    assert hybrid.catch_up_time(state.estimates, CONFIG, 200) == pytest.approx(0.8) != pytest.approx(guessed)
    assert hybrid.catch_up_time(replace(state.estimates, batch=3.0), CONFIG, 200) == pytest.approx(2.4)


def test_a_round_counts_for_the_model_free_drafter_when_it_would_beat_the_caught_up_draft_model():
    good = replace(MEASURED, alpha=0.9)
    assert hybrid.free_offered(good, CONFIG, [1.0] * 8, 4)
    assert not hybrid.free_offered(good, CONFIG, [0.3], 4)  # it pays against a plain step, not against the model
    assert hybrid.free_offered(good, CONFIG, [0.3], 0)  # no draft model this round: against a plain step
    assert not hybrid.free_offered(good, CONFIG, [], 4)


def test_the_share_of_tokens_the_model_free_drafter_takes_is_learnt_over_decaying_counts_per_session():
    est, obs = Estimates(), RoundObservation(k=0, accepted=0, draft_s=0.0, verify_s=0.03, rtt_s=0.002)
    for offered in (True, True, False, True):
        est = learn_offer(est, replace(obs, free_offered=offered), CONFIG.alpha_window)
    assert 0.7 < est.free_offer_rate < 0.8 and est.offered_tokens < 4
    assert learn_offer(est, obs, CONFIG.alpha_window) == est  # the two were not weighed
    # one round that copied 11 tokens outweighs three one-token rounds it would not have taken
    copied = learn_offer(Estimates(), replace(obs, k=12, accepted=10, free_offered=True), CONFIG.alpha_window)
    for _ in range(3):
        copied = learn_offer(copied, replace(obs, free_offered=False), CONFIG.alpha_window)
    assert 0.75 < copied.free_offer_rate < 0.8
    assert inherit(PolicyState(estimates=est)).estimates.free_offer_rate == 0.0  # another request's text


def test_a_sure_model_free_draft_beats_the_draft_model_and_an_unsure_one_does_not():
    assert hybrid.choose(hybrid.AUTO, MEASURED, CONFIG, 4, [1.0] * 8) == (hybrid.FREE, 8)
    assert hybrid.choose(hybrid.AUTO, MEASURED, CONFIG, 4, [0.1]) == (hybrid.MODEL, 4)
    assert hybrid.choose(hybrid.AUTO, MEASURED, CONFIG, 0, [0.05]) == (hybrid.NONE, 0)  # plain mode, a long shot


def test_the_best_prefix_of_a_model_free_draft_is_sent():
    m, _ = hybrid.free_choice(MEASURED, [1.0, 0.9, 0.8, 0.05, 0.01])
    assert m == 3  # the last two cost a verification row each and expect almost nothing


def test_the_request_decides_who_may_draft():
    assert hybrid.choose(hybrid.NONE, MEASURED, CONFIG, 4, [1.0] * 8) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.MODEL, MEASURED, CONFIG, 4, [1.0] * 8) == (hybrid.MODEL, 4)
    assert hybrid.choose(hybrid.FREE, MEASURED, CONFIG, 4, [1.0, 1.0]) == (hybrid.FREE, 2)
    assert hybrid.choose(hybrid.FREE, MEASURED, CONFIG, 4, []) == (hybrid.NONE, 0)  # no match: nothing to draft


def test_a_named_model_free_drafter_drafts_whenever_it_has_a_match_and_only_auto_prices_it_against_plain():
    """`drafter: ngram` is the user's choice, as llama.cpp's --spec-type ngram: a match is drafted (its
    best prefix of at least one token) even where the cost model would take a plain step; `auto` weighs it."""
    long_shot, exit_s = [0.1, 0.05, 0.01], hybrid.stream_exit_time(replace(MEASURED, stream_s=0.0), UNDRAFTED_RUN)
    assert hybrid.choose(hybrid.AUTO, MEASURED, CONFIG, 0, long_shot) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.FREE, MEASURED, CONFIG, 0, long_shot) == (hybrid.FREE, 1)
    assert hybrid.choose(hybrid.FREE, MEASURED, CONFIG, 0, [1.0, 1.0], exit_s=exit_s) == (hybrid.FREE, 2)


def test_drafts_the_target_keeps_rejecting_lower_the_calibration_until_none_is_sent():
    state = PolicyState(estimates=MEASURED)
    scores = [0.9, 0.8, 0.7, 0.6]
    rounds = 0
    while hybrid.choose(hybrid.AUTO, state.estimates, CONFIG, 0, scores)[0] == hybrid.FREE:
        rejected = RoundObservation(k=4, accepted=0, draft_s=0.0, verify_s=0.046, rtt_s=0.002)
        state = hybrid.observe_free(state, rejected, scores, CONFIG)
        rounds += 1
        assert rounds < 10
    assert state.estimates.free_calibration < 0.3 and rounds >= 2  # not one unlucky round


def test_a_probe_of_the_draft_model_is_not_priced_by_the_acceptance_it_is_to_measure():
    """α learnt on other text (prose before this code) says a new session's catch-up would not pay;
    a probe is how the policy finds out whether it is still so, and one round is its whole cost."""
    stale = replace(MEASURED, alpha=0.2)
    assert hybrid.choose(hybrid.AUTO, stale, CONFIG, 2, [], lag=40, remaining=100) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.AUTO, stale, CONFIG, 2, [], lag=40, remaining=100, probe=True) == (hybrid.MODEL, 2)
    assert hybrid.choose(hybrid.AUTO, stale, CONFIG, 2, [0.9], lag=40, remaining=100, probe=True) == (hybrid.MODEL, 2)



def test_a_probe_runs_only_where_a_draft_that_is_always_right_would_repay_its_catch_up():
    """A probe's cost is the draft's pass over everything it lacks: a 40-token prompt's is repaid by
    100 more tokens of a good draft; a 3000-token document's (about 6 s here) is not, nor a 40-token
    lag with 3 tokens to go. Such a round is priced as any other (here: a plain step)."""
    stale = replace(MEASURED, alpha=0.2)
    assert hybrid.choose(hybrid.AUTO, stale, CONFIG, 1, [], lag=40, remaining=100, probe=True) == (hybrid.MODEL, 1)
    assert hybrid.choose(hybrid.AUTO, stale, CONFIG, 1, [], lag=3000, remaining=100, probe=True) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.AUTO, stale, CONFIG, 1, [], lag=40, remaining=3, probe=True) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.AUTO, stale, CONFIG, 1, [0.9], lag=3000, remaining=100, probe=True) == (hybrid.FREE, 1)
    assert hybrid.choose(hybrid.MODEL, stale, CONFIG, 1, [], lag=3000, remaining=3, probe=True) == (hybrid.MODEL, 1)


def test_a_probe_is_paid_from_the_sessions_probe_credit():
    """A probe over a 40-token lag costs 4.1 plain steps here (a 93 ms catch-up, two 15 ms drafts, two
    4 ms rows, against a 32 ms plain token): it runs on a session's starting credit, not on 2 steps."""
    stale = replace(MEASURED, alpha=0.2)
    assert hybrid.probe_cost(stale, CONFIG, 2, 40) == pytest.approx((0.093 + 0.030 + 0.008) / 0.032)
    assert hybrid.choose(hybrid.AUTO, stale, CONFIG, 2, [], lag=40, remaining=100, probe=True) == (hybrid.MODEL, 2)
    assert hybrid.choose(hybrid.AUTO, stale, CONFIG, 2, [], lag=40, remaining=100, probe=True,
                         probe_credit=2.0) == (hybrid.NONE, 0)


def test_a_useless_draft_costs_a_session_in_plain_mode_its_probe_credit_and_no_more():
    """Plain mode from the prior, a draft that is never right, 400 tokens: every probe's cost (its draft
    call and extra rows, in plain steps) comes out of PROBE_START and PROBE_SHARE a plain round, give or
    take the last probe's (decided on its predicted cost, paid at its measured one)."""
    prior = PolicyState(mode="plain", k=1, estimates=replace(MEASURED, alpha=0.3), plain_rounds_until_probe=1)
    drafter = FakeDrafter(useless, compute_s=0.015, catch_up_s=0.002)  # the catch-up the cost model predicts
    verifier = FakeVerifier(repeating, compute_s=0.03, row_s=0.004)
    services = Services(drafter, verifier, FakeStore(learned=prior))
    records: list[RoundRecord] = []

    async def collect():
        return [e async for e in generate(request(max_tokens=400), "s", services, lambda ids: "", True,
                                          records.append)]

    done = asyncio.run(collect())[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 400, repeating)
    probes = [r for r in records if r.drafter == hybrid.MODEL]
    spent = sum(r.observation.draft_s + r.observation.verify_s - 0.03 for r in probes) / 0.032
    assert 1 <= len(probes) and spent <= PROBE_START + PROBE_SHARE * len(records) + 2


def test_a_long_prompts_catch_up_is_paid_once_not_again_after_each_model_free_round():
    """A 200-token lag, 400 tokens to go, and the model-free drafter taking 3 rounds in 10: the draft
    model catches up once (0.41 s over the request) and then lags only the model-free rounds' own
    tokens, not the prompt again; at α = 0.9 it pays."""
    good = replace(MEASURED, alpha=0.9, free_offer_tokens=3.0, offered_tokens=10.0)
    assert hybrid.choose(hybrid.AUTO, good, CONFIG, 4, [], lag=200, remaining=400) == (hybrid.MODEL, 4)
    often = replace(good, free_offer_tokens=9.0)  # it would take 9 in 10: each model round re-catches up on many
    assert hybrid.model_rate(often, CONFIG, 4, 200, 400) < hybrid.model_rate(good, CONFIG, 4, 200, 400)

def sometimes(share: float):
    """A draft model right at `share` of positions (the repeating target's token there, else a wrong one)."""
    return lambda prefix: repeating(prefix) if len(prefix) * 7 % 10 < share * 10 else useless(prefix)


@pytest.mark.parametrize("sure, share, model_drafts", [(0.3, 0.3, False), (0.95, 1.0, True)], ids=["unsure", "sure"])
def test_a_new_session_reads_the_targets_confidence_before_its_draft_model_catches_up(sure, share, model_drafts):
    """A new session from a deployment's prior at which the draft model would just pay (α 0.7 here). On
    text the target is unsure of (confidence 0.3, its draft right 30 % of the time) the draft model never
    catches up on the prompt or drafts; on text it is sure of, the draft model drafts from its second round."""
    prior = PolicyState(estimates=replace(MEASURED, alpha=0.7))
    drafter = FakeDrafter(sometimes(share), compute_s=0.015, catch_up_s=0.002)
    verifier = FakeVerifier(repeating, compute_s=0.03, row_s=0.004, confidence=lambda prefix: sure)
    services = Services(drafter, verifier, FakeStore(learned=prior))
    records: list[RoundRecord] = []

    async def collect():
        return [e async for e in generate(request(max_tokens=60), "s", services, lambda ids: "", True, records.append)]

    done = asyncio.run(collect())[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 60, repeating)
    assert all(r.observation.confidence == (sure,) * (r.observation.accepted + 1) for r in records)
    drafted = [i for i, r in enumerate(records) if r.drafter == hybrid.MODEL]
    if model_drafts:
        assert drafted[0] == 1
    else:
        assert drafted == [] and drafter.calls == 0


def test_a_model_free_round_ages_alpha_and_its_targets_confidence_speaks_for_the_text():
    """The model-free drafter's rounds judge none of the draft model's drafts, but the text they pass
    through is the same: α ages a round and moves toward the target's confidence there."""
    est = replace(MEASURED, alpha=0.7, accepted_count=1.4, tested_count=2.0)
    obs = RoundObservation(2, 0, 0.0, 0.034, 0.002, confidence=(0.2,))
    after = hybrid.learn_free(est, obs, [0.5, 0.4], CONFIG)
    keep = 1 - 1 / CONFIG.alpha_window
    assert after.alpha == pytest.approx((1.4 * keep + 0.5 * 0.2) / (2.0 * keep + 0.5))
    assert after.judged == est.judged and after.draft_step_s == est.draft_step_s


# A 2-core AVX-512 host's passes (ms by positions, measured with eight sessions at once) and its draft step.
LOADED_PASS = {1: 47, 2: 49, 3: 57, 4: 55, 5: 61, 6: 69, 7: 77, 8: 85, 9: 105, 10: 112, 11: 104, 12: 101,
               13: 104, 14: 117, 15: 131, 16: 138, 17: 155}


def test_under_load_a_probe_is_priced_like_any_round_with_its_catch_up_paid_by_the_whole_batch():
    """Eight sessions at once: the draft's catch-up over 60 tokens is a pass over every session's 60
    (they all probe alike) and stalls all their target passes; no acceptance this draft has shown
    repays that in a 100-token request, so the probe does not run. Alone, the same probe runs."""
    table = tuple((rows - 1, ms / 1e3) for rows, ms in LOADED_PASS.items())
    alone = Estimates(alpha=0.7, draft_step_s=0.017, verify_s=table, rtt_s=0.01, observations=50)
    loaded = replace(alone, batch=8.0)
    assert hybrid.choose(hybrid.AUTO, alone, CONFIG, 1, [], lag=60, remaining=100, probe=True) == (hybrid.MODEL, 1)
    assert hybrid.choose(hybrid.AUTO, loaded, CONFIG, 1, [], lag=60, remaining=100, probe=True) == (hybrid.NONE, 0)
    assert hybrid.catch_up_time(loaded, CONFIG, 60) > 7 * hybrid.catch_up_time(alone, CONFIG, 60)


def test_under_load_a_draft_is_priced_by_the_pass_it_joins_and_the_wait_it_adds_to_the_others():
    """Eight sessions in a pass of 8 positions (85 ms): one more position takes it over a tile step
    (105 ms), which all eight wait for. A one-token model-free draft at 0.9 does not repay that, though
    priced as the line through passes of 16 positions (all eight drafting one) it looked as if it
    would (138 ms for 1.9 tokens each). Alone, the same draft pays."""
    table = tuple((rows - 1, ms / 1e3) for rows, ms in LOADED_PASS.items())
    alone = Estimates(alpha=0.7, draft_step_s=0.017, verify_s=table, rtt_s=0.011, stream_s=0.003, observations=50)
    loaded = replace(alone, batch=8.0)
    assert verify_time(loaded, 1) == pytest.approx(0.105 + 7 * (0.105 - 0.085))
    assert 1.9 / (LOADED_PASS[16] / 1e3 + 0.011) > 1 / cost.plain_time(loaded)  # the old price: it pays
    assert hybrid.choose(hybrid.AUTO, loaded, CONFIG, 0, [0.9]) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.AUTO, alone, CONFIG, 0, [0.9]) == (hybrid.FREE, 1)


def test_under_load_a_caught_up_draft_model_drafts_only_where_a_draft_always_right_could_pay():
    """Eight sessions at once on one host's cores: a caught-up draft model's round at K = 4 takes its
    steps from all eight passes and joins one they all wait for, and at these timings not even a
    draft that is always right beats a plain step. The round takes no
    draft, as the fallback's ceiling would decide only after TIMING_EVIDENCE rounds (on an AVX-512
    host one session of eight drafted its first four rounds so, and every pass they joined ran
    slower for all eight). Alone, the same draft model drafts; asked for by name, it drafts anyway."""
    table = tuple((rows - 1, ms / 1e3) for rows, ms in LOADED_PASS.items())
    alone = Estimates(alpha=0.9, draft_step_s=0.017, verify_s=table, rtt_s=0.011, stream_s=0.003, observations=2)
    loaded, config = replace(alone, batch=8.0), replace(CONFIG, draft_contends=True)
    assert cost.could_pay(alone, config, 1.0) and not cost.could_pay(loaded, config, 1.0)
    assert hybrid.choose(hybrid.AUTO, alone, config, 4, [], lag=2) == (hybrid.MODEL, 4)
    assert hybrid.choose(hybrid.AUTO, loaded, config, 4, [], lag=2) == (hybrid.NONE, 0)
    assert hybrid.choose(hybrid.MODEL, loaded, config, 4, [], lag=2) == (hybrid.MODEL, 4)


def test_where_the_table_is_a_line_the_pass_a_draft_joins_costs_as_if_every_session_drafted_alike():
    line = Estimates(alpha=0.7, draft_step_s=0.017, verify_s=tuple((k, 0.04 + 0.006 * k) for k in range(40)),
                     rtt_s=0.01, observations=50, batch=8.0)
    for k in range(4):
        assert verify_time(line, k) == pytest.approx(cost.pass_time(line, 8 * (k + 1) - 1))


def test_a_draft_that_stops_a_stream_pays_for_the_step_calls_until_it_reopens():
    """Under load a turn streams its plain steps (a 3 ms gap each, where a Step call costs 11 ms);
    drafting stops the stream, and the plain steps after the draft are calls until it reopens. A
    draft that pays as a call does not always pay for that."""
    table = tuple((rows - 1, ms / 1e3) for rows, ms in LOADED_PASS.items())
    loaded = Estimates(alpha=0.7, draft_step_s=0.017, verify_s=table, rtt_s=0.011, stream_s=0.003,
                       observations=50, batch=2.0)
    exit_s = hybrid.stream_exit_time(loaded, UNDRAFTED_RUN)
    assert exit_s == pytest.approx(UNDRAFTED_RUN * 0.008)
    assert hybrid.choose(hybrid.AUTO, loaded, CONFIG, 0, [0.6]) == (hybrid.FREE, 1)
    assert hybrid.choose(hybrid.AUTO, loaded, CONFIG, 0, [0.6], exit_s=exit_s) == (hybrid.NONE, 0)
    assert hybrid.stream_exit_time(replace(loaded, stream_s=None), UNDRAFTED_RUN) == 0.0  # nothing streamed


def test_leaving_a_stream_is_priced_by_the_walls_of_warm_plain_calls_and_streamed_steps():
    """Sixteen sessions, eight a pass: a warm plain Step call took 440 ms, its wait for a pass behind the
    streams included, where a streamed step took 185 ms; the round trips alone (11 against 3 ms) said
    8 ms. The walls are learnt from warm plain rounds only: not a prefill, not a drafting round."""
    state = PolicyState(estimates=Estimates(rtt_s=0.011, stream_s=0.003, observations=5))
    call = RoundObservation(k=0, accepted=0, draft_s=0.0, verify_s=0.118, rtt_s=0.011, batch_size=8, wall_s=0.44)
    for obs in (call, replace(call, streamed=True, wall_s=0.185), replace(call, target_cold=True, wall_s=2.4),
                replace(call, k=2, accepted=1, wall_s=0.39)):
        state = observe(state, obs, CONFIG)
    assert (state.estimates.plain_call_s, state.estimates.plain_streamed_s) == (0.44, 0.185)
    assert hybrid.stream_exit_time(state.estimates, UNDRAFTED_RUN) == pytest.approx(UNDRAFTED_RUN * 0.255)


def test_a_key_whose_last_request_fell_back_probes_and_speculates_on_text_its_draft_knows():
    """The key's prior: plain mode, α low (its last text). This request's draft agrees with the target:
    the probe after the prompt runs, and the request speculates."""
    cheap_draft = replace(MEASURED, alpha=0.2, draft_step_s=0.005)  # α 0.2: the catch-up "would not pay"
    prose = PolicyState(mode="plain", k=2, estimates=cheap_draft, plain_rounds_until_probe=64,
                        probe_interval=64)
    store = FakeStore(learned_by={"alice": prose})
    drafter, verifier = FakeDrafter(target_rule), FakeVerifier(target_rule)
    services = Services(drafter, verifier, store)
    records: list[RoundRecord] = []

    async def collect():
        return [e async for e in generate(request(max_tokens=60), "s", services, lambda ids: "", True,
                                          records.append, "alice")]

    done = asyncio.run(collect())[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 60)
    assert drafter.calls > 0 and len(records) < 40  # it probed, then drafted: far fewer rounds than tokens


# -- the loop ----------------------------------------------------------------------------------------


def test_a_named_draft_model_drafts_from_the_first_round_even_where_the_prior_says_plain():
    """`drafter: model` on a deployment whose last session fell back (its prior: plain mode, a probe
    far off): every round with room drafts; K adapts, and only `auto` may fall back to plain steps."""
    prose = PolicyState(mode="plain", k=2, estimates=replace(MEASURED, alpha=0.2), plain_rounds_until_probe=64,
                        probe_interval=64)
    drafter, verifier = FakeDrafter(useless), FakeVerifier(repeating)
    services = Services(drafter, verifier, FakeStore(learned=prose))
    records: list[RoundRecord] = []

    async def collect():
        return [e async for e in generate(request(hybrid.MODEL, max_tokens=12), "s", services, lambda ids: "",
                                          True, records.append)]

    done = asyncio.run(collect())[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 12, repeating)
    assert [r.drafter for r in records[:-1]] == [hybrid.MODEL] * (len(records) - 1)  # the last round has no room
    assert drafter.calls == len(records) - 1




def test_a_repeating_text_is_drafted_without_the_draft_model_and_the_output_is_the_targets():
    drafter, verifier = FakeDrafter(useless), FakeVerifier(repeating)
    records: list[RoundRecord] = []
    done = run(request(), drafter, verifier, SuffixDrafter(), records=records)
    assert list(done.token_ids) == target_alone(PROMPT, 40, repeating)
    assert done.stats.model_free_accepted >= 30 and done.stats.model_free_drafted >= done.stats.model_free_accepted
    assert verifier.calls < 12  # 40 tokens in long accepted runs
    assert {r.drafter for r in records} >= {hybrid.FREE}


def test_the_policy_learns_which_rounds_had_a_model_free_draft_where_it_is_weighed_against_the_model():
    records: list[RoundRecord] = []
    run(request(), FakeDrafter(useless), FakeVerifier(repeating), SuffixDrafter(), records=records)
    offered = [r.observation.free_offered for r in records]
    assert None not in offered and offered.count(True) > len(offered) / 2  # the prompt repeats
    for who, model_free in ((hybrid.MODEL, SuffixDrafter()), (hybrid.AUTO, None)):
        records.clear()
        run(request(who), FakeDrafter(useless), FakeVerifier(repeating), model_free, records=records)
        assert {r.observation.free_offered for r in records} == {None}


@pytest.mark.parametrize("who", [hybrid.NONE, hybrid.MODEL, hybrid.FREE])
def test_a_request_names_its_drafter(who):
    drafter, verifier = FakeDrafter(target_rule), FakeVerifier(repeating)
    records: list[RoundRecord] = []
    done = run(request(who, max_tokens=24), drafter, verifier, SuffixDrafter(), records=records)
    assert list(done.token_ids) == target_alone(PROMPT, 24, repeating)
    used = {r.drafter for r in records} - {hybrid.NONE}
    assert used <= ({who} - {hybrid.NONE})
    assert (drafter.calls > 0) == (who == hybrid.MODEL)
    assert (done.stats.model_free_drafted > 0) == (who == hybrid.FREE)


def test_a_pinned_k_caps_the_model_free_draft():
    records: list[RoundRecord] = []
    run(request(hybrid.FREE, k=2), FakeDrafter(useless), FakeVerifier(repeating), SuffixDrafter(), records=records)
    assert max(r.k for r in records) == 2


def test_an_owner_drafts_from_its_earlier_outputs_and_no_one_else_does():
    free = SuffixDrafter()
    first = run(request(max_tokens=30), FakeDrafter(useless), FakeVerifier(counting), free, "a", "alice")
    assert list(first.token_ids) == target_alone(PROMPT, 30, counting) and first.stats.model_free_drafted == 0
    again = run(request(max_tokens=30), FakeDrafter(useless), FakeVerifier(counting), free, "b", "alice")
    other = run(request(max_tokens=30), FakeDrafter(useless), FakeVerifier(counting), free, "c", "bob")
    assert again.token_ids == other.token_ids == first.token_ids
    assert again.stats.model_free_accepted >= 20  # alice's first output, drafted for alice
    assert other.stats.model_free_drafted == 0  # never for bob


def test_without_a_model_free_drafter_the_loop_is_as_it_was():
    drafter, verifier = FakeDrafter(target_rule), FakeVerifier(target_rule)
    done = run(request(k=4), drafter, verifier, None)
    assert list(done.token_ids) == target_alone(PROMPT, 40) and done.stats.model_free_drafted == 0



def test_with_no_draft_model_the_tokens_at_hand_still_draft():
    verifier = FakeVerifier(repeating)
    records: list[RoundRecord] = []
    services = Services(None, verifier, FakeStore(), model_free=SuffixDrafter())

    async def collect(request):
        return [e async for e in generate(request, "s", services, lambda ids: "", True, records.append, "alice")]

    done = asyncio.run(collect(request()))[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 40, repeating) and done.stats.model_free_accepted >= 30
    assert {r.drafter for r in records} <= {hybrid.FREE, hybrid.NONE} and done.stats.draft_compute_s == 0
    pinned = asyncio.run(collect(request(hybrid.FREE, k=2)))[-1]  # a pinned K caps the model-free draft
    assert list(pinned.token_ids) == target_alone(PROMPT, 40, repeating) and max(r.k for r in records[-pinned.stats.rounds:]) == 2
    plain = asyncio.run(collect(request(hybrid.MODEL, k=3)))[-1]  # no draft model to ask: plain steps
    assert plain.stats.drafted == 0 and list(plain.token_ids) == target_alone(PROMPT, 40, repeating)
