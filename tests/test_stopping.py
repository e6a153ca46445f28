from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pytest
from tokenizers import Tokenizer

from specd.stopping import FINISH_LENGTH, FINISH_STOP, LONG_TAIL, Decode, StopChecker, StopRules


def push_all(checker: StopChecker, tokens) -> list[str]:
    out = []
    for t in tokens:
        out.append(checker.push(t))
        if checker.finish_reason:
            break
    return out


def chars(ids) -> str:
    return "".join(map(chr, ids))


def test_holds_back_a_possible_stop_prefix_then_releases_it():
    checker = StopChecker(StopRules(max_tokens=10, stop=("xyz",)), chars)
    deltas = push_all(checker, map(ord, "abxyq"))
    assert deltas == ["a", "b", "", "", "xyq"]
    assert checker.finish_reason is None


def test_stop_string_spanning_tokens_is_cut():
    checker = StopChecker(StopRules(max_tokens=10, stop=("xyz",)), chars)
    deltas = push_all(checker, map(ord, "abxyzc"))
    assert "".join(deltas) == "ab" and checker.finish_reason == "stop" and len(checker.token_ids) == 5


def test_incomplete_character_is_held_back():
    pieces = {1: "a", 2: "\ufffd", 3: "é"}

    def decode(ids):
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffdé", "é")  # token 2 + 3 form one character

    checker = StopChecker(StopRules(max_tokens=3), decode)
    assert push_all(checker, [1, 2, 3]) == ["a", "", "é"]
    assert checker.finish_reason == "length"


def test_eos_is_kept_in_ids_and_ignore_eos_goes_on():
    checker = StopChecker(StopRules(max_tokens=5, eos_token_ids=frozenset({0})), chars)
    push_all(checker, [97, 0, 98])
    assert checker.token_ids == [97, 0] and checker.finish_reason == "stop"
    ignoring = StopChecker(StopRules(max_tokens=3, eos_token_ids=frozenset({0}), ignore_eos=True), chars)
    push_all(ignoring, [97, 0, 98])
    assert ignoring.token_ids == [97, 0, 98] and ignoring.finish_reason == "length"


# Incremental detokenisation: the same deltas, text and finish as decoding the whole output at
# every token (today's algorithm, kept here as the oracle), with bounded work per token.

TEXTS = ["héllo", " wörld", "日本語", "🙂", "👩\u200d💻", "😀🎉", " ", "  ", "\n", "\n\n", "END", "</s>", "é🙂", "a",
         "the", " the world", "1234", "€", "ß", "\t", "def f(x):\n    return x"]


@dataclass
class QuadraticChecker:
    """specd/stopping.py's StopChecker before incremental decoding: the whole output decoded per token."""

    rules: StopRules
    decode: Decode
    token_ids: list[int] = field(default_factory=list)
    emitted: int = 0
    text: str = ""
    finish_reason: str | None = None

    def push(self, token: int) -> str:
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
        window = max(0, self.emitted - max((len(s) for s in self.rules.stop), default=0))
        hits = [i for s in self.rules.stop if (i := self.text.find(s, window)) >= 0]
        return min(hits) if hits else None

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else self._safe_end()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def _safe_end(self) -> int:
        head = self.text.rstrip("\ufffd")
        hold = max((n for s in self.rules.stop for n in range(1, len(s)) if head.endswith(s[:n])), default=0)
        return len(head) - hold


@dataclass(frozen=True)
class Vocabulary:
    """A real tokenizer as the coordinator decodes with it, and the ids worth drawing often."""

    decode: Decode
    encode: Callable[[str], list[int]]
    size: int
    special: tuple[int, ...]  # skipped by decode
    eos: int
    byte_tokens: dict[int, int]  # SentencePiece byte fallback: id of <0xAB> -> 0xAB


def _vocabulary(tok, decode: Decode, eos: int) -> Vocabulary:
    special = tuple(sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special))
    byte_tokens = {i: int(t[3:5], 16) for t, i in tok.get_vocab().items() if re.fullmatch(r"<0x[0-9A-F]{2}>", t)}
    return Vocabulary(decode, lambda text: tok.encode(text, add_special_tokens=False).ids, tok.get_vocab_size(),
                      special, eos, byte_tokens)


@pytest.fixture(scope="module", params=["tiny", "tiny-spm", "tiny-spm-llama",
                                        pytest.param("qwen", marks=pytest.mark.real),
                                        pytest.param("gemma", marks=pytest.mark.real)])
def vocabulary(request, tmp_path_factory) -> Vocabulary:
    """Byte-level BPE (one token per byte; Qwen's own) and SentencePiece with byte fallback (tiny; Gemma
    3's; and tiny with the Strip that a Llama GGUF's add_space_prefix adds: the first blank is dropped)."""
    from services.coordinator.model_info import load_model_info
    from tests.test_model_info import real, write_spm_gguf

    if request.param == "tiny":
        from tests.tiny import EOS, build_tokenizer

        tok = build_tokenizer().backend_tokenizer
        return _vocabulary(tok, lambda ids: tok.decode(list(ids), skip_special_tokens=True), tok.token_to_id(EOS))
    if request.param.startswith("tiny-spm"):
        info = load_model_info(write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf"))
        if request.param == "tiny-spm-llama":
            spec = json.loads(info.tokenizer.to_str())
            spec["decoder"]["decoders"].append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
            tok = Tokenizer.from_str(json.dumps(spec))
            return _vocabulary(tok, lambda ids: tok.decode(list(ids), skip_special_tokens=True),
                               min(info.eos_token_ids))
    else:
        info = load_model_info(real("target" if request.param == "qwen" else "gemma3-270m"))
    return _vocabulary(info.tokenizer, info.decode, min(info.eos_token_ids))


def _random_ids(rng: random.Random, vocab: Vocabulary, length: int) -> list[int]:
    """Encoded text (multi-byte characters, emoji, spaces), cut at any token, mixed with any id at all."""
    ids: list[int] = []
    while len(ids) < length:
        roll = rng.random()
        if roll < 0.6:
            ids += vocab.encode("".join(rng.choices(TEXTS, k=rng.randint(1, 4))))
        elif roll < 0.8:
            ids.append(rng.randrange(vocab.size))
        elif roll < 0.9:
            ids.append(rng.choice(vocab.special))
        else:  # a run of one character's pieces, or of a broken one's
            ids += vocab.encode(rng.choice(TEXTS))[: rng.randint(1, 3)] * rng.randint(1, 3)
    return ids[:length]


def _random_rules(rng: random.Random, vocab: Vocabulary, ids: list[int]) -> StopRules:
    """Stop strings cut from the output itself (so they span tokens), or from the texts."""
    text = vocab.decode(ids)
    stops = []
    for _ in range(rng.randint(0, 4)):
        if text and rng.random() < 0.7:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 6)])
        else:
            stops.append(rng.choice(TEXTS))
    return StopRules(max_tokens=rng.randint(1, len(ids) + 4), stop=tuple(stops),
                     eos_token_ids=frozenset({vocab.eos}), ignore_eos=rng.random() < 0.7)


def _long_multibyte_run(vocab: Vocabulary, ids: Sequence[int]) -> bool:
    """Whether the ids hold more than LONG_TAIL byte-fallback tokens in a row (skipped special tokens do
    not break a run), some not ASCII. Byte fallback decodes a run as a whole, all "\ufffd" while it is
    not valid UTF-8: only the quadratic decode follows that back to the run's start. StopChecker
    settles long runs at character boundaries, so where such a run is invalid at some token (a
    character not complete yet, a broken one) the two may hold back, emit or end differently."""
    run: list[int] = []
    for token in [*ids, None]:
        if token in vocab.special:
            continue
        if token in vocab.byte_tokens:
            run.append(vocab.byte_tokens[token])
        elif len(run) > LONG_TAIL and max(run) >= 0x80:
            return True
        else:
            run = []
    return False


def _run(checker, ids: Sequence[int]) -> tuple[list[str], str, str | None, list[int]]:
    deltas = push_all(checker, ids)
    return deltas, checker.text, checker.finish_reason, checker.token_ids


def test_incremental_decoding_streams_exactly_what_decoding_the_whole_output_does(vocabulary):
    rng = random.Random(31)
    exact = 0
    for case in range(200):
        ids = _random_ids(rng, vocabulary, rng.choice([8, 40, 120]))
        rules = _random_rules(rng, vocabulary, ids)
        ours = _run(StopChecker(rules, vocabulary.decode), ids)
        theirs = _run(QuadraticChecker(rules, vocabulary.decode), ids)
        if not _long_multibyte_run(vocabulary, theirs[3]):
            assert ours == theirs, (case, ids, rules)
            exact += 1
    assert exact >= 150  # the tiny SentencePiece vocabulary spells most text in byte tokens: ~10% are left out


def test_the_decode_work_per_token_is_bounded(vocabulary):
    """A 4096-token output with 8 stop strings that never match: a count, not a timing."""
    rng = random.Random(5)
    ids = _random_ids(rng, vocabulary, 4096)
    decoded = [0]

    def counting(token_ids: Sequence[int]) -> str:
        decoded[0] += len(token_ids)
        return vocabulary.decode(token_ids)

    stops = tuple(f"<never{i}>" for i in range(8))
    checker = StopChecker(StopRules(max_tokens=len(ids), stop=stops), counting)
    text = "".join(push_all(checker, ids))
    assert checker.finish_reason == FINISH_LENGTH and text
    assert checker.text == vocabulary.decode(ids) or _long_multibyte_run(vocabulary, ids)
    assert decoded[0] <= 64 * len(ids)
