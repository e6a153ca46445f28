"""The cost model: predicted speedup S(K) from α, the draft step, verify(K) and the RTT, and the
decisions read off it (the best K, falling back). Formulas and rationale: docs/policy.md."""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Callable, Iterable, TypeVar

from specd.policy.base import CALIBRATION_ROUNDS, Estimates, PolicyConfig

T = TypeVar("T")

PRIOR_SLOPE = 0.25  # verify(K) ≈ verify(0)·(1 + PRIOR_SLOPE·K) when only one K is measured
TIMING_EVIDENCE = CALIBRATION_ROUNDS + 3  # rounds before timings alone may switch speculation off
MIN_JUDGED = 16  # drafts judged in this session before timings alone may switch speculation off
HOPELESS_JUDGED = 4  # drafts judged in this session before acceptance alone may switch speculation off


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round commits: the accepted drafts plus the recovered/bonus token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def verify_time(est: Estimates, k: int) -> float | None:
    """`_verify_time`, derived once per estimates and K (a plain-mode session's probe check prices every
    K at several α: under load, 16 sessions' checks were most of the coordinator's work)."""
    return derived(est, ("verify", k), lambda: _verify_time(est, k))


def _verify_time(est: Estimates, k: int) -> float | None:
    """Target compute for a round with K drafts, priced as the pass it joins, in two ways, the dearer
    taken: as B sessions (`est.batch`) that each draft K, B·(K + 1) positions (vLLM's batch size -> K
    table, learnt); and as its K + 1 positions beside the B - 1 others' plain steps plus what its K
    extra positions cost each of them, who wait for them: T(B - 1 + K) + (B - 1)·(T(B - 1 + K) - T(B - 1)),
    T the pass by positions - 1. Alone, both are verify(K); were T a line, they would agree. The first
    spans many positions, so one stale or noisy pass cannot make drafts look free; the second sees a
    step in T (a new row tile) that a line through the larger passes smooths away. A round priced
    at its own rows alone would speculate where the batch loses."""
    batch = batch_sessions(est)
    alike = pass_time(est, batch * (k + 1) - 1)
    if batch == 1 or alike is None:
        return alike
    return max(alike, joined_time(est, k, batch))


def joined_time(est: Estimates, k: int, batch: int) -> float:
    """A pass of K + 1 positions beside B - 1 plain steps, with the wait its K add to each of them."""
    joined = pass_time(est, batch - 1 + k)
    return joined + (batch - 1) * (joined - pass_time(est, batch - 1))


def batch_sessions(est: Estimates) -> int:
    return max(1, round(est.batch))


def pass_time(est: Estimates, k: int) -> float | None:
    """Target compute of a pass of k + 1 positions: the measurement when k was measured, else a
    least-squares line through the measured k (slope >= 0: more positions never cost less),
    or PRIOR_SLOPE through a single point. Never below a measured pass of fewer positions, nor
    below what a batched pass can cost: k + 1 positions at once cost at most k + 1 times one
    position; a measurement still at its start-up calibration is priced at the learnt load
    (`_Passes.at_load`), and any measured pass at least at its calibration times the host's pace
    (`_Passes.at_pace`). None when nothing is measured.
    Priced once per estimates and k."""
    passes = derived(est, ("passes",), lambda: _Passes(est))
    if not passes.points:
        return None
    priced = passes.priced.get(k)
    if priced is None:
        priced = passes.priced[k] = passes.price(k)
    return priced


def derived(est: Estimates, key: tuple, compute: Callable[[], T]) -> T:
    """`compute()`, once per estimates and key (`Estimates.derived`)."""
    memo = est.derived
    if key not in memo:
        memo[key] = compute()
    return memo[key]


class _Passes:
    """What `pass_time` reads off one estimates' tables, read once: a round's decisions price a pass
    at every K they weigh (under load, B sessions' positions at each), and the coordinator shares a
    2-core host's cores with the target's passes."""

    def __init__(self, est: Estimates):
        self.points = dict(est.verify_s)
        self.calibrated = dict(est.calibrated_s)
        self.pace = est.pace
        self.ks = sorted(self.points)
        self.ts = [self.points[km] for km in self.ks]
        self.peaks = _running_peaks(est.verify_s)
        self.load_peaks = _running_peaks((km, t / self.calibrated[km]) for km, t in est.verify_s
                                         if self.calibrated.get(km) not in (None, t, 0.0))
        self.fit = _fit(self.points) if self.points else (0.0, 0.0)
        self.calibrated_fit = _fit(self.calibrated) if self.calibrated else (0.0, 0.0)
        self.priced: dict[int, float] = {}

    def price(self, k: int) -> float:
        points = self.points
        below = _peak_below(self.peaks, k)  # noise must not make more positions cheaper
        if k in points:
            return max(points[k], below, self.at_load(k), self.at_pace(k))
        slope, intercept = self.fit
        above = bisect.bisect_right(self.ks, k)
        floor = max((t * (k + 1) / (km + 1) for km, t in zip(self.ks[above:], self.ts[above:])), default=0.0)
        return max(intercept + slope * k, floor, below, self.line_at_load(k))

    def at_load(self, k: int) -> float:
        """A pass still at its start-up calibration, priced at the load the learnt passes of fewer positions
        show: its calibration times the largest ratio of such a pass to its own calibration (0.0: k was
        timed since, or nothing below it was). Under load a session times the batch's passes, T(B - 1),
        while the rest of the table stays the quiet host's: read side by side, one more position beside
        the batch would look free (its pass priced below the one it joins, lifted only to it)."""
        calibrated = self.calibrated.get(k)
        if calibrated is None or self.points[k] != calibrated:
            return 0.0
        return calibrated * _peak_below(self.load_peaks, k)

    def at_pace(self, k: int) -> float:
        """A pass priced at the host's pace (`Estimates.pace`): its calibration times the learnt ratio of
        recent passes to their calibration (0.0: k not calibrated, or no pace learnt). A speculative
        session times only the passes it drafts for, so verify(0) would stay the quiet host's while they
        and the draft step follow a host that slows down: on the AVX2 host draft steps read 1.5x and
        passes 1.2x their calibration, plain still at its own, and rounds that paid looked as if they
        barely did (docs/policy.md)."""
        calibrated = self.calibrated.get(k)
        return calibrated * self.pace if calibrated and self.pace else 0.0

    def line_at_load(self, k: int) -> float:
        """A pass never timed (beyond the table: B sessions' drafts), priced as `at_load` prices a
        calibrated one: the calibration's own line at k times the load the learnt passes of fewer
        positions show (0.0: no calibration). The line through the table alone mixes learnt passes with
        the quiet host's, so past the table it grows at the quiet rate while the pass it is weighed
        against is priced at the load."""
        if not self.calibrated:
            return 0.0
        slope, intercept = self.calibrated_fit
        return (intercept + slope * k) * _peak_below(self.load_peaks, k)


def _running_peaks(pairs: Iterable[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """(position counts in order, the running maximum of their values)."""
    ordered = sorted(pairs)
    return [km for km, _ in ordered], list(itertools.accumulate((t for _, t in ordered), max))


def _peak_below(peaks: tuple[list[int], list[float]], k: int) -> float:
    """The running maximum over the counts below k (`_running_peaks`; 0.0: none), by bisection."""
    ks, values = peaks
    i = bisect.bisect_left(ks, k)
    return values[i - 1] if i else 0.0


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


def predicted_speedup(est: Estimates, config: PolicyConfig, k: int, alpha: float | None = None) -> float:
    """S(K) of docs/policy.md: plain tokens per second of speculative work (`alpha`: in place of the
    learnt α). Needs `is_measured(est)`."""
    if est.draft_step_s is None or verify_time(est, 0) is None:
        raise ValueError("predicted_speedup needs the draft step and a verify time measured")
    return expected_tokens(est.alpha if alpha is None else alpha, k) * plain_time(est) / round_time(est, config, k)


def plain_time(est: Estimates) -> float:
    """T(0): a plain token. A Step call's pass and RPC, or where plain stretches stream (the target
    running the next step while the last one's reply travels) the pass and a streamed step's gap."""
    return derived(est, ("plain",), lambda: verify_time(est, 0) + (est.rtt_s if est.stream_s is None else est.stream_s))


def round_time(est: Estimates, config: PolicyConfig, k: int) -> float:
    """`_round_time`, derived once per estimates, K and whether the draft contends (α does not enter it)."""
    return derived(est, ("round", k, config.draft_contends), lambda: _round_time(est, config, k))


def _round_time(est: Estimates, config: PolicyConfig, k: int) -> float:
    """T(K) of docs/policy.md: one synchronous round with K drafts. Needs `is_measured(est)`. Where the
    draft contends for the target's compute (`PolicyConfig.draft_contends`: one host's cores, one GPU), a
    round that drafts beside B - 1 sessions' plain steps also costs each of them its K draft steps,
    taken from their passes: K·step·B beside its joined pass (the step as timed at this B: under load
    it waits for the cores too), the dearer of that and the batched price."""
    batch = batch_sessions(est)
    step = draft_step(est)
    drafted = k * step + verify_time(est, k)
    if config.draft_contends and batch > 1:
        drafted = max(drafted, k * step * batch + joined_time(est, k, batch))
    return drafted + 2 * est.rtt_s


def draft_step(est: Estimates) -> float:
    """A draft step with B sessions in the passes: as measured at B, else the step measured at the
    nearest smaller B (or alone) grown as the target's pass grows from that many positions to B (both
    are passes over the same sessions' rows). Needs `is_measured(est)`."""
    return derived(est, ("draft_step",), lambda: _draft_step(est))


def _draft_step(est: Estimates) -> float:
    batch = batch_sessions(est)
    measured = {1: est.draft_step_s, **dict(est.draft_batched)}
    if batch in measured:
        return measured[batch]
    below = max(b for b in measured if b < batch)
    return grown(est, measured[below], below, batch)


def grown(est: Estimates, seconds: float, positions: int, to: int) -> float:
    """A draft pass of `positions` positions that took `seconds`, priced at `to` positions: grown as
    the target's pass grows (both models' passes cost their rows alike; the draft reports no rows)."""
    return seconds * pass_time(est, to - 1) / pass_time(est, positions - 1)


def best_k(est: Estimates, config: PolicyConfig) -> tuple[int, float]:
    """(K, S(K)) maximising the predicted speedup over 1..max_k (just the fixed K when not
    adaptive); the smaller K on a tie. Before anything is measured: (the default K, nan)."""
    return derived(est, ("best_k", config), lambda: _best_k(est, config))


def _best_k(est: Estimates, config: PolicyConfig, alpha: float | None = None) -> tuple[int, float]:
    """`best_k`, or were α `alpha`."""
    if not is_measured(est):
        return config.start_k, math.nan
    return max(((k, predicted_speedup(est, config, k, alpha)) for k in _candidates(config)),
               key=lambda ks: (ks[1], -ks[0]))


def sure_k(est: Estimates, config: PolicyConfig, k: int) -> int:
    """K to ask the draft model for where its confidence stop is on: the policy's K, or the best K at the
    acceptance of drafts the draft model is sure of where that is more. A draft it is not sure of ends
    the proposal, so the drafts past the policy's K are made only while it stays sure, and those pass
    at `Estimates.sure_alpha`, not α (priced at this batch, as any round: under load no more pay)."""
    if not config.adaptive or config.min_confidence == 0.0 or est.sure_tested == 0.0 or not is_measured(est):
        return k
    return max(k, derived(est, ("sure_k", config), lambda: _best_k(est, config, est.sure_alpha)[0]))


def _candidates(config: PolicyConfig) -> range | tuple[int]:
    return range(1, config.max_k + 1) if config.adaptive else (config.start_k,)


def best_speedup_at(est: Estimates, config: PolicyConfig, alpha: float) -> float:
    """best_k's S(K) were α `alpha`, at these timings. Needs `is_measured(est)`. S(K) as
    `predicted_speedup` computes it, over T(0) and T(K) read once per estimates (a probe's check
    weighs every K at several α)."""
    rounds = derived(est, ("rounds", config), lambda: _round_times(est, config))
    return max(expected_tokens(alpha, k) * plain / round_s for k, plain, round_s in rounds)


def _round_times(est: Estimates, config: PolicyConfig) -> tuple[tuple[int, float, float], ...]:
    """(K, T(0), T(K)) for every candidate K."""
    predicted_speedup(est, config, 1)  # its check that the timings are measured
    return tuple((k, plain_time(est), round_time(est, config, k)) for k in _candidates(config))


def could_pay(est: Estimates, config: PolicyConfig, bar: float, ks: range | None = None,
              extra_s: Callable[[int], float] = lambda k: 0.0) -> bool:
    """Would a draft that is always right beat `bar` at some K (of `ks`, default 1..max_k), at these
    timings and this batch, its rounds also paying `extra_s(K)` (a catch-up's share)? If not, no draft
    can, and neither drafting nor a probe to measure α is worth a pass: on a CPU, where a pass costs
    about its rows, a batch of sessions makes every further row cost them all. True while the timings
    are not measured."""
    if not is_measured(est):
        return True
    ks = ks or range(1, config.max_k + 1)
    return any((k + 1) * plain_time(est) / (round_time(est, config, k) + extra_s(k)) > bar for k in ks)


def should_fall_back(est: Estimates, config: PolicyConfig) -> bool:
    """Plain decoding is predicted to beat the best K by a margin. Never before the
    comparison rests on measurements: a prior alone must not switch speculation off.

    Two kinds of evidence, trusted at different speeds. Acceptance alone can condemn a draft
    soon: if even free verification (verify(K) = verify(0)) would not pay, no timing noise can
    rescue it, and a useless draft is dropped within five rounds; but not on fewer than
    HOPELESS_JUDGED drafts judged in this session (a prior aged over rounds that did not draft
    leaves one unlucky round, 0 of 2 at α = 0.9, to speak alone). A verdict that rests on
    timings waits for TIMING_EVIDENCE rounds: the first measurements of a fresh session are the
    noisiest (caches warming, the other service's threads still busy), and one slow verify
    must not switch a good draft off; nor may a few unlucky rounds of a good one: at α = 0.8,
    two rounds of 0/4 right after the prompt happen 4 % of the time and read as α = 0.33, so
    the timing verdict also waits for MIN_JUDGED drafts judged in this session. A useless
    draft does not wait for it (acceptance alone condemns it within five rounds); a mediocre
    one pays up to MIN_JUDGED drafts once per deployment (later sessions inherit the verdict). Where
    not even a draft that is always right would pay (`could_pay`: a batch under load), the
    timings alone decide, without waiting for judged drafts; so they do where this session has
    judged none: its α is the prior and the target's confidence, with no unlucky round in it, and a
    session whose draft model never woke (its catch-up would not pay: `hybrid.choose`) would
    otherwise stay speculative, its plain steps Step calls, not a stream (on the AVX2 host a prose
    session ran 0.90x plain so, drafting nothing)."""
    if not is_measured(est) or best_k(est, config)[1] >= config.off_below:
        return False
    timed = est.observations >= TIMING_EVIDENCE
    ceiling = timed and not could_pay(est, config, config.off_below)  # no acceptance would pay: judged drafts moot
    hopeless = est.judged >= HOPELESS_JUDGED and _hopeless(est, config)
    return hopeless or (timed and (est.judged >= MIN_JUDGED or est.judged == 0)) or ceiling


def _hopeless(est: Estimates, config: PolicyConfig) -> bool:
    """Even with verification as cheap as a plain step, no K would pay."""
    plain_s = verify_time(est, 0)

    def free_speedup(k: int) -> float:
        round_s = k * draft_step(est) + plain_s + 2 * est.rtt_s
        return expected_tokens(est.alpha, k) * plain_time(est) / round_s

    return max(free_speedup(k) for k in range(1, config.max_k + 1)) < config.off_below


def explore_k(est: Estimates, config: PolicyConfig, k: int, speedup: float) -> int:
    """K for the next round: the best K, or an unmeasured larger K that could beat it. On a CPU
    verify(K) is concave (one position to two costs most), so the straight line through the small
    K a session measured overestimates large K, which would then never be tried. Optimism in the
    face of that uncertainty: a K above the best is tried once if it would win with verification
    costing no more than at the largest measured K below it (its measurement then stands)."""
    if not config.adaptive or math.isnan(speedup) or batch_sessions(est) > 1:  # a shared pass: its rows are the table's
        return k
    points = dict(est.verify_s)

    def optimistic(candidate: int) -> float:
        below = [km for km in points if km < candidate]
        below_s = points[max(below)] if below else verify_time(est, candidate)
        round_s = candidate * draft_step(est) + below_s + 2 * est.rtt_s
        return expected_tokens(est.alpha, candidate) * plain_time(est) / round_s

    unmeasured = [c for c in range(k + 1, config.max_k + 1) if c not in points]
    best = max(unmeasured, key=optimistic, default=None)
    return best if best is not None and optimistic(best) > speedup else k
