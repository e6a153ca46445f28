"""Acceptance and timings learnt from rounds: α from decayed counts, timings by EWMA, and the
prior a deployment's start-up calibration measures. Rationale: docs/policy.md."""

from __future__ import annotations

import math
from specd.evolve import evolve
from typing import Sequence

from specd.policy.base import CONFIDENCE_WEIGHT, Estimates, PolicyConfig, PolicyState, RoundObservation, decayed
from specd.policy.cost import is_measured

PRIOR_DRAFTS = 2.0  # weight, in drafts, of the prior α: three rejections in a row outweigh it
# A timing counts a round's measurement at most this many times its estimate: on the AVX2 host single
# draft steps of 37-104 ms came between ones of 20 (docs/policy.md).
MAX_RISE = 2.0


def learn(
    est: Estimates, obs: RoundObservation, config: PolicyConfig, draft_cold: bool, target_cold: bool
) -> Estimates:
    """Update the estimates from one round: α from decayed counts, timings by EWMA (a first
    measurement is taken as is); a cold service's timing is skipped."""
    accepted_count, tested_count, judged = _acceptance(est, obs, config.alpha_window)
    alpha = accepted_count / tested_count if tested_count > 0 else est.alpha
    w = config.smoothing
    draft_step, batched = est.draft_step_s, est.draft_batched
    # The step alone, and by the batch the passes held (the draft's passes hold the target's sessions):
    # a step timed under load must not outlive the load (cost.draft_step).
    if obs.k > 0 and not draft_cold:
        step = obs.draft_s / obs.k
        if obs.batch_size > 1 and draft_step is not None:
            batched = learn_verify(batched, obs.batch_size, step, w)
        else:
            draft_step = _timed(draft_step, step, w)
    catch_up = est.catch_up_s
    if obs.k > 0 and obs.draft_cold and obs.draft_sent > 0 and draft_step is not None:
        # a cold call's time beyond its steps, a token: what waking a draft model that lags costs
        catch_up = _timed(catch_up, max(0.0, obs.draft_s - obs.k * draft_step) / obs.draft_sent, w)
    rtt, stream = est.rtt_s, est.stream_s
    if obs.streamed:  # no call of its own: what a plain token costs beyond its pass where stretches stream
        stream = _timed(stream, obs.rtt_s, w)
    else:
        rtt = _timed(None if est.observations == 0 else est.rtt_s, obs.rtt_s, w)
    call, streamed = est.plain_call_s, est.plain_streamed_s
    if obs.k == 0 and not target_cold and obs.wall_s > 0:
        if obs.streamed:
            streamed = _timed(streamed, obs.wall_s, w)
        else:
            call = _timed(call, obs.wall_s, w)
    est = learn_calibration(learn_offer(learn_pass(est, obs, w, target_cold), obs, config.alpha_window), obs, judged,
                            config.alpha_window)
    est = learn_sure(est, obs, config.alpha_window)
    return evolve(est, alpha=alpha, draft_step_s=draft_step, draft_batched=batched, catch_up_s=catch_up, rtt_s=rtt,
                   stream_s=stream,
                   plain_call_s=call, plain_streamed_s=streamed,
                   observations=est.observations + 1, accepted_count=accepted_count, tested_count=tested_count,
                   judged=est.judged + judged)


def learn_pass(est: Estimates, obs: RoundObservation, w: float, target_cold: bool) -> Estimates:
    """What the target's pass showed: its time at the positions it fed, whoever fed them, and how
    many sessions the passes serve. A cold pass (this session caught up on more than the round's
    tokens) times a prefill, not a step. A target that does not report its rows: a shared pass's
    time is skipped once the estimates are measured (it covers rows this model cannot count)."""
    verify_s, pace = est.verify_s, est.pace
    timed = None
    if not target_cold and obs.pass_rows > 0:
        timed = obs.pass_rows - 1
    elif not target_cold and not (obs.target_shared and is_measured(est)):
        timed = obs.k
    if timed is not None:
        verify_s = learn_verify(verify_s, timed, obs.verify_s, w)
        pace = _paced(est, pace, timed, obs.verify_s, w)
    # A pass of eight costs eight at once: the batch rises with a pass and falls off over a few (EWMA).
    # It counts the sessions the pass held up, not only those in it: a round that takes a pass of its
    # own beside seven streaming sessions stalls all seven.
    sessions = float(max(obs.batch_size, obs.active_sessions))
    batch = sessions if est.observations == 0 else max(sessions, _ewma(est.batch, sessions, w))
    return evolve(est, verify_s=verify_s, batch=batch, pace=pace)


def _paced(est: Estimates, pace: float | None, k: int, seconds: float, w: float) -> float | None:
    """The host's pace after a pass of k + 1 positions that took `seconds`: its ratio to the start-up
    calibration's pass of as many positions, timed as any timing (None: k not calibrated)."""
    calibrated = dict(est.calibrated_s).get(k)
    return _timed(pace, seconds / calibrated, w) if calibrated else pace


def learn_offer(est: Estimates, obs: RoundObservation, window: int) -> Estimates:
    """Whether the model-free drafter would have taken the round from a caught-up draft model, counted
    in the tokens the round committed, over counts that decay as α's (`hybrid.model_rate` shares a
    catch-up by it)."""
    if obs.free_offered is None:
        return est
    committed = obs.accepted + 1
    return evolve(est, free_offer_tokens=decayed(est.free_offer_tokens, obs.free_offered * committed, window),
                   offered_tokens=decayed(est.offered_tokens, committed, window))


def learn_text(est: Estimates, obs: RoundObservation, window: int) -> Estimates:
    """What a round that judged none of the draft model's drafts (a model-free draft's) says of α: its
    evidence ages a round, and the target's confidence speaks (`confidence_hint`)."""
    accepted_count, tested_count, _ = _acceptance(est, evolve(obs, k=0, accepted=0), window)
    return evolve(est, accepted_count=accepted_count, tested_count=tested_count, alpha=accepted_count / tested_count)


def _acceptance(est: Estimates, obs: RoundObservation, window: int) -> tuple[float, float, int]:
    """α's decayed counts after a round, the target's confidence in them, and the drafts it judged."""
    accepted_count, tested_count, judged = _learn_acceptance(est, obs, window)
    hinted, hints = confidence_hint(est, obs)
    return accepted_count + hinted, tested_count + hints, judged


def confidence_hint(est: Estimates, obs: RoundObservation) -> tuple[float, float]:
    """(accepted, judged) drafts' worth of evidence on α from the target's confidence at the round's
    last committed position, where the next round's first draft will stand: CONFIDENCE_WEIGHT drafts
    expected to pass at c times that confidence (c: `Estimates.confidence_calibration`). A plain round
    judges no draft, yet it says how predictable the text is now; a new session learns that before its
    draft model's first catch-up, and plain mode's probes follow the text."""
    if not obs.confidence:
        return 0.0, 0.0
    return CONFIDENCE_WEIGHT * min(1.0, est.confidence_calibration * obs.confidence[-1]), CONFIDENCE_WEIGHT


def learn_calibration(est: Estimates, obs: RoundObservation, judged: int, window: int) -> Estimates:
    """c: what the judged drafts scored against the target's confidence at their positions, over
    counts that decay as α's do, a round that judged drafts at a time (a property of the pair of
    models, so sessions inherit it)."""
    if judged == 0 or len(obs.confidence) < judged:
        return est
    return evolve(est, confidence_accepted=decayed(est.confidence_accepted, obs.accepted, window),
                   confidence_expected=decayed(est.confidence_expected, sum(obs.confidence[:judged]), window))


def learn_sure(est: Estimates, obs: RoundObservation, window: int) -> Estimates:
    """The acceptance of the drafts the draft model was sure of (`Estimates.sure_alpha`): of the round's
    first `obs.sure` drafts, those the target judged and those it accepted, over counts that decay as
    α's do, a round with such drafts at a time (a property of the pair of models, so sessions inherit it)."""
    if obs.sure == 0:
        return est
    judged, accepted = min(obs.accepted + 1, obs.sure), min(obs.accepted, obs.sure)
    return evolve(est, sure_accepted=decayed(est.sure_accepted, accepted, window),
                   sure_tested=decayed(est.sure_tested, judged, window))


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
    judged = obs.accepted + (1 if obs.accepted < obs.k else 0)
    return decayed(accepted, obs.accepted, window), decayed(tested, judged, window), judged


def _never_dearer_than_more(verify: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """The table with each pass at most the fastest pass of more positions: noise only adds time, and
    more positions never cost less (the AVX2 host's calibration read 68 ms for two positions and 61
    for three: a slow moment, not the kernel)."""
    table, least = [], math.inf
    for k in sorted(verify, reverse=True):
        least = min(least, verify[k])
        table.append((k, least))
    return tuple(reversed(table))


def alpha_after(est: Estimates, k: int, accepted: int, window: int) -> float:
    """α after one more round that drafted K and had `accepted` of them accepted."""
    accepted_count, tested_count, _ = _learn_acceptance(est, RoundObservation(k, accepted, 0.0, 0.0, 0.0), window)
    return accepted_count / tested_count


def learn_verify(verify_s: tuple[tuple[int, float], ...], k: int, seconds: float, w: float):
    points = dict(verify_s)
    points[k] = _timed(points.get(k), seconds, w)
    return tuple(sorted(points.items()))


def _ewma(old: float, new: float, w: float) -> float:
    return old + w * (new - old)


def _timed(old: float | None, new: float, w: float) -> float:
    """A timing's EWMA; its first measurement is taken as is, a later one at most MAX_RISE times the
    estimate: noise only adds time, and a slower host or a heavier batch still shows within a few rounds."""
    if old is None:
        return new
    return _ewma(old, min(new, MAX_RISE * old) if old > 0 else new, w)


def calibration_ks(config: PolicyConfig) -> tuple[int, ...]:
    """Every K from a plain step to max_k: verify time is not a line through a few K (a kernel's
    cost steps up where a new row tile starts), which a line through a few K would hide."""
    return tuple(range(config.max_k + 1))


def calibrated(rounds: Sequence[RoundObservation]) -> PolicyState:
    """The prior of a fresh deployment from timed rounds (`calibration_ks`, perhaps each more than
    once, and streamed plain steps): verify(K), the draft step, the draft's catch-up a token, the RTT
    and a streamed step's gap, each the fastest measured (noise only ever adds time; a pass also at
    most the fastest of more positions: `_never_dearer_than_more`); acceptance left
    at the prior. A cold service's timing (it caught up on more than the round's tokens) is left out,
    but for the catch-up it times; a streamed step made no call, so its gap is not an RTT."""
    verify: dict[int, float] = {}
    for obs in rounds:
        if not obs.target_cold:
            verify[obs.k] = min(verify.get(obs.k, math.inf), obs.verify_s)
    step = min((o.draft_s / o.k for o in rounds if o.k > 0 and not o.draft_cold), default=None)
    catch_ups = [max(0.0, o.draft_s - o.k * step) / o.draft_sent for o in rounds
                 if step is not None and o.k > 0 and o.draft_cold and o.draft_sent > 0]
    table = _never_dearer_than_more(verify)
    estimates = Estimates(draft_step_s=step, catch_up_s=min(catch_ups, default=None), verify_s=table,
                          calibrated_s=table, rtt_s=min((o.rtt_s for o in rounds if not o.streamed), default=0.0),
                          stream_s=min((o.rtt_s for o in rounds if o.streamed), default=None))
    return PolicyState(estimates=estimates)
