"""Which weights an engine runs: a setting, or `auto`, chosen at start-up by measuring this machine.

Modes (`EngineConfig.quantize`):
- `none`: the checkpoint's dense weights in `EngineConfig.dtype` through the stock modules. With
  float32, greedy output is Hugging Face's float32 `generate`. Not batch-invariant on every CPU
  (oneDNN's packed float32 kernel may block rows differently by row count): exact speculation
  then rests on argmax margins, which the online audit watches.
- `q4`: 4-bit weights, int8 activations, our batch-invariant kernel and per-row attention
  (specd/qkernels.py, specd/qwen2.py): a verification's rows equal plain steps bit for bit.
- `int8`: torch's dynamic int8 (per-tensor activation scales): a draft-only option, as its rows
  depend on the rows beside them.
- `auto`: the fastest mode that passes a batch-invariance self-check here (`choose`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specd import kernels, qkernels

MODES = ("none", "int8", "q4", "auto")
INVARIANT_MODES = ("none", "q4")  # the candidates auto weighs; int8 never passes by design
CHECK_ROWS = (2, 3, 5, 9, 16)  # row counts whose every row must equal the one-row result
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    mode: str  # the mode the engine runs
    reason: str  # why, for logs, health and metrics
    invariant: bool  # passed the batch-invariance self-check on this machine


def choose(shape: tuple[int, int], requested: str = "auto") -> Choice:
    """The mode to run. `requested` other than auto is taken as it is, with its self-check recorded;
    auto takes the fastest invariant candidate at a linear of `shape` ([out, in] of the MLP)."""
    if requested not in MODES:
        raise ValueError(f"quantize must be one of {', '.join(MODES)}; got {requested!r}")
    if requested != "auto":
        invariant = requested != "int8" and _invariant(_linear(requested, shape), shape[1])
        return Choice(requested, "set by configuration", invariant)
    timings, refused = {}, []
    for mode in INVARIANT_MODES:
        if mode == "q4" and (why := qkernels.available()):
            refused.append(f"q4 unavailable ({why.splitlines()[0]})")
            continue
        linear = _linear(mode, shape)
        if not _invariant(linear, shape[1]):
            refused.append(f"{mode} not batch-invariant here")
            continue
        timings[mode] = _seconds(linear, shape[1])
    if not timings:
        choice = Choice("none", "no batch-invariant candidate here (" + "; ".join(refused) + "): dense weights", False)
    else:
        mode = min(timings, key=timings.get)
        measured = ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in sorted(timings.items(), key=lambda kv: kv[1]))
        choice = Choice(mode, f"fastest batch-invariant candidate (1 + 9 rows at {shape[0]}x{shape[1]}: {measured})"
                        + ("; " + "; ".join(refused) if refused else ""), True)
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
    return Choice("gguf", "the file's tensors as stored (" + ", ".join(model.tensor_types()) + "), batch-invariant "
                  "by the start-up check", True)


def _linear(mode: str, shape: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear of `shape` in `mode` with seeded random weights, as the engine would run it."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator) * 0.02
    if mode == "q4":
        q = qkernels.quantize(weight)
        return lambda x: qkernels.linear(x, q)
    layer = torch.nn.Linear(shape[1], shape[0], bias=False)
    layer.weight.data.copy_(weight)
    kernels.use_small_row_matmul(layer)  # the engine's dense CPU path
    return layer


@torch.inference_mode()
def _invariant(linear: Callable[[torch.Tensor], torch.Tensor], features: int) -> bool:
    """Every row of a call with M rows equals that row alone, bit for bit, for M in CHECK_ROWS."""
    x = torch.randn(max(CHECK_ROWS), features, generator=torch.Generator().manual_seed(1))
    alone = [linear(x[i : i + 1]) for i in range(max(CHECK_ROWS))]
    return all(torch.equal(linear(x[:m])[i : i + 1], alone[i]) for m in CHECK_ROWS for i in range(m))


@torch.inference_mode()
def _seconds(linear: Callable[[torch.Tensor], torch.Tensor], features: int, repeats: int = 3) -> float:
    """The best of `repeats` timings of a one-row and a nine-row call: a plain step and a K = 8 check."""
    x = torch.randn(9, features)
    linear(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        linear(x[:1])
        linear(x)
        best = min(best, time.perf_counter() - start)
    return best
