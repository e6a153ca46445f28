"""The coordinator's tokenizer, chat template and limits (services/coordinator/model_info.py,
no torch) give what transformers' own tokenizer gives: from an HF directory (the tiny pair), and
from a GGUF file, checked against `AutoTokenizer.from_pretrained(dir, gguf_file=name)` on the same
file: tiny byte-level BPE (tests/tiny_gguf.py) and SentencePiece files, and the real target (its
tokenizer sidecar) and Gemma 3 when fetched."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter, TokenType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from services.coordinator.model_info import load_model_info
from services.models import is_ready, model_path
from specd import gguf_meta
from tests import tiny_gguf

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "\n", " ",
           "  ", "\u2581", "é", "𝔘", "\0", "def f(x):\n    return x", "the world"]
texts = st.lists(st.one_of(st.text(max_size=24), st.sampled_from(SPECIAL)), max_size=8).map("".join)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": texts}), min_size=1, max_size=4)
EXAMPLES = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))

# A Gemma-style SentencePiece vocabulary ("llama" tokenizer, byte fallback, runs of spaces stored
# as spaces), with a template that writes {{ bos_token }} as Gemma's does.
SPM_PIECES = ["\u2581", "e", "t", "h", "o", "a", "\u2581t", "he", "\u2581the", "\u2581a", "in", "er", "\u2581w", "or",
              "ld", "\u2581wor", "\u2581world", "  ", "   "]
SPM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def write_spm_gguf(path: Path, arch: str = "gemma3") -> Path:
    """A tokenizer-only GGUF in Gemma's layout: tiny_gguf's hyper-parameters for `arch`, a
    SentencePiece vocabulary, a zero token embedding (its rows are the vocabulary size)."""
    hp = tiny_gguf.hparams(arch)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-spm-{arch}")
    for suffix, value in [*((k, f(hp)) for k, f in tiny_gguf.COMMON_KEYS.items()),
                          *((k, tiny_gguf.EXTRA_KEYS[k](hp)) for k in tiny_gguf.DELTAS[arch].keys)]:
        key = f"{arch}.{suffix}"
        writer.add_float32(key, value) if isinstance(value, float) else writer.add_uint32(key, value)
    tokens = (["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
              + ["<start_of_turn>", "<end_of_turn>"] + SPM_PIECES)
    types = ([TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.BYTE] * 256 + [TokenType.CONTROL] * 2
             + [TokenType.NORMAL] * len(SPM_PIECES))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_bool("tokenizer.ggml.add_eos_token", False)
    writer.add_bool("tokenizer.ggml.add_space_prefix", False)
    writer.add_chat_template(SPM_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 256), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def real(model: str) -> Path:
    if not is_ready(model):
        if model == "target":
            pytest.fail("the real pair is not fetched: run `specd models fetch` (scripts/test does)")
        pytest.skip(f"{model} is not fetched (`specd models fetch {model}`)")
    return model_path(model)


def _transformers(path: Path):
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) if path.is_file() \
        else AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=["tiny", "tiny-gguf", "tiny-spm-gguf",
                                        pytest.param("real", marks=pytest.mark.real),
                                        pytest.param("gemma3-270m", marks=pytest.mark.real)])
def pair(request, tiny_pair, tmp_path_factory):
    kind = request.param
    if kind == "tiny":
        path = tiny_pair[1]
    elif kind == "tiny-gguf":
        path = tiny_gguf.write_tiny(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf", "qwen2")
    elif kind == "tiny-spm-gguf":
        path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")
    else:
        path = real("target" if kind == "real" else kind)
    return load_model_info(path), _transformers(path), path


def test_limits_and_end_tokens_are_transformers(pair):
    ours, theirs, path = pair
    if path.is_dir():
        config, generation = AutoConfig.from_pretrained(path), GenerationConfig.from_pretrained(path)
        eos = generation.eos_token_id
        expected = ({eos} if isinstance(eos, int) else set(eos or ())) | {theirs.eos_token_id} - {None}
    else:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        expected = gguf_meta.eog_ids(gguf_meta.read(path))  # llama.cpp's rule: tests/test_gguf_meta.py
        assert theirs.eos_token_id in expected
    assert (ours.vocab_size, ours.max_context) == (config.vocab_size, config.max_position_embeddings)
    assert ours.eos_token_ids == expected


@pytest.mark.real
def test_the_real_targets_end_tokens_are_llama_cpps():
    """Those llama.cpp stops on for Qwen2.5-Coder: eos, the chat and text ends, the FIM pad/repo/file
    separator tokens, and the plain-text token "</s>" (llama.cpp's list has it, for paddleocr)."""
    ours = load_model_info(real("target"))
    names = ["<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "</s>"]
    assert ours.eos_token_ids == {ours.tokenizer.token_to_id(name) for name in names}


@given(text=texts)
@EXAMPLES
def test_encode_is_transformers(pair, text):
    ours, theirs, _ = pair
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


@given(text=texts)
@EXAMPLES
def test_encode_with_special_tokens_is_transformers(pair, text):
    """The BOS a SentencePiece file says to add (add_bos_token) is the post-processor's."""
    ours, theirs, _ = pair
    assert ours.tokenizer.encode(text).ids == theirs.encode(text)


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
    if theirs.chat_template is None:
        assert ours.chat_template is None  # Gemma 3 270M's file carries none
        return
    expected = theirs.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert ours.chat_prompt(conversation) == list(expected if isinstance(expected, list) else expected["input_ids"])


def test_the_tokenizer_json_is_transformers_backend(pair):
    """From a GGUF file, not only the same answers: the same tokenizer, field by field. (From a
    directory transformers' Qwen2Tokenizer rebuilds the file's pre-tokenizer; the answers agree.)"""
    ours, theirs, path = pair
    if path.is_dir():  # read as saved
        assert ours.tokenizer.to_str() == Tokenizer.from_file(str(path / "tokenizer.json")).to_str()
        return
    assert ours.tokenizer.to_str() == theirs.backend_tokenizer.to_str()


# --- the sidecar -------------------------------------------------------------------------------


@pytest.fixture
def tiny_file(tmp_path) -> Path:
    return tiny_gguf.write_tiny(tmp_path / "m.gguf", "qwen2")


def test_a_sidecar_beside_the_file_is_used(tiny_file, monkeypatch):
    sidecar = gguf_meta.tokenizer_sidecar(tiny_file)
    assert sidecar.name == "m.gguf.tokenizer.json"
    sidecar.write_text(gguf_meta.tokenizer_json(gguf_meta.read(tiny_file)))
    monkeypatch.setattr(gguf_meta, "tokenizer_json", lambda meta: pytest.fail("the sidecar is there"))
    assert load_model_info(tiny_file).encode("the fox") == Tokenizer.from_file(str(sidecar)).encode("the fox").ids


def test_a_stale_or_foreign_sidecar_is_ignored(tiny_file, tmp_path, caplog):
    expected = load_model_info(tiny_file).encode("The quick brown fox")
    sidecar = gguf_meta.tokenizer_sidecar(tiny_file)
    other = tiny_gguf.write_tiny(tmp_path / "other.gguf", "qwen2", vocab=300)
    sidecar.write_text(gguf_meta.tokenizer_json(gguf_meta.read(other)))  # another vocabulary
    assert load_model_info(tiny_file).encode("The quick brown fox") == expected
    assert "does not hold" in caplog.text
    stat = tiny_file.stat()
    os.utime(sidecar, ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**9))  # older than the model
    assert load_model_info(tiny_file).encode("The quick brown fox") == expected
    assert "is older than" in caplog.text
    sidecar.write_text("{not json")
    os.utime(sidecar, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert load_model_info(tiny_file).encode("The quick brown fox") == expected


@pytest.mark.real
def test_the_fetched_sidecar_is_the_metadatas_tokenizer():
    path = real("target")
    assert gguf_meta.tokenizer_sidecar(path).read_text() == gguf_meta.tokenizer_json(gguf_meta.read(path))
