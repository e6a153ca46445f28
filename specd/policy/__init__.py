"""When speculation pays, and with how many draft tokens: a cost model from measured
acceptance and timings (docs/policy.md). Pure functions; no transport."""

from specd.policy.base import (
    CALIBRATION_ROUNDS,
    PLAIN,
    SPECULATIVE,
    Estimates,
    PolicyConfig,
    PolicyState,
    RoundObservation,
)
from specd.policy.cost import (
    MIN_JUDGED,
    TIMING_EVIDENCE,
    best_k,
    expected_tokens,
    explore_k,
    is_measured,
    predicted_speedup,
    round_time,
    should_fall_back,
    sure_k,
    verify_time,
)
from specd.policy.learning import PRIOR_DRAFTS, calibrated, calibration_ks, learn
from specd.policy.modes import SESSION_PROBE_AFTER, inherit, joined_at_load, next_k, observe

__all__ = [
    "CALIBRATION_ROUNDS", "MIN_JUDGED", "PLAIN", "PRIOR_DRAFTS", "SESSION_PROBE_AFTER", "SPECULATIVE",
    "TIMING_EVIDENCE", "Estimates", "PolicyConfig", "PolicyState", "RoundObservation", "best_k", "calibrated",
    "calibration_ks", "expected_tokens", "explore_k", "inherit", "is_measured", "joined_at_load", "learn", "next_k",
    "observe", "predicted_speedup", "round_time", "should_fall_back", "sure_k", "verify_time",
]
