"""The GGUF weight types specd multiplies as stored, one row each (kernels: specd/csrc/quants.c).

Model code never names a quant type: it asks `quant_type` for a tensor's row and hands the bytes to
the C kernels, so a new type is one row here plus its kernel. A tensor of any other type is refused
by name at load time rather than converted, since a silent dequantise would change the numbers.
The thin wrappers below (quantize_rows, matmul, dequantize_rows) exist for tests and tools; gguf's
numpy dequantiser (`reference_dequantize`) is the independent oracle they are checked against.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from specd import native

# Activation row formats (quants.h): what the rows multiplying a weight type are quantised to.
ACT_F32, ACT_Q8_0, ACT_Q8_K = 0, 1, 2


@dataclass(frozen=True)
class QuantType:
    """One stored type: `block` values take `type_size` bytes; rows multiply it in format `act`."""

    name: str
    ggml_type: int
    block: int
    type_size: int
    act: int

    def row_bytes(self, K: int) -> int:
        return K // self.block * self.type_size


def _row(t: GGMLQuantizationType, act: int) -> QuantType:
    block, size = GGML_QUANT_SIZES[t]
    return QuantType(t.name, int(t), block, size, act)


_Q = GGMLQuantizationType
REGISTRY: dict[int, QuantType] = {
    q.ggml_type: q
    for q in (
        _row(_Q.F32, ACT_F32), _row(_Q.F16, ACT_F32), _row(_Q.BF16, ACT_F32),
        _row(_Q.Q8_0, ACT_Q8_0), _row(_Q.Q5_0, ACT_Q8_0), _row(_Q.Q4_0, ACT_Q8_0),
        _row(_Q.Q4_K, ACT_Q8_K), _row(_Q.Q5_K, ACT_Q8_K), _row(_Q.Q6_K, ACT_Q8_K),
    )
}


# A draft may run its larger block-32 weights as Q4_0 (`requantize`, `--quantize q4_0`): fewer bytes a
# step, and its numbers change acceptance only. A target's weights never change.
Q4_0 = int(_Q.Q4_0)
REQUANTIZABLE = frozenset({int(_Q.Q5_0), int(_Q.Q8_0)})


def requantize(raw: np.ndarray, ggml_type: int, N: int, K: int, to: int) -> np.ndarray:
    """The N rows of K values stored as `ggml_type`, requantized to `to` by gguf's numpy reference
    quantiser (llama.cpp's `quantize_row_*_ref`): their bytes, [N, row_bytes]."""
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(N, quant_type(ggml_type).row_bytes(K))
    values = gguf_quants.dequantize(rows, GGMLQuantizationType(int(ggml_type)))
    return np.ascontiguousarray(gguf_quants.quantize(values, GGMLQuantizationType(int(to))))


class UnsupportedTensorType(ValueError):
    """A tensor stored in a type specd has no kernel for."""


F32 = int(_Q.F32)


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown type {ggml_type}"


def quant_type(ggml_type: int, tensor: str | None = None) -> QuantType:
    """The registry row of `ggml_type`; UnsupportedTensorType (naming the tensor) when there is none."""
    kind = REGISTRY.get(int(ggml_type))
    if kind is None:
        what = f"tensor {tensor}" if tensor else "a tensor"
        supported = ", ".join(q.name for q in REGISTRY.values())
        raise UnsupportedTensorType(
            f"{what} has type {type_name(int(ggml_type))}, which specd has no kernel for; supported: {supported}")
    return kind


def reference_dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of stored bytes by gguf's numpy dequantiser (the oracle the kernels are tested on)."""
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    return np.asarray(gguf_quants.dequantize(data, GGMLQuantizationType(int(ggml_type))), np.float32).reshape(shape)


def _pointer(t: torch.Tensor | np.ndarray) -> int:
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data


def _linear(weight_raw: np.ndarray, ggml_type: int, N: int, K: int, bias: torch.Tensor | None) -> native.Linear:
    kind = quant_type(ggml_type)
    if weight_raw.nbytes < N * kind.row_bytes(K) or K % kind.block:
        raise ValueError(f"{weight_raw.nbytes} bytes do not hold [{N}, {K}] of {kind.name}")
    return native.Linear(_pointer(weight_raw), kind.ggml_type, N, K, _pointer(bias) if bias is not None else None)


def quantize_rows(x: torch.Tensor, act: int, march: str = native.NATIVE, threads: int = 1) -> torch.Tensor:
    """x [M, K] float32 -> [M, row bytes] uint8: each row in activation format `act`."""
    x = x.detach().to(torch.float32).contiguous()
    M, K = x.shape
    lib = native.library(march)
    out = torch.empty((M, lib.specd_act_row_bytes(act, K)), dtype=torch.uint8)
    lib.specd_quantize_rows(x.data_ptr(), M, K, act, out.data_ptr(), threads)
    return out


def repack(w: native.Linear, march: str = native.NATIVE, threads: int = 1) -> np.ndarray | None:
    """w's weight repacked into column panels (quants.c) in a new 64-byte aligned buffer, and
    w.packed set to it; None (w unchanged) when `march`'s build has no panel kernel for the type.
    The caller keeps the buffer alive as long as w is used."""
    lib = native.library(march)
    size = lib.specd_repack_bytes(w.type, w.N, w.K)
    if size <= 0:
        return None
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    buffer = raw[start:start + size]
    lib.specd_repack(ctypes.byref(w), buffer.ctypes.data, threads)
    w.packed = buffer.ctypes.data
    return buffer


def matmul(x: torch.Tensor, weight_raw: np.ndarray, ggml_type: int, N: int, K: int, bias: torch.Tensor | None = None,
           march: str = native.NATIVE, threads: int = 1, packed: bool = True) -> torch.Tensor:
    """x [M, K] float32 @ W.T (+ bias) -> [M, N], W [N, K] being the stored bytes of `ggml_type`;
    through its repacked panels when `packed` and the build has them (as GGUFModel multiplies),
    else the stored rows."""
    weight_raw = np.ascontiguousarray(weight_raw).view(np.uint8)
    bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    w = _linear(weight_raw, ggml_type, N, K, bias)
    keep = repack(w, march, threads) if packed else None  # noqa: F841  (alive through the call)
    xq = quantize_rows(x, quant_type(ggml_type).act, march, threads)
    y = torch.empty((xq.shape[0], N), dtype=torch.float32)
    native.library(march).specd_matmul(ctypes.byref(w), xq.data_ptr(), xq.shape[0], y.data_ptr(), threads)
    return y


def dequantize_rows(weight_raw: np.ndarray, ggml_type: int, N: int, K: int, rows, march: str = native.NATIVE) -> torch.Tensor:
    """Rows `rows` of W [N, K] (stored bytes of `ggml_type`) as float32 [len(rows), K]."""
    weight_raw = np.ascontiguousarray(weight_raw).view(np.uint8)
    w = _linear(weight_raw, ggml_type, N, K, None)
    index = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    if index.size and (index.min() < 0 or index.max() >= N):
        raise IndexError(f"rows outside [0, {N})")
    out = torch.empty((index.size, K), dtype=torch.float32)
    native.library(march).specd_dequantize_rows(ctypes.byref(w), index.ctypes.data, index.size, out.data_ptr())
    return out
