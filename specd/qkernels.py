"""Batch-invariant int4 linears for CPU decoding: our C kernel (specd/csrc/q4.c), built for this CPU.

Weights are held as 4-bit values in blocks of 32 with a float16 scale and offset per block (the
affine form of GGUF's Q4_K sub-blocks: 5 bits a weight). Activations are quantised per row, per
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

BLOCK = 32  # values per quantisation block, along K (which must hold whole pairs of blocks)
_SOURCE = Path(__file__).with_name("csrc") / "q4.c"
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
NATIVE = "native"  # -march: this CPU's widest path; "haswell" builds the AVX2 path (tests run both)


@dataclass(frozen=True)
class Q4Weight:
    """W [N, K] as 4-bit blocks: w = d * q + m per block of 32 along K."""

    packed: torch.Tensor  # [N, K/64, 32] uint8: byte j of a pair holds value j of both blocks (low, high nibble)
    d: torch.Tensor  # [N, K/32] float16 block scales
    m: torch.Tensor  # [N, K/32] float16 block offsets
    bias: torch.Tensor | None  # [N] float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2 * BLOCK

    @property
    def nbytes(self) -> int:
        tensors = (self.packed, self.d, self.m) + ((self.bias,) if self.bias is not None else ())
        return sum(t.numel() * t.element_size() for t in tensors)


def quantize(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Q4Weight:
    """Round W [N, K] (K a multiple of 64) to 4-bit blocks spanning each block's min..max."""
    N, K = weight.shape
    if K % (2 * BLOCK):
        raise ValueError(f"q4 needs the input size to be a multiple of {2 * BLOCK}, got {K}")
    blocks = weight.detach().float().reshape(N, K // BLOCK, BLOCK)  # [N, B, 32]
    low = blocks.amin(-1)  # [N, B]
    d = ((blocks.amax(-1) - low) / 15).half()  # [N, B]
    m = low.half()
    # Round against the float16 scale and offset the kernel will use, so each value lands nearest.
    scale = d.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    q = ((blocks - m.float()[..., None]) / scale).round_().clamp_(0, 15).to(torch.uint8)  # [N, B, 32]
    pairs = q.reshape(N, K // (2 * BLOCK), 2, BLOCK)
    packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()  # [N, B/2, 32]
    return Q4Weight(packed, d.contiguous(), m.contiguous(), None if bias is None else bias.detach().float().contiguous())


def dequantize(weight: Q4Weight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 W [N, K] the 4-bit blocks stand for, or only its `rows` (an embedding lookup)."""
    packed, d, m = (weight.packed, weight.d, weight.m) if rows is None else (weight.packed[rows], weight.d[rows], weight.m[rows])
    q = torch.stack([packed & 15, packed >> 4], -2).reshape(*d.shape, BLOCK).float()  # [n, B, 32]
    return (q * d.float()[..., None] + m.float()[..., None]).reshape(len(d), -1)


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


def attend_rows(query: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                strides: Sequence[int], seen: Sequence[int], kv_heads: int, scale: float,
                march: str = NATIVE) -> torch.Tensor:
    """Each query row (query: [rows, heads, dim]) attends alone to the first seen[r] of its keys and
    values (keys[r], values[r]: [kv_heads, strides[r], dim] float32, contiguous); [rows, heads, dim]."""
    rows, heads, dim = query.shape
    if dim % 8 or heads % kv_heads:
        raise ValueError(f"attention needs a head size divisible by 8 and whole kv groups, got {dim}, {heads}/{kv_heads}")
    out = torch.empty(rows, heads, dim)
    pointers = torch.tensor([[k.data_ptr() for k in keys], [v.data_ptr() for v in values], list(strides), list(seen)],
                            dtype=torch.int64)  # [4, rows]
    _library(march).specd_attend_rows(query.contiguous().data_ptr(), *(pointers[i].data_ptr() for i in range(4)),
                                      rows, heads, kv_heads, dim, scale, out.data_ptr(), torch.get_num_threads())
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % (2 * BLOCK):
        raise ValueError(f"expected [rows, K] with K a multiple of {2 * BLOCK}, got {tuple(x.shape)}")
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
    lib.specd_attend_rows.argtypes = [pointer] * 5 + [size] * 4 + [ctypes.c_float, pointer, ctypes.c_int]
    for name in ("specd_q8_rows", "specd_rms_norm_q8", "specd_swiglu_q8", "specd_attend_rows"):
        getattr(lib, name).restype = None
    lib.specd_q4_matmul.argtypes = [pointer, pointer, pointer, size, size, pointer, pointer, pointer, pointer,
                                    size, pointer, ctypes.c_int]
    lib.specd_q4_matmul.restype = None
    return lib
