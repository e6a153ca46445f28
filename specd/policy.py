"""When speculation pays, and with how many draft tokens: a cost model from measured
acceptance and timings. Pure functions; no transport.

The cost model (Leviathan et al. 2023, with the network added). A round drafts K tokens,
each accepted with probability α, and the target verifies them in one forward pass:

    tokens per round   E(α, K) = (1 - α^(K+1)) / (1 - α)        (K + 1 when α = 1)
    speculative round  T(K)    = K·draft_step + verify(K) + 2·rtt   (one draft RPC, one verify RPC)
    plain round        T_plain = verify(0) + rtt                  (one token, target only)

    predicted speedup  S(K)    = (E(α, K) / T(K)) / (1 / T_plain)

verify(K) is the target's compute for K drafts (K + 1 positions); it is measured per K and
linearly interpolated between measured K (see `verify_time`). A target that pads its passes to
row blocks (the CPU kernels run 3 rows as 4 and 9-15 as 16, specd/kernels.py; a GPU runs its
captured batch sizes) verifies every K whose K + 1 rows pad to the same block at one cost: given
the blocks (`PolicyConfig.row_blocks`), one measurement prices the whole block, keyed by its
largest K. On the real pair K = 3 (four rows) costs what K = 2 does, and both about a plain step.

The policy runs in two modes. *Speculative*: K = argmax S(K) over 1..max_k, and fall back to
plain decoding when max S < off_below. *Plain*: K = 0, except a probe round every
`probe_interval` rounds that drafts `probe_k` tokens to re-measure α; a failed probe doubles the interval
(up to probe_max), so a useless draft costs O(log n) draft calls over n tokens. Switching back
needs max S > on_above: the gap between off_below and on_above is the hysteresis that stops a
draft sitting at break-even from flipping the mode every round.

Cold rounds: a service that processed more than the round's own tokens (a prompt, the
catch-up after rounds it sat out, a resend after it lost the session) measured a prefill, not
a decode step. Such a round still teaches α; its timing for that service is skipped. The
policy knows two cases itself: a fresh state's first round (the target prefills the prompt)
and any drafting round after a round that did not draft (the draft catches up, e.g. on a
probe). The coordinator marks the others (`draft_cold`, `target_cold`): a new prompt on a
continuing session, a resend.

Pipelining (drafting ahead): while the target verifies, the draft may go on drafting the next
round, betting on full acceptance with its own guess of the bonus token. A won bet (≈ α^(K+1))
hides the next round's K draft steps; the price is paid where both models share hardware: the
draft's work slows the target's verification, and a round after a lost bet waits for the
draft's step in flight. Rather than model each effect, "auto" measures the whole:
`pipelined_ratio`, a pipelined round's wall time over the synchronous round T(K) the estimates
predict, and keeps pipelining while it is below PIPELINE_PAYS_BELOW. The first PIPELINE_TRIAL
measured rounds pipeline to learn it. Pipelined rounds' verify and RPC times are contended, so
they do not enter verify(K) or the RTT. A verdict against pipelining is not forever: the load,
the network and where the services run change (and a trial taken under a burst of load speaks
for that burst), so after PIPELINE_RETRY synchronous rounds "auto" tries again, and each trial
that ends against it doubles that wait (up to PIPELINE_RETRY_MAX), as a failed probe does.

Shared passes: the target verifies concurrent sessions in one pass, and that pass's time
covers all their rows. Learnt as this session's verify(K), it would price a two-draft prose
round at what eight sessions' rows cost together (and fall back to plain steps that cost as
much), so once the estimates are measured a shared pass's time is skipped, like a pipelined
round's: K and the fallback are judged on the pass as it costs alone. Before that (a deployment
under load from its first request) shared times are all there is, and rounds alone correct them.

Start-up calibration: a fresh deployment knows no timings, so its first sessions calibrate
(below) and explore (`explore_k`): a first request on code tried K = 16, a 24-row pass of 1.6 s,
then 14, then 7, before settling at 15. `calibrated` turns timed rounds for every row block (the
coordinator runs them on a scratch session at start, specd/calibration.py) into the prior a
deployment's first session inherits: every block measured, so no session explores or
calibrates; acceptance stays the prior (the scratch text says nothing about real text).

Calibration: S needs verify(0), the plain step time, which speculative rounds never measure.
So a fresh state decodes plainly until verify(0) is measured, at most two rounds (the first
one prefills the prompt, so it is cold): each still commits a token at plain speed. Should
verify(0) stay unknown, it is extrapolated from the K-round timings (`verify_time`), and the
fallback waits until that extrapolation rests on two measured K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from specd.validation import validate_that

SPECULATIVE, PLAIN = "speculative", "plain"

CALIBRATION_ROUNDS = 2  # plain rounds a fresh state may spend measuring verify(0)
PRIOR_DRAFTS = 2.0  # weight, in drafts, of the prior α: three rejections in a row outweigh it
PRIOR_SLOPE = 0.25  # verify(K) ≈ verify(0)·(1 + PRIOR_SLOPE·K) when only one K is measured
TIMING_EVIDENCE = CALIBRATION_ROUNDS + 3  # rounds before timings alone may switch speculation off
SESSION_PROBE_AFTER = 1  # plain rounds (the prompt's prefill) before a new plain-mode session probes
MIN_JUDGED = 16  # drafts judged in this session before timings alone may switch speculation off
PIPELINE_TRIAL = 4  # rounds that draft ahead to measure their cost before "auto" decides
PIPELINE_PAYS_BELOW = 0.97  # pipelined / synchronous round time; within 3 % is timing noise
PIPELINE_RETRY = 64  # synchronous rounds before "auto" tries pipelining again; doubles per failed trial
PIPELINE_RETRY_MAX = 4096
PIPELINE_MODES = ("off", "on", "auto")


@dataclass(frozen=True)
class PolicyConfig:
    max_k: int = 16  # the server's bound; a request may lower it
    default_k: int = 4  # K before anything is measured, and the fixed K when not adaptive
    probe_k: int = 1  # K of a probe in plain mode: the cheapest probe; a good draft passes it as often as K = 4
    adaptive: bool = True  # False: K stays min(default_k, max_k); the fallback still guards
    off_below: float = 0.95  # fall back to plain decoding when the best predicted speedup < this
    on_above: float = 1.05  # leave plain mode (after a probe) only when it is > this (hysteresis)
    probe_every: int = 16  # plain rounds before the first re-probe; doubles after each failed probe
    probe_max: int = 512
    smoothing: float = 0.3  # EWMA weight of a new observation (timings)
    alpha_window: int = 16  # rounds of evidence behind α (its counts decay by 1 - 1/alpha_window a round)
    pipeline: str = "off"  # draft ahead while the target verifies: off | on | auto (the cost model decides)
    row_blocks: tuple[int, ...] = ()  # row counts the target computes verifications at, ascending; () = as fed
    min_confidence: float = 0.4  # confidence stop: drafting ends after a draft with q(token) below this (0: off),
    # as transformers' assisted generation's default
    siblings: bool = True  # greedy: send the draft's runner-up for the target's spare rows (specd/verify.py)

    def validate(self) -> None:
        validate_that(self.max_k >= 1, f"max_k must be >= 1, got {self.max_k}")
        validate_that(self.default_k >= 1, f"default_k must be >= 1, got {self.default_k}")
        validate_that(self.probe_k >= 1, f"probe_k must be >= 1, got {self.probe_k}")
        validate_that(self.off_below <= self.on_above, "off_below must not exceed on_above")
        validate_that(1 <= self.probe_every <= self.probe_max, "need 1 <= probe_every <= probe_max")
        validate_that(0.0 < self.smoothing <= 1.0, f"smoothing must be in (0, 1], got {self.smoothing}")
        validate_that(self.alpha_window >= 1, f"alpha_window must be >= 1, got {self.alpha_window}")
        validate_that(
            self.pipeline in PIPELINE_MODES, f"pipeline must be one of {PIPELINE_MODES}, got {self.pipeline!r}"
        )
        validate_that(
            list(self.row_blocks) == sorted(set(self.row_blocks)) and all(b >= 1 for b in self.row_blocks),
            f"row_blocks must be ascending positive row counts, got {self.row_blocks}",
        )
        validate_that(0.0 <= self.min_confidence < 1.0, f"min_confidence must be in [0, 1), got {self.min_confidence}")

    def cost_k(self, k: int) -> int:
        """The K whose verification costs what K drafts' does: the largest K whose K + 1 rows the
        target pads to the same row block (K itself when it does not pad them)."""
        return next((block - 1 for block in self.row_blocks if block >= k + 1), k)


@dataclass(frozen=True)
class RoundObservation:
    k: int  # tokens drafted this round (0 = a plain step)
    accepted: int  # of those, accepted
    draft_s: float  # draft service compute for the whole round (0 when k = 0)
    verify_s: float  # target service compute for the round
    rtt_s: float  # per-RPC overhead (wall - compute), averaged over the round's RPCs
    draft_cold: bool = False  # the draft processed more than this round's tokens (prefill, catch-up)
    target_cold: bool = False  # the target did: its verify_s is not a decode step
    reused: int = 0  # of the K drafts, those drafted ahead during the previous round (not in draft_s)
    drafted_ahead: bool = False  # the draft drafted ahead while the target verified this round
    target_shared: bool = False  # other sessions' verifications shared the target's pass: verify_s timed theirs too


@dataclass(frozen=True)
class Estimates:
    alpha: float = 0.7  # per-draft-token acceptance rate (prior until measured)
    draft_step_s: float | None = None  # draft compute per drafted token
    verify_s: tuple[tuple[int, float], ...] = ()  # target compute per round, by K (K = 0: plain step)
    rtt_s: float = 0.0  # per RPC: wall time minus service compute
    observations: int = 0
    accepted_count: float = 0.0  # decayed count of accepted drafts; alpha = accepted_count / tested_count
    tested_count: float = 0.0  # decayed count of drafts the target judged (accepted + 1 unless all passed)
    judged: int = 0  # drafts the target judged in this session (not decayed, not inherited)
    pipelined_ratio: float = 1.0  # a pipelined round's wall time / the synchronous T(K) predicted
    pipelined_rounds: int = 0  # rounds behind `pipelined_ratio`
    pipeline_retry_in: int = 0  # "auto" with pipelining off: synchronous rounds until it tries again
    pipeline_retry_every: int = PIPELINE_RETRY  # the wait after the next trial that ends against it


@dataclass(frozen=True)
class PolicyState:
    mode: str = SPECULATIVE
    k: int = 4
    estimates: Estimates = Estimates()
    plain_rounds_until_probe: int = 0
    probe_interval: int = 16
    fallbacks: int = 0
    mode_rounds: int = 0  # rounds since the last switch (a short speculative stint = a failed probe)
    drafted_last_round: bool = False  # else the next drafting round is cold: the draft must catch up


def inherit(prior: PolicyState) -> PolicyState:
    """A new session's start from what the deployment learned last (the store keeps the latest
    finished session's policy). Timings are properties of the deployment and carry over as they
    are; acceptance depends on the text, so it comes back as a light prior (at most PRIOR_DRAFTS worth).
    A deployment whose draft did not pay starts new sessions in plain mode with one probe right
    after the prompt: acceptance depends on the text (code after prose, or a verdict taken while
    the cores were busy), and one round is all it costs a useless draft per request. After that
    probe the session follows the schedule the deployment had reached."""
    est = prior.estimates
    weight = min(est.tested_count, PRIOR_DRAFTS) or PRIOR_DRAFTS
    est = replace(est, accepted_count=est.alpha * weight, tested_count=weight, judged=0)
    return PolicyState(
        mode=prior.mode,
        k=prior.k,
        estimates=est,
        plain_rounds_until_probe=SESSION_PROBE_AFTER if prior.mode == PLAIN else 0,
        probe_interval=prior.probe_interval,
    )


def calibration_ks(config: PolicyConfig) -> tuple[int, ...]:
    """The K whose rounds price every K up to max_k: a plain step, and one K per row block (its
    largest within max_k); without blocks, every K. A target that runs the rows it is fed is not a
    line through a few K: the q4 engine's cost steps up where a second row tile starts (7 rows,
    benchmarks/results/rows_q4.json), and a line through K = 4, 8, 16 hid that step while the
    optimism of `explore_k` tried each K in between once per session."""
    if config.row_blocks:
        ks = {block - 1 for block in config.row_blocks if block - 1 <= config.max_k} | {config.max_k}
    else:
        ks = set(range(1, config.max_k + 1))
    return tuple(sorted(ks | {0}))


def calibrated(rounds: Sequence[RoundObservation], config: PolicyConfig) -> PolicyState:
    """The prior of a fresh deployment from timed rounds (`calibration_ks`, perhaps each more than
    once): verify(K) by row block, the draft step and the RTT, each the fastest measured (noise
    only ever adds time); acceptance left at the prior. A cold service's timing (it caught up on
    more than the round's tokens) is left out."""
    verify: dict[int, float] = {}
    for obs in rounds:
        if not obs.target_cold:
            k = config.cost_k(obs.k)
            verify[k] = min(verify.get(k, math.inf), obs.verify_s)
    steps = [o.draft_s / (o.k - o.reused) for o in rounds if o.k > o.reused and not o.draft_cold]
    estimates = Estimates(
        draft_step_s=min(steps, default=None), verify_s=tuple(sorted(verify.items())),
        rtt_s=min((o.rtt_s for o in rounds), default=0.0),
    )
    return PolicyState(estimates=estimates)


# --- the cost model ---------------------------------------------------------------------


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round commits: the accepted drafts plus the recovered/bonus token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def verify_time(est: Estimates, k: int, config: PolicyConfig = PolicyConfig()) -> float | None:
    """Target compute for a round with K drafts: the measurement when K (or a K of its row block)
    was measured, else a least-squares line through the measured K (slope >= 0: more positions
    never cost less), or PRIOR_SLOPE through a single point. Never below what a batched pass can
    cost: K + 1 positions at once cost at most K + 1 times one position. None when nothing is
    measured."""
    k = config.cost_k(k)
    points = dict(est.verify_s)
    if k in points:
        return points[k]
    if not points:
        return None
    slope, intercept = _fit(points)
    floor = max((t * (k + 1) / (km + 1) for km, t in points.items() if km > k), default=0.0)
    return max(intercept + slope * k, floor)


def _fit(points: dict[int, float]) -> tuple[float, float]:
    """(slope, intercept) of verify time over K."""
    if len(points) == 1:
        ((k1, t1),) = points.items()
        t0 = t1 / (1.0 + PRIOR_SLOPE * k1)
        return PRIOR_SLOPE * t0, t0
    n = len(points)
    mean_k = sum(points) / n
    mean_t = sum(points.values()) / n
    var_k = sum((k - mean_k) ** 2 for k in points)
    slope = max(0.0, sum((k - mean_k) * (t - mean_t) for k, t in points.items()) / var_k)
    return slope, mean_t - slope * mean_k


def is_measured(est: Estimates) -> bool:
    """Enough to compare speculation with plain decoding: the draft step, and verify(0)
    either measured next to a K > 0 or extrapolated from two measured K > 0."""
    measured_k = {k for k, _ in est.verify_s if k > 0}
    has_plain = any(k == 0 for k, _ in est.verify_s)
    return est.draft_step_s is not None and len(measured_k) >= (1 if has_plain else 2)


def predicted_speedup(est: Estimates, k: int, config: PolicyConfig = PolicyConfig()) -> float:
    """S(K) of the module docstring: plain rounds per second of speculative work. Needs
    `is_measured(est)`."""
    plain_s = verify_time(est, 0, config)
    if est.draft_step_s is None or plain_s is None:
        raise ValueError("predicted_speedup needs the draft step and a verify time measured")
    return expected_tokens(est.alpha, k) * (plain_s + est.rtt_s) / round_time(est, k, config)


def round_time(est: Estimates, k: int, config: PolicyConfig = PolicyConfig()) -> float:
    """T(K) of the module docstring: one synchronous round with K drafts. Needs `is_measured(est)`."""
    return k * est.draft_step_s + verify_time(est, k, config) + 2 * est.rtt_s


def best_k(est: Estimates, config: PolicyConfig) -> tuple[int, float]:
    """(K, S(K)) maximising the predicted speedup over 1..max_k (just the fixed K when not
    adaptive); the smaller K on a tie. Before anything is measured: (the default K, nan)."""
    if not is_measured(est):
        return _start_k(config), math.nan
    candidates = range(1, config.max_k + 1) if config.adaptive else (_start_k(config),)
    return max(((k, predicted_speedup(est, k, config)) for k in candidates), key=lambda ks: (ks[1], -ks[0]))


def should_fall_back(est: Estimates, config: PolicyConfig) -> bool:
    """Plain decoding is predicted to beat the best K by a margin. Never before the
    comparison rests on measurements: a prior alone must not switch speculation off.

    Two kinds of evidence, trusted at different speeds. Acceptance alone can condemn a draft at
    once: if even free verification (verify(K) = verify(0)) would not pay, no timing noise can
    rescue it, and a useless draft is dropped within five rounds. A verdict that rests on
    timings waits for TIMING_EVIDENCE rounds: the first measurements of a fresh session are the
    noisiest (caches warming, the other service's threads still busy), and one slow verify
    must not switch a good draft off; nor may a few unlucky rounds of a good one: at α = 0.8,
    two rounds of 0/4 right after the prompt happen 4 % of the time and read as α = 0.33, so
    the timing verdict also waits for MIN_JUDGED drafts judged in this session. A useless
    draft does not wait for it (acceptance alone condemns it within five rounds); a mediocre
    one pays up to MIN_JUDGED drafts once per deployment (later sessions inherit the verdict)."""
    if not is_measured(est) or best_k(est, config)[1] >= config.off_below:
        return False
    enough_evidence = est.observations >= TIMING_EVIDENCE and est.judged >= MIN_JUDGED
    return _hopeless(est, config) or enough_evidence


def _hopeless(est: Estimates, config: PolicyConfig) -> bool:
    """Even with verification as cheap as a plain step, no K would pay."""
    plain_s = verify_time(est, 0, config)

    def free_speedup(k: int) -> float:
        round_s = k * est.draft_step_s + plain_s + 2 * est.rtt_s
        return expected_tokens(est.alpha, k) * (plain_s + est.rtt_s) / round_s

    return max(free_speedup(k) for k in range(1, config.max_k + 1)) < config.off_below


# --- the state machine ------------------------------------------------------------------


def next_k(state: PolicyState, config: PolicyConfig) -> int:
    """K for the coming round; 0 = a plain step. Plain rounds: the calibration of a fresh
    state (see the module docstring) and plain mode between probes. A session's first drafting
    round drafts at most the default K: the deployment's K was learned on another text (15
    drafts after code cost prose a second of its first token), and one round of this text's own
    acceptance decides the next K."""
    if _calibrating(state):
        return 0
    if state.mode == PLAIN:
        return min(config.probe_k, config.max_k) if state.plain_rounds_until_probe <= 0 else 0
    if not config.adaptive:
        return _start_k(config)
    k = min(max(state.k, 1), config.max_k)
    return min(k, _start_k(config)) if state.estimates.judged == 0 else k


def lookahead(state: PolicyState, k: int, config: PolicyConfig) -> int:
    """Tokens the draft should draft ahead after proposing this round's K: the bonus guess and
    the next round's drafts, or 0 when pipelining does not pay."""
    return k + 1 if k > 0 and pipelining_pays(state.estimates, config) else 0


def pipelining_pays(est: Estimates, config: PolicyConfig) -> bool:
    """Pipelined rounds have been measured faster than synchronous ones by a margin. "auto"
    tries it for PIPELINE_TRIAL rounds first: its cost can only be measured by doing it."""
    if config.pipeline != "auto":
        return config.pipeline == "on"
    if not is_measured(est):
        return False
    return est.pipelined_rounds < PIPELINE_TRIAL or est.pipelined_ratio < PIPELINE_PAYS_BELOW


def observe(state: PolicyState, obs: RoundObservation, config: PolicyConfig) -> PolicyState:
    """Learn from one round, then decide K and the mode for the next."""
    draft_cold = obs.draft_cold or not state.drafted_last_round
    target_cold = obs.target_cold or state.estimates.observations == 0
    est = _learn(state.estimates, obs, config, draft_cold, target_cold)
    state = replace(state, estimates=est, drafted_last_round=obs.k > 0)
    if state.mode == SPECULATIVE:
        return _after_speculative_round(state, config)
    if obs.k > 0:
        return _after_probe(state, config)
    countdown = max(0, state.plain_rounds_until_probe - 1)
    return replace(state, plain_rounds_until_probe=countdown, mode_rounds=state.mode_rounds + 1)


def explore_k(est: Estimates, config: PolicyConfig, k: int, speedup: float) -> int:
    """K for the next round: the best K, or an unmeasured larger K that could beat it. On a CPU
    verify(K) is concave (one position to two costs most), so the straight line through the small
    K a session measured overestimates large K, which would then never be tried. Optimism in the
    face of that uncertainty: a K above the best is tried once if it would win with verification
    costing no more than at the largest measured K below it (its measurement then stands)."""
    if not config.adaptive or math.isnan(speedup):
        return k
    points = dict(est.verify_s)
    plain_s = verify_time(est, 0, config)

    def optimistic(candidate: int) -> float:
        below = [km for km in points if km < candidate]
        below_s = points[max(below)] if below else verify_time(est, candidate, config)
        round_s = candidate * est.draft_step_s + below_s + 2 * est.rtt_s
        return expected_tokens(est.alpha, candidate) * (plain_s + est.rtt_s) / round_s

    unmeasured = [c for c in range(k + 1, config.max_k + 1) if config.cost_k(c) not in points]
    best = max(unmeasured, key=optimistic, default=None)
    return best if best is not None and optimistic(best) > speedup else k


def _after_speculative_round(state: PolicyState, config: PolicyConfig) -> PolicyState:
    if should_fall_back(state.estimates, config):
        interval = _interval_after_fallback(state, config)
        return replace(
            state,
            mode=PLAIN,
            fallbacks=state.fallbacks + 1,
            probe_interval=interval,
            plain_rounds_until_probe=interval,
            mode_rounds=0,
        )
    k = explore_k(state.estimates, config, *best_k(state.estimates, config))
    return replace(state, k=k, mode_rounds=state.mode_rounds + 1)


def _after_probe(state: PolicyState, config: PolicyConfig) -> PolicyState:
    k, speedup = best_k(state.estimates, config)
    if math.isnan(speedup) or speedup > config.on_above:
        return replace(state, mode=SPECULATIVE, k=k, mode_rounds=0)
    interval = min(2 * state.probe_interval, config.probe_max)
    return replace(state, probe_interval=interval, plain_rounds_until_probe=interval, mode_rounds=0)


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


def _start_k(config: PolicyConfig) -> int:
    return max(1, min(config.default_k, config.max_k))


# --- learning ---------------------------------------------------------------------------


def _learn(
    est: Estimates, obs: RoundObservation, config: PolicyConfig, draft_cold: bool, target_cold: bool
) -> Estimates:
    """Update the estimates from one round: α from decayed counts, timings by EWMA (a first
    measurement is taken as is); a cold service's timing is skipped."""
    accepted_count, tested_count, judged = _learn_acceptance(est, obs, config.alpha_window)
    alpha = accepted_count / tested_count if tested_count > 0 else est.alpha
    w = config.smoothing
    draft_step = est.draft_step_s
    drafted_here = obs.k - obs.reused
    if drafted_here > 0 and not draft_cold:
        step = obs.draft_s / drafted_here
        draft_step = step if draft_step is None else _ewma(draft_step, step, w)
    verify_s, rtt = est.verify_s, est.rtt_s
    ratio, pipelined = est.pipelined_ratio, est.pipelined_rounds
    if obs.drafted_ahead:  # contended times: they measure pipelining, not the services alone
        if is_measured(est) and not (draft_cold or target_cold):
            wall_s = obs.draft_s + obs.verify_s + 2 * obs.rtt_s
            ratio = _ewma(ratio, wall_s / round_time(est, obs.k, config), w if pipelined else 1.0)
            pipelined += 1
    else:
        if not target_cold and not (obs.target_shared and is_measured(est)):
            verify_s = _learn_verify(est.verify_s, config.cost_k(obs.k), obs.verify_s, w)
        rtt = obs.rtt_s if est.observations == 0 else _ewma(est.rtt_s, obs.rtt_s, w)
    learnt = Estimates(
        alpha, draft_step, verify_s, rtt, est.observations + 1, accepted_count, tested_count, est.judged + judged,
        ratio, pipelined, est.pipeline_retry_in, est.pipeline_retry_every,
    )
    return _schedule_pipeline_trials(est, learnt, obs, config)


def _schedule_pipeline_trials(before: Estimates, est: Estimates, obs: RoundObservation, config: PolicyConfig):
    """"auto": when a round turns pipelining off, wait the retry interval (and double it); when
    the wait is over, forget the verdict, so the next rounds are a new trial."""
    if config.pipeline != "auto" or pipelining_pays(est, config):
        return est
    if pipelining_pays(before, config) and obs.drafted_ahead:  # this round's measurement turned it off
        every = est.pipeline_retry_every
        return replace(est, pipeline_retry_in=every, pipeline_retry_every=min(2 * every, PIPELINE_RETRY_MAX))
    if est.pipelined_rounds < PIPELINE_TRIAL:  # still calibrating: the trial has not started
        return est
    if est.pipeline_retry_in > 1:
        return replace(est, pipeline_retry_in=est.pipeline_retry_in - 1)
    return replace(est, pipelined_rounds=0, pipelined_ratio=1.0, pipeline_retry_in=0)


def _learn_acceptance(est: Estimates, obs: RoundObservation, window: int) -> tuple[float, float, int]:
    """α is accepted / tested over decayed counts, not the mean of accepted / K: drafts after
    the first rejection were never judged, so accepted / K would read α = 0.83 at K = 4 as
    0.64; E[accepted] = α·E[tested] (Wald's identity), so accepted / tested converges to α.

    Counts rather than an EWMA of the ratio, so a round weighs by the drafts it judged; and
    they decay every round, plain ones included, so evidence ages with the text: a probe after
    a long plain stretch speaks for the text as it is now. A window of 16 rounds keeps a few
    unlucky rounds at α = 0.7 from reading as a useless draft; the 2-draft prior lets a truly
    useless one show within three rounds."""
    accepted, tested = est.accepted_count, est.tested_count
    if tested == 0:
        accepted, tested = est.alpha * PRIOR_DRAFTS, PRIOR_DRAFTS
    keep = 1.0 - 1.0 / window
    judged = obs.accepted + (1 if obs.accepted < obs.k else 0)
    return accepted * keep + obs.accepted, tested * keep + judged, judged


def _learn_verify(verify_s: tuple[tuple[int, float], ...], k: int, seconds: float, w: float):
    points = dict(verify_s)
    points[k] = seconds if k not in points else _ewma(points[k], seconds, w)
    return tuple(sorted(points.items()))


def _ewma(old: float, new: float, w: float) -> float:
    return old + w * (new - old)
