"""How long OpenMP threads wait actively after a pass, and what that costs the other processes.

Each model service runs its passes on libgomp's threads (torch loads it; specd's kernels share
it). After a pass they spin GOMP_SPINCOUNT times before they sleep; libgomp's default is 300 000.
specd's services run on one host and hand the cores to each other every round, so a thread
still spinning holds a core from whoever runs next. Two rounds, in two processes that take turns
as the services do, on the fetched GGUF files at a 160-token context:

- `speculative`: the draft process's 4 one-row steps, then the target process's 5-row pass (K = 4);
- `plain`: the target's one-row pass, then Python work that takes ~3 ms alone in another process
  (the coordinator's round, the store's save), timed as it runs then.

Each setting runs in fresh processes (libgomp reads the variable when it loads), alternating.

    .venv/bin/python -m benchmarks.spin [--repeats 3] [--rounds 40]

Writes benchmarks/results/spin.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import specd
from benchmarks.common import machine, write

LIBGOMP_DEFAULT = 300_000  # libgomp's GOMP_SPINCOUNT when neither it nor OMP_WAIT_POLICY is set
SETTINGS = {"libgomp default": LIBGOMP_DEFAULT, "specd": specd.OMP_SPINCOUNT}
CONTEXT = 160
DRAFT_STEPS = 4
BURST_S = 0.003  # the plain round's work outside the target, alone


def _serve(role: str, turns: mp.Queue, done: mp.Queue, ready: mp.Queue) -> None:
    """A process that takes a turn when told: model passes (draft / target) or a Python burst (cpu)."""
    import torch

    from services.models import model_path
    from specd.gguf_model import GGUFModel

    model = None
    if role == "cpu":
        burst = _calibrated_burst()
    else:
        model = GGUFModel(model_path(role))
        cache = model.new_cache()
        model.forward([cache], [list(range(1000, 1000 + CONTEXT))], [1])
    ready.put(torch.get_num_threads())
    while (rows := turns.get()) is not None:
        start = time.perf_counter()
        if model is None:
            _work(burst)
        else:
            for _ in range(DRAFT_STEPS if role == "draft" else 1):
                model.forward([cache], [[5] * rows], [rows])
                cache.crop(CONTEXT)
        done.put(time.perf_counter() - start)


def _work(n: int) -> int:
    return sum(i * i for i in range(n))


def _calibrated_burst() -> int:
    """Iterations of `_work` that take BURST_S in this process alone."""
    n, best = 200_000, float("inf")
    for _ in range(3):
        start = time.perf_counter()
        _work(n)
        best = min(best, time.perf_counter() - start)
    return int(n * BURST_S / best)


def measure(spincount: int, rounds: int) -> dict[str, float]:
    """Median seconds of each round's parts, in fresh processes started with `spincount`."""
    os.environ["GOMP_SPINCOUNT"] = str(spincount)
    context = mp.get_context("spawn")
    queues = {role: (context.Queue(), context.Queue()) for role in ("draft", "target", "cpu")}
    ready = context.Queue()
    procs = [context.Process(target=_serve, args=(role, *queues[role], ready)) for role in queues]
    for proc in procs:
        proc.start()
    threads = [ready.get() for _ in procs][0]

    def turn(role: str, rows: int) -> float:
        queues[role][0].put(rows)
        return queues[role][1].get()

    parts: dict[str, list[float]] = {"draft_steps": [], "target_verify": [], "target_step": [], "other_work": []}
    try:
        for _ in range(rounds):
            parts["draft_steps"].append(turn("draft", 1))
            parts["target_verify"].append(turn("target", DRAFT_STEPS + 1))
            parts["target_step"].append(turn("target", 1))
            parts["other_work"].append(turn("cpu", 0))
    finally:
        for role in queues:
            queues[role][0].put(None)
        for proc in procs:
            proc.join()
    medians = {name: statistics.median(times[2:]) for name, times in parts.items()}  # the first are warm-up
    return medians | {"speculative_round": medians["draft_steps"] + medians["target_verify"],
                      "plain_round": medians["target_step"] + medians["other_work"], "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per setting")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for repeat in range(args.repeats):
        for name in SETTINGS if repeat % 2 == 0 else reversed(SETTINGS):
            runs[name].append(measure(SETTINGS[name], args.rounds))
            print(name, {k: round(v * 1000, 2) for k, v in runs[name][-1].items() if k != "threads"}, flush=True)
    parts = [k for k in runs["specd"][0] if k != "threads"]
    medians = {name: {part: statistics.median(r[part] for r in rs) for part in parts} for name, rs in runs.items()}
    result = {
        "machine": machine(),
        "settings": {"repeats": args.repeats, "rounds": args.rounds, "context": CONTEXT, "spincount": SETTINGS,
                     "threads": runs["specd"][0]["threads"]},
        "median_s": medians,
        "specd_over_default": {part: medians["specd"][part] / medians["libgomp default"][part] for part in parts},
        "runs": runs,
    }
    print({part: round(ratio, 3) for part, ratio in result["specd_over_default"].items()})
    write("spin", result)


if __name__ == "__main__":
    main()
