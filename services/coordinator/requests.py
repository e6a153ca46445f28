"""What a client asks for, whichever edge it came through (gRPC or REST), and its validation
into the loop's GenerationRequest. Each edge converts its wire type into a `ClientRequest`;
the bounds and the error messages live here once."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from specd.contracts import MAX_CLIENT_ID, SamplingParams
from specd.loop import GenerationRequest
from specd.policy import PolicyConfig, hybrid
from specd.stopping import StopRules
from specd.validation import validate_that
from services.coordinator.model_info import ModelInfo


@dataclass(frozen=True)
class Limits:
    """The server's bounds on requests, and what the policy must know of the deployment; the policy's own
    defaults (specd/policy/base.py) are the one source."""

    default_k: int = PolicyConfig.default_k
    max_k: int = PolicyConfig.max_k
    default_max_tokens: int = 128
    max_tokens: int = 4096
    max_prompt_tokens: int = 8192
    max_prompt_chars: int = 64 * 1024
    max_stop_strings: int = 8
    max_stop_chars: int = 128
    min_confidence: float = PolicyConfig.min_confidence  # adaptive K's confidence stop
    request_timeout_s: float = 900.0  # a REST request's whole life, its reply streamed to the end
    stream_stall_s: float = 30.0  # how long one streamed write may wait on a client that does not read
    draft_contends: bool = PolicyConfig.draft_contends  # found at start-up (root.start_up)


@dataclass(frozen=True)
class ClientRequest:
    """A request as the client wrote it; None = the client left it out."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    num_draft_tokens: int | None = None  # a fixed K: adaptive K and fallback off
    ignore_eos: bool = False
    session_id: str = ""
    speculation: bool | None = None  # False: plain target decoding
    max_draft_tokens: int | None = None  # upper bound for adaptive K
    request_id: str = ""  # names a session's turn: a retry with it does not append the prompt again
    drafter: str = ""  # auto (""), model, ngram or none: who drafts (specd/policy/hybrid.py)


SESSION_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CLIENT_ID}}}")  # session and request ids alike


def session_id(value: str, name: str = "session_id") -> str:
    validate_that(SESSION_ID.fullmatch(value) is not None,
                  f"{name} must be 1..{MAX_CLIENT_ID} of A-Z a-z 0-9 . _ : -")
    return value


def generation_request(req: ClientRequest, model: ModelInfo, limits: Limits) -> GenerationRequest:
    prompt = _prompt(req, model, limits)
    max_tokens = req.max_tokens if req.max_tokens is not None else limits.default_max_tokens
    validate_that(0 < max_tokens <= limits.max_tokens, f"max_tokens must be in [1, {limits.max_tokens}]")
    validate_that(
        len(prompt) + max_tokens <= model.max_context,
        f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {model.max_context}",
    )
    fixed_k = _fixed_k(req, limits)
    max_k = req.max_draft_tokens if req.max_draft_tokens is not None else limits.max_k
    validate_that(1 <= max_k <= limits.max_k, f"max_draft_tokens must be in [1, {limits.max_k}]")
    if req.session_id:
        session_id(req.session_id)
    if req.request_id:
        session_id(req.request_id, "request id (Idempotency-Key)")
    validate_that(len(req.stop) <= limits.max_stop_strings, f"at most {limits.max_stop_strings} stop strings")
    validate_that(
        all(0 < len(s) <= limits.max_stop_chars for s in req.stop),
        f"stop strings must be 1..{limits.max_stop_chars} characters",
    )
    validate_that(req.top_k >= 0, "top_k must be >= 0 (0 = off)")
    params = SamplingParams(
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p if req.top_p is not None else 1.0,
        seed=req.seed if req.seed is not None else secrets.randbits(63),
    ).validate()
    rules = StopRules(max_tokens, req.stop, model.eos_token_ids, req.ignore_eos)
    bos = model.bos_token_id if req.token_ids is None else None  # token ids are taken as given
    drafter = req.drafter or hybrid.AUTO
    validate_that(drafter in hybrid.DRAFTERS, f"drafter must be one of {', '.join(hybrid.DRAFTERS)}")
    return GenerationRequest(tuple(prompt), rules, params, policy_config(limits, max_k), fixed_k, bos, drafter,
                             model.max_context)


def policy_config(limits: Limits, max_k: int) -> PolicyConfig:
    """The policy of a request that may draft up to max_k (at most the server's)."""
    return PolicyConfig(
        max_k=max_k, default_k=min(limits.default_k, max_k), min_confidence=limits.min_confidence,
        draft_contends=limits.draft_contends,
    )


def _fixed_k(req: ClientRequest, limits: Limits) -> int | None:
    """A request may pin K (no adaptation or fallback) or turn speculation off (K = 0)."""
    if req.speculation is False:
        return 0
    if req.num_draft_tokens is None:
        return None
    validate_that(1 <= req.num_draft_tokens <= limits.max_k, f"num_draft_tokens (K) must be in [1, {limits.max_k}]")
    return req.num_draft_tokens


def _prompt(req: ClientRequest, model: ModelInfo, limits: Limits) -> list[int]:
    validate_that(
        (req.text is None) != (req.token_ids is None), "a prompt is required: set either text or token ids"
    )
    if req.text is not None:
        validate_that(
            0 < len(req.text) <= limits.max_prompt_chars, f"the prompt must be 1..{limits.max_prompt_chars} characters"
        )
        prompt = model.encode(req.text)
    else:
        prompt = list(req.token_ids)
        validate_that(all(0 <= t < model.vocab_size for t in prompt), f"token ids must be in [0, {model.vocab_size})")
    validate_that(0 < len(prompt) <= limits.max_prompt_tokens, f"the prompt must be 1..{limits.max_prompt_tokens} tokens")
    return prompt
