"""Abuse run: four well-behaved streaming clients, first alone and then beside four abusive ones,
against `specd up` on loopback (the tiny pair in float64 with an 8192-token context, API keys, per-key
quotas: each key 2 requests in flight). The abusers share one key and send, over and over:

- chat bodies of a mebibyte (one just under the body limit, one just over),
- 4096-token outputs with 8 stop strings that never match, read to the end,
- streams whose reader stops after the first event and holds the connection,
- bursts of 32 requests at once, over the key's quota.

The deployment yields long requests' rounds to short ones (`--background-after-tokens`,
specd/priority.py) and keeps each key to its request rate (`--key-requests-per-minute`, checked
before a body is read). The phases alternate (alone, beside, alone, beside, ...) so that a host
whose speed drifts weighs on both alike; each phase kind's figures pool its runs.

Reported: the well-behaved clients' TTFT p99 and tokens a second in both phases and their ratio
(goal: within 1.25x), every status each kind of request got (goal: no 5xx anywhere; every abusive
request a 4xx/429, or bounded: it ends on its own, within the request time limit).

    python -m benchmarks.abuse --seconds 30 --rounds 3     # benchmarks/results/abuse.json
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import TINY_UP_ENV, machine, specd_up_logged, write
from services.common.redis_server import free_port
from services.coordinator.quotas import QuotaLimits
from services.coordinator.requests import Limits
from tests.tiny import build_tiny_pair

GOOD = 4
CONTEXT = 8192
MAX_IN_FLIGHT = 2  # per key
BACKGROUND_AFTER = 256  # tokens: from here a request's rounds yield to shorter requests'
STALL_S = 10.0  # --stream-stall-s: a stalled reader's stream ends this long after its last write
GOOD_TOKENS = 48
LONG_TOKENS = 4096
STOPS = [f"<never {i}>" for i in range(8)]
BURST = 32
PROMPTS = ["Once upon a time", "def add(a, b):", "The weather today", "1, 2, 3, 4,", "Dear friend,"]


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.ttft: list[float] = []
        self.tokens = 0
        self.longest_s: dict[str, float] = collections.defaultdict(float)
        self.elapsed_s = 0.0  # the phases' length, summed

    def summary(self) -> dict:
        ttft = sorted(self.ttft)
        return {
            "requests": len(ttft),
            "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 4),
            "tokens_per_s": round(self.tokens / self.elapsed_s, 1),
            "statuses": {kind: dict(codes) for kind, codes in self.statuses.items()},
            "longest_s": {kind: round(s, 2) for kind, s in self.longest_s.items()},
            "request_timeout_s": Limits.request_timeout_s,
        }

    def status(self, kind: str, code: int | str, took_s: float = 0.0) -> None:
        with self.lock:
            self.statuses[kind][str(code)] += 1
            self.longest_s[kind] = max(self.longest_s[kind], took_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.abuse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of phases (alone, beside abusers)")
    parser.add_argument("--name", default="abuse")
    parser.add_argument("--abusers", default="big_chat,long_with_stops,stalled_reader,burst",
                        help="which abusers run beside the clients (all by default)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specd-abuse-") as tmp:
        result = run(args.seconds, args.rounds, Path(tmp), tuple(args.abusers.split(",")))
    print(f"wrote {write(args.name, result)}")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    return 0 if result["goals_met"] else 1


def run(seconds: float, rounds: int, tmp: Path, abusers: tuple[str, ...]) -> dict:
    draft_dir, target_dir = build_tiny_pair(tmp / "pair", max_positions=CONTEXT)
    keys = {f"good-{i}": secrets.token_urlsafe(24) for i in range(GOOD)} | {"mallory": secrets.token_urlsafe(24)}
    keys_file = tmp / "api-keys"
    keys_file.write_text("".join(f"{name}:{key}\n" for name, key in keys.items()))
    keys_file.chmod(0o600)
    http_port = free_port()
    up = _specd_up(draft_dir, target_dir, keys_file, http_port, tmp / "specd-up.log")
    try:
        base = f"http://127.0.0.1:{http_port}"
        model = target_dir.name
        alone, beside = Tally(), Tally()
        for _ in range(rounds):
            _phase(base, model, keys, seconds, (), alone)
            _phase(base, model, keys, seconds, abusers, beside)
        alone, beside = alone.summary(), beside.summary()
    finally:
        up.terminate()
        up.wait(timeout=60)
    ttft_ratio = beside["ttft_p99_s"] / alone["ttft_p99_s"]
    rate_ratio = alone["tokens_per_s"] / beside["tokens_per_s"]
    server_errors = sum(n for phase in (alone, beside) for kind in phase["statuses"].values()
                        for code, n in kind.items() if code.startswith("5"))
    abusive_ok = all(code[0] in "24" for kind, codes in beside["statuses"].items() if kind != "good" for code in codes)
    bounded = all(s <= beside["request_timeout_s"] for kind, s in beside["longest_s"].items() if kind != "good")
    return {
        "machine": machine(),
        "config": {"seconds_per_phase": seconds, "rounds": rounds, "good_clients": GOOD, "good_max_tokens": GOOD_TOKENS,
                   "deployment": "specd up, tiny pair float64, context 8192, API keys", "key_max_in_flight": MAX_IN_FLIGHT,
                   "key_requests_per_minute": QuotaLimits.requests_per_minute, "background_after_tokens": BACKGROUND_AFTER,
                   "stream_stall_s": STALL_S, "abusers": list(abusers),
                   "abusers_process": "their own, beside the measuring one (same host, 2 cores shared by all), at nice 19"},
        "alone": alone,
        "beside_abusers": beside,
        "ttft_p99_ratio": round(ttft_ratio, 3),
        "tokens_per_s_ratio": round(rate_ratio, 3),
        "server_errors": server_errors,
        "abusive_answered_4xx_or_bounded": abusive_ok and bounded,
        "goals_met": ttft_ratio <= 1.25 and rate_ratio <= 1.25 and server_errors == 0 and abusive_ok and bounded,
    }


def _specd_up(draft_dir: Path, target_dir: Path, keys_file: Path, http_port: int, log: Path) -> subprocess.Popen:
    ports = {role: free_port() for role in ("coordinator", "draft", "target")}
    argv = ["--draft-model", str(draft_dir), "--target-model", str(target_dir), "--draft-quantize", "none",
            "--target-quantize", "none", "--api-keys-file", str(keys_file), "--http-port", str(http_port),
            *[arg for role, port in ports.items() for arg in (f"--{role}-port", str(port))],
            "--draft-metrics-port", "0", "--target-metrics-port", "0", "--audit-rate", "0"]
    quotas = {"SPECD_KEY_MAX_IN_FLIGHT": str(MAX_IN_FLIGHT), "SPECD_STREAM_STALL_S": str(STALL_S),
              "SPECD_BACKGROUND_AFTER_TOKENS": str(BACKGROUND_AFTER)}
    return specd_up_logged(argv, log, TINY_UP_ENV | quotas)


def _phase(base: str, model: str, keys: dict[str, str], seconds: float, abusers: tuple[str, ...],
           tally: Tally) -> None:
    """The well-behaved clients' threads here; the abusers in a process of their own, so that their
    work in this process (building and sending mebibyte bodies) does not slow the clients measured."""
    stop = threading.Event()
    context = multiprocessing.get_context("fork")  # before any thread of this phase starts
    answers = context.Queue()
    abusing = context.Process(target=_abuse, args=(base, model, keys["mallory"], abusers, seconds, answers))
    abusing.start()
    threads = [threading.Thread(target=_good, args=(base, model, keys[f"good-{i}"], i, tally, stop))
               for i in range(GOOD)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    tally.elapsed_s += time.monotonic() - start
    for thread in threads:
        thread.join(timeout=120)
    statuses, longest = answers.get(timeout=180)
    abusing.join(timeout=60)
    for kind, codes in statuses.items():
        tally.statuses[kind].update(codes)
    for kind, s in longest.items():
        tally.longest_s[kind] = max(tally.longest_s[kind], s)


def _abuse(base: str, model: str, key: str, kinds: tuple[str, ...], seconds: float, answers) -> None:
    """The abusers of `kinds` for `seconds` (in their own process); their tally goes to `answers`.
    At the lowest CPU priority: an attacker's client runs on a machine of its own, and here it
    shares the server's two cores; niced, it takes what the server leaves, not the server's share."""
    os.nice(19)
    tally, stop = Tally(), threading.Event()
    threads = [threading.Thread(target=ABUSERS[kind], args=(base, model, key, tally, stop)) for kind in kinds]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    answers.put(({kind: dict(codes) for kind, codes in tally.statuses.items()}, dict(tally.longest_s)))


def _client(base: str, key: str, timeout: float = 120) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def _good(base: str, model: str, key: str, index: int, tally: Tally, stop: threading.Event) -> None:
    """Streamed completions one after another; TTFT and tokens of each."""
    with _client(base, key) as client:
        n = 0
        while not stop.is_set():
            body = {"model": model, "prompt": PROMPTS[(index + n) % len(PROMPTS)], "max_tokens": GOOD_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            n += 1
            start, first, tokens = time.monotonic(), None, 0
            with client.stream("POST", "/v1/completions", json=body) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if first is None and event.get("choices") and event["choices"][0].get("text"):
                        first = time.monotonic() - start
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                tally.status("good", reply.status_code)
            if reply.status_code == 200 and first is not None:
                with tally.lock:
                    tally.ttft.append(first)
                    tally.tokens += tokens


def _big_chat(base: str, model: str, key: str, tally: Tally, stop: threading.Event) -> None:
    with _client(base, key) as client:
        for size in _cycle([1024 * 1024 - 4096, 1024 * 1024 + 4096], stop):
            body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "a" * size}]}
            start = time.monotonic()
            reply = client.post("/v1/chat/completions", json=body)
            tally.status("big_chat", reply.status_code, time.monotonic() - start)


def _long_stops(base: str, model: str, key: str, tally: Tally, stop: threading.Event) -> None:
    with _client(base, key, timeout=1000) as client:
        while not stop.is_set():
            body = {"model": model, "prompt": "Tell it all", "max_tokens": LONG_TOKENS, "stop": STOPS,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            start = time.monotonic()
            with client.stream("POST", "/v1/completions", json=body) as reply:
                for _ in reply.iter_lines():
                    pass
            tally.status("long_with_stops", reply.status_code, time.monotonic() - start)
            if reply.status_code == 429:
                time.sleep(0.5)


def _stalled(base: str, model: str, key: str, tally: Tally, stop: threading.Event) -> None:
    with _client(base, key, timeout=1000) as client:
        while not stop.is_set():
            body = {"model": model, "prompt": "Go on", "max_tokens": LONG_TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            start = time.monotonic()
            with client.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code == 200:
                    next(reply.iter_lines())
                    stop.wait(3 * STALL_S)  # reads nothing more, holds the connection
            tally.status("stalled_reader", reply.status_code, time.monotonic() - start)
            if reply.status_code == 429:
                time.sleep(0.5)


def _burst(base: str, model: str, key: str, tally: Tally, stop: threading.Event) -> None:
    body = {"model": model, "prompt": "Hi", "max_tokens": 4, "temperature": 0}

    def one(client: httpx.Client) -> None:
        start = time.monotonic()
        reply = client.post("/v1/completions", json=body)
        tally.status("burst", reply.status_code, time.monotonic() - start)

    with _client(base, key) as client:
        while not stop.is_set():
            shots = [threading.Thread(target=one, args=(client,)) for _ in range(BURST)]
            for shot in shots:
                shot.start()
            for shot in shots:
                shot.join()
            stop.wait(2.0)


ABUSERS = {"big_chat": _big_chat, "long_with_stops": _long_stops, "stalled_reader": _stalled, "burst": _burst}


def _cycle(values: list, stop: threading.Event):
    while not stop.is_set():
        yield from values


if __name__ == "__main__":
    sys.exit(main())
