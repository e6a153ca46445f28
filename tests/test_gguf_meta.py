"""specd/gguf_meta.py: a GGUF file's metadata as gguf.GGUFReader reads it (only faster), the end of
generation tokens as llama.cpp's vocabulary decides them, and the vocabulary digest."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from specd import gguf_meta
from tests import tiny_gguf


def reader_value(field):
    if field.types[0] == GGUFValueType.ARRAY:
        return list(field.contents())
    return field.contents()


@pytest.mark.parametrize("arch,tensor_type", [("qwen2", "F32"), ("gemma3", "Q4_K"), ("llama", "Q8_0")])
def test_metadata_is_what_gguf_reader_reads(tmp_path, arch, tensor_type):
    path = tiny_gguf.write_tiny(tmp_path / "m.gguf", arch, tensor_type)
    meta, reader = gguf_meta.read(path), GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(meta.keys()) == keys
    for key in keys:
        assert meta.get(key) == pytest.approx(reader_value(reader.fields[key])), key
    assert [t.name for t in reader.tensors] == list(meta.tensors)
    for t in reader.tensors:
        ours = meta.tensors[t.name]
        assert (ours.offset, ours.nbytes, ours.ggml_type) == (t.data_offset, t.n_bytes, int(t.tensor_type)), t.name
        assert ours.dims == tuple(int(d) for d in t.shape)
    assert meta.architecture == arch and meta.name == f"tiny-{arch}"
    assert meta.context_length == tiny_gguf.hparams(arch).context == meta.arch_get("context_length")
    assert meta.vocab_size == tiny_gguf.hparams(arch).vocab == meta.count("tokenizer.ggml.tokens")
    assert meta.get("no.such.key", 7) == 7 and meta.count("no.such.key") is None


def test_it_refuses_what_is_not_gguf(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"not a gguf file at all, just bytes" * 4)
    with pytest.raises(gguf_meta.GGUFError, match="not a GGUF"):
        gguf_meta.read(tmp_path / "x.bin")
    assert not gguf_meta.is_gguf(tmp_path / "x.bin") and not gguf_meta.is_gguf(tmp_path)
    assert gguf_meta.is_gguf(tiny_gguf.write_tiny(tmp_path / "m.gguf", "qwen2"))


def test_it_imports_no_torch():
    import subprocess

    code = "import sys, specd.gguf_meta as m; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.strip() == "False", done.stderr


# --- vocabulary digest -------------------------------------------------------------------------


def test_the_vocab_digest_is_the_tokens_digest_and_tells_vocabularies_apart(tmp_path):
    a = gguf_meta.read(tiny_gguf.write_tiny(tmp_path / "a.gguf", "qwen2"))
    b = gguf_meta.read(tiny_gguf.write_tiny(tmp_path / "b.gguf", "llama", "Q8_0", seed=3))  # same tokens
    c = gguf_meta.read(tiny_gguf.write_tiny(tmp_path / "c.gguf", "qwen2", vocab=300))
    assert gguf_meta.vocab_digest(a) == gguf_meta.digest_tokens(a.tokens)
    assert gguf_meta.vocab_digest(a) == gguf_meta.vocab_digest(b) != gguf_meta.vocab_digest(c)
    swapped = list(a.tokens)
    swapped[300], swapped[301] = swapped[301], swapped[300]
    assert gguf_meta.digest_tokens(swapped) != gguf_meta.vocab_digest(a)  # ids, not just the set
    assert gguf_meta.digest_tokens(["ab", "c"]) != gguf_meta.digest_tokens(["a", "bc"])


# --- end of generation ---------------------------------------------------------------------------


def vocab_file(path: Path, tokens: list[str], model: str = "gpt2", **ids: int) -> gguf_meta.Metadata:
    """A tokenizer-only GGUF: these tokens, tokenizer.ggml.<name>_token_id for each of `ids`."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    for name, value in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{name}_token_id", value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_meta.read(path)


def eog_texts(meta: gguf_meta.Metadata) -> set[str]:
    return {meta.tokens[i] for i in gguf_meta.eog_ids(meta)}


def test_eog_is_the_files_eos_and_eot_and_every_token_named_like_an_end(tmp_path):
    tokens = ["a", "b", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "</s>", "<|im_start|>", "STOP"]
    meta = vocab_file(tmp_path / "v.gguf", tokens, eos=1, eot=8)
    assert eog_texts(meta) == {"b", "STOP", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "</s>"}


def test_eog_has_the_fill_in_the_middle_pad_repo_and_separator_tokens(tmp_path):
    tokens = ["x", "<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|fim_middle|>"]
    assert eog_texts(vocab_file(tmp_path / "a.gguf", tokens, eos=0)) == {
        "x", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    named = vocab_file(tmp_path / "b.gguf", ["x", "y", "<|fim_pad|>"], eos=0, fim_pad=1)  # the key wins
    assert eog_texts(named) == {"x", "y"}


def test_eog_follows_llama_cpps_workarounds(tmp_path):
    harmony = ["x", "<|return|>", "<|call|>", "<|end|>"]  # gpt-oss: <|end|> ends a message, not generation
    assert eog_texts(vocab_file(tmp_path / "h.gguf", harmony, eos=1)) == {"<|return|>", "<|call|>"}
    assert eog_texts(vocab_file(tmp_path / "e.gguf", ["x", "<|end|>"], eos=0)) == {"x", "<|end|>"}
    gemma4 = ["x", "<|tool_response>", "</s>", "<eos>"]
    assert eog_texts(vocab_file(tmp_path / "g.gguf", gemma4, eos=3)) == {"<|tool_response>", "<eos>"}


def test_without_an_eos_key_the_tokenizers_default_is_used(tmp_path):
    """llama.cpp's defaults: 2 for a SentencePiece ("llama") vocabulary; an id out of range is none."""
    assert eog_texts(vocab_file(tmp_path / "s.gguf", ["<unk>", "<s>", "x"], model="llama")) == {"x"}
    assert eog_texts(vocab_file(tmp_path / "o.gguf", ["a", "b"], eos=7)) == set()


# --- tokenizer metadata --------------------------------------------------------------------------


def test_special_tokens_and_template(tmp_path):
    meta = gguf_meta.read(tiny_gguf.write_tiny(tmp_path / "m.gguf", "qwen2"))
    assert gguf_meta.special_tokens(meta) == {"bos_token": tiny_gguf.BOS, "eos_token": tiny_gguf.EOS,
                                              "pad_token": tiny_gguf.PAD}
    assert gguf_meta.chat_template(meta) == tiny_gguf.CHAT_TEMPLATE
    assert gguf_meta.tokenizer_sidecar(meta.path) == tmp_path / "m.gguf.tokenizer.json"


# --- the real files --------------------------------------------------------------------------------


@pytest.mark.real
def test_the_real_target_reads_in_well_under_a_second():
    """gguf.GGUFReader takes about 7 s on this file (its 151,936 tokens and 151,387 merges)."""
    from services.models import is_ready, model_path

    if not is_ready("target"):
        pytest.fail("the real pair is not fetched: run `specd models fetch` (scripts/test does)")
    started = time.perf_counter()
    meta = gguf_meta.read(model_path("target"))
    digest = gguf_meta.vocab_digest(meta)
    eog = gguf_meta.eog_ids(meta)
    assert time.perf_counter() - started < 1.0
    assert (meta.architecture, meta.vocab_size, meta.context_length) == ("qwen2", 151936, 32768)
    assert meta.tensors["token_embd.weight"].shape == (151936, 1536)
    assert 151645 in eog and len(digest) == 64
    draft = gguf_meta.read(model_path("draft"))
    assert gguf_meta.vocab_digest(draft) == digest  # the pair shares its vocabulary
