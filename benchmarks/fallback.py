"""Fallback benchmark: with a useless draft, speculation must switch itself off and cost
at most 10 % against plain decoding; with the real pair on code prompts it must stay on
(no fallback at all).

Requests run one after another on one deployment, as a server sees them: the first one
pays for discovering that the draft is useless; later ones start from what the deployment
learned (`specd.policy.inherit`) and only probe now and then.

    .venv/bin/python -m benchmarks.fallback [--tokens 64]

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
from specd.models import default_models_dir, fetch

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
    real = fetch(roles=("draft",))["draft"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(real), dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(real).save_pretrained(out)
    (out / "generation_config.json").write_text((real / "generation_config.json").read_text())
    return str(out)


def compare(stub, prompt_name: str, prompt: str, tokens: int) -> dict:
    plain = timed(stub, "plain", prompt, tokens, speculation=False)
    adaptive = timed(stub, "adaptive", prompt, tokens)
    if adaptive.token_ids != plain.token_ids:
        raise SystemExit(f"LOSSLESS VIOLATION on {prompt_name}: speculative output differs from plain decoding")
    return {
        "prompt": prompt_name,
        "ratio_vs_plain": round(adaptive.tokens_per_s / plain.tokens_per_s, 3),
        "runs": runs_json([plain, adaptive]),
    }


def overall(comparisons: list[dict]) -> float:
    """Adaptive vs plain over all prompts together: tokens per second of the whole session mix."""
    rate = {}
    for label in ("plain", "adaptive"):
        runs = [r for c in comparisons for r in c["runs"] if r["label"] == label]
        rate[label] = sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs)
    return round(rate["adaptive"] / rate["plain"], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    fetch()
    result = {"machine": machine(), "tokens": args.tokens}
    with specd_up("--draft-model-dir", random_draft()) as stub:
        result["useless_draft"] = [compare(stub, name, text, args.tokens) for name, text in PROMPTS.items()]
    result["useless_draft_overall_ratio"] = overall(result["useless_draft"])
    with specd_up() as stub:  # the first code request starts with no learned prior
        result["real_pair_code"] = [compare(stub, name, text, args.tokens) for name, text in CODE_PROMPTS.items()]
    result["real_pair_code_overall_ratio"] = overall(result["real_pair_code"])
    path = write("fallback", result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
