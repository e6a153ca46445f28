"""A model's one-session pass by the rows it feeds: what a verification of K drafts (K + 1
rows) costs. float32 (`--quantize none`): fed as is and padded to `kernels.padded_rows`' blocks
(the BLAS's small-matrix kernels work in column blocks, so some row counts cost more than a
larger one; the padding feeds zero rows up to the block). q4: as fed (it does not pad). The
repeats go round the row counts (every count once, then again), so a slow minute of this shared
host hits them all alike.

    .venv/bin/python -m benchmarks.rows [--repeats 15] [--max-rows 9] [--quantize q4] [--role draft]

Writes benchmarks/results/rows.json (rows_q4.json, rows_q4_draft.json): per row count the
median pass time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import machine, write
from specd import kernels
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


def sweep(engine: ModelEngine, max_rows: int, repeats: int) -> dict[str, dict[int, float]]:
    as_is = kernels.padded_rows
    paths = {"unpadded_s": lambda rows: rows, "padded_s": as_is}
    if not _pads(engine):
        del paths["padded_s"]
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


def _pads(engine: ModelEngine) -> bool:
    """The dense float32 engine's small-row linears pad rows to blocks; q4 runs the rows it is fed."""
    return engine.numerics.mode == "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--max-rows", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize", default="none", choices=("none", "q4"))
    parser.add_argument("--role", default="target", choices=("target", "draft"))
    args = parser.parse_args()
    config = EngineConfig(model_path(args.role), dtype="float32", threads=args.threads, quantize=args.quantize)
    engine = holding_context(ModelEngine(config))
    result = {
        "benchmark": "rows", "model": args.role, "dtype": "float32", "quantize": args.quantize,
        "threads": args.threads, "context": CONTEXT, "repeats": args.repeats, "machine": machine(),
        "padding": {r: kernels.padded_rows(r) if _pads(engine) else r for r in range(1, args.max_rows + 1)},
        **sweep(engine, args.max_rows, args.repeats),
    }
    print(result)
    name = "rows" + ("" if args.quantize == "none" else f"_{args.quantize}") + ("" if args.role == "target" else "_draft")
    print(f"wrote {write(name, result)}")


if __name__ == "__main__":
    main()
