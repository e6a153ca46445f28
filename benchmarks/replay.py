"""The policy on real texts without a model pass: each prompt's recorded target confidence and draft
agreement, replayed through the loop on fakes that charge a host's costs, adaptive ÷ plain by class.

A run on the real services cannot resolve a few per cent on a noisy 2-core host (the same plain
step moves ±5 % between minutes); a replay is exact and takes seconds, so a policy change is
weighed here first and then in `specd bench`. What it leaves out: the real passes' noise, and the
time outside the model calls beyond a fixed `HostCosts.call` a call. The loop times the calls on a
virtual clock the fakes advance by what they charge, so the policy learns the costs the ratio counts.

    .venv/bin/python -m benchmarks.replay --record     # once: the fetched pair, 16 prompts (minutes)
    .venv/bin/python -m benchmarks.replay --draft-ms 18 --draft-ms 16
    .venv/bin/python -m benchmarks.replay --draft-ms 16 --target-ms 33 --row-ms 3.5 --fixed-k 3 --fixed-k 4

Record: for each prompt of prompts.json and prompts_heldout.json, the target's 128 greedy tokens,
its confidence at each (its probability of its own token) and whether the draft's greedy token there
was the same; written to results/replay_traces.json. Replay: the draft agrees where the record
says, the target reports the recorded confidence, from a fresh owner's calibrated prior (α 0.7);
every round counts, the draft's catch-up on the prompt included (the fakes charge the target's
prefill as a step, alike in both). `--fixed-k K`: the same
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
from specd.model_free import SuffixDrafter
from specd.policy import hybrid
from specd.policy import Estimates, PolicyState
from specd.stopping import StopRules
from tests.fakes import VOCAB, FakeDrafter, FakeStore, FakeVerifier, VirtualClock, target_rule

TRACES = RESULTS / "replay_traces.json"
TOKENS = 128
PROMPT_FILES = ("prompts.json", "prompts_heldout.json", "prompts_repeat.json", "prompts_repeat_heldout.json")


@dataclass(frozen=True)
class HostCosts:
    """Seconds, as the AVX2 host's services reported them (benchmarks/README.md, `rows`)."""

    draft_step: float = 0.018
    catch_up: float = 0.005  # the draft's pass, per token it catches up on beyond the round's own two
    target_step: float = 0.046
    row: float = 0.009  # each further verification row
    call: float = 0.002  # a call's time outside the model (the RPC, the coordinator's work around it)


def replay(trace: dict, costs: HostCosts, tokens: int = TOKENS, fixed_k: int | None = None,
           drafter: str = hybrid.AUTO) -> tuple[float, int]:
    """(plain time ÷ adaptive time, or at a pinned K, drafts the draft model made) for one recorded prompt.
    A trace with its token ids replays them, and the model-free drafter drafts from them beside the
    draft model (`drafter`, as a request's); one without, made-up ids and the draft model alone."""
    start, agree, confidence = trace["prompt_tokens"], trace["agree"], trace["confidence"]
    output = trace.get("output")

    def at(prefix, values):
        return values[max(0, min(len(prefix) - start, len(values) - 1))]

    def target(prefix):
        return at(prefix, output) if output else target_rule(prefix)

    def draft(prefix):
        wanted = target(prefix)
        return wanted if at(prefix, agree) else wanted + 1 if output else (wanted + 1) % VOCAB

    records: list[RoundRecord] = []
    clock = VirtualClock()  # the policy times the calls as the charges below add up
    services = Services(FakeDrafter(draft, compute_s=costs.draft_step, catch_up_s=costs.catch_up, rides_along=2,
                                    clock=clock, rpc_s=costs.call),
                        FakeVerifier(target, compute_s=costs.target_step, row_s=costs.row,
                                     confidence=lambda prefix: at(prefix, confidence), clock=clock, rpc_s=costs.call),
                        FakeStore(learned=_calibrated(costs)), clock=clock,
                        model_free=SuffixDrafter() if output and drafter != hybrid.MODEL else None)
    prompt = tuple(trace["prompt"]) if output else tuple(3 + i % 40 for i in range(start))
    request = GenerationRequest(prompt, StopRules(tokens), SamplingParams(), fixed_k=fixed_k, drafter=drafter)

    async def run():
        return [e async for e in generate(request, "replay", services, lambda ids: "", True, records.append)]

    asyncio.run(run())
    adaptive = sum(r.observation.draft_s + r.observation.verify_s + costs.call * _calls(r) for r in records)
    plain = tokens * (costs.target_step + costs.call)
    return plain / adaptive, sum(r.k for r in records if r.drafter == "model")


def _calls(record: RoundRecord) -> int:
    return 1 + (record.draft_position is not None)


def _calibrated(costs: HostCosts) -> PolicyState:
    """What start-up calibration would measure on such a host (acceptance left at the prior)."""
    verify = tuple((k, costs.target_step + costs.row * k) for k in range(17))
    return PolicyState(estimates=Estimates(draft_step_s=costs.draft_step, catch_up_s=costs.catch_up, rtt_s=costs.call,
                                           verify_s=verify, calibrated_s=verify))


def by_class(traces: list[dict], costs: HostCosts, fixed_k: int | None = None, drafter: str = hybrid.AUTO) -> dict:
    """Mean and worst adaptive (or pinned K, or one drafter) ÷ plain per class, and each prompt's."""
    prompts = {t["name"]: replay(t, costs, fixed_k=fixed_k, drafter=drafter) for t in traces}
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
    from services.common.settings import DRAFT_HEAD_VOCAB
    from services.models import model_path
    from specd.gguf_model import GGUFModel

    draft = GGUFModel(model_path("draft"), head_vocab=DRAFT_HEAD_VOCAB)  # as the draft service scores
    target = GGUFModel(model_path("target"))
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
                           "confidence": sure, "agree": agree, "prompt": list(prompt.token_ids), "output": out})
            print(f"{prompt.name:16s} {prompt.kind:6s} agreement {sum(agree) / len(agree):.3f}", flush=True)
    return traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="record the traces from the fetched pair first")
    parser.add_argument("--draft-ms", type=float, action="append", help="draft step(s) to replay at (repeatable)")
    defaults = HostCosts()
    for flag, field, help_ in (("--target-ms", "target_step", "a one-row pass"),
                               ("--row-ms", "row", "each further verification row"),
                               ("--catch-up-ms", "catch_up", "the draft's catch-up, a token beyond the round's own"),
                               ("--call-ms", "call", "a call's time outside the model")):
        parser.add_argument(flag, type=float, default=getattr(defaults, field) * 1e3,
                            help=f"{help_} (default: the AVX2 host's)")
    parser.add_argument("--fixed-k", type=int, action="append", default=[], help="also replay at this pinned K (repeatable)")
    parser.add_argument("--drafter", action="append", default=[], choices=(hybrid.MODEL, hybrid.FREE),
                        help="also replay with only this drafter (repeatable)")
    parser.add_argument("--name", default="replay", help="result name under benchmarks/results/")
    args = parser.parse_args()
    if args.record:
        TRACES.write_text(json.dumps({"machine": machine(), "tokens": TOKENS, "traces": record()}) + "\n")
    traces = json.loads(TRACES.read_text())["traces"]
    runs = []
    for draft_ms in args.draft_ms or [defaults.draft_step * 1e3]:
        costs = HostCosts(draft_step=draft_ms / 1e3, catch_up=args.catch_up_ms / 1e3, target_step=args.target_ms / 1e3,
                          row=args.row_ms / 1e3, call=args.call_ms / 1e3)
        result = by_class(traces, costs)
        fixed = {k: by_class(traces, costs, fixed_k=k)["classes"] for k in args.fixed_k}
        alone = {d: by_class(traces, costs, drafter=d)["classes"] for d in args.drafter}
        runs.append({"costs": costs.__dict__, **result} | ({"fixed_k": fixed} if fixed else {})
                    | ({"drafter": alone} if alone else {}))
        for label, classes in (("adaptive", result["classes"]), *((f"K = {k}", c) for k, c in fixed.items()),
                               *((f"{d} alone", c) for d, c in alone.items())):
            print(f"draft step {draft_ms:.0f} ms, {label}:", " ".join(f"{kind} {v['mean']:.3f} (worst {v['worst']:.3f})"
                                                                  for kind, v in classes.items()))
    print("wrote", write(args.name, {"benchmark": "replay", "runs": runs}))


if __name__ == "__main__":
    main()
