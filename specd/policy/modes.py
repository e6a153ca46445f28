"""The mode and K machine: speculative rounds at the best K, plain rounds with probes after a
fallback, calibration of a fresh state, and a new session's start from the deployment's prior.
Rationale: docs/policy.md."""

from __future__ import annotations

import math
from specd.evolve import evolve

from specd.policy.base import (CALIBRATION_ROUNDS, PLAIN, PROBE_SHARE, SPECULATIVE, Estimates, PolicyConfig, PolicyState,
                               RoundObservation)
from specd.policy.cost import (batch_sessions, best_k, best_speedup_at, could_pay, derived, explore_k, is_measured,
                               plain_time, should_fall_back, verify_time)
from specd.policy.learning import PRIOR_DRAFTS, alpha_after, learn

SESSION_PROBE_AFTER = 1  # plain rounds (the prompt's prefill) before a new plain-mode session probes
PROBE_RECHECK = 4  # plain rounds between checks of a due probe that no outcome could make decisive
# Under load, as many: there every plain session's every check takes the cores from the target's passes,
# and a probe is priced as any round, so the check rarely lets one through (benchmarks.loop_cpu).
LOADED_RECHECK = 16


def inherit(prior: PolicyState) -> PolicyState:
    """A new session's start from what the deployment learned last (the store keeps the latest
    finished session's policy). Timings are properties of the deployment and carry over as they
    are; acceptance depends on the text, so it comes back as a light prior (at most PRIOR_DRAFTS worth),
    and the share of rounds the model-free drafter would take does not come back (on prose it takes
    them all, and a chat request after it would then never catch its draft model up).
    A deployment whose draft did not pay starts new sessions in plain mode with one probe right
    after the prompt: acceptance depends on the text (code after prose, or a verdict taken while
    the cores were busy), and one round is all it costs a useless draft per request. After that
    probe the session follows the schedule the deployment had reached."""
    est = prior.estimates
    weight = min(est.tested_count, PRIOR_DRAFTS) or PRIOR_DRAFTS
    est = evolve(est, accepted_count=est.alpha * weight, tested_count=weight, judged=0, free_offer_tokens=0.0,
                  offered_tokens=0.0)
    return PolicyState(
        mode=prior.mode,
        k=prior.k,
        estimates=est,
        plain_rounds_until_probe=SESSION_PROBE_AFTER if prior.mode == PLAIN else 0,
        probe_interval=prior.probe_interval,
    )


def joined_at_load(state: PolicyState, sessions: int, config: PolicyConfig) -> PolicyState:
    """A turn that starts while `sessions` share the target's passes (what a pass reported a moment
    ago): its rounds are priced at that batch from the first, and where not even a draft that is
    always right could pay there (`could_pay`: the fallback's ceiling) it starts in plain mode, its
    steps one stream from the prompt on, where it would otherwise learn the load over TIMING_EVIDENCE
    rounds of Step calls, each waiting for a pass behind the streams (a new key's session starts from
    start-up calibration, priced alone). Its probes follow the deployment's schedule."""
    if sessions <= 1:
        return state
    est = evolve(state.estimates, batch=max(state.estimates.batch, float(sessions)))
    state = evolve(state, estimates=est)
    if state.mode == PLAIN or not is_measured(est) or could_pay(est, config, config.on_above):
        return state
    return evolve(state, mode=PLAIN, plain_rounds_until_probe=state.probe_interval, mode_rounds=0)


def next_k(state: PolicyState, config: PolicyConfig) -> int:
    """K for the coming round; 0 = a plain step. Plain rounds: the calibration of a fresh
    state (docs/policy.md) and plain mode between probes. A session's first drafting round drafts
    at most the default K: the deployment's K was learned on another text, and one round of this
    text's own acceptance decides the next K."""
    if _calibrating(state):
        return 0
    if state.mode == PLAIN:
        return decisive_probe_k(state.estimates, config) if state.plain_rounds_until_probe <= 0 else 0
    if not config.adaptive:
        return config.start_k
    k = min(max(state.k, 1), config.max_k)
    return min(k, config.start_k) if state.estimates.judged == 0 else k


def decisive_probe_k(est: Estimates, config: PolicyConfig) -> int:
    """K of plain mode's probe: the smallest K from probe_k whose drafts, all accepted, would switch
    speculation on (`_after_probe`), at these timings; 0 where none would. A probe no outcome of
    which could change the mode costs the draft's catch-up and its drafts for nothing: so right
    after a verdict that the draft is useless (its evidence decays over plain rounds, and a smaller
    probe becomes decisive), and where not even a perfect draft could pay (a batch under load)."""
    return derived(est, ("probe_k", config), lambda: _decisive_probe_k(est, config))


def _decisive_probe_k(est: Estimates, config: PolicyConfig) -> int:
    low = min(config.probe_k, config.max_k)
    if not is_measured(est):
        return low

    def decisive(k: int) -> bool:  # α after K of K accepted grows with K: a bisection finds the least
        return best_speedup_at(est, config, alpha_after(est, k, k, config.alpha_window)) > config.on_above

    if not decisive(config.max_k):
        return 0
    high = config.max_k
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if decisive(mid) else (mid + 1, high)
    return low


def observe(state: PolicyState, obs: RoundObservation, config: PolicyConfig) -> PolicyState:
    """Learn from one round, then decide K and the mode for the next."""
    draft_cold = obs.draft_cold or not state.drafted_last_round
    target_cold = obs.target_cold or state.estimates.observations == 0
    est = learn(state.estimates, obs, config, draft_cold, target_cold)
    state = evolve(state, estimates=est, drafted_last_round=obs.k > 0)
    if state.mode == SPECULATIVE:
        return _after_speculative_round(state, config)
    if obs.k > 0:
        return _after_probe(evolve(state, probe_credit=state.probe_credit - probe_spent(state.estimates, obs)), config)
    return evolve(state, plain_rounds_until_probe=counted_down(state, config), mode_rounds=state.mode_rounds + 1,
                   probe_credit=state.probe_credit + PROBE_SHARE)


def counted_down(state: PolicyState, config: PolicyConfig) -> int:
    """Plain rounds left before the probe after a plain round: one fewer, or PROBE_RECHECK where the
    probe is due but none would be decisive (`decisive_probe_k`: the text or the load says no draft
    pays), or where it was due under load and the round went without it (hybrid.choose prices a
    probe there as any round), so that check, a sweep of the cost model, runs every few rounds rather
    than every one (under load, every plain session's every round: 0.4 ms of a 2-core host's Python a
    round); under load every LOADED_RECHECK rounds."""
    loaded = batch_sessions(state.estimates) > 1
    recheck = LOADED_RECHECK if loaded else PROBE_RECHECK
    if state.plain_rounds_until_probe <= 0 and loaded:
        return recheck
    countdown = max(0, state.plain_rounds_until_probe - 1)
    return recheck if countdown == 0 and decisive_probe_k(state.estimates, config) == 0 else countdown


def probe_spent(est: Estimates, obs: RoundObservation) -> float:
    """What a probe cost beyond a plain step, in plain steps: its draft call (the catch-up with it)
    and its extra verification rows."""
    plain = verify_time(est, 0)
    if plain is None:
        return 0.0
    return (obs.draft_s + max(0.0, obs.verify_s - plain)) / plain_time(est)


def _after_speculative_round(state: PolicyState, config: PolicyConfig) -> PolicyState:
    if should_fall_back(state.estimates, config):
        interval = _interval_after_fallback(state, config)
        return evolve(
            state,
            mode=PLAIN,
            fallbacks=state.fallbacks + 1,
            probe_interval=interval,
            plain_rounds_until_probe=interval,
            mode_rounds=0,
            probe_credit=min(state.probe_credit, 0.0),  # a verdict on this text: the next probe is earned
        )
    k = explore_k(state.estimates, config, *best_k(state.estimates, config))
    return evolve(state, k=k, mode_rounds=state.mode_rounds + 1)


def _after_probe(state: PolicyState, config: PolicyConfig) -> PolicyState:
    k, speedup = best_k(state.estimates, config)
    if math.isnan(speedup) or speedup > config.on_above:
        return evolve(state, mode=SPECULATIVE, k=k, mode_rounds=0)
    interval = min(2 * state.probe_interval, config.probe_max)
    return evolve(state, probe_interval=interval, plain_rounds_until_probe=interval, mode_rounds=0)


def _interval_after_fallback(state: PolicyState, config: PolicyConfig) -> int:
    """Back to probe_every when speculation had paid for at least as long as the last plain
    wait (the draft got worse: news worth re-checking soon); otherwise the re-entry was a
    false start and counts as a failed probe."""
    paid_for_a_while = state.fallbacks == 0 or state.mode_rounds >= state.probe_interval
    return config.probe_every if paid_for_a_while else min(2 * state.probe_interval, config.probe_max)


def _calibrating(state: PolicyState) -> bool:
    est = state.estimates
    plain_measured = any(k == 0 for k, _ in est.verify_s)
    return state.mode == SPECULATIVE and not plain_measured and est.observations < CALIBRATION_ROUNDS
