"""The architectures specd's decoder runs: one table of deltas from the Llama block, read as llama.cpp reads them.

Every architecture is the same pre-norm decoder (specd/csrc/decoder.c); what differs is data: how
rotary pairs a head's values, the gate's activation, q/k norms, norms after each block, the
embedding scale, which layers see a sliding window and with which rotary base, and soft-capping.
Hyper-parameters come from the GGUF's `<arch>.*` keys, tensors by llama.cpp's names. Adding an
architecture is a row in ARCHS plus its tiny-model test (tests/test_archs.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class UnsupportedArchitecture(ValueError):
    """The file's `general.architecture` has no row in ARCHS."""


@dataclass(frozen=True)
class Arch:
    rope_neox: bool = True  # rotary pairs (i, i + d/2); False: (2i, 2i + 1), llama's GGUF q/k layout
    gelu: bool = False  # gate activation: gelu (tanh form) instead of silu
    post_norms: bool = False  # a norm after attention and after the ffn, before each residual add
    embed_scale: bool = False  # embeddings times sqrt(hidden)
    swa_pattern: int = 0  # layer il slides when il % n < n - 1 (llama.cpp's set_swa_pattern); 0: none
    swa_rope_base: float | None = None  # rotary base of the sliding layers (None: the model's)


ARCHS: dict[str, Arch] = {
    "llama": Arch(rope_neox=False),  # Llama 2/3.x, Mistral, SmolLM, TinyLlama
    "qwen2": Arch(),  # q/k/v biases: present as tensors
    "qwen3": Arch(),  # q/k norms: present as tensors
    "gemma2": Arch(gelu=True, post_norms=True, embed_scale=True, swa_pattern=2),
    "gemma3": Arch(gelu=True, post_norms=True, embed_scale=True, swa_pattern=6, swa_rope_base=10_000.0),
    "phi3": Arch(),  # fused qkv and gate|up: present as tensors; its sliding_window key unused, as llama.cpp
}


@dataclass(frozen=True)
class HyperParams:
    """What the decoder needs from the metadata, with llama.cpp's defaults."""

    arch: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dims: int
    eps: float
    rope_base: float
    rope_scale: float  # positions are divided by it (linear scaling), 1 without
    context: int
    window: int  # sliding window of the sliding layers, 0 without
    attn_softcap: float  # 0: none
    final_softcap: float
    attn_scale: float

    def sliding(self, layer: int) -> bool:
        n = ARCHS[self.arch].swa_pattern
        return bool(self.window and n) and layer % n < n - 1

    def rope_base_of(self, layer: int) -> float:
        spec = ARCHS[self.arch]
        return spec.swa_rope_base if self.sliding(layer) and spec.swa_rope_base else self.rope_base

    def rope_scale_of(self, layer: int) -> float:
        """llama.cpp scales the global layers only when the sliding ones have a base of their own."""
        spec = ARCHS[self.arch]
        return 1.0 if self.sliding(layer) and spec.swa_rope_base else self.rope_scale


def arch_of(name: str) -> Arch:
    if name not in ARCHS:
        raise UnsupportedArchitecture(
            f"general.architecture {name!r} is not supported; specd runs {', '.join(sorted(ARCHS))}")
    return ARCHS[name]


def hyper_params(name: str, get: Callable[[str, Any], Any]) -> HyperParams:
    """The hyper-parameters of architecture `name`; get(key, default) reads a metadata key."""
    arch_of(name)
    key = lambda suffix, default=None: get(f"{name}.{suffix}", default)  # noqa: E731
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedArchitecture(f"{name}: rope scaling {scaling!r} is not supported (none, linear)")
    return HyperParams(
        arch=name,
        layers=int(key("block_count")),
        hidden=hidden,
        intermediate=int(key("feed_forward_length")),
        heads=heads,
        kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_dims=int(key("rope.dimension_count", head_dim)),
        eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(key("rope.freq_base", 10_000.0)),
        rope_scale=float(key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        context=int(key("context_length", 2048)),
        window=int(key("attention.sliding_window", 0) or 0),
        attn_softcap=float(key("attn_logit_softcapping", 0.0) or 0.0),
        final_softcap=float(key("final_logit_softcapping", 0.0) or 0.0),
        attn_scale=1.0 / math.sqrt(head_dim),
    )
