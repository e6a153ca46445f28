"""The coordinator's tokenizer, chat template and limits (services/coordinator/model_info.py,
no torch) give what transformers' own tokenizer gives, on the tiny target and the real one."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from services.coordinator.model_info import load_model_info
from services.models import is_ready, model_path

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", " ", "é", "𝔘", "\0", "def f(x):\n    return x"]
texts = st.lists(st.one_of(st.text(max_size=24), st.sampled_from(SPECIAL)), max_size=8).map("".join)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": texts}), min_size=1, max_size=4)
EXAMPLES = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))


def real_target() -> Path:
    if not is_ready("target"):
        pytest.fail("the real pair is not fetched: run `specd models fetch` (scripts/test does)")
    return model_path("target")


@pytest.fixture(scope="module", params=["tiny", pytest.param("real", marks=pytest.mark.real)])
def pair(request, tiny_pair):
    target = tiny_pair[1] if request.param == "tiny" else real_target()
    return load_model_info(target), AutoTokenizer.from_pretrained(target), target


def test_limits_and_end_tokens_are_transformers(pair):
    ours, theirs, target = pair
    config, generation = AutoConfig.from_pretrained(target), GenerationConfig.from_pretrained(target)
    eos = generation.eos_token_id
    expected = ({eos} if isinstance(eos, int) else set(eos or ())) | {theirs.eos_token_id} - {None}
    assert (ours.vocab_size, ours.max_context) == (config.vocab_size, config.max_position_embeddings)
    assert ours.eos_token_ids == expected


@given(text=texts)
@EXAMPLES
def test_encode_is_transformers(pair, text):
    ours, theirs, _ = pair
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


@given(data=st.data())
@EXAMPLES
def test_decode_is_transformers(pair, data):
    ours, theirs, _ = pair
    special = sorted(theirs.get_added_vocab().values())  # control tokens, which decode must drop
    ids = data.draw(st.lists(st.integers(0, len(theirs) - 1) | st.sampled_from(special), max_size=24))
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@given(conversation=messages)
@EXAMPLES
def test_the_chat_prompt_is_transformers_apply_chat_template(pair, conversation):
    ours, theirs, _ = pair
    expected = theirs.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert ours.chat_prompt(conversation) == list(expected if isinstance(expected, list) else expected["input_ids"])
