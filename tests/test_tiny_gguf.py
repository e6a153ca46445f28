"""tests/tiny_gguf.py writes files that transformers reads as the model we meant, and gguf-py reads
in every tensor type: the oracle the GGUF engine is compared with."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import AutoTokenizer
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from tests.tiny_gguf import ARCHS, DELTAS, TENSOR_TYPES, hf_logits, hf_model, hparams, llama_permute, tensors, \
    write_tiny

TOKENS = [280, 277, 105, 99, 107, 301, 267, 97, 105, 100, 58, 32, 104, 195, 169, 271]  # "The quick fox said: ..."

# The keys each file has under `<arch>.`, beyond the common ones (what convert_hf_to_gguf.py writes)
COMMON = {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
          "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base"}
EXTRA = {
    "llama": {"vocab_size", "rope.dimension_count", "attention.key_length", "attention.value_length"},
    "qwen2": set(),
    "qwen3": {"attention.key_length", "attention.value_length"},
    "gemma2": {"attention.key_length", "attention.value_length", "attention.sliding_window",
               "attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3": {"attention.key_length", "attention.value_length", "attention.sliding_window"},
    "phi3": {"rope.dimension_count", "attention.sliding_window", "rope.scaling.original_context_length"},
}
# Relative RMS error of a dequantised weight against the float one it was made from
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_0": 0.06, "Q5_K": 0.06,
             "Q4_0": 0.12, "Q4_K": 0.12}


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gguf")
    return {arch: write_tiny(root / f"{arch}.gguf", arch) for arch in ARCHS}


def _rope_thetas(config) -> tuple[float, float | None]:
    """(global base, sliding layers' base or None) from a transformers 5 config."""
    rope = config.rope_parameters
    if "full_attention" in rope:
        return rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]
    return rope["rope_theta"], None


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reads_the_model_we_wrote(arch, f32):
    hp, model = hparams(arch), hf_model(f32[arch])
    c, attn = model.config, model.model.layers[0].self_attn
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (hp.layers, hp.hidden, hp.intermediate)
    assert (c.num_attention_heads, c.num_key_value_heads) == (hp.heads, hp.kv_heads)
    assert attn.head_dim == hp.head_dim
    assert (c.vocab_size, c.max_position_embeddings, c.tie_word_embeddings) == (hp.vocab, hp.context, hp.tied)
    assert c.rms_norm_eps == pytest.approx(hp.eps, rel=1e-6)
    theta, local_theta = _rope_thetas(c)
    assert theta == hp.rope_base
    assert model.model.embed_tokens.weight.shape == (hp.vocab, hp.hidden)
    if arch.startswith("gemma"):
        # llama.cpp's set_swa_pattern(n): layer i slides iff i % n < n - 1 (gemma2: n=2, gemma3: n=6)
        n = 2 if arch == "gemma2" else 6
        assert c.layer_types == ["sliding_attention" if i % n < n - 1 else "full_attention" for i in range(hp.layers)]
        assert set(c.layer_types) == {"sliding_attention", "full_attention"}
        assert c.sliding_window == hp.window
        assert c.query_pre_attn_scalar == hp.head_dim  # llama.cpp scales q by 1/sqrt(head_dim)
        assert attn.scaling == pytest.approx(hp.head_dim**-0.5)
        assert float(model.model.embed_tokens.embed_scale) == pytest.approx(math.sqrt(hp.hidden))
    if arch == "gemma3":
        assert local_theta == 10_000.0  # llama.cpp's hard-coded rope_freq_base_train_swa
        assert c.attn_logit_softcapping is None and c.final_logit_softcapping is None
    if arch == "gemma2":
        assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (hp.attn_softcap, hp.final_softcap)

    logits = hf_logits(f32[arch], TOKENS[:12])
    assert logits.shape == (12, hp.vocab) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert (logits.std(dim=-1) > 0.3).all()  # not constant within a row ...
    assert len(set(logits.argmax(-1).tolist())) > 3  # ... nor the same prediction everywhere


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_keys_are_llama_cpp_s_and_cover_what_transformers_reads(arch, f32):
    fields = GGUFReader(f32[arch]).fields
    arch_keys = {k.removeprefix(f"{arch}.") for k in fields if k.startswith(f"{arch}.")}
    assert arch_keys == COMMON | EXTRA[arch]
    read = {k for k, v in GGUF_CONFIG_MAPPING[arch].items() if v is not None}
    # llama.cpp writes <arch>.vocab_size for llama only; transformers then counts the tokens
    assert read - arch_keys <= {"vocab_size"}
    for key in ("general.architecture", "general.file_type", "general.quantization_version", "tokenizer.ggml.model",
                "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert key in fields, key
    assert fields["general.architecture"].contents() == arch
    assert len(fields["tokenizer.ggml.tokens"].contents()) == hparams(arch).vocab


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_every_tensor_type_reads_back(arch, tensor_type, tmp_path):
    path = write_tiny(tmp_path / "m.gguf", arch, tensor_type)
    floats = tensors(arch)
    reader = GGUFReader(path)
    arch_enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[arch_enum]}
    assert [t.name for t in reader.tensors] == list(floats)
    for t in reader.tensors:
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", t.name.rsplit(".", 1)[0]) in known, t.name
        want = floats[t.name]
        expected_type = GGMLQuantizationType[tensor_type] if want.ndim == 2 else GGMLQuantizationType.F32
        assert t.tensor_type == expected_type, t.name
        assert tuple(int(n) for n in reversed(t.shape)) == want.shape, t.name  # GGUF lists ne0 first
        values = dequantize(t.data, t.tensor_type).reshape(want.shape)
        assert np.isfinite(values).all(), t.name
        error = np.sqrt(np.mean((values - want) ** 2)) / want.std()
        assert error <= TOLERANCE[tensor_type if want.ndim == 2 else "F32"], (t.name, error)


def test_llama_permutation_is_the_one_transformers_undoes():
    undo = LlamaTensorProcessor()._reverse_permute_weights
    w = np.arange(256 * 8, dtype=np.float32).reshape(256, 8)
    for heads, kv in ((4, 4), (4, 2)):  # attn_q, attn_k of a GQA model with head_dim 64
        rows = w[: kv * 64]
        assert not np.array_equal(llama_permute(rows, heads, kv), rows)
        assert np.array_equal(undo(llama_permute(rows, heads, kv), heads, kv), rows)


def test_llama_and_phi3_files_hold_the_same_model(f32):
    """Same seed and shapes: llama's permuted q/k and phi3's fused qkv and gate|up are two spellings
    of one model, so transformers, undoing each, must compute the same logits."""
    assert not DELTAS["phi3"].hp.keys() - {"window"}  # phi3's window never binds at this length
    torch.testing.assert_close(hf_logits(f32["llama"], TOKENS), hf_logits(f32["phi3"], TOKENS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_norms_are_stored_plus_one(arch, f32):
    stored, state = tensors(arch), hf_model(f32[arch]).state_dict()
    pairs = {"blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
             "blk.0.post_attention_norm.weight": "model.layers.0.post_attention_layernorm.weight",
             "blk.0.ffn_norm.weight": "model.layers.0.pre_feedforward_layernorm.weight",
             "blk.0.post_ffw_norm.weight": "model.layers.0.post_feedforward_layernorm.weight",
             "output_norm.weight": "model.norm.weight"}
    if arch == "gemma3":
        pairs["blk.0.attn_q_norm.weight"] = "model.layers.0.self_attn.q_norm.weight"
    for gguf_name, hf_name in pairs.items():
        np.testing.assert_allclose(state[hf_name].numpy(), stored[gguf_name] - 1.0, atol=1e-6, err_msg=gguf_name)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_sliding_window_binds_within_16_tokens(arch, tmp_path):
    window = hparams(arch).window
    narrow = hf_logits(write_tiny(tmp_path / "narrow.gguf", arch), TOKENS)
    wide = hf_logits(write_tiny(tmp_path / "wide.gguf", arch, window=64), TOKENS)
    torch.testing.assert_close(narrow[:window], wide[:window], rtol=0, atol=1e-5)
    assert (narrow[window:] - wide[window:]).abs().amax(dim=-1).min() > 1e-3


def test_quantized_files_load_in_transformers(tmp_path):
    path = write_tiny(tmp_path / "q4k.gguf", "qwen3", "Q4_K")
    down = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    model = hf_model(path)
    np.testing.assert_array_equal(model.model.layers[1].mlp.down_proj.weight.numpy(),
                                  dequantize(down.data, down.tensor_type).reshape(256, 512))
    assert torch.isfinite(hf_logits(path, TOKENS)).all()


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_tokenizer_section(arch, f32):
    path = f32[arch]
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "The quick fox said: héllo 🚀\n"
    ids = tok.encode(text)
    assert ids[:2] == TOKENS[:2] and tok.decode(ids) == text
    assert max(ids) < hparams(arch).vocab and len(ids) < len(text.encode())  # merges apply
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    chat_ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert (chat_ids[0], chat_ids[-1]) == (im_start, im_end)  # whole special tokens, not bytes
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|im_end|>", "<|endoftext|>")
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    assert backend.encode(text).ids == ids


def test_hf_logits_caches_the_model_and_checks_overrides(f32):
    assert hf_model(f32["llama"]) is hf_model(f32["llama"])
    with pytest.raises(TypeError):
        hparams("llama", hiden=128)
    with pytest.raises(ValueError):
        hparams("mistral")
