"""Which weights an engine runs, and whether a pass's rows equal one-row steps on this machine.

Modes (`EngineConfig.quantize`):
- a GGUF file runs as stored (mode `gguf`, `none` or `auto` accepted): specd's block kernels are
  batch-invariant by construction, and `check_native` proves it at start-up or refuses to serve.
- `none`: a Hugging Face checkpoint's dense weights in `EngineConfig.dtype` through the stock
  modules. With float32, greedy output is Hugging Face's float32 `generate`. Not batch-invariant on
  every CPU (oneDNN's packed float32 kernel may block rows differently by row count): exact
  speculation then rests on argmax margins, which the online audit watches.
- `int8`: torch's dynamic int8 (per-tensor activation scales): a draft-only option, as its rows
  depend on the rows beside them.
- `auto`: a GGUF file as stored; a Hugging Face checkpoint's dense weights, self-checked here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specd import kernels, quants

MODES = ("none", "int8", "auto", "q4_0")  # q4_0: a GGUF draft's (gguf_model.GGUFModel requantize)
CHECK_ROWS = (2, 3, 5, 9, 16)  # row counts whose every row must equal the one-row result
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    mode: str  # the mode the engine runs
    reason: str  # why, for logs, health and metrics
    invariant: bool  # passed the batch-invariance self-check on this machine


def choose(shape: tuple[int, int], requested: str = "auto") -> Choice:
    """A Hugging Face checkpoint's mode, with the batch-invariance self-check of its dense linears
    at `shape` ([out, in] of the MLP) on this machine; int8 never passes by design."""
    if requested not in MODES:
        raise ValueError(f"quantize must be one of {', '.join(MODES)}; got {requested!r}")
    if requested == "int8":
        return Choice("int8", "set by configuration", False)
    invariant = _invariant(_dense_linear(shape), shape[1])
    reason = "set by configuration" if requested == "none" else (
        "a Hugging Face checkpoint's dense weights, " + ("batch-invariant here" if invariant else
        "not batch-invariant here: exact speculation rests on argmax margins (the online audit watches)"))
    choice = Choice("none", reason, invariant)
    log.info("numerics: %s: %s", choice.mode, choice.reason)
    return choice


NATIVE_CHECK_TOKENS = 9  # a one-pass prompt of 9 rows (a K = 8 verification's size) against 9 steps


@torch.inference_mode()
def check_native(model) -> Choice:
    """A GGUF model's start-up self-check: feeding tokens one step at a time and all in one pass,
    and beside another session, must give the same logits bit for bit (with this file's tensor
    types, on this CPU). Refuses to serve otherwise."""
    tokens = [(7 * i + 3) % model.vocab_size for i in range(NATIVE_CHECK_TOKENS)]
    steps = model.new_cache()
    alone = torch.cat([model.forward([steps], [[t]], [1])[0] for t in tokens])
    together = model.forward([model.new_cache()], [tokens], [len(tokens)])[0]
    beside = model.forward([model.new_cache(), model.new_cache()], [tokens[:4], tokens], [4, len(tokens)])[1]
    if not (torch.equal(alone, together) and torch.equal(alone, beside)):
        raise RuntimeError(f"{model.path.name}: a pass's rows differ from one-row steps on this CPU; "
                           "specd's kernels are not batch-invariant here, so speculation would change the output")
    runs = "the file's tensors as stored (" + ", ".join(model.tensor_types()) + ")"
    if model.requantized_to:
        stored = ", ".join(sorted(quants.type_name(t) for t in quants.REQUANTIZABLE))
        runs += f", its {stored} weights requantized to {model.requantized_to} at load"
    return Choice("gguf", runs + ", batch-invariant by the start-up check", True)


def _dense_linear(shape: tuple[int, int]) -> torch.nn.Linear:
    """A dense linear of `shape` with seeded random weights, as the engine runs it on the CPU."""
    layer = torch.nn.Linear(shape[1], shape[0], bias=False)
    layer.weight.data.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02)
    kernels.use_small_row_matmul(layer)  # the engine's dense CPU path
    return layer


@torch.inference_mode()
def _invariant(linear: Callable[[torch.Tensor], torch.Tensor], features: int) -> bool:
    """Every row of a call with M rows equals that row alone, bit for bit, for M in CHECK_ROWS."""
    x = torch.randn(max(CHECK_ROWS), features, generator=torch.Generator().manual_seed(1))
    alone = [linear(x[i : i + 1]) for i in range(max(CHECK_ROWS))]
    return all(torch.equal(linear(x[:m])[i : i + 1], alone[i]) for m in CHECK_ROWS for i in range(m))
