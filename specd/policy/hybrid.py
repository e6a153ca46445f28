"""Which drafter a round uses: the model-free draft at hand, the draft model at the policy's K, or
none, by the tokens per second each is predicted to commit (docs/policy.md).

Rates, with T(0) the plain token (cost.plain_time: a Step call, or a step of a streamed plain stretch):
- none: 1 / T(0)
- the draft model at K: S(K) / T(0) (S from specd/policy/cost.py)
- a model-free draft's first m tokens: (1 + E_m) / (verify(m) + rtt), one RPC (it costs no draft
  call), E_m = Σ_{i<m} min(1, c · score_i): a token's score is the drafter's estimate that it and
  every token before it are accepted, and c corrects it by what this deployment's target has
  accepted of such drafts (decayed counts, as α's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from specd.evolve import evolve

from specd.policy.base import (PLAIN, PROBE_SHARE, PROBE_START, Estimates, PolicyConfig, PolicyState, RoundObservation,
                               decayed)
from specd.policy.cost import (batch_sessions, could_pay, derived, expected_tokens, grown, is_measured, plain_time,
                               round_time, verify_time)
from specd.policy.learning import learn_offer, learn_pass, learn_text
from specd.policy.modes import counted_down

AUTO, MODEL, FREE, NONE = "auto", "model", "ngram", "none"
DRAFTERS = (AUTO, MODEL, FREE, NONE)
UNMEASURED_MIN_EXPECTED = 1.0  # before timings exist, a model-free draft is used when it expects a token
CAUGHT_UP = 2  # committed tokens a draft lacks at a normal round: the last round's accepted tail and its new token
# A catch-up is priced at this many times its time: it is paid before the tokens that repay it, which α and P
# only predict (replayed figures: docs/policy.md).
CATCH_UP_RISK = 1.75


def free_expected(est: Estimates, scores: Sequence[float], m: int) -> float:
    """E_m: the accepted tokens a model-free draft's first m tokens are expected to bring."""
    c = est.free_calibration
    return sum(min(1.0, c * s) for s in scores[:m])


def free_choice(est: Estimates, scores: Sequence[float], exit_s: float = 0.0, named: bool = False) -> tuple[int, float]:
    """(m, tokens/s) of the best prefix of a model-free draft (m = 0: none of it pays); `exit_s`: what
    leaving a stream of plain steps adds to a drafting round (`stream_exit_time`). A `named` drafter
    (the request asked for it) sends at least one token of a match: only `auto` weighs it against plain."""
    scores = tuple(scores)  # a round weighs its draft twice: for its choice and for P (free_offered)
    return derived(est, ("free", scores, exit_s, named), lambda: _free_choice(est, scores, exit_s, named))


def _free_choice(est: Estimates, scores: tuple[float, ...], exit_s: float, named: bool) -> tuple[int, float]:
    if not scores or not is_measured(est):
        pays = named or free_expected(est, scores, len(scores)) >= UNMEASURED_MIN_EXPECTED
        return (len(scores) if pays else 0), math.nan
    rates = [] if named else [(0, 1 / plain_time(est))]
    rates += [(m, (1 + free_expected(est, scores, m)) / (verify_time(est, m) + est.rtt_s + exit_s))
              for m in range(1, len(scores) + 1)]
    return max(rates, key=lambda mr: (mr[1], -mr[0]))


def stream_exit_time(est: Estimates, calls: int) -> float:
    """What a drafting round adds when it stops a stream of plain steps: the `calls` plain steps after
    it are Step calls until a stream reopens, each a warm plain call's wall where a streamed step took
    its own (under load a call waits for a pass behind the streams). Before both were timed, each call's
    round trip where a streamed step costs only the stream's gap."""
    if est.plain_call_s is not None and est.plain_streamed_s is not None:
        return calls * max(0.0, est.plain_call_s - est.plain_streamed_s)
    return 0.0 if est.stream_s is None else calls * max(0.0, est.rtt_s - est.stream_s)


def choose(drafter: str, est: Estimates, config: PolicyConfig, k: int, scores: Sequence[float],
           lag: int = 0, remaining: int = 1, probe: bool = False, exit_s: float = 0.0,
           probe_credit: float = PROBE_START) -> tuple[str, int]:
    """(the round's drafter, its draft length) from the request's `drafter`, the policy's K for the
    draft model (0: plain step or no draft model), a model-free draft's scores, and for `auto` the
    committed tokens the draft model lacks (`lag`) and the tokens the request may still make.
    `exit_s`: what a drafting round adds by stopping the stream of plain steps the turn is in.
    A `probe` (plain mode's test of the draft model) of a session alone goes to the draft model where
    the session's `probe_credit` (plain steps) covers its cost and a draft that is always right would
    repay its catch-up (`probe_repays`): it is there to measure α on this text, and pricing it by the
    α it is to measure would keep it from ever running. Otherwise, and under load (its catch-up stalls
    every session of the pass), it is priced like any round; and under load the draft model drafts only
    where a draft that is always right could beat a plain step (`cost.could_pay`), not for the rounds
    the fallback's verdict waits for."""
    if drafter == NONE:
        return NONE, 0
    probing = probe and drafter == AUTO and k > 0 and batch_sessions(est) == 1
    if drafter == MODEL or (probing and probe_cost(est, config, k, lag) <= probe_credit
                            and probe_repays(est, config, lag, remaining)):
        return (MODEL, k) if k > 0 else (NONE, 0)
    m, free_rate = free_choice(est, scores, exit_s, named=drafter == FREE)
    if drafter == FREE:
        return (FREE, m) if m > 0 else (NONE, 0)
    rate = model_rate(est, config, k, lag, remaining, exit_s) if k > 0 and is_measured(est) else math.nan
    if lag > CAUGHT_UP and not math.isnan(rate) and rate < 1 / plain_time(est):
        k = 0  # the draft model's catch-up does not pay back in what is left of this request
    if k > 0 and batch_sessions(est) > 1 and not could_pay(est, config, 1.0):
        k = 0  # under load not even a draft always right would beat a plain step: the fallback's ceiling, each round
    if m == 0:  # auto, and no model-free draft pays
        return (MODEL, k) if k > 0 else (NONE, 0)
    if k == 0 or math.isnan(free_rate):  # it pays against a plain step; nothing measured to weigh
        return FREE, m
    return (FREE, m) if free_rate >= rate else (MODEL, k)


def probe_cost(est: Estimates, config: PolicyConfig, k: int, lag: int) -> float:
    """A probe of K drafts beyond a plain step, in plain steps: the draft's catch-up over `lag` tokens,
    its K steps and the K extra verification rows (0 before the timings are measured)."""
    if not is_measured(est):
        return 0.0
    catch_up = catch_up_time(est, config, lag) if lag > CAUGHT_UP else 0.0
    return (catch_up + round_time(est, config, k) - 2 * est.rtt_s - verify_time(est, 0)) / plain_time(est)


def probe_repays(est: Estimates, config: PolicyConfig, lag: int, remaining: int) -> bool:
    """Would a draft model that is always right, at its best K, beat plain decoding by `on_above` with
    its catch-up over `lag` tokens paid out of the `remaining` ones? If not, no α the probe could
    find would pay for it (a long prompt, or a request near its end)."""
    if lag <= CAUGHT_UP:
        return True
    ks = range(1, max(1, min(config.max_k, remaining - 1)) + 1)  # a round commits at most what is left
    return could_pay(est, config, config.on_above, ks, lambda k: catch_up_share(est, config, k + 1, lag, remaining))


def free_offered(est: Estimates, config: PolicyConfig, scores: Sequence[float], k: int) -> bool:
    """Would the model-free drafter take this round from a draft model at K that had caught up?"""
    m, free_rate = free_choice(est, scores)
    if m == 0 or k == 0 or math.isnan(free_rate):
        return m > 0
    return free_rate >= model_rate(est, config, k, 0, 1)


def model_rate(est: Estimates, config: PolicyConfig, k: int, lag: int, remaining: int, exit_s: float = 0.0,
               alpha: float | None = None) -> float:
    """Tokens a second of the draft model at K, its catch-up included: a draft that lacks more than
    the round's own tokens (a new prompt, rounds another drafter took) first runs a pass over them,
    paid once and shared by the rounds it then serves, E(α, K) tokens each: the 1 - P of what is
    left of the request that the model-free drafter would not take (P: the share of the tokens
    committed in rounds it would take from a caught-up draft model). After a round it takes, the
    draft model lags only that round's tokens, a catch-up priced when it comes. `exit_s`: as
    `choose`'s; `alpha`: in place of the learnt α (the timings stay the estimates' own, derived once)."""
    tokens = expected_tokens(est.alpha if alpha is None else alpha, k)
    return tokens / (round_time(est, config, k) + catch_up_share(est, config, tokens, lag, remaining) + exit_s)


def catch_up_share(est: Estimates, config: PolicyConfig, tokens: float, lag: int, remaining: int) -> float:
    """A round's share of the draft's catch-up over `lag` tokens (none for a normal round's lag): the
    round's `tokens` of the draft model's part of what is left of the request (`model_rate`), the
    catch-up priced at CATCH_UP_RISK times its time."""
    if lag <= CAUGHT_UP:
        return 0.0
    served = max(remaining * (1.0 - est.free_offer_rate), 1.0)
    return CATCH_UP_RISK * catch_up_time(est, config, lag) * min(1.0, tokens / served)


def catch_up_time(est: Estimates, config: PolicyConfig, lag: int) -> float:
    """The draft's pass over `lag` tokens, priced as the pass it joins (cost.verify_time's rule):
    B sessions that each catch up as much, B·lag positions at the rate a cold draft call showed a
    token (`Estimates.catch_up_s`). Before one was timed, its one-position step grown to B·lag
    positions as the target's pass grows; where the draft contends for the target's compute, at
    least its own pass held by all B (cost.round_time)."""
    batch = batch_sessions(est)
    if est.catch_up_s is not None:  # timed: a prefill costs about its tokens, however the passes hold them
        return est.catch_up_s * batch * lag
    alike = grown(est, est.draft_step_s, 1, batch * lag)
    return max(alike, batch * grown(est, est.draft_step_s, 1, lag)) if config.draft_contends else alike


def learn_free(est: Estimates, obs: RoundObservation, scores: Sequence[float], config: PolicyConfig) -> Estimates:
    """A model-free round teaches the calibration c and the target's verify time at its K; of the draft
    model, only what any round says of the text (`learning.learn_text`), not its step."""
    accepted = decayed(est.free_accepted, obs.accepted, config.alpha_window)
    expected = decayed(est.free_expected, sum(scores[: obs.k]), config.alpha_window)
    est = learn_offer(learn_pass(est, obs, config.smoothing, obs.target_cold), obs, config.alpha_window)
    est = learn_text(est, obs, config.alpha_window)
    return evolve(est, free_accepted=accepted, free_expected=expected)


def observe_free(state: PolicyState, obs: RoundObservation, scores: Sequence[float], config: PolicyConfig) -> PolicyState:
    """After a model-free round: its lessons (`learn_free`); plain mode's wait for a probe of the
    draft model goes on, and that model's next draft is cold (it has the round's tokens to catch up on)."""
    plain = state.mode == PLAIN
    state = evolve(state, estimates=learn_free(state.estimates, obs, scores, config), drafted_last_round=False)
    countdown = counted_down(state, config) if plain else state.plain_rounds_until_probe
    return evolve(state, plain_rounds_until_probe=countdown, probe_credit=state.probe_credit + PROBE_SHARE * plain)
