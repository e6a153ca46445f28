"""Stop conditions applied token by token, and incremental detokenisation for streaming.

Generation ends exactly where the target alone would: on an EOS token (kept in the token
ids, as HF `generate` does), after the token that completes a stop string (the text is
cut before the stop string, as OpenAI does), or at max_tokens.

The text is the decode of all token ids, but each token decodes only a short tail of them: the
text before a point in the tail is settled (kept, never decoded again) once the tokens after it
decode apart to the rest of the text (less the blank that Llama's decoder strips from the start of
a text) and no later token can change it. Byte-level BPE (Qwen) decodes all the bytes as one lossy
UTF-8 string: such a split at a character boundary is final. SentencePiece with byte fallback
(Gemma, Llama) decodes a run of byte tokens as a whole, all "\ufffd" unless it is valid UTF-8: a
token whose piece has two or more characters ends any run (a byte token decodes alone to one) and
settles at once; inside a run a character boundary settles once LONG_TAIL tokens follow it, exact
unless a run that long is invalid at some token. A tail with neither past HARD_TAIL tokens (garbage
bytes) settles at any such split, then as it stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

FINISH_STOP, FINISH_LENGTH = "stop", "length"
LONG_TAIL = 16  # a character boundary settles once this many tokens follow it (a whole token settles at once)
HARD_TAIL = 48  # past this any equal split settles, past HARD_TAIL + 4 the whole tail: a token decodes < 60 ids


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
    finish_reason: str | None = None
    _settled: list[str] = field(default_factory=list, init=False)  # text pieces no later token can change
    _settled_chars: int = field(default=0, init=False)
    _tail: list[int] = field(default_factory=list, init=False)  # the ids after the settled text
    _tail_text: str = field(default="", init=False)
    _mark: int = field(default=0, init=False)  # a point in the tail where its text was whole (0: none)
    _mark_text: str = field(default="", init=False)
    _cut: int | None = field(default=None, init=False)  # where a stop string begins

    @property
    def text(self) -> str:
        text = "".join(self._settled) + self._tail_text
        return text if self._cut is None else text[: self._cut]

    def push(self, token: int) -> str:
        """Commit one token; returns the text that became final. Sets finish_reason when done."""
        assert self.finish_reason is None, "push after finish"
        self.token_ids.append(token)
        self._extend(token)
        # Only text past what was emitted (less a stop string's length) can hold a new match or a held-back tail.
        start = max(0, self.emitted - max((len(s) for s in self.rules.stop), default=0))
        recent = self._text_from(start)
        eos_stop = token in self.rules.eos_token_ids and not self.rules.ignore_eos
        stop_at = self._stop_string_index(recent)
        string_stop = stop_at is not None
        length_stop = len(self.token_ids) >= self.rules.max_tokens
        if string_stop:
            recent, self._cut = recent[:stop_at], start + stop_at
        if eos_stop or string_stop:
            self.finish_reason = FINISH_STOP
        elif length_stop:
            self.finish_reason = FINISH_LENGTH
        return self._release(recent, start, final=self.finish_reason is not None)

    def _extend(self, token: int) -> None:
        """Decode the tail with `token`, and settle the part of it that no later token can change."""
        piece = self.decode([token])
        if not piece and not self.decode([token, token]):
            return  # a skipped special token: it changes no text, now or later
        before = self._tail_text
        self._tail.append(token)
        self._tail_text = self.decode(self._tail)
        newest = len(self._tail) - 1
        head = self._head(before, piece) if newest else None
        if head is not None and (len(piece) > 1 or newest > HARD_TAIL):
            self._settle(newest, head, piece)
        elif not self._tail_text.endswith("\ufffd"):
            self._settle_at_mark()
        if len(self._tail) > HARD_TAIL + 4:  # garbage that no equal split ends (byte-level BPE never gets here)
            self._settle(len(self._tail), self._tail_text, "")

    def _settle_at_mark(self) -> None:
        """The tail's text is whole now: settle at the mark if it is LONG_TAIL tokens back and the rest
        decodes apart to the same text, then mark this point."""
        if self._mark and len(self._tail) - self._mark < LONG_TAIL:
            return  # a run of byte tokens through the mark may still turn invalid
        rest = self.decode(self._tail[self._mark :]) if self._mark else ""
        head = self._head(self._mark_text, rest)
        if head is not None:
            self._settle(self._mark, head, rest)
        self._mark, self._mark_text = len(self._tail), self._tail_text

    def _head(self, prefix: str, rest: str) -> str | None:
        """The text to settle at a point where the tail's text was `prefix` and the tokens after it decode
        apart to `rest`: the tail's text less `rest`, if that is `prefix` and at most the blank that a
        decoder drops from the start of a text (Llama's Strip); None if those tokens changed `prefix`."""
        head = self._tail_text[: len(self._tail_text) - len(rest)]
        if rest and self._tail_text.endswith(rest) and head.startswith(prefix) and not head[len(prefix) :].strip():
            return head
        return None

    def _settle(self, at: int, text: str, rest: str) -> None:
        """Settle the tail's first `at` tokens, whose text is `text`; `rest` is the text of the others."""
        self._settled.append(text)
        self._settled_chars += len(text)
        self._tail, self._tail_text, self._mark = self._tail[at:], rest, 0

    def _text_from(self, start: int) -> str:
        """text[start:], joined from the few pieces it spans."""
        pieces, at = [self._tail_text], self._settled_chars
        for piece in reversed(self._settled):
            if at <= start:
                break
            pieces.append(piece)
            at -= len(piece)
        return "".join(reversed(pieces))[start - at :]

    def _stop_string_index(self, recent: str) -> int | None:
        hits = [i for s in self.rules.stop if (i := recent.find(s)) >= 0]
        return min(hits) if hits else None

    def _release(self, recent: str, start: int, final: bool) -> str:
        """`recent` is the text from `start`, which is at most `emitted`."""
        end = len(recent) if final else self._safe_end(recent)
        delta = recent[self.emitted - start : end]
        self.emitted = max(self.emitted, start + end)
        return delta

    def _safe_end(self, recent: str) -> int:
        """Hold back an incomplete character and any tail that may grow into a stop string."""
        head = recent.rstrip("\ufffd")
        hold = max((n for s in self.rules.stop for n in range(1, len(s)) if head.endswith(s[:n])), default=0)
        return len(head) - hold
