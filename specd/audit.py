"""Online lossless audit: now and then a finished greedy request is decoded again, plainly, on the
target, and the tokens it committed must be exactly the plain steps' tokens.

Speculative decoding is lossless when a verification's K + 1 rows give the tokens K + 1 plain
steps would: bit for bit with a batch-invariant target (a GGUF file), resting on argmax margins otherwise
(specd/numerics.py). The audit checks that claim on live traffic.

What is compared: the first N tokens of plain greedy decoding (the loop with K = 0: every round a
`VerifyRequest` without drafts) from the request's own prefix (the session's committed tokens
before the request, then its prompt), with no stop string and no EOS stop, against the N tokens
the request committed. That is the exact test: a stop is a function of the token prefix (the
`StopChecker` takes tokens one at a time however rounds chunk them), so equal first N tokens mean
plain decoding with the request's own stop rules ends on the same token with the same text, and
output that differs anywhere differs at or before the request's last token.

Greedy requests only. A sampled request is reproducible for one K, not across K: randomness is
keyed by position (specd/sampling.py), but a speculative round accepts the draft's token on
u_accept against p / q and draws a rejected position's token from the residual max(0, p - q),
where a plain step draws from p itself. Both follow the target's distribution; their tokens need
not agree, so a plain run is no reference for them.

The audit runs off the request's path (its client never waits for it), at most one at a time per
coordinator (an audit drawn while one runs is dropped and counted), on a scratch session it
forgets afterwards (target cache and store). A pinned K never writes the deployment's policy
prior, so the audit's plain steps teach the policy nothing. Transport-free: any `Services`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from opentelemetry import context, trace

from specd.contracts import SamplingParams
from specd.loop import Finished, GenerationRequest, Services, generate
from specd.stopping import StopRules
from specd.validation import validate_that

DEFAULT_RATE = 0.01  # the coordinator's default: one finished request in a hundred is drawn
# What became of a drawn request: audited ("match", "mismatch") or not ("sampled": not greedy,
# "busy": another audit was running, "failed": the plain run raised).
AUDITED, SKIPPED = ("match", "mismatch"), ("sampled", "busy", "failed")
log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


def validate_rate(rate: float) -> float:
    validate_that(0.0 <= rate <= 1.0, f"audit rate must be a fraction in [0, 1] (0: off), got {rate}")
    return rate


@dataclass(frozen=True)
class Mismatch:
    position: int  # in the request's output, 0-based
    speculative: int  # the token the request committed there
    plain: int  # the token plain decoding gives there


def first_mismatch(committed: Sequence[int], plain: Sequence[int]) -> Mismatch | None:
    """Where the two first differ; plain decoding of as many tokens never stops earlier."""
    assert len(plain) == len(committed), "the plain run decodes exactly as many tokens"
    return next((Mismatch(i, c, p) for i, (c, p) in enumerate(zip(committed, plain)) if c != p), None)


async def plain_tokens(services: Services, prompt: Sequence[int], n: int, params: SamplingParams) -> tuple[int, ...]:
    """The first n tokens the target alone decodes after `prompt`, on a scratch session the loop
    forgets afterwards. No stop applies, so no text is needed."""
    request = GenerationRequest(tuple(prompt), StopRules(n, ignore_eos=True), params, fixed_k=0)
    events = generate(request, f"audit-{uuid.uuid4().hex}", services, lambda ids: "")
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished):
                return event.token_ids
    raise AssertionError("the loop always ends with Finished")


class Auditor:
    """Draws finished requests at `rate` and audits the greedy ones in the background; tells
    `on_outcome` (metrics) what became of every drawn request (`AUDITED`, `SKIPPED`)."""

    def __init__(
        self,
        services: Services,
        rate: float,
        draw: random.Random | None = None,
        on_outcome: Callable[[str], None] = lambda outcome: None,
    ):
        self.services, self.rate, self.on_outcome = services, validate_rate(rate), on_outcome
        self.draw = draw or random.Random()
        self.running: asyncio.Task | None = None

    def offer(self, session_id: str, request: GenerationRequest, finished: Finished) -> None:
        """A request finished: maybe start its audit. Never waits; call on the event loop."""
        drawn = self.rate > 0 and self.draw.random() < self.rate
        if not drawn:
            return
        if not request.params.greedy:
            self.on_outcome("sampled")
        elif self.running is not None:
            self.on_outcome("busy")
        else:
            origin = trace.get_current_span().get_span_context()  # the request's span, when traced
            self.running = asyncio.create_task(self._audit(session_id, request.params, finished, origin))
            self.running.add_done_callback(self._done)

    async def idle(self) -> None:
        """Wait for the running audit, if any, to end."""
        if self.running is not None:
            await asyncio.wait([self.running])

    async def close(self) -> None:
        """Cancel the running audit (its scratch session is still forgotten)."""
        if self.running is not None:
            self.running.cancel()
            await self.idle()

    def _done(self, task: asyncio.Task) -> None:
        self.running = None

    async def _audit(
        self, session_id: str, params: SamplingParams, finished: Finished, origin: trace.SpanContext
    ) -> None:
        committed = finished.token_ids
        prefix = finished.session.tokens[: len(finished.session.tokens) - len(committed)]
        # A trace of its own (the request's ended with its response), linked to the request's.
        with tracer.start_as_current_span(
            "speculation.audit", context.Context(), links=[trace.Link(origin)] if origin.is_valid else [],
            attributes={"specd.session_id": session_id, "specd.completion_tokens": len(committed)},
        ) as span:
            try:
                plain = await plain_tokens(self.services, prefix, len(committed), params)
            except Exception as error:  # a service away or overloaded: the audit is best effort
                log.warning("lossless audit of session %s failed: %r", session_id, error)
                self.on_outcome("failed")
                return
            mismatch = first_mismatch(committed, plain)
            span.set_attribute("specd.audit_mismatch", mismatch.position if mismatch else -1)
        if mismatch:
            log.warning(
                "lossless audit: session %s differs from plain decoding at output position %d (sequence position "
                "%d) of %d: speculative token %d, plain token %d",
                session_id, mismatch.position, len(prefix) + mismatch.position, len(committed),
                mismatch.speculative, mismatch.plain,
            )
        self.on_outcome("mismatch" if mismatch else "match")
