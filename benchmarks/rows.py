"""A model's one-session pass by the rows it feeds: what a verification of K drafts (K + 1 rows)
costs, on the fetched GGUF file as specd serves it. The repeats go round the row counts (every
count once, then again), so a slow minute of this shared host hits them all alike.

    .venv/bin/python -m benchmarks.rows [--repeats 7] [--max-rows 16] [--role draft [--quantize q4_0]] [--model PATH]
                                        [--llama-server PATH] [--against REV] [--busy SHARE]

Writes benchmarks/results/rows.json (rows_draft.json; SPECD_MARCH=haswell adds _haswell: the AVX2
build on this host; `--name` another name, e.g. rows_avx2 for an AVX2-only host): per row count the
median pass time; with
`--llama-server`, also plain decoding's time per token, ours (`decode_per_token_s`: LLAMA_TOKENS
one-row passes in a row, the engine alone) and llama.cpp's own on the same file and threads (its
`predicted_per_token_ms`, generating LLAMA_TOKENS after the same held tokens): both after each
repeat's row counts, which first alternating, so that the two come from the same minutes (this
host's speed drifts by more than the difference between them).
`--against REV`: the kernels of git revision REV (its specd/csrc) as well, before and after in one
run: each build's engine in a process of its own, their passes taken in turn (each row count by
one, then the other, the order alternating by repeat), so a slow minute of the host hits both.
REV's kernels are loaded through this checkout's Python side: a revision whose C interface (the
structs of quants.h and decoder.c, the entry points) differs cannot be timed this way.
`--busy SHARE`: meanwhile another process keeps one core busy SHARE of every BUSY_PERIOD_S, as the
services' other threads (gRPC, the coordinator, Redis) do on a small host whose cores they share.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks import llama_server
from benchmarks.common import machine, write
from specd import native
from specd.engine import EngineConfig, ModelEngine
from services.models import model_path

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 160  # tokens the session holds: a prompt and some output
LLAMA_TOKENS = 32  # llama-server's tokens per request: its context stays near CONTEXT
LLAMA_SETTLE_S = 0.5  # after a request llama-server's threads poll for work a while: the pass after it waits this long
BUSY_PERIOD_S = 0.008  # --busy: the interfering process's cycle of work and sleep


def pass_s(engine: ModelEngine, rows: int) -> float:
    """One verification-shaped pass (rows - 1 drafts after the held tokens), then rolled back."""
    n = engine.position("s")
    start = time.perf_counter()
    engine.forward_many([("s", [1000 + i for i in range(rows - 1)])])
    elapsed = time.perf_counter() - start
    engine.truncate("s", n)
    return elapsed


@contextlib.contextmanager
def interference(share: float) -> Iterator[None]:
    """Another process busy on one core `share` of every BUSY_PERIOD_S while the block runs (none for 0)."""
    if share <= 0:
        yield
        return
    busy, idle = share * BUSY_PERIOD_S, (1 - share) * BUSY_PERIOD_S
    code = (f"import time\nwhile True:\n    t = time.perf_counter()\n"
            f"    while time.perf_counter() - t < {busy}: pass\n    time.sleep({idle})")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def held_tokens() -> list[int]:
    return [(7 * i) % 20000 + 100 for i in range(CONTEXT)]


def decode_s(engine: ModelEngine, tokens: int) -> float:
    """Plain decoding as llama-server times it: `tokens` one-row passes in a row after session "s"'s
    tokens, each feeding the last one's greedy token; seconds per token, then rolled back."""
    n, token = engine.position("s"), 1000
    start = time.perf_counter()
    for _ in range(tokens):
        token = int(engine.forward_many([("s", [token])])[0][-1].argmax())
    elapsed = time.perf_counter() - start
    engine.truncate("s", n)
    return elapsed / tokens


def holding_context(engine: ModelEngine) -> ModelEngine:
    """Session "s" holding CONTEXT cached tokens, one pass warmed up: what `pass_s` measures on."""
    engine.sync("s", 0, held_tokens())
    engine.forward("s")
    pass_s(engine, 1)  # warm-up
    return engine


def sweep(passes: dict[str, Callable[[int], float]], max_rows: int, repeats: int,
          after_repeat: Callable[[], object] = lambda: None) -> dict[str, dict[int, float]]:
    """Per named pass function, the median seconds by row count; within a repeat each row count runs
    on every function in turn, the order reversed on every other repeat; `after_repeat` runs after
    each repeat (another program's timing, taken in the same minutes)."""
    times = {name: {r: [] for r in range(1, max_rows + 1)} for name in passes}
    for repeat in range(repeats):
        for rows in range(1, max_rows + 1):
            for name in (list(passes) if repeat % 2 == 0 else reversed(list(passes))):
                times[name][rows].append(passes[name](rows))
        after_repeat()
    return {name: {r: round(statistics.median(ts), 4) for r, ts in by_rows.items()} for name, by_rows in times.items()}


def extra_row_s(pass_s: dict[int, float], rows: int = 5) -> float:
    """What each row after the first adds, up to a verification of `rows` - 1 drafts."""
    return round((pass_s[rows] - pass_s[1]) / (rows - 1), 5)


class PassServer:
    """An engine in a process of its own, built from the kernels in `csrc` (None: this checkout's),
    that times one pass of the rows it is sent."""

    def __init__(self, model: Path, threads: int, csrc: Path | None = None, quantize: str = "auto"):
        command = [sys.executable, "-m", "benchmarks.rows", "--serve-passes", "--model", str(model),
                   "--threads", str(threads), "--quantize", quantize, *(["--csrc", str(csrc)] if csrc else [])]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        ready = self.process.stdout.readline()
        if not ready:
            raise RuntimeError(f"the pass server {command} did not start")
        self.numerics: str = json.loads(ready)["numerics"]

    def pass_s(self, rows: int) -> float:
        return self._ask(str(rows))

    def decode_s(self) -> float:
        return self._ask("decode")

    def _ask(self, line: str) -> float:
        self.process.stdin.write(f"{line}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def serve_passes(engine: ModelEngine) -> None:
    """--serve-passes: its numerics when ready, then for each line read from stdin the seconds of one
    pass of that many rows ("decode": a token's of LLAMA_TOKENS decoded in a row)."""
    print(json.dumps({"numerics": engine.numerics.reason}), flush=True)
    for line in sys.stdin:
        print(decode_s(engine, LLAMA_TOKENS) if line.strip() == "decode" else pass_s(engine, int(line)), flush=True)


def side_by_side(ours: PassServer, llama: LlamaTokens, decoded: list[float]) -> None:
    """Our plain decoding and llama-server's, one after the other, which first alternating."""
    steps = [lambda: decoded.append(ours.decode_s()), llama.take]
    for step in steps if len(decoded) % 2 == 0 else reversed(steps):
        step()


def kernel_sources(rev: str, into: Path) -> Path:
    """specd/csrc as git revision `rev` has it, extracted under `into`."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "specd/csrc"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "specd" / "csrc"


class LlamaTokens:
    """llama-server's decoding time per token (its own timings: no HTTP, no sampling setup), one
    request at a time (`take`), on a server started on the same file and threads; the first warms it."""

    def __init__(self, server: llama_server.Server):
        self.url, self.times = server.url, []
        self.take()
        self.times.clear()

    def take(self) -> None:
        body = json.dumps({"prompt": held_tokens(), "n_predict": LLAMA_TOKENS, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        request = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as reply:
            self.times.append(json.load(reply)["timings"]["predicted_per_token_ms"] / 1e3)
        time.sleep(LLAMA_SETTLE_S)

    def median_s(self) -> float:
        return round(statistics.median(self.times), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-rows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--role", default="target", choices=("target", "draft"))
    parser.add_argument("--quantize", default="auto", choices=("auto", "q4_0"),
                        help="the weights it runs: as stored, or a draft's as q4_0 (specd up's default for a GGUF draft)")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the role's fetched file)")
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server: its time per token too")
    parser.add_argument("--against", metavar="REV", help="a git revision whose kernels are timed beside this one's")
    parser.add_argument("--name", help="the result's name (default rows, rows_draft, rows_<march>)")
    parser.add_argument("--busy", type=float, default=0.0, help="share of a core another process keeps busy meanwhile")
    parser.add_argument("--serve-passes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--csrc", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0.0 <= args.busy < 1.0:
        parser.error(f"--busy is a share of a core in [0, 1), not {args.busy}")
    path = args.model or model_path(args.role)
    if args.serve_passes:
        if args.csrc:
            native.CSRC = args.csrc  # this process only: the kernels of the revision it stands for
        serve_passes(holding_context(ModelEngine(EngineConfig(path, threads=args.threads, quantize=args.quantize))))
        return
    result = {"benchmark": "rows", "model": path.name, "role": args.role, "quantize": args.quantize,
              "march": native.default_march(),
              "threads": args.threads, "context": CONTEXT, "repeats": args.repeats, "busy": args.busy,
              "machine": machine()}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as peers:
        llama = (LlamaTokens(peers.enter_context(llama_server.serve(args.llama_server, path, args.threads)))
                 if args.llama_server else None)
        servers = {"pass_s": PassServer(path, args.threads, quantize=args.quantize)}
        if args.against:
            servers["against_pass_s"] = PassServer(path, args.threads, kernel_sources(args.against, Path(tmp)),
                                                   args.quantize)
        try:
            result["numerics"] = servers["pass_s"].numerics
            with interference(args.busy):
                decoded = []
                result |= sweep({name: server.pass_s for name, server in servers.items()}, args.max_rows,
                                args.repeats, (lambda: side_by_side(servers["pass_s"], llama, decoded)) if llama
                                else lambda: None)
        finally:
            for server in servers.values():
                server.close()
    if args.against:
        commit = subprocess.run(["git", "rev-parse", args.against], cwd=ROOT, check=True, capture_output=True,
                                text=True).stdout.strip()
        result["against"] = {"rev": args.against, "commit": commit}
        result["extra_row_s"] = {"this": extra_row_s(result["pass_s"]), "against": extra_row_s(result["against_pass_s"])}
    if llama:
        result["decode_per_token_s"] = round(statistics.median(decoded), 4)
        result["llama_server_per_token_s"] = llama.median_s()
    print(result)
    name = args.name or ("rows" + ("" if args.role == "target" else "_draft")
                         + ("" if result["march"] == native.NATIVE else f"_{result['march']}"))
    print(f"wrote {write(name, result)}")


if __name__ == "__main__":
    main()
