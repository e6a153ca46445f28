"""A tiny, deterministic Qwen2 draft/target pair for tests.

The target is a random 2-layer Qwen2; the draft is its first layer plus seeded noise, so the draft
agrees with the target's greedy choice often but not always, like a real small/large pair. Both share
a byte-level tokenizer (any NFC UTF-8 text round-trips) with Qwen-style chat special tokens.
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MAX_POSITIONS = 1024
INIT_STD = 0.02  # Qwen2's default initializer_range
# Random init gives logits with std ~sqrt(hidden) * INIT_STD = 0.16: near-uniform, so greedy argmax
# near-ties are common. Scaling the lm_head makes next-token distributions peaked (logit std ~4).
LM_HEAD_SCALE = 25.0
# The target's last layer writes a damped update (a refinement), so the draft, which lacks it, is a
# fair approximation; with full-strength layers a 1-layer draft agrees only ~0.3-0.6 depending on seed.
LAST_LAYER_SCALE = 0.3
# Std of the noise added to the draft's copied weights, relative to each tensor's std. With
# LAST_LAYER_SCALE this gives greedy agreement 0.47-0.63 for seeds 0-3 (0.505 for seed 0;
# tests/test_engine.py checks 0.4-0.8).
DRAFT_NOISE = 0.2


def build_tokenizer(max_positions: int = MAX_POSITIONS) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the 256-symbol byte alphabet with no merges: one token per UTF-8 byte.

    NFC-normalised like the real Qwen2 tokenizer: transformers 5 loads any model_type "qwen2"
    directory as Qwen2Tokenizer, which always adds NFC (and its split regex, harmless without
    merges). Setting it here too makes this object encode exactly like the reloaded one; NFC text
    round-trips byte for byte.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=max_positions,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(vocab_size: int, eos_id: int, num_layers: int, max_positions: int = MAX_POSITIONS) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )


def _build_target(config: Qwen2Config, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(config).eval()
    last = target.model.layers[-1]
    with torch.no_grad():
        target.lm_head.weight.mul_(LM_HEAD_SCALE)
        last.self_attn.o_proj.weight.mul_(LAST_LAYER_SCALE)
        last.mlp.down_proj.weight.mul_(LAST_LAYER_SCALE)
    return target


def _build_draft(target: Qwen2ForCausalLM, config: Qwen2Config, seed: int) -> Qwen2ForCausalLM:
    """The target's embeddings, layer 0, final norm and lm_head, each perturbed by seeded noise."""
    draft = Qwen2ForCausalLM(config).eval()
    state = {
        name: value
        for name, value in target.state_dict().items()
        if not name.startswith("model.layers.") or name.startswith("model.layers.0.")
    }
    draft.load_state_dict(state)
    noise = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in draft.parameters():  # norm weights (all ones, std 0) stay exact
            param.add_(torch.randn(param.shape, generator=noise) * (DRAFT_NOISE * param.std()))
    return draft


def build_tiny_pair(out_dir: Path, seed: int = 0, max_positions: int = MAX_POSITIONS) -> tuple[Path, Path]:
    """Write (draft_dir, target_dir) under out_dir: HF model + tokenizer directories, float32 safetensors."""
    tokenizer = build_tokenizer(max_positions)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    vocab_size = -(-len(tokenizer) // 8) * 8  # round up to a multiple of 8, like real checkpoints
    # fork_rng keeps the caller's global RNG untouched by our seeding.
    with torch.random.fork_rng():
        target = _build_target(_config(vocab_size, eos_id, 2, max_positions), seed)
        draft = _build_draft(target, _config(vocab_size, eos_id, 1, max_positions), seed)
    dirs = (Path(out_dir) / "draft", Path(out_dir) / "target")
    for model, model_dir in zip((draft, target), dirs):
        model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    return dirs
