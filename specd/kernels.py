"""CPU kernel paths for decoding-sized inputs.

On this class of CPU, `F.linear` with 2-16 input rows is 2.5-4x slower than with one row
(the BLAS repacks the weight on every call), which is exactly the shape of a speculative
verification (K + 1 rows) and made it cost nearly K single steps. Two ways round it:

- float32 weights are packed once, at load, into oneDNN's blocked layout and multiplied with
  oneDNN's own kernel (`torch.ops.mkldnn._linear_pointwise`, what torch.compile's CPU freezing
  uses): no repacking per call; the 1.5B target's one-session pass is 1.16-1.50x faster than
  with `W @ x.T` from 1 to 64 rows, but for 4 rows (equal; benchmarks/results/kernels.json).
  A row's result does not depend on how many rows are fed with it (bit-identical,
  tests/test_engine.py), so a verification's rows equal the plain steps'. The packed copy
  replaces the dense weight.
- other weights (float64 test models, or a torch without oneDNN): `W @ x.T` with `x`
  contiguous runs those row counts at close to one-row speed, and stays ahead of `F.linear` up
  to 128 rows. The same arithmetic through another kernel; multi-row and single-row results
  agree to rounding (tests/test_engine.py checks every row count).

Dynamic int8 quantisation is for the *draft* only: a quantised model's logits depend on how
many tokens are processed together, so a K-token verification would no longer equal K single
steps. For a draft that only changes acceptance, never the output.
"""

from __future__ import annotations

import types
import warnings
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

SMALL_ROWS = 128
PACKED_FOR_ROWS = 16  # oneDNN picks the packed layout for about this many rows


def padded_rows(rows: int) -> int:
    """The row count to run `rows` rows at. The BLAS's small-matrix kernels work in blocks of 4
    and 8 columns: 9-15 rows cost more than 16, 3 more than 4, 7 more than 8 (5 and 6 do not
    pay for 8), so zero rows are added up to the next such block (measured: CHANGELOG.md)."""
    if rows in (3, 7):
        return rows + 1
    return rows if rows <= 8 else -(-rows // 8) * 8


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous [rows, features] matrix, zero rows added up to `padded_rows` (up to
    SMALL_ROWS rows). Row-major rows matter: the previous small-row linear hands on its output
    transposed in memory, and W @ (a contiguous [in, rows] matrix) runs 3x slower than
    W @ (rows-major).T."""
    rows, features = x.numel() // x.shape[-1], x.shape[-1]
    x_rows = x.reshape(rows, features)
    padding = padded_rows(rows) - rows if rows <= SMALL_ROWS else 0
    return torch.cat([x_rows, x_rows.new_zeros(padding, features)]) if padding else x_rows.contiguous()


def _small_rows_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > SMALL_ROWS:
        return F.linear(x, self.weight, self.bias)
    y = (self.weight @ _row_major(x).T)[:, :rows].T  # [rows, out]
    y = y.reshape(*x.shape[:-1], self.weight.shape[0])
    return y if self.bias is None else y + self.bias


def _packed_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    y = torch.ops.mkldnn._linear_pointwise(_row_major(x), self.packed_weight, self.bias, "none", [], "")[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])


# The ops are torch's private ones (its CPU freezing pass calls them): a build without them takes W @ x.T.
_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and all(
    hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
)


def _packable(weight: torch.Tensor) -> bool:
    return _ONEDNN_LINEAR and weight.dtype == torch.float32 and weight.device.type == "cpu"


def use_small_row_matmul(model: nn.Module) -> int:
    """Route every float nn.Linear through a fast small-row path (a packed float32 weight, else
    `W @ x.T`); returns how many were changed."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    changed = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        if _packable(module.weight):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACKED_FOR_ROWS)
            if uses[id(module.weight)] == 1:  # a tied weight (an embedding's too) stays for its other user
                module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
            module.forward = types.MethodType(_packed_linear, module)
        else:
            module.forward = types.MethodType(_small_rows_linear, module)
        changed += 1
    return changed


def quantize_int8(model: nn.Module) -> nn.Module:
    """Dynamic int8 weights for every nn.Linear (CPU). Draft models only: see the module docstring."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's deprecation notice for quantised tensors
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
