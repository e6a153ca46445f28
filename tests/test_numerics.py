"""Target numerics: a GGUF engine's verification rows equal plain steps bit for bit, and it refuses to
serve where they would not; a Hugging Face checkpoint's mode is a setting with its self-check."""

import logging

import pytest
import torch

from specd import numerics
from specd.engine import EngineConfig, ModelEngine
from specd.gguf_model import GGUFModel


@pytest.fixture(scope="module")
def gguf_target(tiny_gguf_pair) -> ModelEngine:
    return ModelEngine(EngineConfig(tiny_gguf_pair[1], quantize="auto", max_sessions=256))


def test_a_gguf_engine_runs_the_file_as_stored_with_no_dense_model(gguf_target):
    assert gguf_target.model is None and gguf_target.numerics.mode == "gguf" and gguf_target.numerics.invariant
    assert "Q6_K" in gguf_target.numerics.reason and "start-up check" in gguf_target.numerics.reason


def test_a_verification_gives_every_row_of_the_plain_steps_bit_for_bit(gguf_target):
    """K + 1 rows in one pass, with other sessions beside it, equal K + 1 one-row steps."""
    prompt, drafts = [3, 17, 250, 42, 99, 7], [5, 200, 5, 31, 64, 64, 9, 1, 2]
    gguf_target.sync("steps", 0, prompt)
    steps = [gguf_target.forward("steps")[-1]] + [gguf_target.forward("steps", [t])[-1] for t in drafts]
    for K in range(1, len(drafts) + 1):
        gguf_target.sync("verify", 0, prompt)
        gguf_target.sync("other", 0, [9, 9, 9, 8])
        gguf_target.sync("third", 0, [1])
        rows, _, _ = gguf_target.forward_many([("verify", drafts[:K]), ("other", [7, 7]), ("third", drafts)])
        assert all(torch.equal(rows[i], steps[i]) for i in range(K + 1)), f"K = {K}"
        for session in ("verify", "other", "third"):
            gguf_target.release(session)


def test_a_prompt_fed_at_once_equals_it_fed_token_by_token(gguf_target):
    prompt = [3, 17, 250, 42, 99, 7, 7, 128, 64, 5, 200, 11, 12]
    gguf_target.sync("at-once", 0, prompt[:1])
    at_once = gguf_target.forward("at-once", prompt[1:])  # [len(prompt), vocab]
    gguf_target.sync("one-by-one", 0, prompt[:1])
    one_by_one = [gguf_target.forward("one-by-one")[-1]] + [gguf_target.forward("one-by-one", [t])[-1] for t in prompt[1:]]
    assert all(torch.equal(at_once[i], one_by_one[i]) for i in range(len(prompt)))


def test_the_start_up_check_refuses_a_model_whose_rows_depend_on_the_pass(tiny_gguf_pair, monkeypatch):
    model = GGUFModel(tiny_gguf_pair[1])
    assert numerics.check_native(model).invariant
    forward = model.forward

    def row_count_leaks(caches, inputs, keep):  # a kernel whose sums depend on the rows beside them
        rows = sum(len(i) for i in inputs)
        return [logits + rows * 1e-6 for logits in forward(caches, inputs, keep)]

    monkeypatch.setattr(model, "forward", row_count_leaks)
    with pytest.raises(RuntimeError, match="not batch-invariant here"):
        numerics.check_native(model)


def test_a_gguf_file_refuses_int8(tiny_gguf_pair):
    with pytest.raises(ValueError, match="served as stored"):
        ModelEngine(EngineConfig(tiny_gguf_pair[1], quantize="int8"))


def test_auto_on_a_checkpoint_runs_its_dense_weights_and_says_whether_they_are_invariant(caplog):
    with caplog.at_level(logging.INFO, logger="specd.numerics"):
        choice = numerics.choose((128, 64), "auto")
    assert choice.mode == "none" and "dense weights" in choice.reason and choice.reason in caplog.text
    assert ("not batch-invariant here" in choice.reason) != choice.invariant


def test_a_set_mode_is_taken_with_its_self_check_and_a_bad_one_refused(tiny_pair):
    assert numerics.choose((128, 64), "none").reason == "set by configuration"
    assert numerics.choose((128, 64), "int8") == numerics.Choice("int8", "set by configuration", False)
    for retired in ("q4", "int4"):
        with pytest.raises(ValueError, match="quantize must be one of none, int8, auto"):
            numerics.choose((128, 64), retired)
    assert ModelEngine(EngineConfig(tiny_pair[1], quantize="auto")).numerics.mode == "none"
