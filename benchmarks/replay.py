"""The policy on real texts without a model pass: each prompt's recorded target confidence and draft
agreement, replayed through the loop on fakes that charge a host's costs, adaptive ÷ plain by class.

A run on the real services cannot resolve a few per cent on a noisy 2-core host (the same plain
step moves ±5 % between minutes); a replay is exact and takes seconds, so a policy change is
weighed here first and then in `specd bench`. What it leaves out: the real passes' noise and the
time outside the model calls beyond a fixed `HostCosts.overhead` a round.

    .venv/bin/python -m benchmarks.replay --record     # once: the fetched pair, 16 prompts (minutes)
    .venv/bin/python -m benchmarks.replay --draft-ms 18 --draft-ms 16
    .venv/bin/python -m benchmarks.replay --draft-ms 16 --target-ms 33 --row-ms 3.5 --fixed-k 3 --fixed-k 4

Record: for each prompt of prompts.json and prompts_heldout.json, the target's 128 greedy tokens,
its confidence at each (its probability of its own token) and whether the draft's greedy token there
was the same; written to results/replay_traces.json. Replay: the draft agrees where the record
says, the target reports the recorded confidence, from a fresh owner's calibrated prior (α 0.7);
the ratio leaves the prompt's round (the prefill, alike in both) out. `--fixed-k K`: the same
traces at a pinned K as well, what the adaptive policy is to match. Writes results/replay.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import RESULTS, machine, write
from specd.contracts import SamplingParams
from specd.loop import GenerationRequest, RoundRecord, Services, generate
from specd.policy import Estimates, PolicyState
from specd.stopping import StopRules
from tests.fakes import VOCAB, FakeDrafter, FakeStore, FakeVerifier, target_rule

TRACES = RESULTS / "replay_traces.json"
TOKENS = 128
PROMPT_FILES = ("prompts.json", "prompts_heldout.json")


@dataclass(frozen=True)
class HostCosts:
    """Seconds, as the AVX2 host's services reported them (benchmarks/README.md, `rows`)."""

    draft_step: float = 0.018
    catch_up: float = 0.005  # the draft's pass, per token it catches up on
    target_step: float = 0.046
    row: float = 0.009  # each further verification row
    overhead: float = 0.004  # a round's time outside the model calls


def replay(trace: dict, costs: HostCosts, tokens: int = TOKENS, fixed_k: int | None = None) -> tuple[float, int]:
    """(plain time ÷ adaptive time, or at a pinned K, drafts the draft model made) for one recorded prompt."""
    start, agree, confidence = trace["prompt_tokens"], trace["agree"], trace["confidence"]

    def at(prefix, values):
        return values[max(0, min(len(prefix) - start, len(values) - 1))]

    def draft(prefix):
        wanted = target_rule(prefix)
        return wanted if at(prefix, agree) else (wanted + 1) % VOCAB

    records: list[RoundRecord] = []
    services = Services(FakeDrafter(draft, compute_s=costs.draft_step, catch_up_s=costs.catch_up),
                        FakeVerifier(target_rule, compute_s=costs.target_step, row_s=costs.row,
                                     confidence=lambda prefix: at(prefix, confidence)),
                        FakeStore(learned=_calibrated(costs)))
    request = GenerationRequest(tuple(3 + i % 40 for i in range(start)), StopRules(tokens), SamplingParams(),
                                fixed_k=fixed_k)

    async def run():
        return [e async for e in generate(request, "replay", services, lambda ids: "", True, records.append)]

    asyncio.run(run())
    adaptive = sum(r.observation.draft_s + r.observation.verify_s + costs.overhead for r in records[1:])
    plain = (tokens - 1) * (costs.target_step + costs.overhead)
    return plain / adaptive, sum(r.k for r in records if r.drafter == "model")


def _calibrated(costs: HostCosts) -> PolicyState:
    """What start-up calibration would measure on such a host (acceptance left at the prior)."""
    verify = tuple((k, costs.target_step + costs.row * k) for k in range(17))
    return PolicyState(estimates=Estimates(draft_step_s=costs.draft_step, rtt_s=costs.overhead / 2, verify_s=verify))


def by_class(traces: list[dict], costs: HostCosts, fixed_k: int | None = None) -> dict:
    """Mean and worst adaptive (or pinned K) ÷ plain per class, and each prompt's."""
    prompts = {t["name"]: replay(t, costs, fixed_k=fixed_k) for t in traces}
    classes: dict[str, list[float]] = {}
    for t in traces:
        classes.setdefault(t["kind"], []).append(prompts[t["name"]][0])
    return {
        "classes": {kind: {"mean": round(sum(v) / len(v), 3), "worst": round(min(v), 3)} for kind, v in classes.items()},
        "prompts": {name: {"speedup": round(s, 3), "model_drafts": d} for name, (s, d) in prompts.items()},
    }


def record(tokens: int = TOKENS) -> list[dict]:
    """The traces of every prompt from the fetched pair (greedy, one session each)."""
    import torch

    from benchmarks.bench import load_prompts
    from services.models import model_path
    from specd.gguf_model import GGUFModel

    draft, target = GGUFModel(model_path("draft")), GGUFModel(model_path("target"))
    traces = []
    for name in PROMPT_FILES:
        for prompt in load_prompts(model_path("target"), 3, Path(__file__).parent / name):
            cache, out, sure = target.new_cache(), [], []
            logits = target.forward([cache], [list(prompt.token_ids)], [1])[0]
            for _ in range(tokens):
                p = torch.softmax(logits[-1].float(), -1)
                out.append(int(p.argmax()))
                sure.append(round(float(p.max()), 4))
                logits = target.forward([cache], [[out[-1]]], [1])[0]
            guesses = draft.forward([draft.new_cache()], [list(prompt.token_ids) + out[:-1]], [len(out)])[0]
            agree = [int(a) for a in (guesses.argmax(-1) == torch.tensor(out)).tolist()]
            traces.append({"name": prompt.name, "kind": prompt.kind, "prompt_tokens": len(prompt.token_ids),
                           "confidence": sure, "agree": agree})
            print(f"{prompt.name:16s} {prompt.kind:6s} agreement {sum(agree) / len(agree):.3f}", flush=True)
    return traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="record the traces from the fetched pair first")
    parser.add_argument("--draft-ms", type=float, action="append", help="draft step(s) to replay at (repeatable)")
    defaults = HostCosts()
    for flag, field, help_ in (("--target-ms", "target_step", "a one-row pass"),
                               ("--row-ms", "row", "each further verification row"),
                               ("--catch-up-ms", "catch_up", "the draft's catch-up, a token"),
                               ("--overhead-ms", "overhead", "a round's time outside the calls")):
        parser.add_argument(flag, type=float, default=getattr(defaults, field) * 1e3,
                            help=f"{help_} (default: the AVX2 host's)")
    parser.add_argument("--fixed-k", type=int, action="append", default=[], help="also replay at this pinned K (repeatable)")
    parser.add_argument("--name", default="replay", help="result name under benchmarks/results/")
    args = parser.parse_args()
    if args.record:
        TRACES.write_text(json.dumps({"machine": machine(), "tokens": TOKENS, "traces": record()}) + "\n")
    traces = json.loads(TRACES.read_text())["traces"]
    runs = []
    for draft_ms in args.draft_ms or [defaults.draft_step * 1e3]:
        costs = HostCosts(draft_step=draft_ms / 1e3, catch_up=args.catch_up_ms / 1e3, target_step=args.target_ms / 1e3,
                          row=args.row_ms / 1e3, overhead=args.overhead_ms / 1e3)
        result = by_class(traces, costs)
        fixed = {k: by_class(traces, costs, fixed_k=k)["classes"] for k in args.fixed_k}
        runs.append({"costs": costs.__dict__, **result} | ({"fixed_k": fixed} if fixed else {}))
        for label, classes in (("adaptive", result["classes"]), *((f"K = {k}", c) for k, c in fixed.items())):
            print(f"draft step {draft_ms:.0f} ms, {label}:", " ".join(f"{kind} {v['mean']:.3f} (worst {v['worst']:.3f})"
                                                                  for kind, v in classes.items()))
    print("wrote", write(args.name, {"benchmark": "replay", "runs": runs}))


if __name__ == "__main__":
    main()
