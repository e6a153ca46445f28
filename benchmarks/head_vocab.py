"""The draft's output layer over part of the vocabulary (`--head-vocab N`): its step, and how often
it still proposes the target's token.

    .venv/bin/python -m benchmarks.head_vocab [--sizes 0,32768,49152,65536] [--repeats 15]

For each size N (0: every id): the draft's one-row step, measured in turns with the other sizes
(median of `--repeats`), and its agreement with the target: the target's greedy continuation of
every prompt of prompts.json, prompts_heldout.json and prompts_repeat.json (128 tokens), fed to the
full draft in one pass, and at each position whether the argmax over the ids an N-row head scores
(`gguf_model.head_ids`) is the target's token. That agreement is a greedy draft token's chance of
acceptance; the ids outside the head cost at most the positions where the target's token is one of
them (where the full draft was wrong, the head's argmax may be right). Writes
benchmarks/results/head_vocab.json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.bench import load_prompts
from benchmarks.common import machine, write
from benchmarks.rows import holding_context, pass_s
from services.models import model_path
from specd.engine import EngineConfig, ModelEngine
from specd.gguf_model import GGUFModel, head_ids

HERE = Path(__file__).resolve().parent
PROMPT_FILES = ("prompts.json", "prompts_heldout.json", "prompts_repeat.json")
TOKENS = 128


def greedy(model: GGUFModel, prompt: list[int], tokens: int) -> list[int]:
    cache, out = model.new_cache(), []
    logits = model.forward([cache], [prompt], [1])[0]
    for _ in range(tokens):
        out.append(int(logits[-1].argmax()))
        logits = model.forward([cache], [[out[-1]]], [1])[0]
    return out


def agreement(draft: GGUFModel, target: GGUFModel, sizes: list[int]) -> dict[str, dict[str, float]]:
    """Per prompt file, per size: the share of the target's tokens the head's argmax proposes."""
    scored = {n: head_ids(draft.meta, draft.vocab_size, n) for n in sizes}
    result = {}
    for name in PROMPT_FILES:
        hits, total = {n: 0 for n in sizes}, 0
        for prompt in load_prompts(model_path("target"), 3, HERE / name):
            wanted = greedy(target, list(prompt.token_ids), TOKENS)
            logits = draft.forward([draft.new_cache()], [list(prompt.token_ids) + wanted[:-1]], [len(wanted)])[0]
            for n, ids in scored.items():
                proposed = logits.argmax(-1) if ids is None else ids[logits[:, ids].argmax(-1)]
                hits[n] += int((proposed == torch.tensor(wanted)).sum())
            total += len(wanted)
        result[name] = {str(n): round(hits[n] / total, 4) for n in sizes}
    return result


def step_times(sizes: list[int], repeats: int) -> dict[str, float]:
    """The draft's one-row step by head size, the sizes in turns."""
    engines = {n: holding_context(ModelEngine(EngineConfig(model_path("draft"), threads=2, quantize="auto",
                                                           head_vocab=n))) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n, engine in engines.items():
            times[n].append(pass_s(engine, 1))
    return {str(n): round(statistics.median(ts), 5) for n, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,32768,49152,65536")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    draft, target = GGUFModel(model_path("draft")), GGUFModel(model_path("target"))
    result = {
        "benchmark": "head_vocab", "draft": model_path("draft").name, "target": model_path("target").name,
        "vocab": draft.vocab_size, "tokens": TOKENS, "machine": machine(),
        "agreement": agreement(draft, target, sizes),
    }
    del draft, target
    result["step_s"] = step_times(sizes, args.repeats)
    print(result)
    print(f"wrote {write('head_vocab', result)}")


if __name__ == "__main__":
    main()
