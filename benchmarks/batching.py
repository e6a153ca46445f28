"""Batching micro-benchmark: one pass for B sessions vs B passes (target verification, draft steps).

On the real target (float32, 2 threads), B sessions with different context lengths each
verify K = 4 drafts (K+1 = 5 rows fed: the re-fed last token and the drafts). Timed: the B
`forward` calls one after another vs one `forward_many` (specd/ragged.py), median of
repeats, each session rolled back after every pass so all runs see the same caches. Also:
what a padded batch cache would copy every round instead, the float32 difference between the
two paths, and F.linear vs the small-row `W @ x.T` path at batched row counts (x row-major in
memory, as the path feeds it, and column-major, as it fed it before). Then the int8 draft's
drafting step for B sessions (one row each), B passes vs one (`draft_steps`; int8 quantises
each pass's activations together, so its logits in a batch differ more than float32's).

    .venv/bin/python -m benchmarks.batching [--repeats 5]

Writes benchmarks/results/batching.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import machine, write
from specd import kernels
from specd.engine import EngineConfig, ModelEngine
from services.models import model_path

BATCHES = (1, 2, 4, 8)
DRAFTS = 4  # K: each session feeds K + 1 = 5 rows
CONTEXT = 64  # session i holds CONTEXT + 16 i tokens


def median_s(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sessions(engine: ModelEngine, count: int) -> dict[str, int]:
    """Prefilled sessions of different lengths: session id -> committed length."""
    generator = torch.Generator().manual_seed(0)
    lengths = {}
    for i in range(count):
        n = CONTEXT + 16 * i
        engine.sync(f"s{i}", 0, torch.randint(0, 256, (n,), generator=generator).tolist())
        engine.forward(f"s{i}")
        lengths[f"s{i}"] = n
    return lengths


def rolled_back(engine: ModelEngine, lengths: dict[str, int], run: Callable[[], list[torch.Tensor]]):
    """`run`, then every session back at its committed length, so each repeat sees the same caches."""

    def go() -> list[torch.Tensor]:
        out = run()
        for s, n in lengths.items():
            engine.truncate(s, n)
        return out

    return go


def measure(engine: ModelEngine, lengths: dict[str, int], batch: int, repeats: int, drafts: int = DRAFTS) -> dict:
    ids = list(lengths)[:batch]
    requests = [(s, [(7 * i + j) % 256 for j in range(drafts)]) for i, s in enumerate(ids)]
    one_after_another = rolled_back(engine, lengths, lambda: [engine.forward(s, extra) for s, extra in requests])
    batched = rolled_back(engine, lengths, lambda: engine.forward_many(requests))
    sequential_s, batched_s = median_s(one_after_another, repeats), median_s(batched, repeats)
    pairs = list(zip(one_after_another(), batched()))
    return {
        "sessions": batch, "rows": batch * (drafts + 1), "context_tokens": [lengths[s] for s in ids],
        "one_after_another_s": round(sequential_s, 4), "batched_s": round(batched_s, 4),
        "speedup": round(sequential_s / batched_s, 2), "batched_s_per_session": round(batched_s / batch, 4),
        "pad_copy_s": round(median_s(lambda: pad_copy(engine, ids), repeats), 4),
        "float32_max_abs_logit_diff": max(float((a - b).abs().max()) for a, b in pairs),
        "same_argmax": all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in pairs),
    }


def pad_copy(engine: ModelEngine, ids: list[str]) -> None:
    """What a padded design pays each round before its forward: every session's KV, every
    layer, copied into one [B, kv_heads, max_len, head_dim] cache (and the new rows back)."""
    caches = [engine._sessions[s].cache for s in ids]
    for layer in range(len(caches[0].layers)):
        for part in ("keys", "values"):
            tensors = [getattr(c.layers[layer], part) for c in caches]  # each [1, kv_heads, len, head_dim]
            padded = tensors[0].new_zeros(len(tensors), tensors[0].shape[1], max(t.shape[2] for t in tensors),
                                          tensors[0].shape[3])
            for i, t in enumerate(tensors):
                padded[i, :, : t.shape[2]] = t[0]


def linear_paths(engine: ModelEngine, repeats: int) -> list[dict]:
    """F.linear vs W @ x.T (specd/kernels.py) on the MLP's gate and down projections, with x's rows
    row-major in memory (what the kernel path feeds), column-major (what it fed before: a small-row
    linear's own output is transposed in memory), and padded with zero rows to
    `kernels.padded_rows` (what it feeds now)."""
    mlp = engine.model.model.layers[0].mlp
    out = []
    for name, weight in (("gate_proj", mlp.gate_proj.weight), ("down_proj", mlp.down_proj.weight)):
        for rows in (3, 4, 5, 7, 8, 9, 12, 16, 40):
            x = torch.randn(rows, weight.shape[1])  # [rows, in]
            x_column_major = x.T.contiguous().T  # the same values, transposed in memory
            x_padded = torch.cat([x, x.new_zeros(kernels.padded_rows(rows) - rows, x.shape[1])])
            with torch.inference_mode():
                times = {path: median_s(run, repeats * 4) for path, run in (
                    ("f_linear", lambda: F.linear(x, weight)),
                    ("w_xt", lambda: (weight @ x.T).T),
                    ("w_xt_column_major", lambda: (weight @ x_column_major.T).T),
                    ("w_xt_padded", lambda: (weight @ x_padded.T)[:, :rows].T),
                )}
            out.append({"weight": name, "rows": rows, **{f"{k}_ms": round(v * 1e3, 3) for k, v in times.items()}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", default=None, help="default: the real target (specd models fetch)")
    args = parser.parse_args()
    engine = ModelEngine(EngineConfig(args.model_dir or model_path("target"), dtype="float32", threads=args.threads,
                                      max_sessions=max(BATCHES)))
    lengths = sessions(engine, max(BATCHES))
    rows = []
    for batch in BATCHES:
        rows.append(measure(engine, lengths, batch, args.repeats))
        print(rows[-1], flush=True)
    # a lone request: the ragged path must cost what the stock forward costs
    lone = ("s0", [1, 2, 3, 4])
    stock_s = median_s(rolled_back(engine, lengths, lambda: [engine.forward(*lone)]), args.repeats)
    ragged_s = median_s(rolled_back(engine, lengths, lambda: engine.forward_many([lone])), args.repeats)
    result = {
        "benchmark": "batching", "model": "target (Qwen2.5-Coder 1.5B)", "dtype": "float32", "threads": args.threads,
        "drafts_per_session": DRAFTS, "repeats": args.repeats, "machine": machine(),
        "batches": rows,
        "lone_request": {"stock_forward_s": round(stock_s, 4), "ragged_forward_s": round(ragged_s, 4)},
        "linear_paths": linear_paths(engine, args.repeats),
    }
    result["draft_steps"] = draft_steps(args.threads, args.repeats)
    print(f"wrote {write('batching', result)}")


def draft_steps(threads: int, repeats: int) -> list[dict]:
    """The int8 draft's drafting step (one row per session) for B sessions: B passes vs one."""
    engine = ModelEngine(EngineConfig(model_path("draft"), threads=threads, quantize="int8", max_sessions=max(BATCHES)))
    lengths = sessions(engine, max(BATCHES))
    rows = [measure(engine, lengths, batch, repeats * 2, drafts=0) for batch in BATCHES]
    for row in rows:
        print("draft", row, flush=True)
    return rows


if __name__ == "__main__":
    main()
