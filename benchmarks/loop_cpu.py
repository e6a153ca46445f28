"""The coordinator's own CPU a token: N sessions at once through the loop on fakes that cost nothing
(a virtual clock), plain decoding against adaptive speculation, on the replay's recorded texts.

    .venv/bin/python -m benchmarks.loop_cpu [--sessions 16] [--repeats 3]

On a 2-core host the coordinator shares the cores with the target's passes, so what its loop and
policy spend a token comes off every session's rate under load (`specd bench --load` records the real
services' CPU a token beside it). The fakes report the AVX2 host's costs (`replay.HostCosts`) and a
batch of N in every pass, so the policy prices rounds as under that load; their drafts are never
right, as a draft model's are not in a batch it cannot pay in. Writes results/loop_cpu.json: process
CPU milliseconds a token, the least of the repeats (noise only adds time), by configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from benchmarks.common import machine, write
from benchmarks.replay import HostCosts, calibrated_prior, recorded
from specd.contracts import SamplingParams
from specd.loop import Chunk, GenerationRequest, Services, generate
from specd.model_free import SuffixDrafter
from specd.stopping import StopRules
from tests.fakes import FakeDecoder, FakeDrafter, FakeStore, FakeVerifier, VirtualClock

TOKENS = 128
CONFIGS = {"plain": 0, "adaptive": None}  # a request's fixed_k


def with_output() -> list[dict]:
    """The recorded traces that hold their output's token ids (the loop needs the text, not only its agreement)."""
    return [t for t in recorded() if t.get("output")]


def cpu_per_token(traces: list[dict], sessions: int, fixed_k: int | None, costs: HostCosts = HostCosts()
                  ) -> tuple[float, int]:
    """(process CPU seconds a token, tokens) of `sessions` requests at once, each a recorded text's output."""
    clock = VirtualClock()
    texts = {i: traces[i % len(traces)] for i in range(sessions)}
    starts = {i: len(texts[i]["prompt"]) + 1 for i in texts}

    def target(prefix):  # a session's prompt leads with its own id, so the rule knows its text
        i = prefix[0]
        output = texts[i]["output"]
        return output[max(0, min(len(prefix) - starts[i], len(output) - 1))]

    verifier = FakeVerifier(target, compute_s=costs.target_step, row_s=costs.row, clock=clock, rpc_s=costs.call,
                            batch_size=sessions, confidence=lambda prefix: 0.5)
    services = Services(FakeDrafter(lambda prefix: target(prefix) + 1, compute_s=costs.draft_step, clock=clock,
                                    rpc_s=costs.call),
                        verifier, FakeStore(learned=calibrated_prior(costs)), clock=clock, model_free=SuffixDrafter(),
                        decoder=FakeDecoder(verifier))

    async def one(i: int) -> int:
        request = GenerationRequest((i, *texts[i]["prompt"]), StopRules(TOKENS), SamplingParams(), fixed_k=fixed_k)
        return sum([len(e.token_ids) async for e in generate(request, f"s{i}", services, lambda ids: "")
                    if isinstance(e, Chunk)])

    async def everyone() -> int:
        return sum(await asyncio.gather(*(one(i) for i in texts)))

    start = time.process_time()
    tokens = asyncio.run(everyone())
    return (time.process_time() - start) / tokens, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="loop_cpu")
    args = parser.parse_args()
    traces = with_output()
    best = {c: min(cpu_per_token(traces, args.sessions, k)[0] for _ in range(args.repeats)) for c, k in CONFIGS.items()}
    result = {"machine": machine(), "sessions": args.sessions, "repeats": args.repeats, "tokens": TOKENS,
              "cpu_ms_per_token": {c: round(1000 * s, 3) for c, s in best.items()}}
    print(json.dumps(result["cpu_ms_per_token"]))
    write(args.name, result)


if __name__ == "__main__":
    main()
