"""Stop conditions applied token by token, and incremental detokenisation for streaming.

Generation ends exactly where the target alone would: on an EOS token (kept in the token
ids, as HF `generate` does), after the token that completes a stop string (the text is
cut before the stop string, as OpenAI does), or at max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

FINISH_STOP, FINISH_LENGTH = "stop", "length"


@dataclass(frozen=True)
class StopRules:
    max_tokens: int
    stop: tuple[str, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass
class StopChecker:
    rules: StopRules
    decode: Decode
    token_ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of text already handed out
    text: str = ""
    finish_reason: str | None = None

    def push(self, token: int) -> str:
        """Commit one token; returns the text that became final. Sets finish_reason when done."""
        assert self.finish_reason is None, "push after finish"
        self.token_ids.append(token)
        self.text = self.decode(self.token_ids)
        eos_stop = token in self.rules.eos_token_ids and not self.rules.ignore_eos
        stop_at = self._stop_string_index()
        string_stop = stop_at is not None
        length_stop = len(self.token_ids) >= self.rules.max_tokens
        if string_stop:
            self.text = self.text[:stop_at]
        if eos_stop or string_stop:
            self.finish_reason = FINISH_STOP
        elif length_stop:
            self.finish_reason = FINISH_LENGTH
        return self._release(final=self.finish_reason is not None)

    def _stop_string_index(self) -> int | None:
        # Only text past what was emitted (plus a stop string's length) can hold a new match.
        window = max(0, self.emitted - max((len(s) for s in self.rules.stop), default=0))
        hits = [i for s in self.rules.stop if (i := self.text.find(s, window)) >= 0]
        return min(hits) if hits else None

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else self._safe_end()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def _safe_end(self) -> int:
        """Hold back an incomplete character and any tail that may grow into a stop string."""
        head = self.text.rstrip("\ufffd")
        hold = max((n for s in self.rules.stop for n in range(1, len(s)) if head.endswith(s[:n])), default=0)
        return len(head) - hold
