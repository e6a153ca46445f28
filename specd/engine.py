"""A Hugging Face causal LM holding one KV cache per session.

A session is a token sequence plus a DynamicCache over a prefix of it. The tokens are the truth;
the cache is a soft copy: rollback is position bookkeeping (crop the cache), and anything not yet
in the cache is *pending* and is fed on the next forward.

The cache never runs ahead of the tokens. A forward needs at least one token to feed (its last row is
"next-token logits after the last known token", and logits are not stored), so when nothing is pending
it re-feeds the last token. Keeping the KV of every fed token matters: after a fully accepted round the
verified drafts' KV is reused, not recomputed.

Not thread-safe, and bound to one thread: the thread that builds an engine is the only one that may
run its model. The serving layer builds it on its worker thread and runs every call there, so there
are no locks here; and torch's OpenMP pool is per calling thread, so a second thread running torch in
the process would make every forward slower (services/common/worker.py).
"""

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from specd import fused, gguf_model, kernels, numerics, quants, ragged
from specd.contracts import ContextTooLong, EngineError, PositionMismatch, SessionsFull  # noqa: F401 (raised here)
from specd.validation import InvalidParams

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    device: str = "cpu"
    dtype: str = "float32"  # a key of DTYPES
    threads: int | None = None  # torch.set_num_threads when set: services on one host share cores
    max_sessions: int = 64
    idle_evict_s: float = 5.0  # a session idle this long may be evicted (LRU) to make room
    max_context: int | None = None  # default: the model's max_position_embeddings
    small_row_matmul: bool = True  # CPU: fast linears for decoding-sized inputs (packed weights, specd/kernels.py)
    quantize: str = "none"  # none | int8 (a draft's) | auto: the weights it runs (specd/numerics.py)
    fused_int8: bool = True  # int8: fused projections without module calls, same logits (specd/fused.py)
    head_vocab: int = 0  # GGUF: the output layer scores the first this many ids and the special ones (0: all)


class WrongThread(RuntimeError):
    """The model was run from a thread other than the one that built the engine."""


@dataclass
class _Session:
    cache: DynamicCache
    tokens: list[int] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first max(length, 0) cached tokens. A negative argument to crop means "remove that
    many" in every transformers version (5.x rejects the positive, keep-this-many form of 4.x)."""
    excess = cache.get_seq_length() - max(length, 0)
    if excess > 0:
        cache.crop(-excess)


class ModelEngine:
    def __init__(self, config: EngineConfig):
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.config = config
        self.model, self._native, self._fused = None, None, None
        if gguf_model.is_gguf(config.model_dir):
            self._load_gguf(config)
        else:
            self._load_hf(config)
        self.max_context: int = config.max_context or self._context
        self.instance_id = uuid.uuid4().hex  # lets clients notice a restarted engine (all caches lost)
        self._thread = threading.get_ident()  # the one thread that runs the model
        self.evictions = 0
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self.last_pass_rows = 0  # positions the latest forward_many fed, every session's (what its time paid for)

    def _load_gguf(self, config: EngineConfig) -> None:
        """The file's weights as stored, run by specd's decoder (specd/gguf_model.py)."""
        if config.quantize not in ("none", "auto", "q4_0"):
            raise ValueError(f"quantize={config.quantize!r} applies to a Hugging Face checkpoint; a GGUF file is "
                             "served as stored (quantize none or auto; a draft's may run q4_0)")
        if torch.device(config.device).type != "cpu":
            raise ValueError("a GGUF file runs on the CPU decoder; serve a Hugging Face directory on other devices")
        requantize = quants.Q4_0 if config.quantize == "q4_0" else None  # a draft's: fewer bytes a step
        self._native = gguf_model.GGUFModel(config.model_dir, head_vocab=config.head_vocab, requantize=requantize)
        self.numerics = numerics.check_native(self._native)
        self.hf_config = None
        self._new_cache = self._native.new_cache
        self.vocab_size: int = self._native.vocab_size
        self.eos_token_ids: frozenset[int] = self._native.eos_token_ids
        self.vocab_digest: str = self._native.vocab_digest
        self._context = self._native.hp.context

    def _load_hf(self, config: EngineConfig) -> None:
        """A Hugging Face directory: its dense weights through the stock modules (int8: a draft's option)."""
        on_cpu = torch.device(config.device).type == "cpu"
        if config.quantize == "q4_0":
            raise ValueError("quantize='q4_0' requantizes a GGUF file's block-32 weights; a Hugging Face checkpoint "
                             "runs none, auto or int8")
        if config.quantize == "int8" and not on_cpu:
            raise ValueError("quantize='int8' is a CPU option")
        hf_config = AutoConfig.from_pretrained(config.model_dir)
        self.numerics = numerics.choose((hf_config.intermediate_size, hf_config.hidden_size), config.quantize)
        self.model = self._dense(config, on_cpu)
        hf_config, generation = self.model.config, self.model.generation_config
        self.hf_config = hf_config
        self._new_cache = lambda: DynamicCache(config=hf_config)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = frozenset(_eos_ids(generation, hf_config))
        self.vocab_digest = ""  # unknown: the coordinator skips the vocabulary check
        self._context = hf_config.max_position_embeddings

    def _dense(self, config: EngineConfig, on_cpu: bool):
        """The stock modules: in `dtype`, or dynamically int8 (a draft's option), fast small-row linears."""
        model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=DTYPES[config.dtype])
        model = model.to(config.device).eval()
        if self.numerics.mode == "int8":
            model = kernels.quantize_int8(model)
        if config.small_row_matmul and on_cpu:
            kernels.use_small_row_matmul(model)
        # the int8 draft's passes skip the module calls (specd/fused.py); same logits, a step ~25 % shorter
        self._fused = fused.FusedDraft(model) if config.fused_int8 and fused.supports(model) else None
        return model

    # -- queries ------------------------------------------------------------------------------

    def position(self, session_id: str) -> int:
        session = self._sessions.get(session_id)
        return len(session.tokens) if session else 0

    def kv_length(self, session_id: str) -> int:
        session = self._sessions.get(session_id)
        return session.cache.get_seq_length() if session else 0

    def tokens(self, session_id: str) -> tuple[int, ...]:
        session = self._sessions.get(session_id)
        return tuple(session.tokens) if session else ()

    def session_count(self) -> int:
        return len(self._sessions)

    def cached_tokens(self) -> int:
        """Positions held in the KV caches of all sessions (pending tokens not included)."""
        return sum(session.cache.get_seq_length() for session in self._sessions.values())

    # -- updates ------------------------------------------------------------------------------

    def sync(self, session_id: str, start_pos: int, tokens: Sequence[int]) -> int:
        """Make the session's tokens known[:start_pos] + tokens; return the new length.

        KV is kept for the longest prefix the old and new sequences share, so re-sending tokens the
        engine already has costs nothing.
        """
        known = self.tokens(session_id)
        if not 0 <= start_pos <= len(known):
            raise PositionMismatch(
                f"session {session_id!r} has {len(known)} tokens; cannot sync from position {start_pos}",
                position=len(known),
            )
        self._check_tokens(tokens)
        self._check_context(start_pos + len(tokens))
        session = self._touch(session_id, create=True)
        common = start_pos + _common_prefix(known[start_pos:], tokens)
        session.tokens[common:] = tokens[common - start_pos :]
        _crop(session.cache, common)
        return len(session.tokens)

    def check_forward(self, session_id: str, extra: Sequence[int] = ()) -> None:
        """Raise what `forward(session_id, extra)` would refuse, without doing any work."""
        session = self._sessions.get(session_id)
        if session is None or not session.tokens:
            raise PositionMismatch(f"session {session_id!r} has no tokens; sync a prompt first", position=0)
        self._check_tokens(extra)
        self._check_context(len(session.tokens) + len(extra))

    @torch.inference_mode()
    def forward(self, session_id: str, extra: Sequence[int] = ()) -> torch.Tensor:
        """Feed the pending tokens then `extra` in one model call; append `extra` to the session.

        Returns float32 CPU logits [len(extra) + 1, vocab]: row i is the next-token distribution
        after tokens[:n + i], where n is the session length before the call.
        """
        if self._native is not None:  # its one-session pass is its ragged pass
            return self.forward_many([(session_id, extra)])[0]
        session, new = self._prepare(session_id, extra)
        input_ids = torch.tensor([new], dtype=torch.long, device=self.config.device)  # [1, len(new)]
        try:
            out = self.model(
                input_ids=input_ids,
                past_key_values=session.cache,
                use_cache=True,
                logits_to_keep=len(extra) + 1,  # skip the vocab projection for rows nobody reads
            )
        except BaseException:
            self._reset_caches([session])
            raise
        session.tokens.extend(extra)
        return out.logits[0].float().cpu()  # [len(extra) + 1, vocab]

    @torch.inference_mode()
    def forward_many(
        self,
        requests: Sequence[tuple[str, Sequence[int]]],
        newest_only: bool = False,
    ) -> list[torch.Tensor]:
        """`forward(session_id, extra)` for several sessions in ONE model pass (specd/ragged.py).

        Each result is what `forward` returns for that session alone, up to matmul rounding
        (bit-identical for a batch of one). Every request is checked before any work, so a refused
        one leaves all sessions untouched. newest_only: return only the last row ([1, vocab], after
        the newest token), so a session whose cache already holds every token feeds just `extra`
        (drafting one token at a time then feeds one row a step, not two).
        """
        if not requests:
            return []
        session_ids = [session_id for session_id, _ in requests]
        if len(set(session_ids)) != len(session_ids):
            raise ValueError("a batch holds each session at most once")
        for session_id, extra in requests:
            self.check_forward(session_id, extra)
        prepared = [self._prepare(session_id, extra, refeed=not newest_only) for session_id, extra in requests]
        sessions = [session for session, _ in prepared]
        keep = [1 if newest_only else len(extra) + 1 for _, extra in requests]
        self.last_pass_rows = sum(len(new) for _, new in prepared)
        try:
            logits = self._ragged_forward([s.cache for s in sessions], [new for _, new in prepared], keep)
        except BaseException:
            self._reset_caches(sessions)
            raise
        for session, (_, extra) in zip(sessions, requests):
            session.tokens.extend(extra)
        return [rows.float().cpu() for rows in logits]  # each [len(extra) + 1, vocab]

    def truncate(self, session_id: str, pos: int) -> None:
        """Drop tokens from `pos` on. Idempotent; pos >= length (or an unknown session) is a no-op."""
        if pos < 0:
            raise InvalidParams(f"truncate position must be >= 0, got {pos}")
        session = self._sessions.get(session_id)
        if session is None or pos >= len(session.tokens):
            return
        del session.tokens[pos:]
        _crop(session.cache, pos)

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    # -- helpers ------------------------------------------------------------------------------

    def _ragged_forward(self, caches, inputs, keep) -> list[torch.Tensor]:
        if self._native is not None:
            return self._native.forward(caches, inputs, keep)
        if self._fused is not None:
            return self._fused.forward(caches, inputs, keep)
        return ragged.forward(self.model, caches, inputs, keep)

    def _touch(self, session_id: str, create: bool = False) -> _Session:
        """Return the session marked most recently used, creating it (maybe evicting) if asked."""
        session = self._sessions.get(session_id)
        if session is None and create:
            self._make_room()
            session = self._sessions[session_id] = _Session(cache=self._new_cache())
        self._sessions.move_to_end(session_id)
        session.last_used = time.monotonic()
        return session

    def _prepare(self, session_id: str, extra: Sequence[int], refeed: bool = True) -> tuple[_Session, list[int]]:
        """Check a forward, then return the session and the tokens to feed: pending ones, then extra.
        refeed: the row after the last held token is wanted, so with nothing pending the last token
        is fed again (its logits are not kept); a forward with no extra always needs that row."""
        if threading.get_ident() != self._thread:
            raise WrongThread("run the engine on the thread that built it (EngineWorker.call, ModelServicer.load)")
        self.check_forward(session_id, extra)
        session = self._touch(session_id)
        start = _feed_from(session, extra, refeed)
        _crop(session.cache, start)
        return session, session.tokens[start:] + list(extra)  # [>= max(1, len(extra))]

    def _reset_caches(self, sessions: Sequence[_Session]) -> None:
        # An interrupted call may have extended some layers' caches but not others; the
        # tokens are the truth, so start the caches over rather than guess which layers grew.
        for session in sessions:
            session.cache = self._new_cache()

    def _make_room(self) -> None:
        if len(self._sessions) < self.config.max_sessions:
            return
        lru_id, lru = next(iter(self._sessions.items()))
        idle = time.monotonic() - lru.last_used
        if idle < self.config.idle_evict_s:
            raise SessionsFull(
                f"engine holds max_sessions={self.config.max_sessions} sessions and none has been idle "
                f"for {self.config.idle_evict_s}s; release finished sessions, retry later, "
                "or raise max_sessions"
            )
        del self._sessions[lru_id]
        self.evictions += 1

    def _check_context(self, length: int) -> None:
        if length > self.max_context:
            raise ContextTooLong(f"{length} tokens exceed max_context={self.max_context}")

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParams(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")


def _feed_from(session: _Session, extra: Sequence[int], refeed: bool) -> int:
    """The position a forward feeds from: the cached tokens it keeps, less the last one when its
    row is wanted and nothing else is pending (refeed, or no extra)."""
    return min(session.cache.get_seq_length(), len(session.tokens) - (1 if refeed or not extra else 0))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _eos_ids(generation, config) -> set[int]:
    """EOS ids from the generation config and the model config (either may be an int or a list)."""
    ids: set[int] = set()
    for eos in (generation.eos_token_id, config.eos_token_id):
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return ids
