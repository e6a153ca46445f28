"""A model's one-session pass by the rows it feeds: what a verification of K drafts (K + 1 rows)
costs, on the fetched GGUF file as specd serves it. The repeats go round the row counts (every
count once, then again), so a slow minute of this shared host hits them all alike.

    .venv/bin/python -m benchmarks.rows [--repeats 7] [--max-rows 16] [--role draft] [--model PATH]

Writes benchmarks/results/rows.json (rows_draft.json): per row count the median pass time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import machine, write
from specd.engine import EngineConfig, ModelEngine
from services.models import model_path

CONTEXT = 160  # tokens the session holds: a prompt and some output


def pass_s(engine: ModelEngine, rows: int) -> float:
    """One verification-shaped pass (rows - 1 drafts after the held tokens), then rolled back."""
    n = engine.position("s")
    start = time.perf_counter()
    engine.forward_many([("s", [1000 + i for i in range(rows - 1)])])
    elapsed = time.perf_counter() - start
    engine.truncate("s", n)
    return elapsed


def holding_context(engine: ModelEngine) -> ModelEngine:
    """Session "s" holding CONTEXT cached tokens, one pass warmed up: what `pass_s` measures on."""
    engine.sync("s", 0, [(7 * i) % 20000 + 100 for i in range(CONTEXT)])
    engine.forward("s")
    pass_s(engine, 1)  # warm-up
    return engine


def sweep(engine: ModelEngine, max_rows: int, repeats: int) -> dict[int, float]:
    times: dict[int, list[float]] = {r: [] for r in range(1, max_rows + 1)}
    for _ in range(repeats):
        for rows in times:
            times[rows].append(pass_s(engine, rows))
    return {r: round(statistics.median(ts), 4) for r, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-rows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--role", default="target", choices=("target", "draft"))
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the role's fetched file)")
    args = parser.parse_args()
    path = args.model or model_path(args.role)
    engine = holding_context(ModelEngine(EngineConfig(path, threads=args.threads, quantize="auto")))
    result = {
        "benchmark": "rows", "model": path.name, "role": args.role, "numerics": engine.numerics.reason,
        "threads": args.threads, "context": CONTEXT, "repeats": args.repeats, "machine": machine(),
        "pass_s": sweep(engine, args.max_rows, args.repeats),
    }
    print(result)
    print(f"wrote {write('rows' + ('' if args.role == 'target' else '_draft'), result)}")


if __name__ == "__main__":
    main()
