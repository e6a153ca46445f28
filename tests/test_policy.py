"""The speculation policy: the cost model by hand, then simulated sessions with the CPU timings
of the real pair (draft 0.1 s/token, verify(K) = 0.4·(1 + 0.1·K) s, rtt 1 ms) and a draft whose
acceptance is drawn from a seeded geometric model.

Over 350 lines: the cost model and the mode machine, case by case."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.policy import (
    PLAIN,
    MIN_JUDGED,
    SPECULATIVE,
    Estimates,
    PolicyConfig,
    PolicyState,
    RoundObservation,
    best_k,
    expected_tokens,
    explore_k,
    hybrid,
    inherit,
    next_k,
    observe,
    predicted_speedup,
    should_fall_back,
    sure_k,
    verify_time,
)
from specd.policy.cost import HOPELESS_JUDGED, batch_sessions, pass_time, plain_time
from specd.policy.learning import learn
from specd.policy.base import PROBE_SHARE
from specd.policy import modes
from specd.policy.modes import decisive_probe_k

CONFIG = PolicyConfig()
DRAFT_STEP, PLAIN_STEP, RTT = 0.1, 0.4, 0.001


def cpu_round(k: int, accepted: int) -> RoundObservation:
    return RoundObservation(k, accepted, DRAFT_STEP * k, PLAIN_STEP * (1 + 0.1 * k), RTT)


def measured(alpha: float) -> Estimates:
    """Estimates as after a few rounds at the realistic timings."""
    return Estimates(alpha=alpha, draft_step_s=DRAFT_STEP, verify_s=((0, 0.4), (4, 0.56)), rtt_s=RTT)


def draw_accepted(rng: random.Random, alpha: float, k: int) -> int:
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted


@dataclasses.dataclass
class Run:
    ks: list[int]  # K of each round
    modes: list[str]  # mode after each round
    state: PolicyState

    @property
    def switches(self) -> int:
        return sum(a != b for a, b in zip([SPECULATIVE] + self.modes, self.modes))

    def probes(self, start: int = 0) -> int:
        """Drafting rounds taken in plain mode."""
        before = [SPECULATIVE] + self.modes
        return sum(k > 0 and before[i] == PLAIN for i, k in enumerate(self.ks) if i >= start)


def simulate(alpha, rounds: int, seed: int = 0, config: PolicyConfig = CONFIG, state=None) -> Run:
    """alpha: a number, or a function of the round index."""
    alpha_at = alpha if callable(alpha) else (lambda i: alpha)
    rng, state = random.Random(seed), state or PolicyState()
    ks, modes = [], []
    for i in range(rounds):
        k = next_k(state, config)
        state = observe(state, cpu_round(k, draw_accepted(rng, alpha_at(i), k)), config)
        ks.append(k)
        modes.append(state.mode)
    return Run(ks, modes, state)


# --- the cost model ---------------------------------------------------------------------


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0  # only the recovered token
    assert expected_tokens(1.0, 4) == 5.0  # all K plus the bonus token
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.83, 4) == pytest.approx((1 - 0.83**5) / 0.17)


def test_verify_time_exact_then_linear_fit():
    est = Estimates(verify_s=((0, 0.4), (4, 0.56)))
    assert verify_time(est, 4) == 0.56
    assert verify_time(est, 2) == pytest.approx(0.48)
    assert verify_time(est, 8) == pytest.approx(0.72)
    assert verify_time(Estimates(), 3) is None


def test_verify_time_with_one_point_uses_the_prior_slope():
    est = Estimates(verify_s=((4, 0.6),))
    # verify(K) = verify(0)·(1 + 0.25·K) through the point: verify(0) = 0.6 / 2
    assert verify_time(est, 0) == pytest.approx(0.3)
    assert verify_time(est, 2) == pytest.approx(0.45)


def test_verify_time_never_falls_with_positions_nor_goes_below_a_batched_pass():
    noisy = Estimates(verify_s=((2, 0.5), (4, 0.45)))  # timing noise: more positions looked cheaper
    assert verify_time(noisy, 4) == pytest.approx(0.5)  # measured, but not below a pass of fewer positions
    assert verify_time(noisy, 8) == pytest.approx(0.5)  # the fit is flat (0.475), not extrapolated downwards
    steep = Estimates(verify_s=((1, 0.1), (3, 1.0)))  # the line would give a negative verify(0)
    assert verify_time(steep, 0) == pytest.approx(1.0 / 4)  # 4 positions cost at most 4 single steps


def test_a_noisy_pass_table_reads_as_no_cheaper_with_more_positions():
    """Tables learnt under load, every measured pass jittered: priced at any number of positions, a
    pass costs no less than any measured pass of fewer, and a measurement above every such pass is
    read as is."""
    rng = random.Random(7)
    for _ in range(50):
        table = tuple(sorted({rng.randrange(40): 0.04 + 0.006 * k + rng.uniform(-0.02, 0.02) for k in range(25)}.items()))
        est = Estimates(verify_s=table)
        for k in range(45):
            assert pass_time(est, k) >= max((t for km, t in table if km < k), default=0.0)
        for k, t in table:
            if all(t >= u for km, u in table if km < k):
                assert pass_time(est, k) == t


def test_predicted_speedup_by_hand():
    est = measured(0.8)
    tokens = 1 + 0.8 + 0.64  # E(0.8, 2)
    round_s = 2 * 0.1 + 0.48 + 2 * 0.001  # two draft steps, verify(2) from the fit, two RPCs
    plain_s = 0.4 + 0.001
    assert predicted_speedup(est, CONFIG, 2) == pytest.approx(tokens / round_s * plain_s)
    assert predicted_speedup(est, CONFIG, 2) == pytest.approx(1.4346, abs=1e-4)


def test_best_k_grows_with_alpha():
    chosen = {alpha: best_k(measured(alpha), CONFIG)[0] for alpha in (0.5, 0.7, 0.83, 0.95)}
    assert chosen == {0.5: 1, 0.7: 2, 0.83: 3, 0.95: 7}
    assert best_k(measured(0.95), PolicyConfig(max_k=5))[0] == 5  # within the request's bound


def test_fallback_predicate():
    assert should_fall_back(replace(measured(0.0), judged=HOPELESS_JUDGED), CONFIG)  # S(1) = 0.74
    assert not should_fall_back(replace(measured(0.0), judged=HOPELESS_JUDGED - 1), CONFIG)  # too few judged
    assert not should_fall_back(measured(0.35), CONFIG)  # about break-even: S(1) = 1.00
    assert not should_fall_back(measured(0.95), CONFIG)
    nothing_timed = Estimates(alpha=0.0)
    assert not should_fall_back(nothing_timed, CONFIG)  # a prior alone never switches speculation off
    assert best_k(nothing_timed, CONFIG)[0] == 4 and math.isnan(best_k(nothing_timed, CONFIG)[1])


# --- calibration and cold rounds --------------------------------------------------------


def test_a_fresh_state_calibrates_with_plain_steps_then_speculates_with_default_k():
    config = PolicyConfig(default_k=3)
    state = PolicyState()
    assert next_k(state, config) == 0  # round 1: the target prefills the prompt, its time says nothing
    state = observe(state, RoundObservation(0, 0, 0.0, 2.5, RTT), config)
    assert verify_time(state.estimates, 0) is None
    assert next_k(state, config) == 0  # round 2 measures the plain step
    state = observe(state, cpu_round(0, 0), config)
    assert verify_time(state.estimates, 0) == pytest.approx(0.4)
    assert next_k(state, config) == 3


def test_a_drafting_round_after_a_plain_one_does_not_time_the_draft():
    state = simulate(0.9, 2).state  # calibrated
    state = observe(state, RoundObservation(4, 4, 3.0, 0.56, RTT), CONFIG)  # the draft caught up on the prompt
    assert state.estimates.draft_step_s is None
    assert state.estimates.alpha > 0.9  # acceptance still counts
    state = observe(state, cpu_round(state.k, 2), CONFIG)
    assert state.estimates.draft_step_s == pytest.approx(DRAFT_STEP)


def test_rounds_marked_cold_teach_acceptance_only():
    state = simulate(0.9, 6).state
    before = state.estimates
    cold = RoundObservation(state.k, 0, 9.0, 9.0, RTT, draft_cold=True, target_cold=True)
    after = observe(state, cold, CONFIG).estimates
    assert (after.draft_step_s, after.verify_s) == (before.draft_step_s, before.verify_s)
    assert after.alpha < before.alpha


def test_a_pass_shared_with_other_sessions_is_timed_only_while_nothing_else_is_measured():
    fresh = PolicyState()
    shared = lambda k, seconds: RoundObservation(k, k, DRAFT_STEP * k, seconds, RTT, target_shared=True)  # noqa: E731
    calibrating = observe(observe(fresh, shared(0, 1.0), CONFIG), shared(0, 2.0), CONFIG)
    assert dict(calibrating.estimates.verify_s) == {0: 2.0}  # under load from the start: all there is
    state = simulate(0.6, 8).state
    before = state.estimates
    after = observe(state, shared(state.k, 5.0), CONFIG).estimates  # eight sessions' rows in one pass
    assert after.verify_s == before.verify_s and after.alpha > before.alpha and after.observations == before.observations + 1
    assert not should_fall_back(after, CONFIG)


# Timings of the AVX2 host: a pass of R positions costs 43 ms + 13 ms per further position, a
# draft step 14 ms alone and 5 ms more per further session; eight sessions share the passes when they run at once.
def avx2_pass(rows: int) -> float:
    return 0.043 + 0.013 * (rows - 1)


def batched_round(k: int, accepted: int, sessions: int, active: int | None = None) -> RoundObservation:
    """A round in a pass with `sessions` sessions that each draft k (the target reports the rows it fed
    and the sessions its passes serve: `active`, else those in this one)."""
    rows = sessions * (k + 1)
    draft_s = k * (0.014 + 0.005 * (sessions - 1))
    return RoundObservation(k, accepted, draft_s, avx2_pass(rows), RTT, target_shared=sessions > 1,
                            batch_size=sessions, pass_rows=rows, active_sessions=active or sessions)


def simulate_batched(alpha: float, sessions, rounds: int, state: PolicyState, seed: int = 0,
                     active: int | None = None, config: PolicyConfig = CONFIG, round_of=batched_round) -> Run:
    """`sessions`: the pass's sessions at each round index; `active`: the sessions the passes serve;
    `round_of(k, accepted, sessions, active)`: what a round shows (every session drafting alike by default)."""
    rng, ks, modes = random.Random(seed), [], []
    for i in range(rounds):
        k = next_k(state, config)
        state = observe(state, round_of(k, draw_accepted(rng, alpha, k), sessions(i), active), config)
        ks.append(k)
        modes.append(state.mode)
    return Run(ks, modes, state)


def test_a_round_is_priced_by_the_pass_it_joins():
    """Alone a good draft pays; with eight sessions in every pass the same draft's rows cost all of
    them (8·(K+1) positions against 8 for plain steps), and the policy falls back; when the load is
    gone, a probe takes speculation back."""
    start = PolicyState(estimates=Estimates(draft_step_s=0.014, verify_s=tuple((k, avx2_pass(k + 1)) for k in range(17)),
                                            rtt_s=RTT))
    alone = simulate_batched(0.8, lambda i: 1, 60, start)
    assert alone.state.mode == SPECULATIVE and alone.state.fallbacks == 0 and min(alone.ks[-20:]) >= 1

    loaded = simulate_batched(0.8, lambda i: 8, 60, start)
    assert loaded.state.mode == PLAIN and loaded.state.fallbacks >= 1
    # Off on the timings' verdict, and never probed again: not even a perfect draft would pay.
    assert loaded.probes() == 0 and sum(k > 0 for k in loaded.ks) <= MIN_JUDGED + 1
    assert dict(loaded.state.estimates.verify_s)[7] == pytest.approx(avx2_pass(8))  # plain steps of eight: rows 8
    assert round(loaded.state.estimates.batch) == 8
    assert verify_time(loaded.state.estimates, 0) == pytest.approx(avx2_pass(8))
    assert verify_time(loaded.state.estimates, 4) == pytest.approx(avx2_pass(40), rel=0.05)

    relieved = simulate_batched(0.8, lambda i: 1, 200, loaded.state)
    assert relieved.state.mode == SPECULATIVE and round(relieved.state.estimates.batch) == 1


def test_a_round_in_a_pass_of_its_own_is_priced_by_the_sessions_that_pass_holds_up():
    """A drafting session whose verifications take passes of their own (batch_size 1) while seven
    others stream plain steps: each of its passes holds up all eight (the target reports them), so it
    is priced as the batch and falls back as a session in their passes would, where the sessions in
    its pass alone (the signal before) let it speculate for the whole request."""
    start = PolicyState(estimates=Estimates(draft_step_s=0.014, verify_s=tuple((k, avx2_pass(k + 1)) for k in range(17)),
                                            rtt_s=RTT))
    assert simulate_batched(0.8, lambda i: 1, 60, start).state.mode == SPECULATIVE
    held_up = simulate_batched(0.8, lambda i: 1, 60, start, active=8).state
    assert held_up.mode == PLAIN and round(held_up.estimates.batch) == 8


def test_a_draft_that_shares_the_targets_compute_is_priced_by_the_sessions_its_steps_hold_up():
    """One session drafting beside seven streaming plain steps (each of its passes 8 + K rows), a draft
    that is always right: where the draft has compute of its own, its K steps delay only its session
    and speculation pays; where it runs on the target's cores (`draft_contends`), every step is taken
    from the seven's passes too, and the same rounds fall back (seen on a 2-core host: one such session
    drafting for 14 s of an 8-session phase, the phase 0.82x plain)."""
    def joined(k: int, accepted: int, sessions: int, active: int | None) -> RoundObservation:
        return RoundObservation(k, accepted, 0.014 * k, avx2_pass(sessions + k), RTT, target_shared=True,
                                batch_size=sessions, pass_rows=sessions + k, active_sessions=sessions)

    start = PolicyState(estimates=Estimates(draft_step_s=0.014, verify_s=tuple((k, avx2_pass(k + 1)) for k in range(17)),
                                            rtt_s=RTT))
    for config, mode in ((CONFIG, SPECULATIVE), (replace(CONFIG, draft_contends=True), PLAIN)):
        run = simulate_batched(1.0, lambda i: 8, 40, start, config=config, round_of=joined)
        assert run.state.mode == mode and round(run.state.estimates.batch) == 8, config


# One pass of a session by rows fed, the 1.5B target on a 2-core AMD EPYC (benchmarks/results/rows_avx2.json)
AVX2_ROWS_MS = {1: 39.6, 2: 52.5, 3: 60.3, 4: 73.3, 5: 77.3, 6: 101.5, 7: 113.7, 8: 125.1, 9: 148.9, 10: 166.0,
                11: 175.5, 12: 217.2, 13: 229.9, 14: 237.6, 15: 235.8, 16: 253.8}


def test_a_pass_not_timed_since_calibration_is_priced_at_the_load_the_learnt_ones_show():
    """Eight sessions streaming: the session times their 8-row passes 1.6x slower than start-up
    calibration did, and nothing else. Read beside the quiet table, a 9-row pass would cost what the
    8-row one does and a 90 %-sure one-token model-free draft would look like a gain; priced at the
    load the learnt pass shows (its calibration times 1.6), it does not pay (a round log of 8 held-out
    sessions: 46 such rounds in a phase, passes of 11-14 rows at 1.5-2.4x the 8-row pass)."""
    quiet = tuple((rows - 1, ms / 1e3) for rows, ms in AVX2_ROWS_MS.items())
    est = Estimates(alpha=0.7, draft_step_s=0.021, verify_s=quiet, calibrated_s=quiet, rtt_s=0.004, stream_s=0.002,
                    plain_call_s=0.14, plain_streamed_s=0.13, observations=50, batch=8.0)
    loaded = replace(est, verify_s=tuple((k, t * 1.6 if k == 7 else t) for k, t in quiet))
    cal = dict(quiet)
    assert pass_time(loaded, 7) == pytest.approx(1.6 * cal[7])  # learnt: as it stands
    assert pass_time(loaded, 8) == pytest.approx(1.6 * cal[8]) and pass_time(loaded, 15) == pytest.approx(1.6 * cal[15])
    assert pass_time(loaded, 3) == cal[3]  # nothing learnt below it
    exit_s = hybrid.stream_exit_time(loaded, 2)
    assert hybrid.free_choice(loaded, [0.9], exit_s)[0] == 0
    assert hybrid.free_choice(replace(loaded, calibrated_s=()), [0.9], exit_s)[0] == 1  # the quiet table's reading
    relearnt = replace(loaded, verify_s=tuple((k, t * 1.1 if k == 8 else t) for k, t in loaded.verify_s))
    assert pass_time(relearnt, 8) == pytest.approx(max(1.1 * cal[8], 1.6 * cal[7]))  # timed since: no longer scaled


# Start-up calibration on the AVX-512 AMD EPYC (Zen 4) host, ms by rows, from a round log of 16 held-out sessions.
ZEN4_ROWS_MS = {1: 35.7, 2: 34.0, 3: 36.5, 4: 39.4, 5: 42.3, 6: 59.0, 7: 59.9, 8: 63.0, 9: 65.8, 10: 80.1, 11: 87.1,
                12: 87.7, 13: 90.5, 14: 101.4, 15: 105.3, 16: 125.5, 17: 126.0}


def test_a_pass_beyond_the_calibrated_table_is_priced_at_the_load_the_learnt_ones_show():
    """Sixteen sessions streaming in passes of eight: the session times those passes 1.38x slower
    than start-up calibration did. A one-token draft of every session is a pass of 32 positions,
    beyond the table: read off the line through it at the quiet host's rates while the plain pass
    of 16 is priced at the load, a 60 %-sure draft looked like a gain (a round log: ~50 such rounds
    a run, 9-row passes 7 ms dearer than the 8-row ones for all 16 sessions, 0.935x plain at 16
    sessions against 1.00x at 8, whose 16-position passes the table holds). Priced at the load, it
    does not pay."""
    quiet = tuple((rows - 1, ms / 1e3) for rows, ms in ZEN4_ROWS_MS.items())
    est = Estimates(alpha=0.6, draft_step_s=0.017, verify_s=quiet, calibrated_s=quiet, rtt_s=0.012, stream_s=0.002,
                    plain_call_s=0.19, plain_streamed_s=0.19, observations=80, batch=16.0)
    loaded = replace(est, verify_s=tuple((k, t * 1.38 if k in (7, 8) else t) for k, t in quiet))
    assert pass_time(loaded, 31) == pytest.approx(1.38 * pass_time(replace(est, calibrated_s=()), 31))
    assert pass_time(loaded, 15) == pytest.approx(1.38 * dict(quiet)[15])  # in the table: as before
    assert pass_time(loaded, 5) == dict(quiet)[5] and pass_time(est, 31) == pass_time(replace(est, calibrated_s=()), 31)
    assert hybrid.free_choice(loaded, [0.6])[0] == 0
    line_through_the_table = pass_time(replace(loaded, calibrated_s=()), 31)  # the reading before
    assert (1 + 0.6) / (line_through_the_table + loaded.rtt_s) > 1 / plain_time(loaded)  # at which it paid


def test_a_round_is_priced_alone_when_its_pass_is_its_own():
    """The batch-size table is the lone session's verify(K) when nothing shares the pass."""
    est = Estimates(alpha=0.8, draft_step_s=DRAFT_STEP, verify_s=((0, 0.4), (4, 0.56)), rtt_s=RTT)
    assert verify_time(est, 4) == 0.56 and verify_time(replace(est, batch=1.3), 4) == 0.56
    assert verify_time(replace(est, batch=2.0), 1) == verify_time(est, 3)  # two sessions of two positions


def test_alpha_counts_only_the_drafts_the_target_judged():
    """At K = 4 and α = 0.83 the mean of accepted / K is about 0.64; the estimate must not be."""
    fixed = PolicyConfig(adaptive=False, default_k=4)
    run = simulate(0.83, 400, seed=3, config=fixed)
    assert run.state.estimates.alpha == pytest.approx(0.83, abs=0.08)


# --- simulated sessions -----------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.02])
def test_a_useless_draft_is_dropped_fast_and_probed_logarithmically(alpha):
    run = simulate(alpha, 2 + 5 + 1000)  # calibration, at most 5 speculative rounds, 1000 more
    first_plain = run.modes.index(PLAIN)
    speculative_rounds = sum(k > 0 for k in run.ks[: first_plain + 1])
    assert speculative_rounds <= 5  # acceptance alone condemns it before MIN_JUDGED drafts
    assert sum(run.ks[: first_plain + 1]) <= 12  # K = 4 at first, then it shrinks
    assert run.modes[first_plain:] == [PLAIN] * len(run.modes[first_plain:])  # never flips back
    assert run.probes(first_plain + 1) <= 8  # 16 + 32 + 64 + 128 + 256 + 512 > 1000: 5 probes
    assert run.state.fallbacks == 1


def test_a_good_draft_stays_speculative_with_a_long_k():
    run = simulate(0.95, 300)
    assert run.state.fallbacks == 0 and PLAIN not in run.modes
    late = run.ks[100:]
    assert sum(late) / len(late) >= 5
    assert min(late) >= 1 and max(late) <= CONFIG.max_k


def test_k_follows_alpha():
    def mean_k(alpha):
        late = simulate(alpha, 300, seed=1).ks[50:]
        return sum(late) / len(late)

    assert mean_k(0.7) < mean_k(0.83) < mean_k(0.95)
    assert 1.5 <= mean_k(0.7) <= 2.5


def test_realistic_acceptance_never_falls_back():
    for seed in range(3):
        assert simulate(0.7, 1000, seed=seed).state.fallbacks == 0  # prose, S ≈ 1.29


def test_a_draft_that_becomes_useful_is_taken_back_at_a_probe():
    run = simulate(lambda i: 0.0 if i < 100 else 0.95, 400)
    assert run.modes[99] == PLAIN and run.modes[-1] == SPECULATIVE
    assert run.switches == 2


def test_hysteresis_at_break_even():
    """α wandering around break-even (S(1) = 1 at α ≈ 0.35): the mode must not flip-flop."""

    def switches(config, seed):
        noise = random.Random(100 + seed)
        return simulate(lambda i: noise.uniform(0.25, 0.45), 2000, seed, config).switches

    no_hysteresis = PolicyConfig(off_below=1.0, on_above=1.0, probe_every=1, probe_max=1)
    for seed in range(3):
        assert switches(CONFIG, seed) <= 10
        assert switches(no_hysteresis, seed) > 5 * switches(CONFIG, seed)


def test_one_unlucky_round_after_the_prior_has_aged_does_not_condemn_the_draft():
    """A session whose draft model waited out its prompt's catch-up for 30 rounds: the inherited α
    aged to a fifth of a draft's weight, and its first round drafted 2 and had none accepted (1 in
    100 rounds of a draft at α = 0.9). Acceptance alone condemns a draft only on HOPELESS_JUDGED drafts
    judged in this session."""
    aged = inherit(PolicyState(estimates=measured(0.7)))
    aged = replace(aged, estimates=replace(aged.estimates, accepted_count=0.18, tested_count=0.25))
    state = observe(aged, cpu_round(2, 0), CONFIG)
    assert state.estimates.alpha < 0.2 and state.mode == SPECULATIVE
    for _ in range(HOPELESS_JUDGED - 1):
        state = observe(state, cpu_round(2, 0), CONFIG)
    assert state.mode == PLAIN  # a draft that keeps failing is still dropped within a few rounds


def test_a_fallback_spends_the_starting_probe_credit():
    """The credit a session starts with pays for a first probe where it has no verdict of its own; a
    fallback is one, on this text: the probe after it is paid from what plain rounds earn."""
    state = PolicyState(mode=SPECULATIVE, k=1, estimates=measured(0.0))
    while state.mode == SPECULATIVE:
        state = observe(state, cpu_round(1, 0), CONFIG)
    assert state.probe_credit == 0.0
    for _ in range(10):
        state = observe(state, cpu_round(0, 0), CONFIG)
    assert state.probe_credit == pytest.approx(10 * PROBE_SHARE)


def test_a_short_stint_after_a_probe_counts_as_a_failed_probe():
    judged = replace(measured(0.0), judged=HOPELESS_JUDGED)
    state = PolicyState(mode=SPECULATIVE, k=1, estimates=judged, probe_interval=64, fallbacks=3, mode_rounds=2)
    state = observe(state, cpu_round(1, 0), CONFIG)
    assert (state.mode, state.probe_interval, state.plain_rounds_until_probe) == (PLAIN, 128, 128)
    long_stint = dataclasses.replace(state, mode=SPECULATIVE, mode_rounds=200)
    assert observe(long_stint, cpu_round(1, 0), CONFIG).probe_interval == CONFIG.probe_every


def test_probe_schedule_in_plain_mode():
    """The probe drafts the least K whose full acceptance would switch speculation on: after a verdict
    of α = 0 on the 2-draft prior, 1 of 1 would read as α ≈ 0.38 (S = 1.02, below on_above), 2 of 2
    as α ≈ 0.55 (S = 1.15)."""
    state = PolicyState(mode=PLAIN, estimates=measured(0.0), plain_rounds_until_probe=2, probe_interval=16)
    ks = []
    for _ in range(4):
        ks.append(next_k(state, CONFIG))
        state = observe(state, cpu_round(ks[-1], 0), CONFIG)
    assert ks == [0, 0, 2, 0]
    assert (state.probe_interval, state.plain_rounds_until_probe) == (32, 31)


def test_a_due_probe_that_no_outcome_could_make_decisive_is_checked_every_few_rounds(monkeypatch):
    """The check is a sweep of the cost model: a plain session whose due probe cannot switch it on (here
    all drafts rejected so far) checks again after PROBE_RECHECK rounds, not every round, and still
    probes within PROBE_RECHECK rounds of the evidence having aged enough."""
    config = PolicyConfig(max_k=4)
    state = PolicyState(mode=PLAIN, estimates=replace(measured(0.0), accepted_count=0.0, tested_count=16.0),
                        plain_rounds_until_probe=1, probe_interval=16)
    sweeps = []
    real = modes._decisive_probe_k
    monkeypatch.setattr(modes, "_decisive_probe_k", lambda est, cfg: sweeps.append(1) or real(est, cfg))
    ks, seen = [], []
    for _ in range(80):
        ks.append(next_k(state, config))
        if ks[-1]:
            break
        state = observe(state, cpu_round(0, 0), config)
        seen.append(state.estimates)
    rounds = len(ks)
    assert ks[-1] == 4 and len(sweeps) <= rounds // modes.PROBE_RECHECK + 2
    first_decisive = next(i for i, est in enumerate(seen) if real(est, config))  # checked every round
    assert rounds - 1 <= first_decisive + 1 + modes.PROBE_RECHECK


def test_under_load_a_due_probe_the_batch_refuses_is_checked_every_few_rounds(monkeypatch):
    """Eight sessions at once: a plain session's probe falls due and is decisive, but the round goes
    without it (under load hybrid.choose prices it as any round: the batch refused it, or a model-free
    draft paid more), so the probe stays due. Its check, a sweep of the cost model, then runs again
    after LOADED_RECHECK rounds, not every round nor every PROBE_RECHECK: on a 2-core host every plain
    session's every check takes it from the target's passes (the coordinator 0.28 ms of CPU a token over
    plain decoding when checked every round)."""
    state = PolicyState(mode=PLAIN, estimates=observe(PolicyState(estimates=measured(0.7)), batched_round(0, 0, 8),
                                                      CONFIG).estimates, plain_rounds_until_probe=0, probe_interval=16)
    assert batch_sessions(state.estimates) > 1 and decisive_probe_k(state.estimates, CONFIG) > 0
    sweeps = []
    real = modes._decisive_probe_k
    monkeypatch.setattr(modes, "_decisive_probe_k", lambda est, cfg: sweeps.append(1) or real(est, cfg))
    rounds = 40
    for _ in range(rounds):
        state = observe(state, batched_round(0, 0, 8), CONFIG)  # a round without the probe
    assert state.mode == PLAIN and len(sweeps) <= rounds // modes.LOADED_RECHECK + 1


def test_a_probe_that_could_not_change_the_mode_is_not_run_until_its_evidence_has_aged():
    """Sixteen judged drafts all rejected, and a request that drafts at most 4: no 4 drafts all
    accepted would switch speculation on, so no probe runs; over plain rounds that evidence decays
    (α's counts age with the text) until a probe of 4 is decisive; later one of probe_k would be."""
    config = PolicyConfig(max_k=4)
    state = PolicyState(mode=PLAIN, estimates=replace(measured(0.0), accepted_count=0.0, tested_count=16.0),
                        plain_rounds_until_probe=0, probe_interval=16)
    ks = []
    for _ in range(80):
        ks.append(next_k(state, config))
        if ks[-1]:
            break
        state = observe(state, cpu_round(0, 0), config)
    assert ks[:10] == [0] * 10 and ks[-1] == 4 and len(ks) < 80
    aged = replace(state.estimates, accepted_count=0.0, tested_count=0.01)
    assert decisive_probe_k(aged, config) == config.probe_k


# --- bounds, fixed K, purity ------------------------------------------------------------

observations = st.lists(
    st.tuples(
        st.integers(0, 12),  # accepted, clipped to K below
        st.floats(0.0, 2.0),  # draft seconds
        st.floats(0.01, 3.0),  # verify seconds
        st.floats(0.0, 0.05),  # rtt
        st.booleans(),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(observations, st.integers(1, 12), st.integers(1, 12), st.booleans())
def test_k_stays_within_bounds(rounds, max_k, default_k, adaptive):
    config = PolicyConfig(max_k=max_k, default_k=default_k, adaptive=adaptive)
    state = PolicyState(k=12)  # e.g. left by a request that allowed a larger K
    for accepted, draft_s, verify_s, rtt, cold in rounds:
        k = next_k(state, config)
        if state.mode == SPECULATIVE and state.estimates.observations >= 2:
            assert 1 <= k <= max_k
            if not adaptive:
                assert k == min(default_k, max_k)
        assert 0 <= k <= max_k
        state = observe(state, RoundObservation(k, min(accepted, k), draft_s, verify_s, rtt, cold), config)


def test_fixed_k_keeps_k_but_still_falls_back():
    fixed = PolicyConfig(adaptive=False, default_k=6, max_k=5)
    good = simulate(0.95, 200, config=fixed)
    assert set(good.ks[2:]) == {5}
    useless = simulate(0.0, 50, config=fixed)
    assert useless.state.fallbacks == 1


def test_pure_and_deterministic():
    state = simulate(0.8, 30).state
    obs = cpu_round(3, 2)
    assert observe(state, obs, CONFIG) == observe(state, obs, CONFIG)
    assert simulate(0.6, 200, seed=7).ks == simulate(0.6, 200, seed=7).ks
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.k = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad, message",
    [
        (PolicyConfig(max_k=0), "max_k"),
        (PolicyConfig(off_below=1.1, on_above=1.0), "off_below"),
        (PolicyConfig(probe_every=0), "probe_every"),
        (PolicyConfig(smoothing=0.0), "smoothing"),
    ],
)
def test_config_validation_says_what_to_change(bad, message):
    with pytest.raises(ValueError, match=message):
        bad.validate()
    PolicyConfig().validate()


def test_one_slow_early_verify_does_not_switch_a_good_draft_off():
    state = simulate(0.95, 2).state  # calibrated: verify(0) measured
    state = observe(state, RoundObservation(4, 4, 0.4, 0.56, RTT), CONFIG)  # cold draft: acceptance only
    slow = RoundObservation(4, 4, 0.4, 5 * PLAIN_STEP, RTT)  # a verify 5x a plain step: noise, not the truth
    state = observe(state, slow, CONFIG)
    assert should_fall_back(state.estimates, CONFIG) is False and state.mode == "speculative"
    for _ in range(6):  # but timings that stay this bad are believed
        state = observe(state, slow, CONFIG)
    assert state.mode == PLAIN


def test_a_new_session_inherits_timings_and_a_useless_drafts_verdict():
    learned = simulate(0.0, 2 + 3 + 100).state
    assert learned.mode == PLAIN
    fresh = inherit(learned)
    assert fresh.mode == PLAIN and next_k(fresh, CONFIG) == 0  # no calibration: the prompt goes plainly
    assert fresh.probe_interval == learned.probe_interval and fresh.fallbacks == 0
    useless = simulate(0.0, 200, state=fresh)  # one probe of its own text, then the deployment's schedule
    assert useless.ks[0] == 0 and useless.ks[1] > 0
    assert useless.probes() <= 1 + 200 // (2 * learned.probe_interval)
    good_text = simulate(0.9, 20, state=fresh)  # e.g. code after prose: the probe takes speculation back
    assert good_text.modes[1] == SPECULATIVE and good_text.state.fallbacks == 0
    assert fresh.estimates.verify_s == learned.estimates.verify_s
    assert fresh.estimates.alpha == learned.estimates.alpha
    assert fresh.estimates.tested_count <= 2.0  # acceptance is only a light prior
    good = inherit(simulate(0.95, 50).state)
    assert good.mode == "speculative" and good.k > CONFIG.default_k  # the deployment's long K...
    first = next_k(good, CONFIG)
    assert first == CONFIG.default_k  # ...is not bet on a text whose acceptance is unknown
    after = observe(good, cpu_round(first, first), CONFIG)
    assert next_k(after, CONFIG) >= good.k  # one round of it, and the long K is back


def test_a_one_draft_probe_takes_good_text_back_as_often_as_four():
    """A deployment that dropped a useless-on-prose draft gets code (α = 0.9) at the real pair's
    timings: the new session's probe must take speculation back; K = 1 costs least and passes
    at least as often as K = 4."""

    def slow_round(k: int, accepted: int) -> RoundObservation:
        return RoundObservation(k, accepted, 0.08 * k, 0.43 * (1 + 0.33 * k), RTT)

    def taken_back(config: PolicyConfig) -> float:
        learned = simulate(0.0, 100, config=config).state
        back = 0
        for seed in range(100):
            rng, state = random.Random(seed), inherit(learned)
            for _ in range(3):
                k = next_k(state, config)
                state = observe(state, slow_round(k, draw_accepted(rng, 0.9, k)), config)
            back += state.mode == SPECULATIVE
        return back / 100

    one, four = taken_back(CONFIG), taken_back(PolicyConfig(probe_k=4))
    assert CONFIG.probe_k == 1 and one >= four and one >= 0.8


def test_an_unlucky_start_does_not_switch_a_good_draft_off():
    """A good draft (α = 0.9) at the real pair's timings on this CPU (verify(4) ≈ 2.3 plain
    steps): two rounds of 0/4 right after the prompt read as α = 0.33 and a predicted loss; the
    timing verdict waits for MIN_JUDGED judged drafts, by which time acceptance has shown its
    real level."""

    def slow_round(k: int, accepted: int) -> RoundObservation:
        return RoundObservation(k, accepted, 0.08 * k, 0.43 * (1 + 0.33 * k), RTT)

    for seed in range(20):
        rng, state = random.Random(seed), simulate(0.9, 2).state  # calibrated
        for round_index in range(30):
            k = next_k(state, CONFIG)
            accepted = 0 if round_index < 2 else draw_accepted(rng, 0.9, k)
            state = observe(state, slow_round(k, accepted), CONFIG)
        assert state.fallbacks == 0, seed


def test_a_burst_of_slow_draft_steps_does_not_switch_a_good_draft_off():
    """The AVX2 host's calibrated pair (draft step 20 ms, plain pass 52 ms, 27 ms a row from two rows
    to three) and code at α 0.95: a session's draft model woke after the prompt and took three steps
    of 37-104 ms between ones of 20 (the host, not the draft). One such step must not count five
    times over: at that step even free verification would not pay, and the session fell back for
    the rest of its request (0.8x plain)."""
    table = ((0, 0.052), (1, 0.059), (2, 0.086), (3, 0.113), (4, 0.13), (5, 0.141), (6, 0.16), (8, 0.19))
    est = Estimates(alpha=0.89, draft_step_s=0.0198, verify_s=table, calibrated_s=table, rtt_s=0.0035,
                    stream_s=0.0001, observations=20, accepted_count=0.89 * 3, tested_count=3, judged=1)
    state = PolicyState(k=1, estimates=est, drafted_last_round=True)
    for step_s in (0.02, 0.043, 0.037, 0.022, 0.104) + (0.02,) * 10:
        k = next_k(state, CONFIG)
        state = observe(state, RoundObservation(k, k, step_s * k, 0.06 + 0.014 * (k - 1), 0.0035), CONFIG)
        assert state.mode == SPECULATIVE and state.fallbacks == 0
    assert state.estimates.draft_step_s < 0.025  # the burst left the estimate once the steps were quick again


def test_a_slower_host_still_shows_in_the_timings_within_a_few_rounds():
    """A rise is counted at most double a round (the burst above), so a host four times slower for good
    is learnt in rounds, not at once."""
    est = replace(measured(0.9), observations=10)
    seen = []
    for _ in range(12):
        est = learn(est, RoundObservation(4, 4, 4 * 4 * DRAFT_STEP, 4 * 0.56, RTT), CONFIG, False, False)
        seen.append(est.draft_step_s)
    assert seen[0] == pytest.approx(DRAFT_STEP * 1.3)  # double the estimate, at the EWMA's weight
    assert seen[-1] > 0.95 * 4 * DRAFT_STEP and dict(est.verify_s)[4] > 0.95 * 4 * 0.56


def test_concave_verify_times_are_explored_up_to_a_long_k():
    """The real pair on this CPU: verify(K) ≈ 0.46 s for a plain step, then 0.7 + 0.085·K (one to
    two positions is the expensive step). A session that learned its timings at K = 1 and 2 (on
    prose) meets code (α = 0.99): the line through those points overestimates large K (without
    exploration K stays at 2 for 13 rounds); trying each larger K once reaches long rounds fast."""

    def concave_round(k: int, accepted: int) -> RoundObservation:
        return RoundObservation(k, accepted, 0.14 * k, 0.46 if k == 0 else 0.7 + 0.085 * k, RTT)

    config = PolicyConfig(max_k=16)
    learned = Estimates(alpha=0.5, draft_step_s=0.14, verify_s=((0, 0.46), (1, 0.785), (2, 0.87)), rtt_s=RTT,
                        observations=50, accepted_count=1.0, tested_count=2.0)
    rng, state, ks = random.Random(0), PolicyState(k=1, estimates=learned, drafted_last_round=True), []
    for _ in range(30):
        k = next_k(state, config)
        state = observe(state, concave_round(k, draw_accepted(rng, 0.99, k)), config)
        ks.append(k)
    assert state.fallbacks == 0
    assert max(ks[:6]) >= 10 and min(ks[-20:]) >= 10  # long rounds within six rounds, and they stay
    assert len(state.estimates.verify_s) <= 12  # each K explored at most once
    short = explore_k(replace(learned, alpha=0.3), config, 1, 1.0)
    assert short == 1  # at α = 0.3 no longer K could win even with free verification



def test_the_targets_confidence_is_evidence_on_alpha_worth_half_a_judged_draft():
    """A plain round judges no draft, yet the target's confidence at its token says how predictable the
    text is: α moves toward c times it (c = 1 before any draft was judged against it), by half a draft;
    a round that reports no confidence leaves α as the decay finds it."""
    state = PolicyState(mode=PLAIN, estimates=replace(measured(0.7), accepted_count=1.4, tested_count=2.0))
    unsure, sure, silent = (observe(state, replace(cpu_round(0, 0), confidence=c), CONFIG).estimates
                            for c in ((0.2,), (1.0,), ()))
    keep = 1 - 1 / CONFIG.alpha_window
    assert unsure.alpha == pytest.approx((1.4 * keep + 0.5 * 0.2) / (2.0 * keep + 0.5))
    assert sure.alpha == pytest.approx((1.4 * keep + 0.5) / (2.0 * keep + 0.5))
    assert silent.alpha == pytest.approx(0.7)
    many = state
    for _ in range(64):
        many = observe(many, replace(cpu_round(0, 0), confidence=(0.4,)), CONFIG)
    assert many.estimates.alpha == pytest.approx(0.4, abs=0.01)  # plain mode follows the text


def test_the_confidence_calibration_learns_what_judged_drafts_scored_and_sessions_inherit_it():
    """c: accepted drafts per unit of the target's confidence at the judged positions (here a round of
    four drafts, one accepted: the judged rows' confidences 0.9 and 0.5), from a prior of 1; a new
    session keeps it, as it keeps the timings."""
    state = PolicyState(estimates=measured(0.7))
    after = observe(state, replace(cpu_round(4, 1), confidence=(0.9, 0.5)), CONFIG).estimates
    assert (after.confidence_accepted, after.confidence_expected) == (1.0, pytest.approx(1.4))
    assert after.confidence_calibration == pytest.approx((1.0 + 2.0) / (1.4 + 2.0))
    assert inherit(PolicyState(estimates=after)).estimates.confidence_calibration == after.confidence_calibration
    unreported = observe(state, cpu_round(4, 1), CONFIG).estimates
    assert unreported.confidence_calibration == 1.0


def test_the_drafts_the_draft_model_was_sure_of_are_learnt_apart_from_alpha():
    est = measured(0.6)
    # sure of its first three, the fourth rejected: α sees 3 of 4, its sure drafts 3 of 3
    for _ in range(8):
        est = learn(est, replace(cpu_round(4, 3), sure=3), CONFIG, False, False)
    assert est.alpha == pytest.approx(0.75, abs=0.03)
    assert est.sure_alpha > 0.9
    # one judged beyond the rejection is never counted: sure of three, the second rejected, 1 of 2
    once = learn(measured(0.6), replace(cpu_round(4, 1), sure=3), CONFIG, False, False)
    assert (once.sure_accepted, once.sure_tested) == (1, 2)
    assert learn(measured(0.6), cpu_round(4, 1), CONFIG, False, False).sure_tested == 0  # no stop: no evidence


def test_the_draft_model_is_asked_for_the_best_k_of_the_drafts_it_is_sure_of():
    sure = replace(measured(0.6), sure_accepted=30.0, sure_tested=30.0)
    k, _ = best_k(sure, CONFIG)
    asked = sure_k(sure, CONFIG, k)
    assert asked > k
    assert asked == max(range(1, CONFIG.max_k + 1), key=lambda c: predicted_speedup(sure, CONFIG, c, sure.sure_alpha))
    # no evidence, a stop that is off, or a fixed K: the policy's K alone
    assert sure_k(measured(0.6), CONFIG, k) == k
    assert sure_k(sure, replace(CONFIG, min_confidence=0.0), k) == k
    assert sure_k(sure, replace(CONFIG, adaptive=False), k) == k
    # sure drafts that pass at α add nothing; a batch of eight, whose passes every draft lengthens, fewer
    assert sure_k(replace(measured(0.6), sure_accepted=18.0, sure_tested=30.0), CONFIG, k) == k
    assert sure_k(replace(sure, batch=8.0), CONFIG, 1) < asked


def test_a_pass_not_timed_since_calibration_is_priced_at_the_hosts_pace():
    table = ((0, 0.05), (1, 0.06), (4, 0.09))
    quiet = Estimates(draft_step_s=0.02, verify_s=table, calibrated_s=table)
    assert verify_time(quiet, 0) == pytest.approx(0.05)
    # passes of five positions timed at 1.3x their calibration: the host is slower, plain with it
    slow = quiet
    for _ in range(12):
        slow = learn(slow, RoundObservation(4, 4, 0.08, 0.117, 0.001), CONFIG, False, False)
    assert slow.pace == pytest.approx(1.3, rel=0.02)
    assert verify_time(slow, 0) == pytest.approx(0.065, rel=0.02)
    assert verify_time(slow, 1) == pytest.approx(0.078, rel=0.02)
    # a faster host lowers no price: noise only adds time
    fast = learn(quiet, RoundObservation(4, 4, 0.08, 0.07, 0.001), CONFIG, False, False)
    assert fast.pace < 1.0 and verify_time(fast, 0) == pytest.approx(0.05)
