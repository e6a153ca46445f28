"""The policy on real texts without a model pass: each prompt's recorded target confidence and draft
agreement, replayed through the loop on fakes that charge a host's costs, adaptive ÷ plain by class.

A run on the real services cannot resolve a few per cent on a noisy 2-core host (the same plain
step moves ±5 % between minutes); a replay is exact and takes seconds, so a policy change is
weighed here first and then in `specd bench`. What it leaves out: the real passes' noise, and the
time outside the model calls beyond a fixed `HostCosts.call` a call. The loop times the calls on a
virtual clock the fakes advance by what they charge, so the policy learns the costs the ratio counts.

    .venv/bin/python -m benchmarks.replay --record     # once: the fetched pair, 31 prompts (minutes)
    .venv/bin/python -m benchmarks.replay --draft-ms 18 --draft-ms 16
    .venv/bin/python -m benchmarks.replay --draft-ms 16 --target-ms 33 --row-ms 3.5 --fixed-k 3 --fixed-k 4
    .venv/bin/python -m benchmarks.replay --record --draft-quantize q4_0 --traces replay_traces_q4_0.json

Record: for each prompt of the four prompt files (ordinary and repeating, each with its held-out
set), the target's 128 greedy tokens, its confidence at each (its probability of its own token),
whether the draft's greedy token there was the same and the draft's probability of it (the draft
as stored, or `--draft-quantize q4_0`); written to results/replay_traces.json (`--traces`). Replay:
the draft agrees where the record says and stops on its recorded probability as the service does
(the confidence stop), the target reports the recorded confidence, from a fresh owner's calibrated prior
(α 0.7); every round counts, the draft's catch-up on the prompt included (the fakes charge the
target's prefill as a step, alike in both). `--fixed-k K`: the same traces at a pinned K as well,
what the adaptive policy is to match. Writes results/replay.json.

Ceiling: what an oracle that knows the output would make of the same costs, choosing each round
plain, a copy of what followed an earlier occurrence of the last token (the run it picks is the
longest), or K draft-model tokens (each right while the record agrees), by dynamic programming over
the committed length and the draft model's catch-up. No suffix drafter and no policy can beat it:
it bounds what a class can gain at these costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from benchmarks.common import RESULTS, machine, write
from specd.contracts import SamplingParams
from specd.loop import GenerationRequest, RoundRecord, Services, generate
from specd.model_free import SuffixDrafter
from specd.policy import hybrid
from specd.policy import Estimates, PolicyConfig, PolicyState
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
    draft_confidence = trace.get("draft_confidence")  # the draft's probability of its own token (None: always sure)
    services = Services(FakeDrafter(draft, compute_s=costs.draft_step, catch_up_s=costs.catch_up, rides_along=2,
                                    clock=clock, rpc_s=costs.call,
                                    confidence=(lambda prefix: at(prefix, draft_confidence)) if draft_confidence
                                    else lambda prefix: 1.0),
                        FakeVerifier(target, compute_s=costs.target_step, row_s=costs.row,
                                     confidence=lambda prefix: at(prefix, confidence), clock=clock, rpc_s=costs.call),
                        FakeStore(learned=calibrated_prior(costs)), clock=clock,
                        model_free=SuffixDrafter() if output and drafter != hybrid.MODEL else None)
    prompt = tuple(trace["prompt"]) if output else tuple(3 + i % 40 for i in range(start))
    request = GenerationRequest(prompt, StopRules(tokens), SamplingParams(), fixed_k=fixed_k, drafter=drafter)

    async def run():
        return [e async for e in generate(request, "replay", services, lambda ids: "", True, records.append)]

    asyncio.run(run())
    adaptive = sum(r.observation.draft_s + r.observation.verify_s + costs.call * _calls(r) for r in records)
    plain = tokens * (costs.target_step + costs.call)
    return plain / adaptive, sum(r.k for r in records if r.drafter == "model")


def ceiling(trace: dict, costs: HostCosts, tokens: int = TOKENS, max_k: int = PolicyConfig().max_k) -> float:
    """Plain time ÷ the oracle's least time to commit the trace's tokens (the module's docstring).
    The state is (committed, what the draft model holds): waking a draft model that lags costs its
    catch-up, as in the replay (the prompt's included; the round's own two tokens ride along)."""
    agree = trace["agree"][:tokens]
    copies = _copy_runs(trace.get("prompt", ()), trace.get("output", ())[:tokens]) or [0] * tokens
    agreeing = [0] * (len(agree) + 1)  # agreeing[i]: the draft model's right tokens in a row from position i
    for i in reversed(range(len(agree))):
        agreeing[i] = agreeing[i + 1] + 1 if agree[i] else 0
    plain_round = costs.target_step + costs.call
    least: list[dict[int, float]] = [{} for _ in range(tokens + 1)]  # least[n][d]: time to commit n, the draft at d
    least[0][-trace["prompt_tokens"]] = 0.0  # output positions; the draft starts with nothing, the prompt neither
    for n in range(tokens):
        left = tokens - n - 1  # a round drafts at most this: it commits one more than it accepts
        for d, seconds in least[n].items():
            for k in range(min(max_k, left, copies[n]) + 1):  # a copy of k tokens (k = 0: plain)
                _relax(least[n + k + 1], d, seconds + plain_round + costs.row * k)
            catch_up = costs.catch_up * max(0, n - d - 2)
            for k in range(1, min(max_k, left, agreeing[n] + 1) + 1):  # K model drafts, right up to the first wrong
                accepted = min(k, agreeing[n])
                cost = catch_up + k * (costs.draft_step + costs.row) + plain_round + costs.call
                _relax(least[n + accepted + 1], n + accepted, seconds + cost)
    return tokens * plain_round / min(least[tokens].values())


def _relax(least: dict[int, float], d: int, seconds: float) -> None:
    least[d] = min(least.get(d, math.inf), seconds)


def _copy_runs(prompt: Sequence[int], output: Sequence[int]) -> list[int]:
    """For each output position, the longest run from there that equals what followed an earlier
    occurrence of the token before it (the shortest match a suffix drafter acts on; a copy may
    overlap what it copies: a repeating pattern)."""
    tokens, start = list(prompt) + list(output), len(prompt)
    runs = []
    for at in range(start, len(tokens)):
        best = 0
        for j in range(1, at):
            if tokens[j - 1] != tokens[at - 1]:
                continue
            run = 0
            while at + run < len(tokens) and tokens[j + run] == tokens[at + run]:
                run += 1
            best = max(best, run)
        runs.append(best)
    return runs


def _calls(record: RoundRecord) -> int:
    return 1 + (record.draft_position is not None)


def calibrated_prior(costs: HostCosts) -> PolicyState:
    """What start-up calibration would measure on such a host (acceptance left at the prior)."""
    verify = tuple((k, costs.target_step + costs.row * k) for k in range(17))
    return PolicyState(estimates=Estimates(draft_step_s=costs.draft_step, catch_up_s=costs.catch_up, rtt_s=costs.call,
                                           verify_s=verify, calibrated_s=verify))


def recorded(path: Path = TRACES) -> list[dict]:
    """The traces a `--record` run wrote."""
    return json.loads(path.read_text())["traces"]


def by_class(traces: list[dict], costs: HostCosts, fixed_k: int | None = None, drafter: str = hybrid.AUTO) -> dict:
    """Mean and worst adaptive (or pinned K, or one drafter) ÷ plain per class, and each prompt's."""
    prompts = {t["name"]: replay(t, costs, fixed_k=fixed_k, drafter=drafter) for t in traces}
    return {
        "classes": _classes(traces, {name: s for name, (s, _) in prompts.items()}),
        "prompts": {name: {"speedup": round(s, 3), "model_drafts": d} for name, (s, d) in prompts.items()},
    }


def ceilings(traces: list[dict], costs: HostCosts) -> dict:
    """The oracle's mean and worst ÷ plain per class (`ceiling`)."""
    return _classes(traces, {t["name"]: ceiling(t, costs) for t in traces})


def _classes(traces: list[dict], speedups: dict[str, float]) -> dict:
    classes: dict[str, list[float]] = {}
    for t in traces:
        classes.setdefault(t["kind"], []).append(speedups[t["name"]])
    return {kind: {"mean": round(sum(v) / len(v), 3), "worst": round(min(v), 3)} for kind, v in classes.items()}


def record(tokens: int = TOKENS, draft_quantize: str = "auto") -> list[dict]:
    """The traces of every prompt from the fetched pair (greedy, one session each); the draft's
    agreement as it runs at `draft_quantize` (auto: as stored; q4_0: requantized)."""
    import torch

    from benchmarks.bench import load_prompts
    from services.common.settings import DRAFT_HEAD_VOCAB
    from services.models import model_path
    from specd import quants
    from specd.gguf_model import GGUFModel
    from specd.sampling import top1

    requantize = quants.Q4_0 if draft_quantize == "q4_0" else None
    draft = GGUFModel(model_path("draft"), head_vocab=DRAFT_HEAD_VOCAB, requantize=requantize)  # as the service scores
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
            drafted, draft_sure = top1(guesses)
            agree = [int(a == b) for a, b in zip(drafted, out)]
            traces.append({"name": prompt.name, "kind": prompt.kind, "prompt_tokens": len(prompt.token_ids),
                           "confidence": sure, "agree": agree, "draft_confidence": [round(p, 4) for p in draft_sure],
                           "prompt": list(prompt.token_ids), "output": out})
            print(f"{prompt.name:16s} {prompt.kind:6s} agreement {sum(agree) / len(agree):.3f}", flush=True)
    return traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="record the traces from the fetched pair first")
    parser.add_argument("--draft-quantize", choices=("auto", "q4_0"), default="auto",
                        help="with --record: the draft's numerics its agreement is recorded at")
    parser.add_argument("--traces", default=TRACES.name, help="the traces' file under benchmarks/results/")
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
    path = RESULTS / args.traces
    if args.record:
        traces = record(draft_quantize=args.draft_quantize)
        path.write_text(json.dumps({"machine": machine(), "tokens": TOKENS, "draft_quantize": args.draft_quantize,
                                    "traces": traces}) + "\n")
    traces = recorded(path)
    runs = []
    for draft_ms in args.draft_ms or [defaults.draft_step * 1e3]:
        costs = HostCosts(draft_step=draft_ms / 1e3, catch_up=args.catch_up_ms / 1e3, target_step=args.target_ms / 1e3,
                          row=args.row_ms / 1e3, call=args.call_ms / 1e3)
        result = by_class(traces, costs)
        fixed = {k: by_class(traces, costs, fixed_k=k)["classes"] for k in args.fixed_k}
        alone = {d: by_class(traces, costs, drafter=d)["classes"] for d in args.drafter}
        oracle = ceilings(traces, costs)
        runs.append({"costs": costs.__dict__, **result, "ceiling": oracle} | ({"fixed_k": fixed} if fixed else {})
                    | ({"drafter": alone} if alone else {}))
        for label, classes in (("adaptive", result["classes"]), *((f"K = {k}", c) for k, c in fixed.items()),
                               *((f"{d} alone", c) for d, c in alone.items()), ("ceiling", oracle)):
            print(f"draft step {draft_ms:.0f} ms, {label}:", " ".join(f"{kind} {v['mean']:.3f} (worst {v['worst']:.3f})"
                                                                  for kind, v in classes.items()))
    print("wrote", write(args.name, {"benchmark": "replay", "runs": runs}))


if __name__ == "__main__":
    main()
