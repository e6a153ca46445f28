"""Target numerics: the q4 kernel and engine are batch-invariant bit for bit; auto chooses a mode."""

import logging
from contextlib import contextmanager

import pytest
import torch

from specd import numerics, qkernels, qwen2
from specd.engine import EngineConfig, ModelEngine

MAX_ROWS = 16
# The real target's linears (Qwen2.5-Coder-1.5B): q/k/v fused, o, gate/up fused, down, the LM head.
REAL_TARGET_SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)]


@contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_kernel_builds_here():
    assert qkernels.available() is None  # a CI host without a compiler fails here, not silently


# This CPU's widest path, and the AVX2 one (AMD hosts without AVX-512 run it), built here too.
MARCHES = [qkernels.NATIVE, "haswell"]


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("shape", REAL_TARGET_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_row_of_a_q4_linear_equals_that_row_alone_at_the_real_targets_shapes(shape, march):
    generator = torch.Generator().manual_seed(shape[0])
    weight = qkernels.quantize(torch.randn(shape, generator=generator) * 0.02, torch.randn(shape[0], generator=generator))
    x = torch.randn(MAX_ROWS, shape[1], generator=generator)
    with threads(2):  # the services' thread count: threads split columns, never a row's sum
        alone = torch.cat([qkernels.linear(x[i : i + 1], weight, march) for i in range(MAX_ROWS)])
        for rows in range(2, MAX_ROWS + 1):
            assert torch.equal(qkernels.linear(x[:rows], weight, march), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("march", MARCHES)
def test_a_q4_linear_computes_x_times_the_dequantised_weight(march):
    generator = torch.Generator().manual_seed(3)
    dense = torch.randn(98, 128, generator=generator) * 0.02  # 98: a last, partial group of columns
    weight = qkernels.quantize(dense, torch.randn(98, generator=generator))
    x = torch.randn(5, 128, generator=generator)
    exact = x @ qkernels.dequantize(weight).T + weight.bias
    got = qkernels.linear(x, weight, march)
    assert ((got - exact).norm() / exact.norm()).item() < 0.02  # int8 activations: ~0.5 % here
    assert ((qkernels.dequantize(weight) - dense).abs().amax() / dense.abs().amax()).item() < 0.07  # 4 bits


def test_quantize_refuses_an_input_size_not_a_multiple_of_the_block():
    with pytest.raises(ValueError, match="multiple of 32"):
        qkernels.quantize(torch.zeros(4, 80))


@pytest.fixture(scope="module")
def q4_target(tiny_pair) -> ModelEngine:
    return ModelEngine(EngineConfig(tiny_pair[1], quantize="q4", max_sessions=256))


def test_the_q4_engine_holds_no_dense_model_and_weights_in_5_bits(q4_target, tiny_pair):
    assert q4_target.model is None and q4_target.numerics.mode == "q4" and q4_target.numerics.invariant
    float32_bytes = sum(f.stat().st_size for f in tiny_pair[1].glob("*.safetensors"))
    assert q4_target._native.nbytes < 0.25 * float32_bytes  # 5 bits a weight, plus the float32 norms


def test_a_verification_gives_every_row_of_the_plain_steps_bit_for_bit(q4_target):
    """K + 1 rows in one pass, with other sessions beside it, equal K + 1 one-row steps."""
    prompt, drafts = [3, 17, 250, 42, 99, 7], [5, 200, 5, 31, 64, 64, 9, 1, 2]
    q4_target.sync("steps", 0, prompt)
    steps = [q4_target.forward("steps")[-1]] + [q4_target.forward("steps", [t])[-1] for t in drafts]
    for K in range(1, len(drafts) + 1):
        q4_target.sync("verify", 0, prompt)
        q4_target.sync("other", 0, [9, 9, 9, 8])
        q4_target.sync("third", 0, [1])
        rows, _, _ = q4_target.forward_many([("verify", drafts[:K]), ("other", [7, 7]), ("third", drafts)])
        assert all(torch.equal(rows[i], steps[i]) for i in range(K + 1)), f"K = {K}"
        for session in ("verify", "other", "third"):
            q4_target.release(session)


def test_a_prompt_fed_at_once_equals_it_fed_token_by_token(q4_target):
    prompt = [3, 17, 250, 42, 99, 7, 7, 128, 64, 5, 200, 11, 12]
    q4_target.sync("at-once", 0, prompt[:1])
    at_once = q4_target.forward("at-once", prompt[1:])  # [len(prompt), vocab]
    q4_target.sync("one-by-one", 0, prompt[:1])
    one_by_one = [q4_target.forward("one-by-one")[-1]] + [q4_target.forward("one-by-one", [t])[-1] for t in prompt[1:]]
    assert all(torch.equal(at_once[i], one_by_one[i]) for i in range(len(prompt)))


def test_a_restart_reads_the_cached_quantised_weights_back_bit_for_bit(tiny_pair):
    first = qwen2.Q4Qwen2(tiny_pair[1])  # quantises, or reads the cache the fixture's engine wrote
    assert list(qkernels.cache_dir().glob(f"{qwen2.FORMAT}-*.safetensors"))
    state = qwen2._quantised_state(tiny_pair[1], first.config)  # what quantising afresh gives
    second = qwen2.Q4Qwen2(tiny_pair[1])
    for net in (first, second):
        layer = net.decoder.layers[1]
        assert torch.equal(layer.gate_up.packed, state["1.gate_up.packed"]) and torch.equal(layer.qkv.bias, state["1.qkv.bias"])
        assert torch.equal(net.lm_head.d, state["lm_head.d"]) and torch.equal(layer.post_norm, state["1.post_norm"])
    caches = [first.new_cache(), second.new_cache()]
    logits = [net.forward([cache], [[3, 17, 250, 42]], [4])[0] for net, cache in zip((first, second), caches)]
    assert torch.equal(logits[0], logits[1])


def test_auto_chooses_an_invariant_mode_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="specd.numerics"):
        choice = numerics.choose((128, 64), "auto")
    assert choice.mode in numerics.INVARIANT_MODES and choice.invariant
    assert "fastest batch-invariant candidate" in choice.reason and choice.reason in caplog.text


def test_a_set_mode_is_taken_with_its_self_check_and_a_bad_one_refused(tiny_pair):
    assert numerics.choose((128, 64), "q4") == numerics.Choice("q4", "set by configuration", True)
    assert not numerics.choose((128, 64), "int8").invariant
    with pytest.raises(ValueError, match="quantize must be one of"):
        numerics.choose((128, 64), "int4")
    assert ModelEngine(EngineConfig(tiny_pair[1], quantize="auto")).numerics.invariant
