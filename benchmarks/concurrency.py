"""Concurrent sessions on one host: the draft and target services taking turns at the cores
(`specd up --core-turns on`, the default) vs both computing whenever they have work (off).

On a small CPU both services' torch pools are sized for every core. Concurrent sessions keep
both services busy at once, and then each pass runs against the other's threads. With turns,
each pass has the cores to itself while the other service's work queues up (and batches).

For each setting, one `specd up` on free ports; N adaptive greedy sessions one after another,
then the same N at once (`benchmarks.bench.concurrency_runs`); aggregate tokens/s of each and
their ratio. Every concurrent output must equal the same prompt's sequential output.

    .venv/bin/python -m benchmarks.concurrency [--sessions 8] [--tokens 64] [--core-turns off,on] [--draft-max-batch 8]
        [--batch-wait 0.1] [--name concurrency]

Writes benchmarks/results/<name>.json: per setting the aggregate rates, and for the sequential and
the concurrent sessions their rounds, fallbacks, accepted of drafted tokens and wall time by prompt.
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from benchmarks.bench import (
    BenchConfig, LosslessViolation, _model_dirs, concurrency_runs, load_prompts, mismatches, warm_up,
)
from benchmarks.common import machine, specd_up, write
from services.common.worker import Batching


def measure(turns: str, cfg: BenchConfig, prompts, draft_dir, target_dir, up_flags: tuple[str, ...]) -> dict:
    flags = ("--core-turns", turns, *up_flags, "--draft-model", str(draft_dir), "--target-model", str(target_dir))
    with specd_up(*flags) as up, tqdm(total=2 * cfg.concurrency, unit="req", desc=f"turns {turns}") as bar:
        warm_up(up.stub, prompts[0])
        scaling = concurrency_runs(up.stub, cfg, prompts, bar)
    runs = scaling.pop("runs")
    sequential = {r.prompt: r.output for r in runs if r.config == "sequential"}
    scaling["mismatches"] = mismatches(sequential, [r for r in runs if r.config == "concurrent"])
    for config in ("sequential", "concurrent"):
        these = [r for r in runs if r.config == config]
        scaling[config] = {
            "rounds": sum(r.stats["rounds"] for r in these),
            "fallbacks": sum(r.stats["fallbacks"] for r in these),
            "accepted_of_drafted": [sum(r.stats["accepted_tokens"] for r in these),
                                    sum(r.stats["drafted_tokens"] for r in these)],
            "wall_s_by_prompt": {r.prompt: round(r.wall_s, 1) for r in these},
        }
    return scaling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.concurrency", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--core-turns", default="off,on", help="settings to run, in order")
    parser.add_argument("--name", default="concurrency", help="result name under benchmarks/results/")
    parser.add_argument("--draft-max-batch", type=int, default=8, help="specd up --draft-max-batch")
    parser.add_argument("--batch-wait", type=float, default=Batching.wait, help="specd up --batch-wait")
    args = parser.parse_args(argv)
    cfg = BenchConfig(tokens=args.tokens, concurrency=args.sessions, prompts_per_class=3)
    draft_dir, target_dir = _model_dirs(cfg)
    prompts = load_prompts(target_dir, cfg.prompts_per_class)
    settings = args.core_turns.split(",")
    if not set(settings) <= {"on", "off"}:
        parser.error(f"--core-turns takes on and/or off, got {args.core_turns!r}")
    up_flags = ("--draft-max-batch", str(args.draft_max_batch), "--batch-wait", str(args.batch_wait))
    by_setting = {turns: measure(turns, cfg, prompts, draft_dir, target_dir, up_flags) for turns in settings}
    result = {
        "benchmark": "concurrency", "machine": machine(), "sessions": args.sessions, "tokens": args.tokens,
        "draft_max_batch": args.draft_max_batch, "batch_wait": args.batch_wait,
        "prompts": [p.name for p in prompts][: args.sessions],
        "core_turns": by_setting,
    }
    if len(by_setting) == 2:
        result["ratio_on_over_off"] = round(
            by_setting["on"]["concurrent_tokens_per_s"] / by_setting["off"]["concurrent_tokens_per_s"], 3
        )
    print(json.dumps(result, indent=2))
    write(args.name, result)
    if problems := [p for s in by_setting.values() for p in s["mismatches"]]:
        raise LosslessViolation("LOSSLESS VIOLATION: " + "; ".join(problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
