"""One OpenMP pool per process: model steps with the engine's thread the only torch thread,
vs the same engine after a second thread has run torch.

torch's OpenMP backend keeps a thread pool per calling thread. The services used to load the
model on the main thread and run it on their worker thread, so each held two pools (four
OpenMP threads on two cores), and every forward paid for it. They now build the engine on the
worker (`ModelServicer.load`) and the engine refuses any other thread (`WrongThread`).

Timed on the real pair, each layout in a fresh process, alternating, median of each process:
- `one_pool`: engine built and run on a worker thread, nothing else runs torch (the services now);
- `two_pools`: the same, after the main thread has run one parallel torch op (what loading the
  model there did before);
- `main_thread`: built and run on the main thread (HF assisted in `specd bench` runs this way).
Steps: the draft's one-token step, the target's one-token step and its K = 4 verification
(5 rows), at a 120-token context, on the fetched GGUF files as specd serves them.

    .venv/bin/python -m benchmarks.threads [--repeats 3]

Writes benchmarks/results/threads.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.common import machine, write
from specd.engine import EngineConfig, ModelEngine
from services.models import model_path

LAYOUTS = ("one_pool", "two_pools", "main_thread")
CONTEXT = 120
STEPS = {  # name: (role, rows fed, repeats)
    "draft_step": ("draft", 1, 20),
    "target_step": ("target", 1, 8),
    "target_verify_k4": ("target", 5, 8),
}


def time_steps(engine: ModelEngine, rows: int, repeats: int) -> float:
    """Median seconds of a forward feeding `rows` tokens after the context (rolled back each time)."""
    engine.sync("s", 0, list(range(1000, 1000 + CONTEXT)))
    engine.forward("s")
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        engine.forward("s", list(range(2000 + i, 2000 + i + rows - 1)))  # + the re-fed last token
        times.append(time.perf_counter() - start)
        engine.truncate("s", CONTEXT)
    return statistics.median(times[1:])  # the first is warm-up


def measure(layout: str) -> dict[str, float]:
    """In this process: every step, with the engines laid out as `layout` says."""
    worker = ThreadPoolExecutor(max_workers=1)
    on_engine_thread = (lambda fn, *args: fn(*args)) if layout == "main_thread" else (
        lambda fn, *args: worker.submit(fn, *args).result())
    if layout == "two_pools":
        torch.ones(1 << 22).mul_(2)  # a parallel op on the main thread: it now holds a pool too
    results, engines = {}, {}
    for name, (role, rows, repeats) in STEPS.items():
        if role not in engines:
            engines[role] = on_engine_thread(ModelEngine, EngineConfig(model_path(role), quantize="auto"))
        results[name] = on_engine_thread(time_steps, engines[role], rows, repeats)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="processes per layout")
    parser.add_argument("--layout", choices=LAYOUTS, help=argparse.SUPPRESS)  # one process's share
    args = parser.parse_args()
    if args.layout:
        print(json.dumps(measure(args.layout)))
        return
    runs: dict[str, list[dict[str, float]]] = {layout: [] for layout in LAYOUTS}
    for repeat in range(args.repeats):
        for layout in LAYOUTS if repeat % 2 == 0 else reversed(LAYOUTS):
            out = subprocess.run([sys.executable, "-m", "benchmarks.threads", "--layout", layout],
                                 check=True, capture_output=True, text=True).stdout
            runs[layout].append(json.loads(out.strip().splitlines()[-1]))
            print(layout, runs[layout][-1], flush=True)
    medians = {layout: {step: statistics.median(r[step] for r in rs) for step in STEPS} for layout, rs in runs.items()}
    result = {
        "machine": machine(),
        "settings": {"repeats": args.repeats, "context": CONTEXT, "threads": torch.get_num_threads()},
        "median_s": medians,
        "two_pools_over_one_pool": {step: medians["two_pools"][step] / medians["one_pool"][step] for step in STEPS},
        "runs": runs,
    }
    print(json.dumps({k: result[k] for k in ("median_s", "two_pools_over_one_pool")}, indent=1))
    write("threads", result)


if __name__ == "__main__":
    main()
