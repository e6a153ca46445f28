"""specd bench --load: adaptive speculation against plain decoding with N sessions at once.

    .venv/bin/specd bench --load [--sessions 8,16] [--tokens 128] [--repeats 2] [--name load] [-- specd up flags]

One `specd up` (defaults, audit off). For each N, N greedy requests at once (the prompts of
`--prompts`, held-out by default, round-robin), first with speculation off, then adaptive, then the
other way round on the next repeat: aggregate tokens/s of each, pooled over the repeats, and their
ratio, and each service's CPU time a token (its processes' user and system seconds: on a small host the
coordinator's work takes the cores from the target's passes). Issue 30's goal: adaptive ≥ 0.98× plain
at 8 and 16 sessions (the load where a round must be priced by the batch it joins, docs/policy.md).
Every adaptive output must equal the same prompt's plain one.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import common
from benchmarks.bench import Prompt, load_prompts, mismatches, stream, warm_up
from benchmarks.summary import Measured
from services.models import fetch

HELD_OUT = Path(__file__).resolve().parent / "prompts_heldout.json"
CONFIGS = {"plain": {"speculation": False}, "adaptive": {}}
GOAL = 0.98


def at_once(stub, config: str, prompts: list[Prompt], sessions: int, tokens: int) -> tuple[float, list[Measured]]:
    """N requests at once: (their wall seconds, the runs)."""
    batch = [prompts[i % len(prompts)] for i in range(sessions)]
    start = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        runs = list(pool.map(lambda p: stream(stub, config, p, tokens, **CONFIGS[config]), batch))
    return time.perf_counter() - start, runs


def run(sessions: tuple[int, ...], tokens: int, repeats: int, prompts_path: Path, up_flags: tuple[str, ...]) -> dict:
    started = time.perf_counter()
    paths = fetch()
    prompts = load_prompts(paths["target"], 3, prompts_path)
    flags = ("--draft-model", str(paths["draft"]), "--target-model", str(paths["target"]), "--audit-rate", "0",
             *up_flags)
    by_repeat = {(n, c): [] for n in sessions for c in CONFIGS}  # each repeat's (tokens, seconds)
    cpu = {(n, c): collections.Counter() for n in sessions for c in CONFIGS}  # CPU seconds by service role
    runs: list[Measured] = []
    with common.specd_up(*flags) as up:
        warm_up(up.stub, prompts[0])
        for repeat in range(repeats):
            for n in sessions:
                for config in (CONFIGS if repeat % 2 == 0 else reversed(CONFIGS)):
                    before = up.cpu_s()
                    seconds, these = at_once(up.stub, config, prompts, n, tokens)
                    cpu[n, config].update({role: t - before[role] for role, t in up.cpu_s().items()})
                    by_repeat[n, config].append((sum(len(r.output) for r in these), seconds))
                    runs += these
    plain = {r.prompt: r.output for r in runs if r.config == "plain"}
    by_n = {}
    for n in sessions:
        rates = {c: _rate(by_repeat[n, c]) for c in CONFIGS}
        by_n[str(n)] = {f"{c}_tokens_per_s": round(rate, 2) for c, rate in rates.items()} | {
            "adaptive_vs_plain": round(rates["adaptive"] / rates["plain"], 3),
            "adaptive_vs_plain_by_repeat": [round(_rate([a]) / _rate([p]), 3)
                                            for a, p in zip(by_repeat[n, "adaptive"], by_repeat[n, "plain"])],
            "met": rates["adaptive"] / rates["plain"] >= GOAL,
            "cpu_ms_per_token": {c: {role: round(1000 * t / sum(k for k, _ in by_repeat[n, c]), 2)
                                     for role, t in sorted(cpu[n, c].items())} for c in CONFIGS}}
    return {
        "machine": common.machine(),
        "settings": {"sessions": list(sessions), "tokens": tokens, "repeats": repeats, "prompts": prompts_path.name,
                     "services": "specd up " + " ".join(flags[4:]), "goal": f"adaptive >= {GOAL}x plain"},
        "duration_s": round(time.perf_counter() - started, 1),
        "sessions": by_n,
        "lossless": {"checked": sum(r.config == "adaptive" for r in runs),
                     "mismatches": mismatches(plain, [r for r in runs if r.config == "adaptive"])},
        "adaptive": {name: sum(r.stats[name] for r in runs if r.config == "adaptive")
                     for name in ("rounds", "drafted_tokens", "accepted_tokens", "model_free_drafted_tokens",
                                  "model_free_accepted_tokens", "fallbacks")},
    }


def _rate(measured: list[tuple[int, float]]) -> float:
    """Tokens a second over (tokens, seconds) runs."""
    return sum(t for t, _ in measured) / sum(s for _, s in measured)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specd bench --load", description=__doc__.splitlines()[0])
    parser.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sessions", default="8,16", help="sessions at once, each N in turn")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="of every N, the configurations' order alternating")
    parser.add_argument("--prompts", type=Path, default=HELD_OUT)
    parser.add_argument("--name", default="load", help="result name under benchmarks/results/")
    parser.add_argument("up_flags", nargs="*", help="extra specd up flags (after --)")
    args = parser.parse_args(argv)
    result = run(tuple(int(n) for n in args.sessions.split(",")), args.tokens, args.repeats, args.prompts,
                 tuple(args.up_flags))
    common.write(args.name, result)
    print(json.dumps({k: result[k] for k in ("sessions", "lossless", "adaptive")}, indent=2))
    return 1 if result["lossless"]["mismatches"] else 0
