"""Shared by the benchmarks: run `specd up` as a subprocess and time requests through it."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch

from services.common.redis_server import free_port
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"


@contextmanager
def specd_up(*flags: str, timeout_s: float = 600):
    """Start draft + target + coordinator (+ Redis) on free ports; yield a coordinator stub."""
    ports = {role: free_port() for role in ("coordinator", "draft", "target", "http", "draft-metrics", "target-metrics")}
    port_flags = [arg for role, port in ports.items() for arg in (f"--{role}-port", str(port))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", *port_flags, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            if "specd is up" in line:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("specd up did not come up")
        else:
            raise RuntimeError(f"specd up exited with {proc.wait()}")
        with grpc.insecure_channel(f"127.0.0.1:{ports['coordinator']}") as channel:
            yield coordinator_pb2_grpc.CoordinatorStub(channel)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@dataclass(frozen=True)
class Run:
    label: str
    prompt: str
    tokens: int
    wall_s: float
    tokens_per_s: float
    rounds: int
    drafted: int
    accepted: int
    drafting_rounds: int
    fallbacks: int
    mode: str
    reused: int  # drafts made ahead during the previous round (pipelining)
    token_ids: list[int]


def timed(stub, label: str, prompt: str, max_tokens: int, **fields) -> Run:
    request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=max_tokens, **fields)
    start = time.perf_counter()
    reply = stub.Complete(request, timeout=3600)
    wall = time.perf_counter() - start
    s = reply.stats
    return Run(
        label, prompt, len(reply.token_ids), round(wall, 3), round(len(reply.token_ids) / wall, 3), s.rounds,
        s.drafted_tokens, s.accepted_tokens, s.drafted_per_position[0] if s.drafted_per_position else 0,
        s.fallbacks, s.mode, s.reused_drafts, list(reply.token_ids),
    )


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads()}


def write(name: str, result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def runs_json(runs: list[Run]) -> list[dict]:
    return [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in runs]
