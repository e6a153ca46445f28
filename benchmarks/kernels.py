"""The target's one-session pass by rows on the two small-row paths of specd/kernels.py: weights
packed for oneDNN (served) and `W @ x.T` (served before). Both engines are loaded and the repeats
go round paths and row counts alike, so a slow minute of this shared host hits both.

    .venv/bin/python -m benchmarks.kernels [--repeats 9] [--rows 1,2,4,5,8,16,24,32,64]

Writes benchmarks/results/kernels.json: per path and row count the median pass time, and the
ratio W @ x.T / packed.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import machine, write
from benchmarks.rows import CONTEXT, holding_context, pass_s
from specd import kernels
from specd.engine import EngineConfig, ModelEngine
from services.models import model_path


def engine(packed: bool, threads: int) -> ModelEngine:
    built = ModelEngine(EngineConfig(model_path("target"), dtype="float32", threads=threads, small_row_matmul=False))
    kernels.use_small_row_matmul(built.model, pack=packed)
    return holding_context(built)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", default="1,2,4,5,8,16,24,32,64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    engines = {"packed_s": engine(True, args.threads), "w_xt_s": engine(False, args.threads)}
    times = {path: {r: [] for r in rows} for path in engines}
    for _ in range(args.repeats):
        for path, built in engines.items():
            for r in rows:
                times[path][r].append(pass_s(built, r))
    medians = {path: {r: round(statistics.median(ts), 4) for r, ts in by.items()} for path, by in times.items()}
    result = {
        "benchmark": "kernels", "model": "target (Qwen2.5-Coder 1.5B)", "dtype": "float32", "threads": args.threads,
        "context": CONTEXT, "repeats": args.repeats, "machine": machine(), **medians,
        "w_xt_over_packed": {r: round(medians["w_xt_s"][r] / medians["packed_s"][r], 3) for r in rows},
    }
    print(result)
    print(f"wrote {write('kernels', result)}")


if __name__ == "__main__":
    main()
