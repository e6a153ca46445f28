"""specd_matmul (specd/csrc/quants.c) at the target's shapes: ms per call and, at M = 1, GB/s of weight.

    .venv/bin/python -m benchmarks.quant_kernels [--types Q4_K,Q6_K,Q8_0] [--rows 1,2,4,5,8,9,16]
                                                 [--threads 2] [--march native] [--no-logits]
                                                 [--layouts stored,packed] [--shapes q/o,down]

Shapes are Qwen2.5-1.5B's (hidden 1536, intermediate 8960, q 1536, kv 256, vocab 151936). A real
model's weights do not fit in the last-level cache, so each call goes to the next of enough copies
of the weight to exceed it ("cold", what a decoding pass sees); "hot" repeats one copy. Activations
are quantised once, outside the timing: this times the product alone. `--layouts` picks the weight
layouts timed: "stored" (the GGUF rows as stored) and "packed" (specd_repack's column panels, what
GGUFModel multiplies; types without panels in this build are skipped there), each a table row, the
two layouts' calls interleaved. Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from specd import native, quants

SHAPES = {  # name: (N, K)
    "q/o 1536x1536": (1536, 1536),
    "k/v 256x1536": (256, 1536),
    "gate/up 8960x1536": (8960, 1536),
    "down 1536x8960": (1536, 8960),
    "logits 151936x1536": (151936, 1536),
}
COLD_BYTES = 96 << 20  # more than this host's 32 MiB L3, twice over


def random_weight(kind: T, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with sane fp16 scales (the kernels' speed does not depend on the values)."""
    q = quants.quant_type(kind)
    raw = rng.integers(0, 256, (N, K // q.block, q.type_size), dtype=np.uint8)
    d = np.full(raw.shape[:2], 0.004, np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    raw[..., (q.type_size - 2 if kind == T.Q6_K else 0):][..., :2] = d
    if kind in (T.Q4_K, T.Q5_K):
        raw[..., 2:4] = d
    return raw.reshape(N, -1)


def time_rounds(lib, cases, x, y, threads, repeats, budget_s=3.0) -> list[float]:
    """Median seconds per call of each (linears, M) case, timed in rounds (one call of every case
    per round, so a slow moment of a shared host hits all cases alike); each call takes the next
    copy of its weight (a rotation shared by the cases of one weight list, so a copy comes back
    only after all the others: cold). Stops early past budget_s."""
    times = [[] for _ in cases]
    turn: dict[int, int] = {}
    start = time.perf_counter()
    for i in range(repeats):
        for (linears, M), out in zip(cases, times):
            k = turn.get(id(linears), 0)
            turn[id(linears)] = k + 1
            w = linears[k % len(linears)]
            t0 = time.perf_counter()
            lib.specd_matmul(ctypes.byref(w), x.data_ptr(), M, y.data_ptr(), threads)
            out.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s and i >= 5:
            break
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    parser.add_argument("--rows", default="1,2,4,5,8,9,16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--march", default=native.NATIVE)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-logits", action="store_true", help="skip the 151936-row output projection")
    parser.add_argument("--layouts", default="stored,packed")
    parser.add_argument("--shapes", default="", help="comma-separated prefixes of shape names (default: all)")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    lib = native.library(args.march)
    rng = np.random.default_rng(0)
    print(f"march={args.march} threads={args.threads}; ms per call (cold: weights from DRAM), "
          f"GB/s = weight bytes / time at M=1")
    header = (f"{'type':5} {'shape':20} {'layout':6} {'MB':>7} {'hot M=1':>8} {'GB/s':>6} "
              + " ".join(f"{'M=' + str(m):>7}" for m in rows))
    print(header)
    for name in args.types.split(","):
        kind = T[name]
        for shape, (N, K) in SHAPES.items():
            if args.no_logits and N > 100_000:
                continue
            if args.shapes and not any(shape.startswith(p) for p in args.shapes.split(",")):
                continue
            q = quants.quant_type(kind)
            size = N * q.row_bytes(K)
            base = random_weight(kind, N, K, rng)
            copies = [base] + [base.copy() for _ in range(max(1, -(-COLD_BYTES // size)))]  # copy 0 hot, the rest cold
            xs = quants.quantize_rows(torch.randn(max(rows), K), q.act, args.march)
            y = torch.empty(max(rows), N)
            cases, labels, buffers = [], [], []
            for layout in layouts:
                linears = [native.Linear(c.ctypes.data, int(kind), N, K, None) for c in copies]
                if layout == "packed":
                    buffers += [quants.repack(w, args.march, args.threads) for w in linears]
                    if buffers[-1] is None:
                        continue
                nbytes = buffers[-1].nbytes if layout == "packed" else size
                cold = linears[1:] or linears  # the hot case keeps copy 0 for itself
                cases += [(linears[:1], 1)] + [(cold, M) for M in rows]
                labels.append((layout, nbytes))
            times = time_rounds(lib, cases, xs, y, args.threads, args.repeats)
            for i, (layout, nbytes) in enumerate(labels):
                hot, *timed = times[i * (1 + len(rows)):(i + 1) * (1 + len(rows))]
                cold = dict(zip(rows, timed))
                gbs = nbytes / cold[rows[0]] / 1e9 if rows[0] == 1 else float("nan")
                print(f"{name:5} {shape:20} {layout:6} {nbytes / 1e6:7.2f} {hot * 1e3:8.3f} {gbs:6.1f} "
                      + " ".join(f"{cold[M] * 1e3:7.3f}" for M in rows), flush=True)
            del copies, cases, buffers


if __name__ == "__main__":
    main()
