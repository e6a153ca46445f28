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
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from specd import qkernels, ragged
from specd.qkernels import DecoderLayer, Q4Weight, RowCache


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
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.rotary = Qwen2RotaryEmbedding(config)
        state = _cached_state(Path(model_dir), config)
        weight = lambda name: _q4_weight(state, name)  # noqa: E731
        self.embed = weight("embed")  # its rows are dequantised on lookup
        self.lm_head = self.embed if config.tie_word_embeddings else weight("lm_head")
        self.norm = state["norm"]
        layers = [
            DecoderLayer(state[f"{i}.input_norm"], weight(f"{i}.qkv"), weight(f"{i}.o"), state[f"{i}.post_norm"],
                         weight(f"{i}.gate_up"), weight(f"{i}.down"))
            for i in range(config.num_hidden_layers)
        ]
        self.decoder = qkernels.Decoder(layers, self.heads, self.kv_heads, self.head_dim, self.eps)  # holds them

    @property
    def nbytes(self) -> int:
        weights = [self.embed, self.lm_head] + [w for layer in self.decoder.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        unique = {id(w): w for w in weights}.values()
        norms = [self.norm] + [n for layer in self.decoder.layers for n in (layer.input_norm, layer.post_norm)]
        return sum(w.nbytes for w in unique) + sum(n.numel() * n.element_size() for n in norms)

    def new_cache(self) -> "KVCache":
        return KVCache(self.config.num_hidden_layers, self.kv_heads, self.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        caches: Sequence["KVCache"],
        inputs: Sequence[Sequence[int]],
        keep: Sequence[int],
    ) -> list[torch.Tensor]:
        """What `ragged.forward` returns (per sequence [keep[i], vocab] float32), each row computed
        as a one-row step at its position would compute it."""
        bounds = ragged.row_bounds([len(x) for x in inputs])
        pasts = [cache.get_seq_length() for cache in caches]
        tokens = [t for x in inputs for t in x]
        positions = [p for past, x in zip(pasts, inputs) for p in range(past, past + len(x))]
        hidden = qkernels.dequantize(self.embed, torch.tensor(tokens, dtype=torch.long))  # [rows, hidden]
        cos, sin = self.rotary(hidden[None], torch.tensor(positions)[None])  # each [1, rows, head_dim]
        for cache, past, x in zip(caches, pasts, inputs):
            cache.reserve(past + len(x))
        rows = [RowCache(cache.keys, cache.values, past + j) for cache, past, x in zip(caches, pasts, inputs)
                for j in range(len(x))]
        self.decoder(hidden, cos[0], sin[0], rows)
        kept = [list(range(end - k, end)) for (_, end), k in zip(bounds, keep)]
        for cache, past, x in zip(caches, pasts, inputs):
            cache.extend(past + len(x))
        logits = qkernels.matmul(qkernels.rms_norm_rows(hidden[[r for rows in kept for r in rows]], self.norm, self.eps),
                                 self.lm_head)
        return list(logits.split([len(rows) for rows in kept]))


class KVCache:
    """One sequence's keys and values, each [layers, kv_heads, capacity, head_dim] float32, grown by
    doubling; the first `length` positions are the cache. Rollback is `crop` (bookkeeping only)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int = 64):
        self.length = 0
        self.keys = torch.empty(layers, kv_heads, capacity, head_dim)
        self.values = torch.empty(layers, kv_heads, capacity, head_dim)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """As DynamicCache.crop: keep max_length positions, or drop -max_length when negative."""
        self.length = max(0, self.length + max_length) if max_length < 0 else min(self.length, max_length)

    def extend(self, length: int) -> None:
        self.length = length

    def reserve(self, needed: int) -> None:
        """Room for `needed` positions (the forward writes the new ones in place)."""
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.empty(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)


FORMAT = "q4-v2"  # the cached file's layout: bump when quantize() or the names change


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
        state.update({f"{name}.packed": weight.packed, f"{name}.d": weight.d, f"{name}.m": weight.m,
                      f"{name}.columns": torch.tensor(weight.columns)})
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
    return Q4Weight(state[f"{name}.packed"], state[f"{name}.d"], state[f"{name}.m"], state.get(f"{name}.bias"),
                    int(state[f"{name}.columns"]))


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
