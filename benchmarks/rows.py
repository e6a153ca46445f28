"""A model's one-session pass by the rows it feeds: what a verification of K drafts (K + 1 rows)
costs, on the fetched GGUF file as specd serves it. The repeats go round the row counts (every
count once, then again), so a slow minute of this shared host hits them all alike.

    .venv/bin/python -m benchmarks.rows [--repeats 7] [--max-rows 16] [--role draft] [--model PATH]
                                        [--llama-server PATH]

Writes benchmarks/results/rows.json (rows_draft.json; SPECD_MARCH=haswell adds _haswell: the AVX2
build on this host; `--name` another name, e.g. rows_avx2 for an AVX2-only host): per row count the
median pass time; with
`--llama-server`, also llama.cpp's own decoding time per token on the same file and threads (its
`predicted_per_token_ms`, generating LLAMA_TOKENS after the same held tokens), measured after ours.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import json
import urllib.request

from benchmarks import llama_server
from benchmarks.common import machine, write
from specd import native
from specd.engine import EngineConfig, ModelEngine
from services.models import model_path

CONTEXT = 160  # tokens the session holds: a prompt and some output
LLAMA_TOKENS = 32  # llama-server's tokens per request: its context stays near CONTEXT


def pass_s(engine: ModelEngine, rows: int) -> float:
    """One verification-shaped pass (rows - 1 drafts after the held tokens), then rolled back."""
    n = engine.position("s")
    start = time.perf_counter()
    engine.forward_many([("s", [1000 + i for i in range(rows - 1)])])
    elapsed = time.perf_counter() - start
    engine.truncate("s", n)
    return elapsed


def held_tokens() -> list[int]:
    return [(7 * i) % 20000 + 100 for i in range(CONTEXT)]


def holding_context(engine: ModelEngine) -> ModelEngine:
    """Session "s" holding CONTEXT cached tokens, one pass warmed up: what `pass_s` measures on."""
    engine.sync("s", 0, held_tokens())
    engine.forward("s")
    pass_s(engine, 1)  # warm-up
    return engine


def sweep(engine: ModelEngine, max_rows: int, repeats: int) -> dict[int, float]:
    times: dict[int, list[float]] = {r: [] for r in range(1, max_rows + 1)}
    for _ in range(repeats):
        for rows in times:
            times[rows].append(pass_s(engine, rows))
    return {r: round(statistics.median(ts), 4) for r, ts in times.items()}


def llama_per_token_s(binary: Path, model: Path, threads: int, repeats: int) -> float:
    """llama-server's median decoding time per token (its own timings: no HTTP, no sampling setup)."""
    body = json.dumps({"prompt": held_tokens(), "n_predict": LLAMA_TOKENS, "temperature": 0, "ignore_eos": True,
                       "cache_prompt": False}).encode()
    times = []
    with llama_server.serve(binary, model, threads) as server:
        for _ in range(repeats + 1):
            request = urllib.request.Request(server.url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as reply:
                times.append(json.load(reply)["timings"]["predicted_per_token_ms"] / 1e3)
    return round(statistics.median(times[1:]), 4)  # the first warms it up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-rows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--role", default="target", choices=("target", "draft"))
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the role's fetched file)")
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server: its time per token too")
    parser.add_argument("--name", help="the result's name (default rows, rows_draft, rows_<march>)")
    args = parser.parse_args()
    path = args.model or model_path(args.role)
    engine = holding_context(ModelEngine(EngineConfig(path, threads=args.threads, quantize="auto")))
    result = {
        "benchmark": "rows", "model": path.name, "role": args.role, "numerics": engine.numerics.reason,
        "march": native.default_march(),
        "threads": args.threads, "context": CONTEXT, "repeats": args.repeats, "machine": machine(),
        "pass_s": sweep(engine, args.max_rows, args.repeats),
    }
    if args.llama_server:
        del engine  # its cores and memory back before llama-server starts
        result["llama_server_per_token_s"] = llama_per_token_s(args.llama_server, path, args.threads, args.repeats)
    print(result)
    name = args.name or ("rows" + ("" if args.role == "target" else "_draft")
                         + ("" if result["march"] == native.NATIVE else f"_{result['march']}"))
    print(f"wrote {write(name, result)}")


if __name__ == "__main__":
    main()
