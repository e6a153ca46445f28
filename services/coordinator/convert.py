"""The coordinator's edge: validate a GenerateRequest into a GenerationRequest, and
turn loop events into responses."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from specd.loop import Finished, GenerationRequest, Stats
from specd.sampling import InvalidParams, SamplingParams
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


def _validate_that(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidParams(message)


def generation_request(msg: coordinator_pb2.GenerateRequest, model: ModelInfo, limits: Limits) -> GenerationRequest:
    prompt = _prompt(msg, model, limits)
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else limits.default_max_tokens
    _validate_that(0 < max_tokens <= limits.max_tokens, f"max_tokens must be in [1, {limits.max_tokens}]")
    _validate_that(
        len(prompt) + max_tokens <= model.max_context,
        f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {model.max_context}",
    )
    k = msg.num_draft_tokens if msg.HasField("num_draft_tokens") else limits.default_k
    _validate_that(1 <= k <= limits.max_k, f"num_draft_tokens (K) must be in [1, {limits.max_k}]")
    _validate_that(len(msg.stop) <= limits.max_stop_strings, f"at most {limits.max_stop_strings} stop strings")
    _validate_that(
        all(0 < len(s) <= limits.max_stop_chars for s in msg.stop),
        f"stop strings must be 1..{limits.max_stop_chars} characters",
    )
    _validate_that(msg.top_k >= 0, "top_k must be >= 0 (0 = off)")
    params = SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else secrets.randbits(63),
    ).validate()
    rules = StopRules(max_tokens, tuple(msg.stop), model.eos_token_ids, msg.ignore_eos)
    return GenerationRequest(tuple(prompt), rules, params, k)


def _prompt(msg: coordinator_pb2.GenerateRequest, model: ModelInfo, limits: Limits) -> list[int]:
    kind = msg.WhichOneof("prompt")
    _validate_that(kind is not None, "a prompt is required: set `text` or `token_ids`")
    if kind == "text":
        _validate_that(0 < len(msg.text) <= limits.max_prompt_chars, f"text must be 1..{limits.max_prompt_chars} characters")
        prompt = model.encode(msg.text)
    else:
        prompt = list(msg.token_ids.ids)
        _validate_that(
            all(0 <= t < model.vocab_size for t in prompt), f"token_ids must be in [0, {model.vocab_size})"
        )
    _validate_that(0 < len(prompt) <= limits.max_prompt_tokens, f"the prompt must be 1..{limits.max_prompt_tokens} tokens")
    return prompt


def stats_to_proto(stats: Stats, prompt_tokens: int, completion_tokens: int) -> coordinator_pb2.GenerationStats:
    return coordinator_pb2.GenerationStats(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        rounds=stats.rounds,
        drafted_tokens=stats.drafted,
        accepted_tokens=stats.accepted,
        mean_acceptance_length=stats.mean_acceptance_length,
        accepted_per_position=stats.accepted_per_position,
    )


def complete_response(done: Finished, prompt_tokens: int) -> coordinator_pb2.CompleteResponse:
    return coordinator_pb2.CompleteResponse(
        text=done.text,
        token_ids=done.token_ids,
        finish_reason=done.finish_reason,
        stats=stats_to_proto(done.stats, prompt_tokens, len(done.token_ids)),
    )
