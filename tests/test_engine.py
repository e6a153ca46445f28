"""Over 350 lines: the engine contract (sync, truncate, eviction, numerics), one case each."""

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd.engine import (
    ContextTooLong,
    EngineConfig,
    ModelEngine,
    PositionMismatch,
    SessionsFull,
    WrongThread,
)
from specd import fused as fused_path, ragged
from tests.tiny import build_tiny_pair

PROMPT = [3, 17, 250, 42, 99, 7, 7, 128, 64, 5, 200]  # arbitrary byte-token ids (< 256)


def make_engine(model_dir: Path, **kwargs) -> ModelEngine:
    return ModelEngine(EngineConfig(model_dir=model_dir, **kwargs))


@pytest.fixture(scope="module")
def target(tiny_pair) -> ModelEngine:
    return make_engine(tiny_pair[1])


def full_logits(engine: ModelEngine, tokens: list[int]) -> torch.Tensor:
    """Logits from one cache-free forward over the whole sequence."""
    with torch.inference_mode():
        return engine.model(torch.tensor([tokens])).logits[0].float()  # [len(tokens), vocab]


def greedy_via_engine(engine: ModelEngine, session: str, prompt: list[int], steps: int) -> list[int]:
    engine.sync(session, 0, prompt)
    out = [int(engine.forward(session)[-1].argmax())]
    while len(out) < steps and out[-1] not in engine.eos_token_ids:
        out.append(int(engine.forward(session, [out[-1]])[-1].argmax()))
    return out


# -- forward -----------------------------------------------------------------------------------


def test_multi_token_forward_matches_single_steps_and_full_forward(target):
    extra = [5, 70, 12, 200, 3]
    target.sync("multi", 0, PROMPT)
    multi = target.forward("multi", extra)  # [len(extra) + 1, vocab]

    target.sync("single", 0, PROMPT)
    single = torch.stack([target.forward("single")[0]] + [target.forward("single", [t])[-1] for t in extra])

    full = full_logits(target, PROMPT + extra)[len(PROMPT) - 1 :]
    assert multi.shape == (len(extra) + 1, target.vocab_size)
    assert multi.dtype == torch.float32
    torch.testing.assert_close(multi, single, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(multi, full, rtol=1e-4, atol=1e-4)
    assert torch.equal(multi.argmax(-1), single.argmax(-1))
    assert target.tokens("multi") == tuple(PROMPT + extra) == target.tokens("single")


def test_cache_keeps_every_fed_token_and_refeeds_when_nothing_is_pending(target):
    target.sync("inv", 0, PROMPT)
    assert target.kv_length("inv") == 0
    last_row = target.forward("inv", [1, 2, 3])[-1]
    assert target.position("inv") == len(PROMPT) + 3
    assert target.kv_length("inv") == len(PROMPT) + 3  # the drafts' KV stays for a full acceptance
    again = target.forward("inv")  # nothing pending: the last token is fed again
    torch.testing.assert_close(again[0], last_row, rtol=1e-4, atol=1e-4)
    target.truncate("inv", 4)
    assert target.kv_length("inv") <= 4


def test_forward_needs_a_synced_session(target):
    with pytest.raises(PositionMismatch) as err:
        target.forward("never-synced")
    assert err.value.position == 0


def test_rejects_token_ids_outside_the_vocabulary(target):
    with pytest.raises(ValueError, match="token ids"):
        target.sync("bad", 0, [target.vocab_size])


# -- rollback ----------------------------------------------------------------------------------


def test_sync_truncates_and_refeed_reproduces_logits(target):
    target.sync("roll", 0, PROMPT)
    target.forward("roll", [9, 9, 9, 9])  # rejected draft tokens
    assert target.sync("roll", len(PROMPT) + 1, [40, 41]) == len(PROMPT) + 3
    rolled = target.forward("roll", [42])

    target.sync("fresh", 0, PROMPT + [9, 40, 41])
    torch.testing.assert_close(rolled, target.forward("fresh", [42]), rtol=1e-4, atol=1e-4)


def test_truncate_then_forward_matches_fresh_session(target):
    target.sync("trunc", 0, PROMPT)
    target.forward("trunc", [7, 8, 9, 10])
    target.truncate("trunc", len(PROMPT) + 1)
    assert target.tokens("trunc") == tuple(PROMPT + [7])
    rolled = target.forward("trunc", [11])

    target.sync("fresh2", 0, PROMPT + [7])
    torch.testing.assert_close(rolled, target.forward("fresh2", [11]), rtol=1e-4, atol=1e-4)


def test_truncate_is_idempotent(target):
    target.sync("idem", 0, PROMPT)
    target.forward("idem", [1, 2])
    for _ in range(2):
        target.truncate("idem", 4)
        assert target.tokens("idem") == tuple(PROMPT[:4])
        assert target.kv_length("idem") <= 4
    target.truncate("idem", 100)  # beyond the end: no-op
    target.truncate("unknown", 0)  # unknown session: no-op
    assert target.tokens("idem") == tuple(PROMPT[:4])


def test_resync_of_known_tokens_keeps_the_cache(target):
    target.sync("keep", 0, PROMPT)
    target.forward("keep", [1, 2])
    kv = target.kv_length("keep")
    target.sync("keep", 0, PROMPT + [1, 2, 3])  # same prefix, one new token
    assert target.kv_length("keep") == kv
    assert target.position("keep") == len(PROMPT) + 3


def test_position_mismatch_reports_actual_length(target):
    target.sync("pm", 0, PROMPT)
    with pytest.raises(PositionMismatch) as err:
        target.sync("pm", len(PROMPT) + 1, [1])
    assert err.value.position == len(PROMPT)
    with pytest.raises(PositionMismatch) as err:
        target.sync("pm-unknown", 3, [1])
    assert err.value.position == 0
    assert target.position("pm-unknown") == 0


# -- limits ------------------------------------------------------------------------------------


def test_idle_sessions_are_evicted_lru(tiny_pair):
    engine = make_engine(tiny_pair[1], max_sessions=2, idle_evict_s=0)
    engine.sync("a", 0, PROMPT)
    engine.sync("b", 0, PROMPT)
    engine.forward("a")  # "b" is now least recently used
    engine.sync("c", 0, PROMPT)
    assert engine.session_count() == 2
    assert engine.position("b") == 0 and engine.position("a") == len(PROMPT)
    assert engine.evictions == 1


def test_sessions_full_when_none_idle(tiny_pair):
    engine = make_engine(tiny_pair[1], max_sessions=2, idle_evict_s=3600)
    engine.sync("a", 0, PROMPT)
    engine.sync("b", 0, PROMPT)
    with pytest.raises(SessionsFull, match="max_sessions=2"):
        engine.sync("c", 0, PROMPT)
    engine.release("a")
    engine.release("a")  # idempotent
    engine.sync("c", 0, PROMPT)
    assert engine.session_count() == 2 and engine.evictions == 0


def test_context_too_long(tiny_pair):
    engine = make_engine(tiny_pair[1], max_context=len(PROMPT) + 2)
    with pytest.raises(ContextTooLong):
        engine.sync("s", 0, PROMPT + [1, 2, 3])
    assert engine.session_count() == 0
    engine.sync("s", 0, PROMPT)
    engine.forward("s", [1, 2])
    with pytest.raises(ContextTooLong):
        engine.forward("s", [3])
    assert engine.position("s") == len(PROMPT) + 2


def test_default_max_context_is_the_model_limit(target):
    assert target.max_context == 1024


# -- numerics and models -----------------------------------------------------------------------


def test_float64_matches_float32(tiny_pair, target):
    engine = make_engine(tiny_pair[1], dtype="float64")
    assert engine.model.dtype == torch.float64
    engine.sync("s", 0, PROMPT)
    target.sync("f64-ref", 0, PROMPT)
    logits = engine.forward("s", [1, 2])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, target.forward("f64-ref", [1, 2]), rtol=1e-4, atol=1e-4)


def test_hf_generate_matches_engine_greedy(tiny_pair, target):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1])
    ids = torch.tensor([PROMPT])
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    assert greedy_via_engine(target, "greedy", PROMPT, 40) == generated[0, len(PROMPT) :].tolist()


def test_engine_reads_model_metadata(target):
    assert target.vocab_size == 264  # 259 tokens rounded up to a multiple of 8
    assert target.eos_token_ids == {256}
    assert len(target.instance_id) == 32


def _weights_digest(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_pair_is_deterministic(tmp_path, tiny_pair):
    again = build_tiny_pair(tmp_path / "again")
    other = build_tiny_pair(tmp_path / "other", seed=1)
    for built, rebuilt, different in zip(tiny_pair, again, other):
        assert _weights_digest(built) == _weights_digest(rebuilt)
        assert _weights_digest(built) != _weights_digest(different)


def test_tiny_tokenizer_round_trips_and_chats(tiny_pair):
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    text = "naïve café ✓ 你好 🙂\n\tx = 1"
    ids = tok(text).input_ids
    assert len(ids) == len(text.encode())  # one token per byte
    assert tok.decode(ids) == text
    messages = [{"role": "user", "content": "hi"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [256, 257, 258]


def test_tiny_pair_is_peaked_and_draft_agrees_often_not_always(tiny_pair):
    draft, target = (AutoModelForCausalLM.from_pretrained(d) for d in tiny_pair)
    tok = AutoTokenizer.from_pretrained(tiny_pair[1])
    agree, total, stds = 0, 0, []
    with torch.inference_mode():
        for prompt in ("def fib(n):", "Once upon a time", "The quick brown fox", "x = [1, 2, 3]"):
            ids = tok(prompt, return_tensors="pt").input_ids  # [1, len(prompt)]
            path = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                                   min_new_tokens=48, do_sample=False)
            q = draft(path).logits[0, ids.shape[1] - 1 : -1]  # [48, vocab]
            p = target(path).logits[0, ids.shape[1] - 1 : -1]  # [48, vocab]
            agree += int((q.argmax(-1) == p.argmax(-1)).sum())
            total += p.shape[0]
            stds.append(p.std(-1).mean())
    assert 0.4 <= agree / total <= 0.8
    assert 3 <= float(torch.stack(stds).mean()) <= 5


def test_failed_forward_resets_cache_but_keeps_tokens(tiny_pair, target, monkeypatch):
    engine = make_engine(tiny_pair[1])
    engine.sync("s", 0, PROMPT)

    def fail(hidden):  # runs after every layer has already extended its cache
        raise RuntimeError("interrupted")

    monkeypatch.setattr(engine.model.lm_head, "forward", fail)
    with pytest.raises(RuntimeError):
        engine.forward("s", [1, 2])
    monkeypatch.undo()
    assert engine.tokens("s") == tuple(PROMPT) and engine.kv_length("s") == 0
    target.sync("reset-ref", 0, PROMPT)
    expected = target.forward("reset-ref", [1, 2])
    torch.testing.assert_close(engine.forward("s", [1, 2]), expected, rtol=1e-4, atol=1e-4)


# -- kernel paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16, 17, 40, 128, 129])
def test_small_row_matmul_is_the_same_arithmetic_as_f_linear(rows):
    from specd.kernels import _small_rows_linear

    layer = torch.nn.Linear(64, 48)
    x = torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(_small_rows_linear(layer, x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_a_packed_linear_is_f_linear_and_each_row_is_the_same_whatever_rows_come_with_it():
    from specd import kernels

    layer, dense = torch.nn.Linear(64, 48), torch.nn.Linear(64, 48)
    dense.load_state_dict(layer.state_dict())
    kernels.use_small_row_matmul(layer)  # packs float32 weights for oneDNN; the dense copy goes
    assert layer.weight.numel() == 0
    x = torch.randn(1, 129, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), dense(x))
        first = layer(x[:, :1])
        for rows in (2, 3, 5, 8, 9, 16, 17, 40, 128, 129):  # padded or not, a row's result is its own
            assert torch.equal(layer(x[:, :rows])[:, :1], first)


def test_a_tied_weight_keeps_its_dense_copy_for_its_other_user():
    from specd import kernels

    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight
    assert kernels.use_small_row_matmul(model) == 1
    assert model[0].weight.shape == (10, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([[1, 2]])), model[0](torch.tensor([[1, 2]])) @ model[0].weight.T)


def test_engines_with_and_without_the_fast_path_agree(tiny_pair):
    fast = ModelEngine(EngineConfig(tiny_pair[1]))
    stock = ModelEngine(EngineConfig(tiny_pair[1], small_row_matmul=False))
    for engine in (fast, stock):
        engine.sync("k", 0, PROMPT)
    torch.testing.assert_close(fast.forward("k", [1, 2, 3, 4]), stock.forward("k", [1, 2, 3, 4]), rtol=1e-4, atol=1e-4)


def test_int8_draft_runs_and_bad_options_are_refused(tiny_pair):
    draft = ModelEngine(EngineConfig(tiny_pair[0], quantize="int8"))
    draft.sync("q", 0, PROMPT)
    assert draft.forward("q", [1, 2]).shape == (3, draft.vocab_size)
    with pytest.raises(ValueError, match="quantize"):
        ModelEngine(EngineConfig(tiny_pair[0], quantize="int4"))


# -- batched forward (several sessions, one pass) ----------------------------------------------


def _mixed_sessions(engine: ModelEngine) -> list[tuple[str, list[int]]]:
    """Sessions at different cache lengths, each with its own K (0 is a plain step)."""
    engine.sync("fresh", 0, PROMPT)  # nothing cached yet: a prefill
    engine.sync("warm", 0, PROMPT[:5])
    engine.forward("warm", [8, 9, 10])  # cached, nothing pending: re-feeds its last token
    engine.sync("rolled", 0, PROMPT + PROMPT)
    engine.forward("rolled", [1, 2, 3, 4])
    engine.sync("rolled", 4, [60, 61, 62])  # rolled back and resent: three tokens pending
    engine.sync("step", 0, PROMPT[:2])
    engine.forward("step")
    return [("fresh", [5, 70, 12]), ("warm", [4]), ("rolled", [200, 3, 7, 7, 9, 1, 2, 3]), ("step", [])]


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-12), ("float32", 1e-4)])
def test_batched_forward_equals_one_session_at_a_time(tiny_pair, dtype, tolerance):
    alone, batched = make_engine(tiny_pair[1], dtype=dtype), make_engine(tiny_pair[1], dtype=dtype)
    requests = _mixed_sessions(alone)
    assert _mixed_sessions(batched) == requests
    for _ in range(2):  # the second round runs on caches the batched pass itself built
        expected = [alone.forward(session, extra) for session, extra in requests]
        got = batched.forward_many(requests)
        for (session, extra), want, row in zip(requests, expected, got):
            assert row.shape == (len(extra) + 1, alone.vocab_size) and row.dtype == torch.float32
            torch.testing.assert_close(row, want, rtol=tolerance, atol=tolerance)
            assert torch.equal(row.argmax(-1), want.argmax(-1)), session
            assert batched.tokens(session) == alone.tokens(session)
            assert batched.kv_length(session) == alone.kv_length(session)
        # next round: each session's argmax as its drafts, K = 0, 1, 2
        requests = [(session, [int(rows[-1].argmax())] * (i % 3))
                    for i, ((session, _), rows) in enumerate(zip(requests, got))]



def test_the_fused_int8_draft_is_the_stock_int8_forward_bit_for_bit(tiny_pair):
    fused, stock = (make_engine(tiny_pair[0], quantize="int8", fused_int8=on) for on in (True, False))
    assert fused._fused is not None and stock._fused is None
    requests = _mixed_sessions(stock)
    assert _mixed_sessions(fused) == requests
    for _ in range(3):  # later rounds run on caches the fused passes built
        expected, got = stock.forward_many(requests), fused.forward_many(requests)
        for (session, _), want, rows in zip(requests, expected, got):
            assert torch.equal(rows, want), session
            assert fused.tokens(session) == stock.tokens(session)
            for mine, theirs in zip(fused._sessions[session].cache.layers, stock._sessions[session].cache.layers):
                assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        requests = [(session, [int(rows[-1].argmax())] * (i % 3)) for i, ((session, _), rows) in enumerate(zip(requests, got))]
    newest = [(session, [7]) for session, _ in requests]
    assert all(torch.equal(a, b) for a, b in zip(fused.forward_many(newest, newest_only=True),
                                                 stock.forward_many(newest, newest_only=True)))


def test_only_int8_qwen2_models_take_the_fused_path(tiny_pair):
    assert not fused_path.supports(make_engine(tiny_pair[0]).model)  # float linears
    with pytest.raises(TypeError, match="int8"):
        fused_path.FusedDraft(make_engine(tiny_pair[0]).model)

def test_a_batch_of_one_is_the_stock_forward_bit_for_bit(tiny_pair):
    engine = make_engine(tiny_pair[1])
    for session in ("stock", "ragged"):
        engine.sync(session, 0, PROMPT)
    for extra in ([], [1, 2], [3], [4, 5, 6, 7]):
        assert torch.equal(engine.forward_many([("ragged", extra)])[0], engine.forward("stock", extra))


def test_newest_only_feeds_just_the_new_tokens_of_a_fully_cached_session(tiny_pair, monkeypatch):
    engine = make_engine(tiny_pair[1], dtype="float64")
    for session in ("full", "newest"):
        engine.sync(session, 0, PROMPT)
        engine.forward(session, [8])  # every token cached, nothing pending
    fed = []
    forward = ragged.forward
    monkeypatch.setattr(ragged, "forward", lambda model, caches, inputs, keep: fed.append(inputs) or forward(model, caches, inputs, keep))
    for extra in ([9], [], [3, 4]):
        want = engine.forward_many([("full", extra)])[0][-1:]
        got = engine.forward_many([("newest", extra)], newest_only=True)[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert engine.tokens("newest") == engine.tokens("full")
    # full re-feeds the last held token for its row; newest_only feeds it only when there is no extra
    assert fed == [[[8, 9]], [[9]], [[9]], [[9]], [[9, 3, 4]], [[3, 4]]]


def test_a_refused_request_leaves_every_session_of_the_batch_untouched(target):
    target.sync("ok", 0, PROMPT)
    for bad in ([("ok", [1]), ("never-synced", [2])], [("ok", [1]), ("ok", [2])], [("ok", [target.vocab_size])]):
        with pytest.raises((PositionMismatch, ValueError)):
            target.forward_many(bad)
        assert target.tokens("ok") == tuple(PROMPT) and target.kv_length("ok") == 0
    assert target.forward_many([]) == []


def test_a_failed_batched_pass_resets_every_cache_but_keeps_tokens(tiny_pair, monkeypatch):
    engine = make_engine(tiny_pair[1])
    for session in ("a", "b"):
        engine.sync(session, 0, PROMPT)
        engine.forward(session)

    def fail(hidden):  # runs after every layer has already extended every cache
        raise RuntimeError("interrupted")

    monkeypatch.setattr(engine.model.lm_head, "forward", fail)
    with pytest.raises(RuntimeError):
        engine.forward_many([("a", [1]), ("b", [2, 3])])
    monkeypatch.undo()
    assert [engine.kv_length(s) for s in "ab"] == [0, 0] and engine.tokens("a") == tuple(PROMPT) == engine.tokens("b")
    engine.sync("ref", 0, PROMPT)
    expected = engine.forward("ref", [1])
    torch.testing.assert_close(engine.forward_many([("a", [1]), ("b", [1])])[1], expected, rtol=1e-4, atol=1e-4)


def test_only_the_thread_that_built_an_engine_runs_its_model(tiny_pair):
    # Services build the engine on their worker thread: one OpenMP pool per process (specd/engine.py).
    with ThreadPoolExecutor(max_workers=1) as owner:
        engine = owner.submit(make_engine, tiny_pair[0]).result()
        engine.sync("s", 0, PROMPT)
        owner.submit(engine.forward, "s").result()  # the prompt's KV: both forwards below feed [last, 9]
        expected = owner.submit(engine.forward, "s", [9]).result()
        engine.truncate("s", len(PROMPT))
        with pytest.raises(WrongThread):
            engine.forward("s", [9])
        with pytest.raises(WrongThread):
            engine.forward_many([("s", [9])])
        assert engine.tokens("s") == tuple(PROMPT)  # refused before any work
        assert torch.equal(owner.submit(engine.forward, "s", [9]).result(), expected)
