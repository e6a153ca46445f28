"""The coordinator's edge: validate a GenerateRequest into a GenerationRequest, and
turn loop events into responses."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from specd.loop import Finished, GenerationRequest
from specd.policy import PolicyConfig
from specd.sampling import SamplingParams
from specd.validation import validate_that
from specd.session import SessionState, SessionStats
from specd.stopping import StopRules
from services.coordinator.model_info import ModelInfo
from services.protogen.specd.v1 import coordinator_pb2


@dataclass(frozen=True)
class Limits:
    default_k: int = 4
    max_k: int = 16
    default_max_tokens: int = 128
    max_tokens: int = 4096
    max_prompt_tokens: int = 8192
    max_prompt_chars: int = 64 * 1024
    max_stop_strings: int = 8
    max_stop_chars: int = 128


SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def session_id(value: str) -> str:
    validate_that(SESSION_ID.fullmatch(value) is not None, "session_id must be 1..128 of A-Z a-z 0-9 . _ : -")
    return value


def generation_request(msg: coordinator_pb2.GenerateRequest, model: ModelInfo, limits: Limits) -> GenerationRequest:
    prompt = _prompt(msg, model, limits)
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else limits.default_max_tokens
    validate_that(0 < max_tokens <= limits.max_tokens, f"max_tokens must be in [1, {limits.max_tokens}]")
    validate_that(
        len(prompt) + max_tokens <= model.max_context,
        f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {model.max_context}",
    )
    fixed_k = _fixed_k(msg, limits)
    max_k = msg.max_draft_tokens if msg.HasField("max_draft_tokens") else limits.max_k
    validate_that(1 <= max_k <= limits.max_k, f"max_draft_tokens must be in [1, {limits.max_k}]")
    if msg.session_id:
        session_id(msg.session_id)
    validate_that(len(msg.stop) <= limits.max_stop_strings, f"at most {limits.max_stop_strings} stop strings")
    validate_that(
        all(0 < len(s) <= limits.max_stop_chars for s in msg.stop),
        f"stop strings must be 1..{limits.max_stop_chars} characters",
    )
    validate_that(msg.top_k >= 0, "top_k must be >= 0 (0 = off)")
    params = SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else secrets.randbits(63),
    ).validate()
    rules = StopRules(max_tokens, tuple(msg.stop), model.eos_token_ids, msg.ignore_eos)
    policy = PolicyConfig(max_k=max_k, default_k=min(limits.default_k, max_k))
    return GenerationRequest(tuple(prompt), rules, params, policy, fixed_k)


def _fixed_k(msg: coordinator_pb2.GenerateRequest, limits: Limits) -> int | None:
    """A request may pin K (no adaptation or fallback) or turn speculation off (K = 0)."""
    speculation_off = msg.HasField("speculation") and not msg.speculation
    if speculation_off:
        return 0
    if not msg.HasField("num_draft_tokens"):
        return None
    validate_that(1 <= msg.num_draft_tokens <= limits.max_k, f"num_draft_tokens (K) must be in [1, {limits.max_k}]")
    return msg.num_draft_tokens


def _prompt(msg: coordinator_pb2.GenerateRequest, model: ModelInfo, limits: Limits) -> list[int]:
    kind = msg.WhichOneof("prompt")
    validate_that(kind is not None, "a prompt is required: set `text` or `token_ids`")
    if kind == "text":
        validate_that(0 < len(msg.text) <= limits.max_prompt_chars, f"text must be 1..{limits.max_prompt_chars} characters")
        prompt = model.encode(msg.text)
    else:
        prompt = list(msg.token_ids.ids)
        validate_that(
            all(0 <= t < model.vocab_size for t in prompt), f"token_ids must be in [0, {model.vocab_size})"
        )
    validate_that(0 < len(prompt) <= limits.max_prompt_tokens, f"the prompt must be 1..{limits.max_prompt_tokens} tokens")
    return prompt


def stats_to_proto(
    stats: SessionStats, prompt_tokens: int, completion_tokens: int, mode: str
) -> coordinator_pb2.GenerationStats:
    return coordinator_pb2.GenerationStats(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        rounds=stats.rounds,
        drafted_tokens=stats.drafted,
        accepted_tokens=stats.accepted,
        mean_acceptance_length=stats.mean_acceptance_length,
        accepted_per_position=stats.accepted_per_position,
        drafted_per_position=stats.drafted_per_position,
        fallbacks=stats.fallbacks,
        resyncs=stats.resyncs,
        mode=mode,
    )


def final_stats(done: Finished, prompt_tokens: int) -> coordinator_pb2.GenerationStats:
    return stats_to_proto(done.stats, prompt_tokens, len(done.token_ids), done.session.policy.mode)


def complete_response(done: Finished, prompt_tokens: int) -> coordinator_pb2.CompleteResponse:
    return coordinator_pb2.CompleteResponse(
        text=done.text,
        token_ids=done.token_ids,
        finish_reason=done.finish_reason,
        stats=final_stats(done, prompt_tokens),
    )


def session_summary(state: SessionState) -> coordinator_pb2.SessionSummary:
    return coordinator_pb2.SessionSummary(
        session_id=state.session_id,
        length=len(state.tokens),
        mode=state.policy.mode,
        k=state.policy.k,
        alpha=state.policy.estimates.alpha,
        stats=stats_to_proto(state.stats, 0, 0, state.policy.mode),
        requests=state.requests,
    )
