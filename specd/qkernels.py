"""Batch-invariant int4 linears for CPU decoding: our C kernel (specd/csrc/q4.c), built for this CPU.

Weights are held as 4-bit values in blocks of 32 with a float16 scale and offset per block (the
affine form of GGUF's Q4_K sub-blocks: 5 bits a weight), in panels of 16 output columns so that
each column's dot product runs in a vector lane of its own. Activations are quantised per row, per
block of 32, to int8, so a block's dot product is an exact integer sum; the float sums run in a
fixed order per row, and threads split output columns, never the reduction. A row's output is
therefore bit-identical whatever rows share the call: a verification of K + 1 rows equals K + 1
plain steps (tests/test_numerics.py checks it at the real target's shapes).

The library is compiled once per source and CPU (`-march=native`: AVX-512 VNNI where the CPU has
it, else AVX2) into the cache directory, with the C compiler found on PATH; `available()` says
why not when it cannot be built, and the engine then refuses `q4` with that reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

BLOCK = 32  # values per quantisation block, along K
PANEL = 16  # output columns per panel: one 32-bit lane each
_SOURCE = Path(__file__).with_name("csrc") / "q4.c"
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
NATIVE = "native"  # -march: this CPU's widest path; "haswell" builds the AVX2 path (tests run both)


@dataclass(frozen=True)
class Q4Weight:
    """W [N, K] as 4-bit blocks: w = d * q + m per block of 32 along K, in panels of 16 rows of W
    (the last one zero-padded) laid out as the kernel reads them (specd/csrc/q4.c)."""

    packed: torch.Tensor  # [P, K/32, 4, 64] uint8, P = ceil(N / 16)
    d: torch.Tensor  # [P, K/32, 16] float16 block scales
    m: torch.Tensor  # [P, K/32, 16] float16 block offsets
    bias: torch.Tensor | None  # [N] float32
    columns: int  # N

    @property
    def shape(self) -> tuple[int, int]:
        return self.columns, self.packed.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        tensors = (self.packed, self.d, self.m) + ((self.bias,) if self.bias is not None else ())
        return sum(t.numel() * t.element_size() for t in tensors)


def quantize(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Q4Weight:
    """Round W [N, K] (K a multiple of 32) to 4-bit blocks spanning each block's min..max."""
    N, K = weight.shape
    if K % BLOCK:
        raise ValueError(f"q4 needs the input size to be a multiple of {BLOCK}, got {K}")
    padded = -(-N // PANEL) * PANEL
    blocks = torch.zeros(padded, K // BLOCK, BLOCK)  # [N', B, 32]
    blocks[:N] = weight.detach().float().reshape(N, K // BLOCK, BLOCK)
    low = blocks.amin(-1)  # [N', B]
    d = ((blocks.amax(-1) - low) / 15).half()  # [N', B]
    m = low.half()
    # Round against the float16 scale and offset the kernel will use, so each value lands nearest.
    scale = d.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    q = ((blocks - m.float()[..., None]) / scale).round_().clamp_(0, 15).to(torch.uint8)  # [N', B, 32]
    # [P, 16 columns, B, 8 groups of 4] -> [P, B, 4 chunks, 16 columns, 4]: group c low, c + 4 high.
    groups = q.reshape(padded // PANEL, PANEL, K // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)
    packed = (groups[:, :, :4] | (groups[:, :, 4:] << 4)).reshape(padded // PANEL, K // BLOCK, 4, 64)
    bias = None if bias is None else bias.detach().float().contiguous()
    return Q4Weight(packed.contiguous(), _panels(d), _panels(m), bias, N)


def _panels(scales: torch.Tensor) -> torch.Tensor:
    """[N', B] -> [N'/16, B, 16]: each block's 16 scales of a panel side by side."""
    return scales.reshape(-1, PANEL, scales.shape[1]).transpose(1, 2).contiguous()


def dequantize(weight: Q4Weight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 W [N, K] the 4-bit blocks stand for, or only its `rows` (an embedding lookup)."""
    rows = torch.arange(weight.columns) if rows is None else rows
    panel, lane = rows // PANEL, rows % PANEL
    chunks = weight.packed[panel].view(len(rows), -1, 4, PANEL, 4)  # [n, B, 4, 16, 4]
    mine = chunks[torch.arange(len(rows)), :, :, lane]  # [n, B, 4, 4]
    q = torch.cat([mine & 15, mine >> 4], dim=2).reshape(len(rows), -1, BLOCK).float()  # [n, B, 32]
    d, m = weight.d[panel, :, lane].float(), weight.m[panel, :, lane].float()  # [n, B]
    return (q * d[..., None] + m[..., None]).reshape(len(rows), -1)


@dataclass(frozen=True)
class Q8Rows:
    """Activation rows quantised on their own to int8 blocks of 32: what a q4 linear multiplies."""

    q: torch.Tensor  # [rows, K] int8
    d: torch.Tensor  # [rows, K/32] float32 block scales (amax / 127)
    s: torch.Tensor  # [rows, K/32] float32 block scale times the block's sum of q

    @classmethod
    def empty(cls, rows: int, features: int) -> "Q8Rows":
        blocks = features // BLOCK
        return cls(torch.empty(rows, features, dtype=torch.int8), torch.empty(rows, blocks), torch.empty(rows, blocks))

    def pointers(self) -> tuple[int, int, int]:
        return self.q.data_ptr(), self.d.data_ptr(), self.s.data_ptr()


def quantize_rows(x: torch.Tensor, march: str = NATIVE) -> Q8Rows:
    """x [rows, K] float32 -> its int8 rows."""
    x = _rows(x)
    out = Q8Rows.empty(*x.shape)
    _library(march).specd_q8_rows(x.data_ptr(), *x.shape, *out.pointers(), torch.get_num_threads())
    return out


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, march: str = NATIVE) -> Q8Rows:
    """The int8 rows of Qwen2's RMS norm of x [rows, K] (x * rsqrt(mean(x^2) + eps) * weight)."""
    x = _rows(x)
    out = Q8Rows.empty(*x.shape)
    _library(march).specd_rms_norm_q8(x.data_ptr(), weight.data_ptr(), eps, *x.shape, *out.pointers(),
                                      torch.get_num_threads())
    return out


def swiglu_rows(gate_up: torch.Tensor, march: str = NATIVE) -> Q8Rows:
    """The int8 rows of silu(gate) * up, from gate_up [rows, 2 * I] (a fused gate/up projection)."""
    gate_up = _rows(gate_up)
    rows, features = gate_up.shape[0], gate_up.shape[1] // 2
    out = Q8Rows.empty(rows, features)
    _library(march).specd_swiglu_q8(gate_up.data_ptr(), rows, features, *out.pointers(), torch.get_num_threads())
    return out


def matmul(x: Q8Rows, weight: Q4Weight, march: str = NATIVE) -> torch.Tensor:
    """x [rows, K] (int8 rows) @ W.T (+ bias) -> [rows, N] float32; each row computed on its own."""
    N, K = weight.shape
    rows = x.q.shape[0]
    if x.q.shape[1] != K:
        raise ValueError(f"rows of {x.q.shape[1]} values for a weight of {K} inputs")
    y = torch.empty(rows, N)
    bias = weight.bias.data_ptr() if weight.bias is not None else None
    _library(march).specd_q4_matmul(*x.pointers(), rows, K, weight.packed.data_ptr(), weight.d.data_ptr(),
                                    weight.m.data_ptr(), bias, N, y.data_ptr(), torch.get_num_threads())
    return y


def linear(x: torch.Tensor, weight: Q4Weight, march: str = NATIVE) -> torch.Tensor:
    """x [..., K] float32 @ W.T (+ bias) -> [..., N] float32; each row computed on its own."""
    y = matmul(quantize_rows(x.reshape(-1, x.shape[-1]), march), weight, march)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class _Linear(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("N", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear)]


class _Row(ctypes.Structure):
    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("position", ctypes.c_int64)]


@dataclass(frozen=True)
class DecoderLayer:
    """One Qwen2 decoder layer's weights: norms [hidden] and q4 linears (q/k/v and gate/up fused)."""

    input_norm: torch.Tensor
    qkv: Q4Weight  # [(heads + 2 kv_heads) * head_dim, hidden], with q/k/v biases
    o: Q4Weight  # [hidden, heads * head_dim]
    post_norm: torch.Tensor
    gate_up: Q4Weight  # [2 * intermediate, hidden]
    down: Q4Weight  # [hidden, intermediate]


@dataclass(frozen=True)
class RowCache:
    """Where a row's session keeps its keys and values (each [layers, kv_heads, capacity, dim]
    float32) and the keys before the row (its position, where its own go in)."""

    keys: torch.Tensor
    values: torch.Tensor
    position: int


class Decoder:
    """A Qwen2 model's decoder layers run by one C call per pass (specd_q4_layers)."""

    def __init__(self, layers: Sequence[DecoderLayer], heads: int, kv_heads: int, head_dim: int, eps: float,
                 march: str = NATIVE):
        self.layers, self.heads, self.kv_heads, self.head_dim, self.eps = list(layers), heads, kv_heads, head_dim, eps
        self.hidden, self.intermediate = layers[0].o.shape[0], layers[0].down.shape[1]
        if head_dim % 8 or heads % kv_heads:
            raise ValueError(f"q4 attention needs a head size divisible by 8 and whole kv groups, got {head_dim}, {heads}/{kv_heads}")
        self._library = _library(march)
        self._structs = (_Layer * len(layers))(*(_Layer(
            layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
            *(_Linear(w.packed.data_ptr(), w.d.data_ptr(), w.m.data_ptr(),
                      None if w.bias is None else w.bias.data_ptr(), w.columns)
              for w in (layer.qkv, layer.o, layer.gate_up, layer.down)))
            for layer in layers))

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: Sequence[RowCache]) -> None:
        """hidden [R, hidden] float32, updated in place by every layer; cos / sin [R, head_dim]."""
        R = hidden.shape[0]
        structs = (_Row * R)(*(_Row(r.keys.data_ptr(), r.values.data_ptr(), r.keys.shape[2], r.position)
                               for r in rows))
        self._library.specd_q4_layers(self._structs, len(self.layers), hidden.data_ptr(), R, self.hidden,
                                      self.intermediate, self.heads, self.kv_heads, self.head_dim, self.eps,
                                      self.head_dim**-0.5, cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
                                      structs, torch.get_num_threads())


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"expected [rows, K] with K a multiple of {BLOCK}, got {tuple(x.shape)}")
    return x.float().contiguous()


def available() -> str | None:
    """None when the kernel library builds and loads here, else why not."""
    try:
        _library()
    except (OSError, RuntimeError) as error:
        return str(error)
    return None


def cache_dir() -> Path:
    env = os.environ.get("SPECD_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specd" / "kernels"


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


@lru_cache(maxsize=None)
def _library(march: str = NATIVE) -> ctypes.CDLL:
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the q4 kernel is written for x86-64 (AVX2), not {platform.machine()}")
    if "avx2" not in _cpu_flags() or "fma" not in _cpu_flags():
        raise RuntimeError("the q4 kernel needs a CPU with AVX2 and FMA")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH to build the q4 kernel: apt-get install gcc")
    source = _SOURCE.read_bytes()
    flags = [f"-march={march}", *_FLAGS]
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_flags().encode()).hexdigest()[:16]
    path = cache_dir() / f"q4-{march}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            done = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building the q4 kernel failed:\n{done.stderr[-2000:]}")
            built.replace(path)  # atomic: a concurrent builder finds a whole file or none
    # torch is imported above, so its OpenMP runtime (same soname) is the one the kernel joins.
    lib = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.specd_q8_rows.argtypes = [pointer, size, size, pointer, pointer, pointer, ctypes.c_int]
    lib.specd_rms_norm_q8.argtypes = [pointer, pointer, ctypes.c_float, size, size, pointer, pointer, pointer,
                                      ctypes.c_int]
    lib.specd_swiglu_q8.argtypes = [pointer, size, size, pointer, pointer, pointer, ctypes.c_int]
    lib.specd_q4_layers.argtypes = [ctypes.POINTER(_Layer), size, pointer, size, size, size, size, size, size,
                                    ctypes.c_float, ctypes.c_float, pointer, pointer, ctypes.POINTER(_Row), ctypes.c_int]
    for name in ("specd_q8_rows", "specd_rms_norm_q8", "specd_swiglu_q8", "specd_q4_layers"):
        getattr(lib, name).restype = None
    lib.specd_q4_matmul.argtypes = [pointer, pointer, pointer, size, size, pointer, pointer, pointer, pointer,
                                    size, pointer, ctypes.c_int]
    lib.specd_q4_matmul.restype = None
    return lib
