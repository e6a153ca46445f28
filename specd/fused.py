"""The ragged forward of an int8 draft with fused projections and no module calls.

A one-token draft step of the int8 0.5B draft spent ~36 ms in its 169 quantised linears and
~20 ms around them (module calls, the quantised-linear wrapper, HF's norm and rotary helpers).
Here each layer runs four quantised linears instead of seven, calling the int8 kernel directly:
q/k/v are one [q + k + v, hidden] weight and gate/up one [2 * intermediate, hidden] weight
(measured both ways: CHANGELOG.md).

Fusing is exact, not approximate. Dynamic quantisation quantises the activation once per call
and each weight per tensor; the fused weight keeps every row's int8 values with its own tensor's
scale and zero point as per-channel parameters, and the activation is the same for all of q, k,
v (and for gate and up), so every output element is computed from the same integers and scales.
The norms, rotary embedding and attention are the same functions the stock modules call
(tests/test_engine.py checks the logits and caches bit for bit against specd/ragged.py).

Draft only: the target stays on the stock modules (a target's numerics are the output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
from transformers import DynamicCache
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

from specd import ragged

_int8_linear = torch.ops.quantized.linear_dynamic
_REDUCE_RANGE = True  # what DynamicQuantizedLinear passes on x86 (fbgemm): the same numerics


def _packed(linear: DynamicQuantizedLinear):
    return linear._packed_params._packed_params


def _fuse(linears: Sequence[DynamicQuantizedLinear]):
    """One packed int8 weight whose rows are the linears' rows, each with its own scale."""
    ints, scales, zero_points, biases = [], [], [], []
    for linear in linears:
        weight, bias = linear._packed_params._weight_bias()
        rows = weight.shape[0]
        ints.append(weight.int_repr())
        scales.append(torch.full((rows,), weight.q_scale(), dtype=torch.double))
        zero_points.append(torch.full((rows,), weight.q_zero_point(), dtype=torch.long))
        biases.append(torch.zeros(rows) if bias is None else bias)
    weight = torch._make_per_channel_quantized_tensor(torch.cat(ints), torch.cat(scales), torch.cat(zero_points), 0)
    return torch.ops.quantized.linear_prepack(weight, torch.cat(biases))


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: object  # packed int8 [(heads + 2 kv_heads) * head_dim, hidden]
    o: object  # packed int8 [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: object  # packed int8 [2 * intermediate, hidden]
    down: object  # packed int8 [hidden, intermediate]


def supports(model: nn.Module) -> bool:
    """A Qwen2 whose every linear is dynamically quantised to int8, without sliding-window layers."""
    return (
        isinstance(model, Qwen2ForCausalLM)
        and not model.model.has_sliding_layers
        and all(type(m) is not nn.Linear for m in model.modules())
        and all(m._packed_params.dtype == torch.qint8 for m in model.modules() if isinstance(m, DynamicQuantizedLinear))
    )


class FusedDraft:
    """`ragged.forward` for an int8 Qwen2 (`supports`), faster and with the same logits."""

    def __init__(self, model: Qwen2ForCausalLM):
        if not supports(model):
            raise TypeError("FusedDraft needs an int8 dynamically quantised Qwen2 without sliding-window layers")
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.embed = model.model.embed_tokens.weight  # [vocab, hidden]
        self.rotary = model.model.rotary_emb  # one call a pass: keeps the model's rope scaling
        self.norm = model.model.norm.weight
        self.lm_head = _packed(model.lm_head)
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm.weight,
                qkv=_fuse((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
                o=_packed(layer.self_attn.o_proj),
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=_fuse((layer.mlp.gate_proj, layer.mlp.up_proj)),
                down=_packed(layer.mlp.down_proj),
            )
            for layer in model.model.layers[: config.num_hidden_layers]
        ]

    @torch.inference_mode()
    def forward(
        self, caches: Sequence[DynamicCache], inputs: Sequence[Sequence[int]], keep: Sequence[int]
    ) -> list[torch.Tensor]:
        """What `ragged.forward(model, caches, inputs, keep)` returns, bit for bit."""
        bounds = ragged.row_bounds([len(x) for x in inputs])
        pasts = [cache.get_seq_length() for cache in caches]
        ids = torch.tensor([t for x in inputs for t in x], dtype=torch.long)  # [rows]
        hidden = F.embedding(ids, self.embed)  # [rows, hidden]
        positions = torch.cat([torch.arange(past, past + len(x)) for past, x in zip(pasts, inputs)])  # [rows]
        cos, sin = self.rotary(hidden[None], positions[None])  # each [1, rows, head_dim]
        rotation = (cos[0, :, None], sin[0, :, None])  # each [rows, 1, head_dim]: broadcast over heads
        masks = [_causal_mask(past, end - start) for past, (start, end) in zip(pasts, bounds)]
        for index, layer in enumerate(self.layers):
            attended = self._attention(layer, index, self._norm(hidden, layer.input_norm), rotation, caches, bounds, masks)
            hidden = hidden + _int8_linear(attended, layer.o, _REDUCE_RANGE)
            gate_up = _int8_linear(self._norm(hidden, layer.post_norm), layer.gate_up, _REDUCE_RANGE)
            gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]  # each [rows, intermediate]
            hidden = hidden + _int8_linear(F.silu(gate) * up, layer.down, _REDUCE_RANGE)
        rows = torch.cat([torch.arange(end - k, end) for (_, end), k in zip(bounds, keep)])
        logits = _int8_linear(self._norm(hidden[rows], self.norm), self.lm_head, _REDUCE_RANGE)  # [sum(keep), vocab]
        return list(logits.split(list(keep)))

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden, (hidden.shape[-1],), weight, self.eps)

    def _attention(self, layer, index, hidden, rotation, caches, bounds, masks) -> torch.Tensor:
        """q/k/v over all rows in one int8 linear, rotary on q and k together, attention per sequence."""
        rows, heads, kv_heads = hidden.shape[0], self.heads, self.kv_heads
        qkv = _int8_linear(hidden, layer.qkv, _REDUCE_RANGE)  # [rows, (heads + 2 kv_heads) * head_dim]
        qk = ragged.rotate(qkv[:, : (heads + kv_heads) * self.head_dim].view(rows, heads + kv_heads, self.head_dim), *rotation)
        query, key = qk[:, :heads].transpose(0, 1), qk[:, heads:].transpose(0, 1)  # [heads | kv_heads, rows, head_dim]
        value = qkv[:, (heads + kv_heads) * self.head_dim :].view(rows, kv_heads, self.head_dim).transpose(0, 1)
        outputs = []
        for cache, (start, end), mask in zip(caches, bounds, masks):
            # keys, values: [1, kv_heads, cached + n, head_dim], this sequence's whole past
            keys, values = cache.update(key[None, :, start:end], value[None, :, start:end], index)
            out = F.scaled_dot_product_attention(query[None, :, start:end], keys, values, attn_mask=mask, enable_gqa=True)
            outputs.append(out[0])  # [heads, n, head_dim]
        out = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]  # [heads, rows, head_dim]
        return out.transpose(0, 1).reshape(rows, heads * self.head_dim)


def _causal_mask(past: int, n: int) -> torch.Tensor | None:
    """[n, past + n], True where new row i may attend: everything up to its own position.
    One row attends to everything, so it needs no mask (and the kernel skips the masking)."""
    if n == 1:
        return None
    return torch.arange(past + n)[None] <= (past + torch.arange(n))[:, None]
