"""Pipelined drafting vs the synchronous loop, through the real services with an injected
network delay (default 2 ms RTT on every model-service call), greedy, on code prompts (where
acceptance is high and a bet on full acceptance wins most often).

On one machine the draft and the target share the cores, so each configuration is run with
torch's default threads for both services (they time-share the cores) and with the cores split
between them (draft 1 thread, target the rest). `auto` lets the cost model decide per session.
Drafting ahead means both services computing at once, so the services do not take turns at the
cores here (`specd up --core-turns off`); the synchronous baseline is also run with turns (the
default), where a single session's rounds never overlap anyway.
Greedy outputs must agree across configurations, or the benchmark fails.

    .venv/bin/python -m benchmarks.pipeline [--tokens 64] [--rtt-ms 2]

Writes benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.common import machine, runs_json, specd_up, timed, write
from benchmarks.fallback import CODE_PROMPTS
from specd.models import fetch

MODES = ("off", "on", "auto")


def splits() -> dict[str, tuple[str, ...]]:
    target = max(1, (os.cpu_count() or 2) - 1)
    no_turns = ("--core-turns", "off")
    return {"shared": no_turns, f"split 1+{target}": (*no_turns, "--draft-threads", "1", "--target-threads", str(target))}


def run_config(mode: str, threads: tuple[str, ...], rtt_ms: float, tokens: int) -> list:
    with specd_up("--pipeline", mode, "--inject-rtt-ms", str(rtt_ms), *threads) as up:
        timed(up.stub, "warm-up", CODE_PROMPTS["code"], 8)
        return [timed(up.stub, name, text, tokens) for name, text in CODE_PROMPTS.items()]


def rate(runs) -> float:
    return sum(r.tokens for r in runs) / sum(r.wall_s for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rtt-ms", type=float, default=2.0)
    args = parser.parse_args()
    fetch()
    result = {"machine": machine(), "tokens": args.tokens, "rtt_ms": args.rtt_ms, "configs": []}
    outputs, baseline = {}, None
    configs = [(split, threads, mode) for split, threads in splits().items() for mode in MODES]
    # Last, the synchronous loop as `specd up` runs it by default: the services taking turns.
    for split, threads, mode in configs + [("shared, turns", ("--core-turns", "on"), "off")]:
        runs = run_config(mode, threads, args.rtt_ms, args.tokens)
        for r in runs:
            if outputs.setdefault(r.label, r.token_ids) != r.token_ids:
                raise SystemExit(f"LOSSLESS VIOLATION: {r.label} differs with pipeline={mode}, {split}")
        tokens_per_s = rate(runs)
        baseline = baseline or tokens_per_s  # the first: synchronous, shared threads
        result["configs"].append({
            "pipeline": mode, "threads": split, "tokens_per_s": round(tokens_per_s, 3),
            "vs_synchronous_shared": round(tokens_per_s / baseline, 3),
            "reused": sum(r.reused for r in runs), "drafted": sum(r.drafted for r in runs),
            "runs": runs_json(runs),
        })
        print(f"pipeline={mode:4} {split:10} {tokens_per_s:.3f} tok/s ({tokens_per_s / baseline:.3f}x)", flush=True)
    path = write("pipeline", result)
    print(json.dumps([{k: v for k, v in c.items() if k != "runs"} for c in result["configs"]], indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
