"""The int8 draft's pass through the stock modules (specd/ragged.py) and fused (specd/fused.py):
one drafting step (one new row per session) for 1, 4 and 8 sessions, and a catch-up pass of
three rows after a rollback. The two engines hold the same sessions and take turns pass by pass,
so a slow minute of this shared host hits both alike; each pass is rolled back after timing.

    .venv/bin/python -m benchmarks.draft_step [--repeats 30]

Writes benchmarks/results/draft_step.json: median ms per pass each way and the ratio, and
whether every pass's logits were identical.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import machine, write
from specd.engine import EngineConfig, ModelEngine
from services.models import model_path

CONTEXT = 160  # tokens each session holds: a prompt and some output
SHAPES = {"1 session x 1 row": (1, 1), "4 sessions x 1 row": (4, 1), "8 sessions x 1 row": (8, 1),
          "1 session x 3 rows": (1, 3)}


def timed_pass(engine: ModelEngine, sessions: int, rows: int) -> tuple[float, list[torch.Tensor]]:
    """One drafting-shaped pass over `sessions` sessions (the newest row each), rolled back."""
    names = [f"s{i}" for i in range(sessions)]
    lengths = [engine.position(name) for name in names]
    start = time.perf_counter()
    logits = engine.forward_many([(name, [1000 + r for r in range(rows)]) for name in names], newest_only=True)
    elapsed = time.perf_counter() - start
    for name, n in zip(names, lengths):
        engine.truncate(name, n)
    return elapsed, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engines = {path: ModelEngine(EngineConfig(model_path("draft"), quantize="int8", fused_int8=path == "fused",
                                              threads=args.threads)) for path in ("stock", "fused")}
    for engine in engines.values():
        for i in range(max(s for s, _ in SHAPES.values())):
            engine.sync(f"s{i}", 0, [(7 * i + 11 * j) % 20000 + 100 for j in range(CONTEXT)])
            engine.forward(f"s{i}")  # cache the prompt: a step then feeds only its new rows
    times = {shape: {path: [] for path in engines} for shape in SHAPES}
    identical = True
    for _ in range(args.repeats):
        for shape, (sessions, rows) in SHAPES.items():
            stock_s, stock_logits = timed_pass(engines["stock"], sessions, rows)
            fused_s, fused_logits = timed_pass(engines["fused"], sessions, rows)
            times[shape]["stock"].append(stock_s)
            times[shape]["fused"].append(fused_s)
            identical &= all(torch.equal(a, b) for a, b in zip(stock_logits, fused_logits))
    ms = {shape: {path: round(1000 * statistics.median(ts), 1) for path, ts in by_path.items()}
          for shape, by_path in times.items()}
    result = {
        "benchmark": "draft_step", "model": "draft (Qwen2.5-Coder 0.5B), dynamic int8", "threads": args.threads,
        "context": CONTEXT, "repeats": args.repeats, "machine": machine(), "identical_logits": identical,
        "median_ms": ms, "stock_over_fused": {shape: round(m["stock"] / m["fused"], 2) for shape, m in ms.items()},
    }
    print(result)
    print(f"wrote {write('draft_step', result)}")
    if not identical:
        raise SystemExit("the fused draft's logits differ from the stock forward's")


if __name__ == "__main__":
    main()
