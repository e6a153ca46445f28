"""One-session conveniences over the role engines, for tests that drive a `ModelEngine` whose
sessions they sync by hand: the session is taken as it stands (nothing to catch up on), and an
error is raised rather than returned."""

from __future__ import annotations

from specd.contracts import (
    DraftReply,
    Proposal,
    ProposeRequest,
    SamplingParams,
    SyncPoint,
    Verdict,
    VerifyReply,
    VerifyRequest,
)
from specd.draft_engine import DraftEngine
from specd.engine import ModelEngine
from specd.target_engine import TargetEngine


def held(engine: ModelEngine, session_id: str) -> SyncPoint:
    """A SyncPoint at what the engine holds of the session."""
    return SyncPoint(engine.position(session_id), (), engine.instance_id)


def propose(
    engine: ModelEngine, session_id: str, K: int, params: SamplingParams, min_confidence: float = 0.0
) -> Proposal:
    """Up to K drafts after the session's current tokens (a confidence stop may draft fewer)."""
    request = ProposeRequest(session_id, held(engine, session_id), K, params, min_confidence=min_confidence)
    return alone(DraftEngine(engine).propose([request])).proposal


def verify_proposal(engine: ModelEngine, session_id: str, proposal: Proposal, params: SamplingParams) -> Verdict:
    """Score all K drafts in one target forward, decide, and leave the session at the new
    committed length. With K = 0 this is one plain decoding step (the bonus token is drawn from p)."""
    request = VerifyRequest(session_id, held(engine, session_id), proposal, params)
    return alone(TargetEngine(engine).verify([request])).verdict


def alone(replies: list[DraftReply | VerifyReply | Exception]):
    """The one reply of a batch of one, or its error raised."""
    [reply] = replies
    if isinstance(reply, Exception):
        raise reply
    return reply
