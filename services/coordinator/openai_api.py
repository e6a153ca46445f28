"""The coordinator's REST edge, OpenAI-compatible: request schemas, their conversion into a
ClientRequest (validated in requests.py like a gRPC one), and response bodies.

Fields OpenAI defines that specd cannot honour exactly (n > 1, logprobs, penalties, logit
bias, echo, suffix, tools) are refused with a 400 when set to anything but their neutral
value: silently ignoring them would return something other than what was asked. Unknown
fields are ignored, as vLLM does. specd's own fields (speculation on/off, K, a session) sit
next to OpenAI's; the official client sends them with `extra_body`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specd.loop import Finished
from specd.session import SessionStats
from specd.validation import valid_text, validate_that
from services.coordinator.model_info import ModelInfo
from services.coordinator.requests import ClientRequest, Limits

MAX_MESSAGES = 256
MAX_STOP = 64  # list lengths are bounded here; requests.py applies the real limit with a clear message


class SpecdOptions(BaseModel):
    """specd's extensions, accepted on both endpoints."""

    model_config = ConfigDict(extra="ignore")

    speculation: bool | None = None  # false: plain target decoding
    drafter: str | None = Field(None, max_length=16)  # auto | model | ngram | none
    num_draft_tokens: int | None = Field(None, ge=1)  # a fixed K: adaptive K and fallback off
    max_draft_tokens: int | None = Field(None, ge=1)  # upper bound for adaptive K
    session_id: str | None = None  # continue (or start) a multi-turn session
    ignore_eos: bool = False
    top_k: int | None = None  # 0 or -1 = off (vLLM's convention)


class SamplingFields(SpecdOptions):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)  # OpenAI's default is 1
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=1)
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, unused


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None


COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def completion_request(body: CompletionRequest) -> ClientRequest:
    _refuse_unsupported(body)
    validate_that(not body.echo, "echo is not supported")
    validate_that(body.suffix is None, "suffix is not supported")
    validate_that(body.best_of in (None, 1), "best_of must be 1")
    text, token_ids = _single_prompt(body.prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS
    return _client_request(body, text=text, token_ids=token_ids, max_tokens=max_tokens)


def chat_request(body: ChatCompletionRequest, model: ModelInfo, limits: Limits) -> ClientRequest:
    """Rendered and tokenised here: call it off the event loop (its work grows with the messages)."""
    _refuse_unsupported(body)
    validate_that(body.tools is None and body.tool_choice is None, "tools are not supported")
    validate_that(body.response_format in (None, {"type": "text"}), "response_format is not supported")
    validate_that(model.chat_template is not None, "this model has no chat template: use /v1/completions")
    messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
    chars = sum(len(m["content"]) for m in messages)
    validate_that(chars <= limits.max_prompt_chars,  # before the template and tokenizer see them
                  f"the messages must hold at most {limits.max_prompt_chars} characters in all, not {chars}")
    token_ids = model.chat_prompt(messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _client_request(body, token_ids=tuple(token_ids), max_tokens=max_tokens)


def _refuse_unsupported(body: SamplingFields) -> None:
    validate_that(body.logprobs in (None, False), "logprobs are not supported")
    validate_that(body.presence_penalty == 0.0 and body.frequency_penalty == 0.0, "penalties are not supported")
    validate_that(not body.logit_bias, "logit_bias is not supported")


def _single_prompt(prompt) -> tuple[str | None, tuple[int, ...] | None]:
    """A string or token ids; OpenAI's batch forms are accepted holding exactly one prompt."""
    if isinstance(prompt, str):
        return valid_text(prompt, "the prompt"), None
    validate_that(len(prompt) > 0, "the prompt must not be empty")
    if isinstance(prompt[0], int):
        return None, tuple(prompt)
    validate_that(len(prompt) == 1, "one prompt per request")
    return _single_prompt(prompt[0])


def _message_text(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return valid_text(message.content, "a message's content")
    parts = []
    for part in message.content:
        validate_that(part.get("type") == "text" and isinstance(part.get("text"), str), "only text content parts")
        parts.append(valid_text(part["text"], "a message's content"))
    return "".join(parts)


def _client_request(body: SamplingFields, **prompt_and_length) -> ClientRequest:
    stop = tuple(valid_text(s, "a stop string") for s in ((body.stop,) if isinstance(body.stop, str) else body.stop or ()))
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    return ClientRequest(
        **prompt_and_length,
        stop=stop,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=top_k,
        top_p=body.top_p,
        seed=body.seed,
        num_draft_tokens=body.num_draft_tokens,
        ignore_eos=body.ignore_eos,
        session_id=body.session_id or "",
        speculation=body.speculation,
        max_draft_tokens=body.max_draft_tokens,
        drafter=body.drafter or "",
    )


def include_usage(body: SamplingFields) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))


# --- responses ----------------------------------------------------------------------------


class Reply:
    """Ids and timestamps shared by one response's body or stream chunks."""

    def __init__(self, kind: Literal["completion", "chat"], model: str):
        self.kind, self.model = kind, model
        self.prompt_tokens, self.session_id = 0, ""  # known once the request is validated
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        obj = "text_completion" if self.kind == "completion" else ("chat.completion.chunk" if chunk else "chat.completion")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, done: Finished) -> dict:
        choice = {"index": 0, "finish_reason": done.finish_reason}
        if self.kind == "completion":
            choice |= {"text": done.text, "logprobs": None}
        else:
            choice |= {"message": {"role": "assistant", "content": done.text}}
        return self._envelope(False) | {
            "choices": [choice],
            "usage": self.usage(len(done.token_ids)),
            "specd": self.specd(done),
        }

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        else:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return self._envelope(True) | {"choices": [choice]}

    def final_chunk(self, done: Finished) -> dict:
        return self.chunk("", done.finish_reason) | {"specd": self.specd(done)}

    def usage_chunk(self, done: Finished) -> dict:
        return self._envelope(True) | {"choices": [], "usage": self.usage(len(done.token_ids))}

    def usage(self, completion_tokens: int) -> dict:
        total = self.prompt_tokens + completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}

    def specd(self, done: Finished) -> dict:
        return {"session_id": self.session_id or None, "mode": done.session.policy.mode, **stats_json(done.stats)}


def stats_json(stats: SessionStats) -> dict:
    return {
        "rounds": stats.rounds,
        "drafted_tokens": stats.drafted,
        "accepted_tokens": stats.accepted,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "accepted_per_position": list(stats.accepted_per_position),
        "drafted_per_position": list(stats.drafted_per_position),
        "fallbacks": stats.fallbacks,
        "resyncs": stats.resyncs,
        "judged_tokens": stats.judged,
        "draft_compute_s": stats.draft_compute_s,
        "verify_compute_s": stats.verify_compute_s,
        "round_wall_s": stats.round_wall_s,
        "outage_rounds": stats.outage_rounds,
        "model_free_drafted_tokens": stats.model_free_drafted,
        "model_free_accepted_tokens": stats.model_free_accepted,
        "draft_wall_s": stats.draft_wall_s,
        "verify_wall_s": stats.verify_wall_s,
        "verify_queued_s": stats.verify_queued_s,
        "save_s": stats.save_s,
    }


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
