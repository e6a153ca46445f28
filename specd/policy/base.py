"""The policy's vocabulary: its settings, what a round shows it, what it has learned, its state."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from specd.validation import validate_that

SPECULATIVE, PLAIN = "speculative", "plain"
CALIBRATION_ROUNDS = 2  # plain rounds a fresh state may spend measuring verify(0)
FREE_PRIOR = 2.0  # weight, in drafts, of the prior that a model-free draft's scores are right
SURE_PRIOR = 2.0  # weight, in drafts, of the prior that a draft the draft model is sure of passes at α
# The target's confidence (its probability of its own most likely token) at a round's last committed
# position is evidence on α worth CONFIDENCE_WEIGHT judged drafts: the draft agrees with the target
# about as often as the target is sure (2-core AVX2 host, 16 prompts: the first 16 tokens' mean
# confidence 0.37-0.61 on prose, 0.81-0.93 on code and chat), calibrated by what drafts then scored.
CONFIDENCE_WEIGHT = 0.5
# Plain mode's probes are paid from an account in plain steps, so that a useless draft costs a session
# about PROBE_START plain steps and PROBE_SHARE of its plain time: a probe's draft catch-up grows with
# the plain stretch before it, and probes at doubling intervals would cost a share of every plain step
# (on a 2-core AVX2 host, ~6 ms of draft prefill per token against a 64 ms step). PROBE_START covers a
# new session's first probe over a prompt of some 40 tokens there (4.6 steps).
PROBE_START = 6.0
PROBE_SHARE = 0.02


@dataclass(frozen=True)
class PolicyConfig:
    max_k: int = 16  # the server's bound; a request may lower it
    default_k: int = 4  # K before anything is measured, and the fixed K when not adaptive
    probe_k: int = 1  # the least K of a probe in plain mode (modes.decisive_probe_k may need more to switch)
    adaptive: bool = True  # False: K stays min(default_k, max_k); the fallback still guards
    off_below: float = 0.95  # fall back to plain decoding when the best predicted speedup < this
    on_above: float = 1.05  # leave plain mode (after a probe) only when it is > this (hysteresis)
    probe_every: int = 16  # plain rounds before the first re-probe; doubles after each failed probe
    probe_max: int = 512
    smoothing: float = 0.3  # EWMA weight of a new observation (timings)
    alpha_window: int = 16  # rounds of evidence behind α (its counts decay by 1 - 1/alpha_window a round)
    # confidence stop: drafting ends after a draft with q(token) below this (0: off). Past such a draft the
    # next one's chance to count is too small for its step and row (docs/design.md: the draft's recorded
    # confidence replayed; transformers' assisted generation stops at 0.4)
    min_confidence: float = 0.7
    draft_contends: bool = False  # the draft computes on what the target's passes use (one host's cores, one GPU)

    def validate(self) -> None:
        validate_that(self.max_k >= 1, f"max_k must be >= 1, got {self.max_k}")
        validate_that(self.default_k >= 1, f"default_k must be >= 1, got {self.default_k}")
        validate_that(self.probe_k >= 1, f"probe_k must be >= 1, got {self.probe_k}")
        validate_that(self.off_below <= self.on_above, "off_below must not exceed on_above")
        validate_that(1 <= self.probe_every <= self.probe_max, "need 1 <= probe_every <= probe_max")
        validate_that(0.0 < self.smoothing <= 1.0, f"smoothing must be in (0, 1], got {self.smoothing}")
        validate_that(self.alpha_window >= 1, f"alpha_window must be >= 1, got {self.alpha_window}")
        validate_that(0.0 <= self.min_confidence < 1.0, f"min_confidence must be in [0, 1), got {self.min_confidence}")

    @property
    def start_k(self) -> int:
        """K before anything is measured, within max_k."""
        return max(1, min(self.default_k, self.max_k))


@dataclass(frozen=True)
class RoundObservation:
    k: int  # tokens drafted this round (0 = a plain step)
    accepted: int  # of those, accepted
    draft_s: float  # draft service compute for the whole round (0 when k = 0)
    verify_s: float  # target service compute for the round
    rtt_s: float  # per-RPC overhead (wall - compute), averaged over the round's RPCs
    draft_cold: bool = False  # the draft processed more than this round's tokens (prefill, catch-up)
    draft_sent: int = 0  # committed tokens the draft caught up on before drafting (its sync)
    target_cold: bool = False  # the target did: its verify_s is not a decode step
    target_shared: bool = False  # other sessions' verifications shared the target's pass: verify_s timed theirs too
    batch_size: int = 1  # sessions in the target's pass
    active_sessions: int = 1  # sessions the target's last passes served or queued behind this one: what it held up
    pass_rows: int = 0  # positions that pass fed, every session's: what verify_s paid for (0: not reported)
    streamed: bool = False  # a plain step of a Decode stream: no RPC of its own, so rtt_s says nothing
    free_offered: bool | None = None  # the model-free drafter would take the round from a caught-up draft model (None: not weighed)
    wall_s: float = 0.0  # the target's reply as the loop waited for it (a streamed step: since the last reply)
    confidence: tuple[float, ...] = ()  # the target's confidence at each committed position (empty: not reported)
    sure: int = 0  # of the K drafts, those the draft model was sure of: it drafted on after each (its confidence stop)


@dataclass(frozen=True)
class Estimates:
    alpha: float = 0.7  # per-draft-token acceptance rate (prior until measured)
    draft_step_s: float | None = None  # draft compute per drafted token
    catch_up_s: float | None = None  # the draft's pass a token of a catch-up (a cold call's; None: not timed yet)
    # target compute of a pass, by its positions - 1: K for a session alone (K = 0: a plain step); a shared
    # pass of R positions counts as K = R - 1 (specd/policy/cost.py prices a round by the pass it joins)
    verify_s: tuple[tuple[int, float], ...] = ()
    # start-up calibration's verify_s, never learnt: a pass's cost by positions on the quiet host, the
    # shape that prices a pass not timed since at the load the learnt ones show (cost.pass_time)
    calibrated_s: tuple[tuple[int, float], ...] = ()
    rtt_s: float = 0.0  # per RPC: wall time minus service compute
    stream_s: float | None = None  # a streamed plain step's wall beyond its pass (None: none streamed yet)
    # a warm plain step's whole wall, as a Step call and as a streamed step: under load a call also waits
    # for a pass behind the streams (hybrid.stream_exit_time)
    plain_call_s: float | None = None
    plain_streamed_s: float | None = None
    observations: int = 0
    accepted_count: float = 0.0  # decayed count of accepted drafts; alpha = accepted_count / tested_count
    tested_count: float = 0.0  # decayed count of drafts the target judged (accepted + 1 unless all passed)
    judged: int = 0  # drafts the target judged in this session (not decayed, not inherited)
    free_accepted: float = 0.0  # decayed count of accepted model-free drafts (specd/policy/hybrid.py)
    free_expected: float = 0.0  # decayed sum of those drafts' scores: what the drafter expected
    # decayed counts of the tokens committed in rounds the model-free drafter would take from a caught-up
    # draft model, and in all rounds it was weighed (this session's: not inherited)
    free_offer_tokens: float = 0.0
    offered_tokens: float = 0.0
    confidence_accepted: float = 0.0  # decayed count of accepted drafts at positions whose target confidence was reported
    confidence_expected: float = 0.0  # decayed sum of the target's confidence at those drafts' positions
    sure_accepted: float = 0.0  # decayed count of accepted drafts the draft model was sure of (RoundObservation.sure)
    sure_tested: float = 0.0  # decayed count of those drafts the target judged
    pace: float | None = None  # recent passes ÷ their start-up calibration (EWMA; None: none timed against it)
    batch: float = 1.0  # sessions sharing the target's passes (up at once, down by EWMA): a round is priced as a pass of them all
    draft_batched: tuple[tuple[int, float], ...] = ()  # the draft step with that many sessions in the passes (> 1)

    @functools.cached_property
    def derived(self) -> dict:
        """What the cost model derived from these estimates (specd/policy/cost.py): a round's decisions
        ask for the same pass times and best K many times over. Not a field: not saved, not compared, and
        a new estimate (`specd.evolve`) starts with nothing derived."""
        return {}

    @property
    def free_calibration(self) -> float:
        """c: accepted model-free drafts per unit of score."""
        return _calibration(self.free_accepted, self.free_expected)

    @property
    def confidence_calibration(self) -> float:
        """Accepted drafts per unit of the target's confidence at their positions (learning.confidence_hint)."""
        return _calibration(self.confidence_accepted, self.confidence_expected)

    @property
    def sure_alpha(self) -> float:
        """Acceptance of the drafts the draft model was sure of, from a prior of α worth SURE_PRIOR drafts:
        a draft that is sure passes more often than α says (AVX2 host's traces: 0.95-0.98 on every class,
        where α read 0.93 on code at K = 1)."""
        return (self.sure_accepted + SURE_PRIOR * self.alpha) / (self.sure_tested + SURE_PRIOR)

    @property
    def free_offer_rate(self) -> float:
        """P: the share of committed tokens that came in rounds the model-free drafter would take from a
        caught-up draft model: what is left for the draft model to serve (and repay its catch-up with)
        is the rest of the tokens, not of the rounds (one round that copies a line commits many)."""
        return self.free_offer_tokens / self.offered_tokens if self.offered_tokens > 0 else 0.0


def _calibration(accepted: float, expected: float) -> float:
    """Accepted drafts per unit of what was expected of them, from a prior of 1 worth FREE_PRIOR drafts."""
    return (accepted + FREE_PRIOR) / (expected + FREE_PRIOR)


def decayed(count: float, new: float, window: int) -> float:
    """A count of evidence after one more round: what the older rounds counted is scaled by 1 - 1/window (α's window)."""
    return count * (1.0 - 1.0 / window) + new


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
    probe_credit: float = PROBE_START  # plain steps' worth of time this session may still spend on probes
