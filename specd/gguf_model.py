"""A GGUF model served as stored: memory-mapped, every tensor in its file's type, run by one C call per pass.

The file is mapped read-only (its metadata read by specd/gguf_meta.py); the decoder (specd/csrc/decoder.c) reads the
weights' blocks where they lie, so the process holds the file's pages and the KV caches, and no
float32 copy of a quantised weight is ever made. Which architecture and hyper-parameters come
from the metadata (specd/archs.py); which kernel multiplies a tensor comes from its type
(specd/quants.py); the model code names neither.

`forward` has `ragged.forward`'s contract: several sessions' new tokens in one pass, each
session's result [keep, vocab]. Each row is computed as a one-row step at its position would
compute it (see decoder.c), so a verification's rows equal plain steps bit for bit.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from specd import archs, gguf_meta, native, quants
from specd.archs import HyperParams

Linear = native.Linear
is_gguf = gguf_meta.is_gguf
SPECIAL_TOKEN_TYPES = (3, 4)  # llama.cpp's token types CONTROL and USER_DEFINED


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("attn_norm", "attn_post_norm", "ffn_norm", "ffn_post_norm", "q_norm", "k_norm")] + \
               [(name, Linear) for name in ("q", "k", "v", "o", "gate", "up", "down")] + \
               [("window", ctypes.c_int64), ("rope_set", ctypes.c_int64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("n_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "rope_dims",
                 "rope_neox", "gelu")] + \
               [(name, ctypes.c_float) for name in ("eps", "attn_scale", "attn_softcap", "final_softcap",
                                                    "embed_scale")] + \
               [("out_norm", ctypes.c_void_p), ("embed", Linear), ("out", Linear),
                ("layers", ctypes.POINTER(_Layer))]


class _Row(ctypes.Structure):
    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("position", ctypes.c_int64)]


class GGUFModel:
    """The decoder of a GGUF file: `forward(caches, inputs, keep)` as `ragged.forward`."""

    def __init__(self, path: Path | str, march: str | None = None, head_vocab: int = 0,
                 requantize: int | None = None):
        """`head_vocab` > 0: the output layer scores only the first that many token ids and the special
        ones (`head_ids`); the rest get -inf. A draft's option: a token it cannot propose is a rejection,
        never a wrong output, and its step skips most of the vocabulary's rows. `requantize` (a draft's
        option too, `quants.Q4_0`): the linears stored in a larger block-32 type run in that one."""
        self.path = Path(path)
        self.meta = gguf_meta.read(self.path)
        self._file = np.memmap(self.path, dtype=np.uint8, mode="r")  # the weights: read where they lie
        self.architecture = self.meta.architecture
        self.spec = archs.arch_of(self.architecture)
        self.hp: HyperParams = archs.hyper_params(self.architecture, self.meta.get)
        self._tensors = self.meta.tensors
        self.eos_token_ids: frozenset[int] = gguf_meta.eog_ids(self.meta)
        self.vocab_digest: str = gguf_meta.vocab_digest(self.meta)
        march = march or native.default_march()
        self._library = _declare(native.library(march))
        self._march, self._packed = march, []  # the linears' repacked weights (quants.repack), kept alive here
        self._requantize = requantize
        self._layers = (_Layer * self.hp.layers)(*(self._layer(i) for i in range(self.hp.layers)))
        embed = self._linear("token_embd.weight", pack=False)  # looked up by rows, as stored
        stored_out = self._tensor("output.weight", optional=True)  # None: tied to the embedding
        out = self._linear("output.weight", optional=True, pack=False) or Linear(embed.data, embed.type, embed.N,
                                                                                 embed.K, embed.bias)
        self.vocab_size = int(embed.N)
        self.head_ids = head_ids(self.meta, self.vocab_size, head_vocab)  # None: every id
        out = self._pack(out, stored_out) if self.head_ids is None else self._rows_of(out, self.head_ids, stored_out)
        hp = self.hp
        self._model = _Model(hp.layers, hp.hidden, hp.heads, hp.kv_heads, hp.head_dim, hp.intermediate,
                             int(out.N), hp.rope_dims, int(self.spec.rope_neox), int(self.spec.gelu), hp.eps,
                             hp.attn_scale, hp.attn_softcap, hp.final_softcap,
                             hp.hidden**0.5 if self.spec.embed_scale else 1.0,
                             self._norm("output_norm.weight"), embed, out, self._layers)
        self._rope = self._rope_tables()
        _return_freed_heap()

    # -- metadata and tensors ---------------------------------------------------------------

    def metadata(self, key: str, default=None):
        return self.meta.get(key, default)

    def tensor_types(self) -> list[str]:
        """The stored types of the file's tensors, most numerous first (for logs and health)."""
        counts: dict[str, int] = {}
        for tensor in self._tensors.values():
            name = quants.type_name(tensor.ggml_type)
            counts[name] = counts.get(name, 0) + 1
        return [f"{n} {name}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])]

    @property
    def requantized_to(self) -> str | None:
        """The type its requantizable weights run as instead of their stored one (None: as stored)."""
        return None if self._requantize is None else quants.type_name(self._requantize)

    @property
    def nbytes(self) -> int:
        """Bytes of the weights as stored (what serving them maps)."""
        return sum(t.nbytes for t in self._tensors.values())

    @property
    def held_bytes(self) -> int:
        """Bytes held beside the file's mapping: repacked panels, requantized or gathered rows."""
        return sum(buffer.nbytes for buffer in self._packed)

    def _tensor(self, name: str, optional: bool = False) -> gguf_meta.TensorInfo | None:
        tensor = self._tensors.get(name)
        if tensor is None and not optional:
            raise ValueError(f"{self.path.name}: no tensor {name!r}, which {self.architecture!r} needs")
        return tensor

    def _address(self, tensor: gguf_meta.TensorInfo) -> int:
        if tensor.offset + tensor.nbytes > len(self._file):
            raise ValueError(f"{self.path.name}: tensor {tensor.name} runs past the end of the file (truncated?)")
        return self._file.ctypes.data + tensor.offset

    def _floats(self, tensor: gguf_meta.TensorInfo) -> np.ndarray:
        return np.frombuffer(self._file, np.float32, int(np.prod(tensor.dims)), tensor.offset)

    def _norm(self, name: str, optional: bool = False) -> int | None:
        tensor = self._tensor(name, optional)
        if tensor is None:
            return None
        if tensor.ggml_type != quants.F32:
            raise ValueError(f"{name}: norm weights must be F32, got {quants.type_name(tensor.ggml_type)}")
        return self._address(tensor)

    def _linear(self, name: str, optional: bool = False, bias: str | None = None, pack: bool = True) -> Linear | None:
        tensor = self._tensor(name, optional)
        if tensor is None:
            return None
        kind = quants.quant_type(tensor.ggml_type, name)
        if len(tensor.dims) != 2:
            raise ValueError(f"{name}: a weight matrix has 2 dimensions, got {tensor.dims}")
        K, N = tensor.dims  # GGUF lists the fastest dimension first
        if K % kind.block:
            raise ValueError(f"{name}: {K} inputs are not whole {kind.name} blocks of {kind.block}")
        b = self._norm(bias, optional=True) if bias else None
        linear = Linear(self._address(tensor), tensor.ggml_type, N, K, b)
        return self._pack(linear, tensor) if pack else linear

    def _pack(self, linear: Linear, stored: gguf_meta.TensorInfo | None = None, gathered: np.ndarray | None = None,
              home: int | None = None) -> Linear:
        """linear with its weight repacked into column panels (specd/csrc/quants.c: the same integers and
        scales, multiplied faster at several rows), when this build has them for its type. `stored`: the
        tensor's file bytes, then no longer read: their pages leave the process (RSS stays near the
        file's size, not twice it). `gathered`: the rows `linear.data` points into when this model made
        them rather than the file, `home` where in the file they came from. Only the bytes the kernels
        read stay: the panels, else requantized rows, else the gathered ones; with panels, `data` points
        into the file (non-null, not read)."""
        packing, rows = self._smaller(linear)
        buffer = quants.repack(packing, self._march, torch.get_num_threads())
        read = buffer if buffer is not None else rows if rows is not None else gathered
        if read is not None:
            self._packed.append(read)
        if buffer is not None:
            if stored is not None:
                _drop_pages(self._file, stored.offset, stored.nbytes)
            packing.data = linear.data if home is None else home
        return packing

    def _smaller(self, linear: Linear) -> tuple[Linear, np.ndarray | None]:
        """linear in the `requantize` type and its new rows, or as it is (None) when its type is not
        one of the larger block-32 ones (`quants.REQUANTIZABLE`)."""
        if self._requantize is None or linear.type not in quants.REQUANTIZABLE:
            return linear, None
        rows = quants.requantize(_stored_rows(linear), linear.type, linear.N, linear.K, self._requantize)
        return Linear(rows.ctypes.data, self._requantize, linear.N, linear.K, linear.bias), rows

    def _rows_of(self, linear: Linear, ids: torch.Tensor, stored: gguf_meta.TensorInfo | None) -> Linear:
        """The linear of only the output rows `ids`: their stored bytes gathered, then packed; the
        file's pages of `stored` (an output layer of its own) then leave the process."""
        rows = np.ascontiguousarray(_stored_rows(linear)[ids.numpy()])
        if stored is not None:
            _drop_pages(self._file, stored.offset, stored.nbytes)
        head = Linear(rows.ctypes.data, linear.type, len(ids), linear.K, None)
        return self._pack(head, gathered=rows, home=linear.data)

    def _layer(self, i: int) -> _Layer:
        t = lambda role: f"blk.{i}.{role}.weight"  # noqa: E731
        fused_qkv = t("attn_qkv") in self._tensors
        fused_ffn = t("ffn_gate") not in self._tensors
        empty = Linear(None, 0, 0, 0, None)
        q = self._linear(t("attn_qkv") if fused_qkv else t("attn_q"), bias=f"blk.{i}.attn_q.bias")
        k = empty if fused_qkv else self._linear(t("attn_k"), bias=f"blk.{i}.attn_k.bias")
        v = empty if fused_qkv else self._linear(t("attn_v"), bias=f"blk.{i}.attn_v.bias")
        gate = self._linear(t("ffn_up") if fused_ffn else t("ffn_gate"))
        up = empty if fused_ffn else self._linear(t("ffn_up"))
        post = self.spec.post_norms
        return _Layer(self._norm(t("attn_norm")), self._norm(t("post_attention_norm")) if post else None,
                      self._norm(t("ffn_norm")), self._norm(t("post_ffw_norm")) if post else None,
                      self._norm(t("attn_q_norm"), optional=True), self._norm(t("attn_k_norm"), optional=True),
                      q, k, v, self._linear(t("attn_output")), gate, up, self._linear(t("ffn_down")),
                      self.hp.window if self.hp.sliding(i) else 0, self._rope_set(i))

    # -- rotary -----------------------------------------------------------------------------

    def _rope_keys(self) -> list[tuple[float, float]]:
        return sorted({(self.hp.rope_base_of(i), self.hp.rope_scale_of(i)) for i in range(self.hp.layers)})

    def _rope_set(self, layer: int) -> int:
        return self._rope_keys().index((self.hp.rope_base_of(layer), self.hp.rope_scale_of(layer)))

    def _rope_tables(self) -> list[torch.Tensor]:
        """Per rotary set, the inverse frequencies [rope_dims / 2] (as transformers computes them)."""
        dims = self.hp.rope_dims
        factors = self._tensor("rope_freqs.weight", optional=True)  # Llama 3.x's long-context factors
        tables = []
        for base, scale in self._rope_keys():
            inv = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))
            if factors is not None:
                inv = inv / torch.from_numpy(self._floats(factors).copy())
            tables.append(inv / scale)
        return tables

    def _cos_sin(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        at = torch.tensor(positions, dtype=torch.float32)[:, None]
        freqs = torch.stack([at * inv[None] for inv in self._rope])  # [sets, R, rope_dims / 2]
        return freqs.cos().contiguous(), freqs.sin().contiguous()

    # -- the pass -----------------------------------------------------------------------------

    def new_cache(self) -> "KVCache":
        return KVCache(self.hp.layers, self.hp.kv_heads, self.hp.head_dim)

    @torch.inference_mode()
    def forward(self, caches: Sequence["KVCache"], inputs: Sequence[Sequence[int]],
                keep: Sequence[int]) -> list[torch.Tensor]:
        """Per sequence i: feed inputs[i] after caches[i]'s positions; return the logits of its
        last keep[i] rows, [keep[i], vocab] float32."""
        pasts = [cache.get_seq_length() for cache in caches]
        tokens = [t for x in inputs for t in x]
        positions = [p for past, x in zip(pasts, inputs) for p in range(past, past + len(x))]
        for cache, past, x in zip(caches, pasts, inputs):
            cache.reserve(past + len(x))
        rows = (_Row * len(tokens))(*(_Row(c.keys.data_ptr(), c.values.data_ptr(), c.capacity, past + j)
                                      for c, past, x in zip(caches, pasts, inputs) for j in range(len(x))))
        ends = np.cumsum([len(x) for x in inputs])
        kept = [r for end, k in zip(ends, keep) for r in range(end - k, end)]
        cos, sin = self._cos_sin(positions)
        ids = torch.tensor(tokens, dtype=torch.int64)
        picked = torch.tensor(kept, dtype=torch.int64)
        logits = torch.empty(len(kept), self._model.vocab)
        self._library.specd_forward(ctypes.byref(self._model), ids.data_ptr(), len(tokens), rows, cos.data_ptr(),
                                    sin.data_ptr(), picked.data_ptr(), len(kept), logits.data_ptr(),
                                    torch.get_num_threads())
        for cache, past, x in zip(caches, pasts, inputs):
            cache.extend(past + len(x))
        if self.head_ids is not None:  # the ids the head scored; every other id -inf
            full = torch.full((len(kept), self.vocab_size), -math.inf)
            logits = full.index_copy_(1, self.head_ids, logits)
        return list(logits.split(list(keep)))


def head_ids(meta: gguf_meta.Metadata, vocab: int, head_vocab: int) -> torch.Tensor | None:
    """The token ids a head of `head_vocab` scores (None: all): the first head_vocab ids, which a
    BPE vocabulary orders by merge rank and a SentencePiece one by score (both frequency orders), and
    every special id (control, user-defined, end of generation) wherever it sits."""
    if head_vocab <= 0 or head_vocab >= vocab:
        return None
    types = meta.get("tokenizer.ggml.token_type") or []
    special = {i for i, t in enumerate(types[:vocab]) if t in SPECIAL_TOKEN_TYPES} | gguf_meta.eog_ids(meta)
    return torch.tensor(sorted(set(range(head_vocab)) | {i for i in special if i < vocab}), dtype=torch.int64)


def _stored_rows(linear: Linear) -> np.ndarray:
    """The bytes `linear.data` points at, one row of its type a row: [N, row bytes] (a view, no copy)."""
    row = quants.quant_type(linear.type).row_bytes(linear.K)
    return np.frombuffer((ctypes.c_uint8 * (linear.N * row)).from_address(linear.data), np.uint8).reshape(linear.N, row)


def _return_freed_heap() -> None:
    """Give the heap that loading freed back to the system: glibc keeps freed blocks for reuse, and a
    Q4_0 draft's requantizing temporaries otherwise stay in its RSS (~190 MB of the fetched draft's)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: glibc's, where it is glibc
    if trim is not None:
        trim(0)


def _drop_pages(file: np.memmap, offset: int, nbytes: int) -> None:
    """Unmap the whole pages of file[offset:offset + nbytes] from this process (MADV_DONTNEED on a
    read-only file mapping: a later read would fault them back in from the page cache)."""
    mapping = getattr(file, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    start, end = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE, (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if mapping is not None and advice is not None and end > start:
        mapping.madvise(advice, start, end - start)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.specd_forward.argtypes = [ctypes.POINTER(_Model), pointer, size, ctypes.POINTER(_Row), pointer, pointer,
                                  pointer, size, pointer, ctypes.c_int]
    lib.specd_forward.restype = None
    return lib


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

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

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
