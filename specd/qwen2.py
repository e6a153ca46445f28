"""A Qwen2 forward of our own over int4 weights (specd/qkernels.py): batch-invariant by construction.

Every step treats a row on its own: the embedding is a lookup, norms and the MLP are per row, the
linears are the q4 kernel (a row's result does not depend on the rows beside it), and attention
runs one query row at a time against exactly the keys a plain step at that position would see.
So the logits of row i of a K + 1-row verification, or of a row in a pass shared with other
sessions, are bit for bit those of a one-row step at that position: greedy speculation gives the
plain decoding's text, and sampled speculation its distribution, in this numerics.

The weights are read tensor by tensor from the model's safetensors and quantised as they come:
no float32 model is ever built, and nothing of the file stays mapped (weights held once, 5 bits).
The quantised weights are cached (one file per checkpoint, in the kernels' cache directory), so a
restart reads 1.1 GB instead of quantising 7 GB.
q/k/v and gate/up are each one fused weight (rows are independent, so fusing changes nothing).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from specd import qkernels, ragged
from specd.qkernels import Q4Weight


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Q4Weight  # [(heads + 2 kv_heads) * head_dim, hidden], with q/k/v biases
    o: Q4Weight  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Q4Weight  # [2 * intermediate, hidden]
    down: Q4Weight  # [hidden, intermediate]


class Q4Qwen2:
    """`ragged.forward` for a Qwen2 checkpoint with int4 linears and per-row attention."""

    def __init__(self, model_dir: Path | str):
        config = AutoConfig.from_pretrained(model_dir)
        if config.model_type != "qwen2":
            raise ValueError(f"the q4 engine runs Qwen2 checkpoints, not {config.model_type!r}")
        if getattr(config, "use_sliding_window", False) and config.sliding_window:
            raise ValueError("the q4 engine does not run sliding-window attention")
        self.config = config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.rotary = Qwen2RotaryEmbedding(config)
        state = _cached_state(Path(model_dir), config)
        weight = lambda name: _q4_weight(state, name)  # noqa: E731
        self.embed = weight("embed")  # its rows are dequantised on lookup
        self.lm_head = self.embed if config.tie_word_embeddings else weight("lm_head")
        self.norm = state["norm"]
        self.layers = [
            _Layer(state[f"{i}.input_norm"], weight(f"{i}.qkv"), weight(f"{i}.o"), state[f"{i}.post_norm"],
                   weight(f"{i}.gate_up"), weight(f"{i}.down"))
            for i in range(config.num_hidden_layers)
        ]

    @property
    def nbytes(self) -> int:
        weights = [self.embed, self.lm_head] + [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        unique = {id(w): w for w in weights}.values()
        norms = [self.norm] + [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        return sum(w.nbytes for w in unique) + sum(n.numel() * n.element_size() for n in norms)

    def new_cache(self) -> "KVCache":
        return KVCache(self.config.num_hidden_layers, self.kv_heads, self.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        caches: Sequence["KVCache"],
        inputs: Sequence[Sequence[int]],
        keep: Sequence[int],
        branches: Sequence[ragged.Branch | None] = (),
    ) -> list[torch.Tensor]:
        """What `ragged.forward` returns (per sequence [keep[i] (+ 1 with a branch), vocab] float32),
        each row computed as a one-row step at its position would compute it."""
        branches = list(branches) or [None] * len(inputs)
        bounds = ragged.row_bounds([len(x) for x in inputs])
        rows_in = bounds[-1][1]
        branch_rows = {i: rows_in + n for n, i in enumerate(i for i, b in enumerate(branches) if b)}
        pasts = [cache.get_seq_length() for cache in caches]
        tokens = [t for x in inputs for t in x] + [b.token for b in branches if b]
        positions = [p for past, x in zip(pasts, inputs) for p in range(past, past + len(x))]
        positions += [past + b.at for past, b in zip(pasts, branches) if b]
        hidden = qkernels.dequantize(self.embed, torch.tensor(tokens, dtype=torch.long))  # [rows, hidden]
        cos, sin = self.rotary(hidden[None], torch.tensor(positions)[None])  # each [1, rows, head_dim]
        rotation = (cos[0, :, None], sin[0, :, None])  # each [rows, 1, head_dim]: broadcast over heads
        sides = [(branch_rows[i], pasts[i] + b.at) if b else None for i, b in enumerate(branches)]
        for index, layer in enumerate(self.layers):
            qkv = qkernels.matmul(self._norm(hidden, layer.input_norm), layer.qkv)  # [rows, (heads + 2 kv) * dim]
            attended = self._attention(qkv, index, rotation, caches, pasts, bounds, sides)
            hidden = hidden + qkernels.linear(attended, layer.o)
            gate_up = qkernels.matmul(self._norm(hidden, layer.post_norm), layer.gate_up)  # [rows, 2 * intermediate]
            hidden = hidden + qkernels.matmul(qkernels.swiglu_rows(gate_up), layer.down)
        kept = [list(range(end - k, end)) + ([branch_rows[i]] if i in branch_rows else [])
                for i, ((_, end), k) in enumerate(zip(bounds, keep))]
        for cache, past, x in zip(caches, pasts, inputs):
            cache.extend(past + len(x))
        logits = qkernels.matmul(self._norm(hidden[[r for rows in kept for r in rows]], self.norm), self.lm_head)
        return list(logits.split([len(rows) for rows in kept]))

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> qkernels.Q8Rows:
        return qkernels.rms_norm_rows(hidden, weight, self.eps)

    def _attention(self, qkv, index, rotation, caches, pasts, bounds, sides) -> torch.Tensor:
        """Rotary on q and k, the new keys and values into each cache; then each row attends alone to
        the keys up to its own (a branch row to its prefix and itself). qkv: [rows, (heads + 2 kv) * dim]."""
        rows, heads, kv_heads, dim = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        qk = ragged.rotate(qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), *rotation)
        query, key = qk[:, :heads].contiguous(), qk[:, heads:]  # [rows, heads | kv_heads, dim]
        value = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
        keys, values, strides, seen = [None] * rows, [None] * rows, [0] * rows, [0] * rows
        held = []  # a branch row's keys and values, alive until the kernel has read them
        for cache, past, (start, end), side in zip(caches, pasts, bounds, sides):
            layer_keys, layer_values = cache.write(index, past, key[start:end], value[start:end])
            for row in range(start, end):
                keys[row], values[row], strides[row] = layer_keys, layer_values, cache.capacity
                seen[row] = past + row - start + 1
            if side:
                row, prefix = side
                branch_keys = torch.cat([layer_keys[:, :prefix], key[row, :, None]], dim=1)  # [kv_heads, prefix + 1, dim]
                branch_values = torch.cat([layer_values[:, :prefix], value[row, :, None]], dim=1)
                held += [branch_keys, branch_values]
                keys[row], values[row], strides[row], seen[row] = branch_keys, branch_values, prefix + 1, prefix + 1
        out = qkernels.attend_rows(query, keys, values, strides, seen, kv_heads, self.scaling)  # [rows, heads, dim]
        return out.reshape(rows, heads * dim)


class KVCache:
    """One sequence's keys and values, per layer [kv_heads, capacity, head_dim] float32, grown by
    doubling; the first `length` positions are the cache. Rollback is `crop` (bookkeeping only)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int = 64):
        self.capacity, self.length = capacity, 0
        self.keys = [torch.empty(kv_heads, capacity, head_dim) for _ in range(layers)]
        self.values = [torch.empty(kv_heads, capacity, head_dim) for _ in range(layers)]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """As DynamicCache.crop: keep max_length positions, or drop -max_length when negative."""
        self.length = max(0, self.length + max_length) if max_length < 0 else min(self.length, max_length)

    def write(self, layer: int, past: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put one layer's new keys and values ([n, kv_heads, dim]) at positions past..; the layer's
        whole keys and values. `length` moves when the pass is done (`extend`)."""
        self._reserve(past + key.shape[0])
        self.keys[layer][:, past : past + key.shape[0]] = key.transpose(0, 1)
        self.values[layer][:, past : past + key.shape[0]] = value.transpose(0, 1)
        return self.keys[layer], self.values[layer]

    def extend(self, length: int) -> None:
        self.length = length

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                tensors[i] = torch.empty(old.shape[0], capacity, old.shape[2])
                tensors[i][:, : self.length] = old[:, : self.length]
        self.capacity = capacity


FORMAT = "q4-v1"  # the cached file's layout: bump when quantize() or the names change


def _cached_state(model_dir: Path, config) -> dict[str, torch.Tensor]:
    """The quantised weights and norms by name, from the cache (specd/qkernels' cache directory)
    when this checkpoint was quantised before, else quantised now and cached. Read into memory: the
    file is closed afterwards."""
    files = sorted(model_dir.glob("*.safetensors"))
    stamp = "".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns};" for f in files)
    key = hashlib.sha256((FORMAT + str(model_dir.resolve()) + stamp).encode()).hexdigest()[:20]
    path = qkernels.cache_dir() / f"{FORMAT}-{key}.safetensors"
    if path.exists():
        with safe_open(str(path), framework="pt") as cached:
            return {name: cached.get_tensor(name).clone() for name in cached.keys()}
    state = _quantised_state(model_dir, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".partial", delete=False) as partial:
        save_file(state, partial.name)
    Path(partial.name).replace(path)  # atomic: a concurrent loader finds a whole file or none
    return state


def _quantised_state(model_dir: Path, config) -> dict[str, torch.Tensor]:
    """Read the checkpoint tensor by tensor and quantise its linears (q/k/v and gate/up fused)."""
    state: dict[str, torch.Tensor] = {}

    def put(name: str, weight: Q4Weight) -> None:
        state.update({f"{name}.packed": weight.packed, f"{name}.d": weight.d, f"{name}.m": weight.m})
        if weight.bias is not None:
            state[f"{name}.bias"] = weight.bias

    with _Tensors(model_dir) as tensors:
        put("embed", qkernels.quantize(tensors.take("model.embed_tokens.weight")))
        if not config.tie_word_embeddings:
            put("lm_head", qkernels.quantize(tensors.take("lm_head.weight")))
        state["norm"] = tensors.take("model.norm.weight")
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            qkv = [tensors.take(f"{attn}{p}_proj.weight") for p in "qkv"]
            biases = [tensors.take(f"{attn}{p}_proj.bias", optional=True) for p in "qkv"]
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, qkv)])
            put(f"{i}.qkv", qkernels.quantize(torch.cat(qkv), bias))
            put(f"{i}.o", qkernels.quantize(tensors.take(attn + "o_proj.weight")))
            gate_up = torch.cat([tensors.take(mlp + "gate_proj.weight"), tensors.take(mlp + "up_proj.weight")])
            put(f"{i}.gate_up", qkernels.quantize(gate_up))
            put(f"{i}.down", qkernels.quantize(tensors.take(mlp + "down_proj.weight")))
            state[f"{i}.input_norm"] = tensors.take(prefix + "input_layernorm.weight")
            state[f"{i}.post_norm"] = tensors.take(prefix + "post_attention_layernorm.weight")
    return state


def _q4_weight(state: dict[str, torch.Tensor], name: str) -> Q4Weight:
    return Q4Weight(state[f"{name}.packed"], state[f"{name}.d"], state[f"{name}.m"], state.get(f"{name}.bias"))


class _Tensors:
    """The checkpoint's tensors, read one at a time and copied out (the files are closed after)."""

    def __init__(self, model_dir: Path):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __enter__(self) -> "_Tensors":
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()
        self._where.clear()

    def take(self, name: str, optional: bool = False) -> torch.Tensor | None:
        handle = self._where.get(name)
        if handle is None:
            if optional:
                return None
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        return handle.get_tensor(name).float().clone()  # a copy: nothing keeps the file mapped
