"""Fallback benchmark: with a useless draft, speculation must switch itself off and cost
at most 10 % against plain decoding; with the real pair on code prompts it must stay on
(no fallback at all).

Requests run one after another on one deployment, as a server sees them: the first one
pays for discovering that the draft is useless; later ones start from what the deployment
learned (`specd.policy.inherit`) and only probe now and then. Each prompt runs `--repeats`
times, plain first then adaptive first in turn, so a drift of the machine's speed during the
run does not favour either; ratios are over the summed times.

    .venv/bin/python -m benchmarks.fallback [--tokens 64] [--repeats 2]

The useless draft is the real 0.5B architecture with seeded random weights (so a probe
costs what a real draft step costs). Every configuration runs through the real services
(`specd up`); the greedy outputs must equal plain decoding's, or the benchmark fails.
Writes benchmarks/results/fallback.json.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks.common import machine, runs_json, specd_up, timed, write
from services.models import default_models_dir, fetch

PROMPTS = {
    "code": "def merge_sort(items):",
    "prose": "The history of the printing press begins",
    "chat": "Q: What should I pack for a weekend hiking trip?\nA:",
}
CODE_PROMPTS = {
    "code": PROMPTS["code"],
    "code_http": "import json\nfrom http.server import BaseHTTPRequestHandler\n\nclass Handler(BaseHTTPRequestHandler):",
    "code_tests": "import unittest\n\ndef is_palindrome(s: str) -> bool:",
}


def random_draft() -> str:
    """The real draft's architecture with random weights, cached next to the real models."""
    out = default_models_dir() / "random-draft-0.5b"
    if (out / "model.safetensors").exists():
        return str(out)
    real = fetch(None, ("draft",))["draft"]  # the GGUF file
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(real.parent, gguf_file=real.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(real.parent, gguf_file=real.name).save_pretrained(out)
    return str(out)


def compare(stub, prompt_name: str, prompt: str, tokens: int, plain_first: bool) -> dict:
    def plain():
        return timed(stub, "plain", prompt, tokens, speculation=False)

    def adaptive():
        return timed(stub, "adaptive", prompt, tokens)

    runs = [plain(), adaptive()] if plain_first else [adaptive(), plain()]
    if runs[0].token_ids != runs[1].token_ids:
        raise SystemExit(f"LOSSLESS VIOLATION on {prompt_name}: speculative output differs from plain decoding")
    return {"prompt": prompt_name, "runs": runs_json(runs)}


def ratio(runs: list[dict]) -> float:
    """Adaptive vs plain tokens per second over the given runs together."""
    rate = {}
    for label in ("plain", "adaptive"):
        mine = [r for r in runs if r["label"] == label]
        rate[label] = sum(r["tokens"] for r in mine) / sum(r["wall_s"] for r in mine)
    return round(rate["adaptive"] / rate["plain"], 3)


def session_mix(stub, prompts: dict[str, str], tokens: int, repeats: int) -> list[dict]:
    """Every prompt `repeats` times, the order of plain and adaptive alternating; per prompt,
    the runs of all repeats and their ratio. A plain request first warms the target up (a fresh
    process's first request runs ~30 % slow); it teaches the policy nothing (K is pinned to 0)."""
    timed(stub, "warm-up", next(iter(prompts.values())), 8, speculation=False)
    comparisons = [
        compare(stub, name, text, tokens, plain_first=repeat % 2 == 0)
        for repeat in range(repeats)
        for name, text in prompts.items()
    ]
    return [
        {"prompt": name, "ratio_vs_plain": ratio(runs), "runs": runs}
        for name in prompts
        for runs in [[r for c in comparisons if c["prompt"] == name for r in c["runs"]]]
    ]


def overall(comparisons: list[dict]) -> float:
    """Adaptive vs plain over all prompts together: tokens per second of the whole session mix."""
    return ratio([r for c in comparisons for r in c["runs"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    fetch()
    result = {"machine": machine(), "tokens": args.tokens, "repeats": args.repeats}
    with specd_up("--draft-model", random_draft()) as up:
        result["useless_draft"] = session_mix(up.stub, PROMPTS, args.tokens, args.repeats)
    result["useless_draft_overall_ratio"] = overall(result["useless_draft"])
    with specd_up() as up:  # the first code request starts with no learned prior
        result["real_pair_code"] = session_mix(up.stub, CODE_PROMPTS, args.tokens, args.repeats)
    result["real_pair_code_overall_ratio"] = overall(result["real_pair_code"])
    path = write("fallback", result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
