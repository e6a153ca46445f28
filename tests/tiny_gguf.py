"""Tiny random-weight GGUF files, one per Llama-family architecture, written as llama.cpp writes them.

`write_tiny(path, arch, tensor_type, seed)` writes a file that llama.cpp's `convert_hf_to_gguf.py`
could have produced from a small Hugging Face checkpoint: its tensor names and shapes, its metadata
keys, and its weight transformations (Llama's q/k row permutation for interleaved rotary, Gemma's
norms stored as `1 + w`, Phi-3's fused qkv and gate|up). Two readers use them: transformers, as an
independent oracle (`hf_logits`: `from_pretrained(dir, gguf_file=name)` undoes those transformations
itself), and specd's own GGUF engine.

The model is generated in Hugging Face's layout from a seeded RNG and only then converted, so the
same seed gives the same float model in every `tensor_type`: the quantised files are quantisations
of the F32 one. The 2-D weights (attention, ffn, token_embd, output) are stored in `tensor_type`;
norms and biases stay F32, as llama.cpp keeps every 1-D tensor. Q8_0/Q5_0/Q4_0/BF16 are quantised
by `gguf.quants`; gguf-py cannot quantise K-quants, so Q4_K/Q5_K/Q6_K are quantised here by a
plain per-block min/max rule into ggml's block layouts (checked against `gguf.quants.dequantize`).

Shapes suit K-quant blocks: every weight's input dimension is a multiple of 256.

What differs from Llama is one table, DELTAS: hyper-parameters, extra metadata keys, and which
tensors exist. In short (all also write the common keys, see `_write_metadata`):

  arch    tensors beyond llama's                 extra metadata keys                       notes
  llama   -                                      vocab_size, rope.dimension_count,         q/k rows permuted
                                                 attention.key_length/value_length
  qwen2   attn_{q,k,v}.bias                      -                                          tied
  qwen3   attn_{q,k}_norm                        attention.key_length/value_length         head_dim 128
  gemma2  post_attention_norm, post_ffw_norm     key/value_length, sliding_window,         norms 1+w, tied,
                                                 attn/final_logit_softcapping              head_dim 256, 4 layers
  gemma3  attn_{q,k}_norm, post_attention_norm,  key/value_length, sliding_window          norms 1+w, tied,
          post_ffw_norm                                                                     head_dim 256, 6 layers
  phi3    attn_qkv and ffn_up = gate|up replace  rope.dimension_count, sliding_window,     -
          attn_{q,k,v} and ffn_gate/ffn_up       rope.scaling.original_context_length
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_VERSION

# ---------------------------------------------------------------------------------------------
# Hyper-parameters and the per-architecture deltas
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HParams:
    """The tiny model's shape. `write_tiny(..., **overrides)` replaces any of these fields."""

    layers: int = 2
    hidden: int = 256
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 2  # GQA
    head_dim: int = 64
    vocab: int = 320  # 256 byte symbols + merges + 3 special tokens (padded with [PADn] if short)
    context: int = 256
    eps: float = 1e-5
    rope_base: float = 10_000.0
    tied: bool = False  # no output.weight: the head is token_embd
    window: int = 0  # attention.sliding_window (written by the archs that have the key)
    attn_softcap: float = 0.0  # gemma2 only
    final_softcap: float = 0.0  # gemma2 only
    pre: str = "qwen2"  # tokenizer.ggml.pre


@dataclass(frozen=True)
class Delta:
    """How an architecture's file differs from llama's (beyond the name)."""

    hp: dict = field(default_factory=dict)  # HParams fields that differ from the defaults
    keys: tuple[str, ...] = ()  # metadata keys written beyond COMMON_KEYS (see EXTRA_KEYS)
    permute_qk: bool = False  # llama.cpp permutes attn_q/attn_k rows for its interleaved rotary
    norm_shift: float = 0.0  # stored norm = HF norm + shift (Gemma's RMSNorm multiplies by 1 + w)
    qkv_bias: bool = False  # attn_q/k/v.bias
    qk_norm: bool = False  # attn_q_norm / attn_k_norm, [head_dim]
    post_norms: bool = False  # post_attention_norm / post_ffw_norm
    fused: bool = False  # attn_qkv = q|k|v rows, ffn_up = gate|up rows, no ffn_gate


DELTAS: dict[str, Delta] = {
    "llama": Delta(
        keys=("vocab_size", "rope.dimension_count", "attention.key_length", "attention.value_length"),
        permute_qk=True,
    ),
    "qwen2": Delta(hp=dict(eps=1e-6, rope_base=1_000_000.0, tied=True), qkv_bias=True),
    # transformers ignores qwen3.attention.key_length and takes Qwen3Config's head_dim=128
    "qwen3": Delta(
        hp=dict(eps=1e-6, rope_base=1_000_000.0, head_dim=128),
        keys=("attention.key_length", "attention.value_length"),
        qk_norm=True,
    ),
    # transformers reads neither softcapping key: it uses Gemma2Config's 50/30, so keep those. Its
    # query_pre_attn_scalar is always the default 256 while llama.cpp scales by 1/sqrt(head_dim):
    # head_dim 256 makes them agree. Layers alternate sliding/full (pattern 2 in both).
    "gemma2": Delta(
        hp=dict(layers=4, eps=1e-6, head_dim=256, tied=True, window=4, attn_softcap=50.0, final_softcap=30.0),
        keys=("attention.key_length", "attention.value_length", "attention.sliding_window",
              "attn_logit_softcapping", "final_logit_softcapping"),
        norm_shift=1.0,
        post_norms=True,
    ),
    # Both llama.cpp and transformers hard-code gemma3's sliding pattern 6 (layer i slides unless
    # i % 6 == 5) and the sliding layers' rotary base 10000: 6 layers give 5 sliding + 1 full.
    "gemma3": Delta(
        hp=dict(layers=6, eps=1e-6, head_dim=256, rope_base=1_000_000.0, tied=True, window=4),
        keys=("attention.key_length", "attention.value_length", "attention.sliding_window"),
        norm_shift=1.0,
        qk_norm=True,
        post_norms=True,
    ),
    # Phi-3-mini's converter writes its sliding_window (2047); llama.cpp disables Phi SWA when
    # loading and transformers does not read the key, so it never binds (> context here anyway).
    "phi3": Delta(
        hp=dict(window=2047),
        keys=("rope.dimension_count", "attention.sliding_window", "rope.scaling.original_context_length"),
        fused=True,
    ),
}

ARCHS: tuple[str, ...] = tuple(DELTAS)

# Every architecture writes these (llama.cpp's TextModel.set_gguf_parameters); values from HParams.
COMMON_KEYS = {
    "context_length": lambda hp: hp.context,
    "embedding_length": lambda hp: hp.hidden,
    "block_count": lambda hp: hp.layers,
    "feed_forward_length": lambda hp: hp.intermediate,
    "attention.head_count": lambda hp: hp.heads,
    "attention.head_count_kv": lambda hp: hp.kv_heads,
    "attention.layer_norm_rms_epsilon": lambda hp: float(hp.eps),
    "rope.freq_base": lambda hp: float(hp.rope_base),
}
EXTRA_KEYS = {
    "vocab_size": lambda hp: hp.vocab,
    "rope.dimension_count": lambda hp: hp.head_dim,
    "attention.key_length": lambda hp: hp.head_dim,
    "attention.value_length": lambda hp: hp.head_dim,
    "attention.sliding_window": lambda hp: hp.window,
    "attn_logit_softcapping": lambda hp: float(hp.attn_softcap),
    "final_logit_softcapping": lambda hp: float(hp.final_softcap),
    "rope.scaling.original_context_length": lambda hp: hp.context,
}

TENSOR_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_M, "Q5_K": LlamaFileType.MOSTLY_Q5_K_M, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}


def hparams(arch: str, **overrides) -> HParams:
    """The hyper-parameters `write_tiny(path, arch, **overrides)` writes."""
    if arch not in DELTAS:
        raise ValueError(f"unknown arch {arch!r}; this module writes {', '.join(ARCHS)}")
    known = {f.name for f in fields(HParams)}
    if unknown := set(overrides) - known:
        raise TypeError(f"unknown overrides {sorted(unknown)}; known: {sorted(known)}")
    return replace(HParams(), **{**DELTAS[arch].hp, **overrides})


# ---------------------------------------------------------------------------------------------
# Weights: generated in HF layout, then converted as llama.cpp's converter does
# ---------------------------------------------------------------------------------------------


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's half-split rotary rows -> interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Gemma's embeddings enter at unit RMS (x sqrt(hidden)) and its head is the tied embedding: with
# post-norms of gain 1 the residual stays dominated by the input token, whose own logit then wins at
# most positions. Louder blocks (real Gemma post-norm weights are large too) make it a model.
POST_NORM_GAIN = 4.0


def tensors(arch: str, seed: int = 0, **overrides) -> dict[str, np.ndarray]:
    """The float32 tensors of the file, by GGUF name, as stored (numpy layout [out, in]) before the
    2-D weights are cast/quantised to the file's tensor_type. Deterministic in (arch, seed, overrides)."""
    hp, d = hparams(arch, **overrides), DELTAS[arch]
    rng = np.random.default_rng(seed)

    def linear(out_features: int, in_features: int, gain: float = 0.5) -> np.ndarray:
        # each matmul maps unit-RMS inputs to ~gain-RMS outputs: activations stay O(1) through layers
        return (rng.standard_normal((out_features, in_features)) * gain / np.sqrt(in_features)).astype(np.float32)

    def norm(n: int, gain: float = 1.0) -> np.ndarray:
        # effective scale gain +- 0.1 in both conventions; Gemma's HF weight w scales by (1 + w)
        hf = rng.standard_normal(n) * 0.1 + (gain - d.norm_shift)
        return (hf + d.norm_shift).astype(np.float32)

    q_dim, kv_dim = hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim
    out: dict[str, np.ndarray] = {}
    # tied: logits = embeddings . h, so the embeddings need ~unit-RMS logits on their own (std
    # ~1/sqrt(hidden)); Gemma multiplies embeddings by sqrt(hidden), which then gives O(1) inputs.
    out["token_embd.weight"] = (rng.standard_normal((hp.vocab, hp.hidden)) / np.sqrt(hp.hidden)).astype(np.float32)
    for i in range(hp.layers):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = norm(hp.hidden)
        q, k, v = linear(q_dim, hp.hidden), linear(kv_dim, hp.hidden), linear(kv_dim, hp.hidden)
        if d.permute_qk:
            q, k = llama_permute(q, hp.heads, hp.heads), llama_permute(k, hp.heads, hp.kv_heads)
        if d.fused:
            out[b + "attn_qkv.weight"] = np.concatenate([q, k, v])
        else:
            out[b + "attn_q.weight"], out[b + "attn_k.weight"], out[b + "attn_v.weight"] = q, k, v
        if d.qkv_bias:
            for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                out[b + name + ".bias"] = (rng.standard_normal(n) * 0.1).astype(np.float32)
        if d.qk_norm:
            out[b + "attn_q_norm.weight"], out[b + "attn_k_norm.weight"] = norm(hp.head_dim), norm(hp.head_dim)
        out[b + "attn_output.weight"] = linear(hp.hidden, q_dim)
        if d.post_norms:
            out[b + "post_attention_norm.weight"] = norm(hp.hidden, POST_NORM_GAIN)
        out[b + "ffn_norm.weight"] = norm(hp.hidden)
        gate, up = linear(hp.intermediate, hp.hidden, 1.0), linear(hp.intermediate, hp.hidden, 1.0)
        if d.fused:
            out[b + "ffn_up.weight"] = np.concatenate([gate, up])  # Phi-3's gate_up_proj: gate first
        else:
            out[b + "ffn_gate.weight"], out[b + "ffn_up.weight"] = gate, up
        out[b + "ffn_down.weight"] = linear(hp.hidden, hp.intermediate, 1.0)
        if d.post_norms:
            out[b + "post_ffw_norm.weight"] = norm(hp.hidden, POST_NORM_GAIN)
    out["output_norm.weight"] = norm(hp.hidden)
    if not hp.tied:
        out["output.weight"] = linear(hp.vocab, hp.hidden, 1.0)
    return out


# ---------------------------------------------------------------------------------------------
# K-quants (gguf-py dequantises them but cannot quantise): ggml's block layouts, simple rounding
# ---------------------------------------------------------------------------------------------

QK_K = 256


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b > 0)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block into Q4_K/Q5_K's 12 bytes (inverse of Q4_K.get_scale_min)."""
    lo = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _affine_k(x: np.ndarray, levels: int):
    """Per 32-value sub-block x ~ d*sc*q - dmin*m with q in [0, levels]: (d, dmin, sc, m, q)."""
    lo, hi = np.minimum(x.min(-1), 0.0), np.maximum(x.max(-1), 0.0)
    scale, mn = (hi - lo) / levels, -lo
    d, dmin = _f16(scale.max(-1) / 63), _f16(mn.max(-1) / 63)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_div(mn, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_div(x + offset[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Sub-blocks (2j, 2j+1) share 32 bytes: low nibble from 2j, high from 2j+1."""
    pairs = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _halves(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint8).reshape(x.shape[0], 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, m, q = _affine_k(x, 15)
    blocks = [_halves(d), _halves(dmin), _pack_k_scales(sc, m), _nibbles(q)]
    return np.concatenate(blocks, axis=1).reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, m, q = _affine_k(x, 31)
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for i in range(8):  # bit i of qh[l] is the fifth bit of sub-block i's value l
        qh |= ((q[:, i] >> 4) & 1) << i
    blocks = [_halves(d), _halves(dmin), _pack_k_scales(sc, m), qh, _nibbles(q)]
    return np.concatenate(blocks, axis=1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 16, 16).astype(np.float32)
    n = x.shape[0]
    scale = np.abs(x).max(-1) / 31
    d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(_div(x, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, QK_K)
    lo = (q & 0x0F).reshape(n, 2, 2, 64)  # value h*128 + s*64 + p: nibble s of ql[h*64 + p]
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    hi = (q >> 4).reshape(n, 2, 4, 32)  # value h*128 + s*32 + p: bits 2s..2s+1 of qh[h*32 + p]
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    blocks = [ql, qh, sc.view(np.uint8), _halves(d)]
    return np.concatenate(blocks, axis=1).reshape(w.shape[0], -1)


K_QUANTIZERS = {
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}


def encode(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`w` [rows, K] in ggml type `qtype`: float arrays for F32/F16, else uint8 [rows, bytes per row]."""
    if qtype in K_QUANTIZERS:
        if w.shape[-1] % QK_K:
            raise ValueError(f"{qtype.name} needs rows of whole {QK_K}-blocks, got {w.shape}")
        return K_QUANTIZERS[qtype](w)
    return gguf_quants.quantize(w, qtype)


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE (tokenizer.ggml.model "gpt2"), Qwen-style chat tokens
# ---------------------------------------------------------------------------------------------

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS, EOS, PAD = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog is not amused, and the fox runs into the "
    "forest. In the morning the sun rises over the hills; in the evening it sets behind the sea. "
    "def main(): return print('hello world') if the answer is 42 then the question is the question. "
    "Speculative decoding lets a small draft model propose tokens that the target model verifies."
)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte, indexed by byte value (bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


@lru_cache(maxsize=None)
def _bpe(n_merges: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Up to n_merges merges learnt from _CORPUS: (merged tokens, "a b" merge rules), deterministic."""
    spell = _byte_symbols()
    words = Counter(tuple(spell[b] for b in w.encode()) for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", _CORPUS))
    tokens, merges = [], []
    while len(merges) < n_merges:
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(merged)
        new_words = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return tuple(tokens), tuple(merges)


def vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of `vocab_size` tokens: bytes, merges, specials, then [PADn]
    filler if the corpus runs out of merges."""
    n_merges = vocab_size - 256 - len(SPECIALS)
    if n_merges < 0:
        raise ValueError(f"vocab {vocab_size} < {256 + len(SPECIALS)} (bytes + special tokens)")
    merged, merges = _bpe(n_merges)
    tokens = _byte_symbols() + list(merged) + list(SPECIALS)
    types = [TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [TokenType.CONTROL] * len(SPECIALS)
    pads = [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]  # ids no token has, as get_vocab_base fills
    tokens += pads
    types += [TokenType.UNUSED] * len(pads)
    return tokens, [int(t) for t in types], list(merges)


# ---------------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------------


def _write_metadata(w: GGUFWriter, arch: str, hp: HParams, tensor_type: str) -> None:
    w.add_type("model")
    w.add_name(f"tiny-{arch}")
    for suffix, value in [*((k, f(hp)) for k, f in COMMON_KEYS.items()),
                          *((k, EXTRA_KEYS[k](hp)) for k in DELTAS[arch].keys)]:
        key = f"{arch}.{suffix}"
        w.add_float32(key, value) if isinstance(value, float) else w.add_uint32(key, value)
    w.add_file_type(FILE_TYPES[tensor_type])
    w.add_quantization_version(GGML_QUANT_VERSION)

    tokens, types, merges = vocabulary(hp.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(hp.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(BOS))
    w.add_eos_token_id(tokens.index(EOS))
    w.add_pad_token_id(tokens.index(PAD))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_tiny(path: Path, arch: str, tensor_type: str = "F32", seed: int = 0, **overrides) -> Path:
    """Write a tiny `arch` model to `path` (a .gguf file), its 2-D weights in `tensor_type`.

    `overrides` replace HParams fields (layers, hidden, vocab, window, tied, ...); shapes must keep
    every input dimension a multiple of the type's block (256 for K-quants, 32 for Q*_0).
    """
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r} not in {TENSOR_TYPES}")
    hp = hparams(arch, **overrides)
    qtype = GGMLQuantizationType[tensor_type]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch)
    _write_metadata(w, arch, hp, tensor_type)
    for name, data in tensors(arch, seed, **overrides).items():
        if data.ndim == 2 and qtype != GGMLQuantizationType.F32:
            w.add_tensor(name, encode(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------
# The oracle: transformers' reading of the file
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _hf_model(path: str, mtime_ns: int, size: int):
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    # eager attention: the reference implementation of every arch (softcapping, sliding windows)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval().requires_grad_(False)


def hf_model(path: Path):
    """transformers' model of the GGUF at `path`, float32, cached per (path, mtime, size)."""
    p = Path(path).resolve()
    stat = p.stat()
    return _hf_model(str(p), stat.st_mtime_ns, stat.st_size)


def hf_logits(path: Path, tokens: list[int]):
    """transformers' logits for `tokens` from the GGUF at `path`: one forward, no cache,
    [len(tokens), vocab] float32."""
    import torch

    model = hf_model(path)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(tokens)], dtype=torch.int64), use_cache=False)
    return out.logits[0].float()
