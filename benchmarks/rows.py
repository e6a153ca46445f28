"""The target's one-session pass by the rows it feeds: what a verification of K drafts (K + 1
rows) costs, fed as is and padded to `kernels.padded_rows`' blocks.

The BLAS's small-matrix kernels work in column blocks, so some row counts cost more than a
larger one; the padding feeds zero rows up to the block. The repeats go round the row counts
(every count once, then again), so a slow minute of this shared host hits them all alike.

    .venv/bin/python -m benchmarks.rows [--repeats 15] [--max-rows 9]

Writes benchmarks/results/rows.json: per row count the median pass time unpadded and padded.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import machine, write
from specd import kernels
from specd.engine import EngineConfig, ModelEngine
from specd.models import model_path

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


def sweep(engine: ModelEngine, max_rows: int, repeats: int) -> dict[str, dict[int, float]]:
    as_is = kernels.padded_rows
    paths = {"unpadded_s": lambda rows: rows, "padded_s": as_is}
    times: dict[str, dict[int, list[float]]] = {path: {r: [] for r in range(1, max_rows + 1)} for path in paths}
    try:
        for _ in range(repeats):
            for path, padding in paths.items():
                kernels.padded_rows = padding  # the small-row linear looks it up on every call
                for rows in range(1, max_rows + 1):
                    times[path][rows].append(pass_s(engine, rows))
    finally:
        kernels.padded_rows = as_is
    return {path: {r: round(statistics.median(ts), 4) for r, ts in by_rows.items()} for path, by_rows in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--max-rows", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = holding_context(ModelEngine(EngineConfig(model_path("target"), dtype="float32", threads=args.threads)))
    result = {
        "benchmark": "rows", "model": "target (Qwen2.5-Coder 1.5B)", "dtype": "float32", "threads": args.threads,
        "context": CONTEXT, "repeats": args.repeats, "machine": machine(),
        "padding": {r: kernels.padded_rows(r) for r in range(1, args.max_rows + 1)},
        **sweep(engine, args.max_rows, args.repeats),
    }
    print(result)
    print(f"wrote {write('rows', result)}")


if __name__ == "__main__":
    main()
