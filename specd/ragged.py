"""One forward pass of a Qwen2 model over several sequences, each with its own KV cache.

A decode-sized forward on a CPU is bound by reading the weights, so verifying B sessions' K+1
rows together costs little more than one session's. The sessions' caches have different
lengths, and padding them into one batched cache would copy every cache every round; instead
the batch is *ragged*: all sessions' new tokens are concatenated into one [1, rows] sequence for
everything that treats rows independently (embedding, norms, q/k/v/o projections, MLP, lm_head),
and only attention runs per session, against that session's own DynamicCache.

Every step reuses the model's own modules and transformers' own functions (rotary embedding,
causal masks, the configured attention implementation), called exactly as `Qwen2Model.forward`
calls them for one session. So a batch of one is the stock forward, and in a larger batch each
row differs from its one-session value only by how the BLAS blocks a matmul with more rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2Attention,
    Qwen2ForCausalLM,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

Masks = dict[str, torch.Tensor | None]  # by layer type ("full_attention", "sliding_attention")


@torch.inference_mode()
def forward(
    model: Qwen2ForCausalLM,
    caches: Sequence[DynamicCache],
    inputs: Sequence[Sequence[int]],
    keep: Sequence[int],
) -> list[torch.Tensor]:
    """Feed inputs[i] to the sequence held by caches[i] (which grow by them), all in one pass.

    Returns per sequence the logits of its last keep[i] fed tokens: [keep[i], vocab], in the
    model's dtype, exactly what `model(inputs[i], past_key_values=caches[i],
    logits_to_keep=keep[i]).logits[0]` returns up to matmul rounding.
    """
    if not isinstance(model, Qwen2ForCausalLM):
        raise TypeError(f"the ragged forward follows Qwen2's layer layout, not {type(model).__name__}")
    base = model.model
    bounds = row_bounds([len(x) for x in inputs])
    device = base.embed_tokens.weight.device
    ids = torch.tensor([[t for x in inputs for t in x]], dtype=torch.long, device=device)  # [1, rows]
    hidden = base.embed_tokens(ids)  # [1, rows, hidden]
    position_ids = torch.cat(
        [torch.arange(c.get_seq_length(), c.get_seq_length() + len(x), device=device) for c, x in zip(caches, inputs)]
    )[None]  # [1, rows]: each token at its own session's position
    # Masks depend on each cache's length before this pass, so they are made before any layer grows it.
    masks = [
        _masks(model, hidden[:, start:end], cache, position_ids[:, start:end])
        for cache, (start, end) in zip(caches, bounds)
    ]
    rotary = base.rotary_emb(hidden, position_ids)  # (cos, sin), each [1, rows, head_dim]

    for i, layer in enumerate(base.layers[: model.config.num_hidden_layers]):
        layer_masks = [m[model.config.layer_types[i]] for m in masks]
        residual = hidden
        hidden = layer.input_layernorm(hidden)
        hidden = _attention(layer.self_attn, hidden, rotary, caches, bounds, layer_masks)
        hidden = residual + hidden
        residual = hidden
        hidden = layer.post_attention_layernorm(hidden)
        hidden = layer.mlp(hidden)
        hidden = residual + hidden

    hidden = base.norm(hidden)
    rows = torch.cat([torch.arange(end - k, end, device=device) for (_, end), k in zip(bounds, keep)])
    logits = model.lm_head(hidden[:, rows])[0]  # [sum(keep), vocab]: the vocab projection only where read
    return list(logits.split(list(keep)))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, as transformers' apply_rotary_pos_emb (rotate_half) computes it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def row_bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each sequence's rows in the concatenation."""
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [(end - n, end) for n, end in zip(lengths, ends)]


def _masks(model: Qwen2ForCausalLM, embeds: torch.Tensor, cache: DynamicCache, position_ids: torch.Tensor) -> Masks:
    """The attention masks Qwen2Model.forward would build for this one sequence."""
    kwargs = dict(config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=cache,
                  position_ids=position_ids)
    masks: Masks = {"full_attention": create_causal_mask(**kwargs)}
    if model.model.has_sliding_layers:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
    return masks


def _attention(
    attn: Qwen2Attention,
    hidden: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    caches: Sequence[DynamicCache],
    bounds: Sequence[tuple[int, int]],
    masks: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """Qwen2Attention.forward with the projections over all rows and attention per sequence."""
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    query = attn.q_proj(hidden).view(shape).transpose(1, 2)  # [1, heads, rows, head_dim]
    key = attn.k_proj(hidden).view(shape).transpose(1, 2)  # [1, kv_heads, rows, head_dim]
    value = attn.v_proj(hidden).view(shape).transpose(1, 2)  # [1, kv_heads, rows, head_dim]
    query, key = apply_rotary_pos_emb(query, key, *rotary)  # rotation is per row: each at its own position
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    outputs = []
    for cache, (start, end), mask in zip(caches, bounds, masks):
        # keys, values: [1, kv_heads, cached + n, head_dim], this sequence's whole past
        keys, values = cache.update(key[:, :, start:end], value[:, :, start:end], attn.layer_idx)
        out, _ = interface(attn, query[:, :, start:end], keys, values, mask, dropout=0.0, scaling=attn.scaling,
                           sliding_window=attn.sliding_window)
        outputs.append(out)  # [1, n, heads, head_dim]
    out = torch.cat(outputs, dim=1).reshape(*hidden.shape[:-1], -1).contiguous()  # [1, rows, heads * head_dim]
    return attn.o_proj(out)
