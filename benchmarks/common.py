"""Shared by the benchmarks: run `specd up` as a subprocess and time requests through it."""

from __future__ import annotations

import collections
import itertools
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch

from services.common.redis_server import free_port
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"


TENANTS = 4096  # API keys a benchmark's deployment knows: one per request, so none sees another's


class FreshTenants:
    """A coordinator stub whose every request comes from an API key of its own. The model-free
    drafter keeps each key's recent outputs; a benchmark asks the same prompts again and again, and
    must time decoding text, not recalling the answer it gave a moment ago."""

    def __init__(self, stub: coordinator_pb2_grpc.CoordinatorStub, keys: list[str]):
        self._stub, self._keys = stub, itertools.cycle(keys)

    def __getattr__(self, method: str):
        call = getattr(self._stub, method)
        return lambda request, **kwargs: call(request, metadata=[("authorization", f"Bearer {next(self._keys)}")],
                                              **kwargs)


def tenant_keys(directory: Path, n: int = TENANTS) -> tuple[Path, list[str]]:
    """An API keys file of n keys (`specd up --api-keys-file`), and the keys."""
    keys = [secrets.token_urlsafe(24) for _ in range(n)]
    path = directory / "api-keys"
    path.write_text("".join(f"bench-{i}:{key}\n" for i, key in enumerate(keys)))
    path.chmod(0o600)
    return path, keys


@dataclass(frozen=True)
class Up:
    stub: coordinator_pb2_grpc.CoordinatorStub | FreshTenants
    pid: int  # the `specd up` process; the services are its children

    def rss(self) -> dict[str, int]:
        """Resident bytes of each service process (draft, target, coordinator) right now."""
        return {role: sum(rss_bytes(pid) for pid in pids) for role, pids in self._roles().items()}

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user and system) each service role's processes have used so far."""
        return {role: sum(cpu_seconds(pid) for pid in pids) for role, pids in self._roles().items()}

    def _roles(self) -> dict[str, list[int]]:
        children = descendants(self.pid)
        return {role: [pid for pid, command in children.items() if f"services.{role}" in command]
                for role in ("draft", "target", "coordinator")}


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process under `root` (Linux /proc)."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found[child] = commands.get(child, "")
                frontier.append(child)
    return found


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process (Linux /proc), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc), 0 when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((x for x in status.splitlines() if x.startswith("VmRSS:")), "VmRSS: 0 kB")
    return int(line.split()[1]) * 1024


@contextmanager
def specd_up(*flags: str, timeout_s: float = 600):
    """Start draft + target + coordinator (+ Redis) on free ports; yield `Up` (a coordinator stub
    and the services' memory)."""
    ports = {role: free_port() for role in ("coordinator", "draft", "target", "http", "draft-metrics", "target-metrics")}
    port_flags = [arg for role, port in ports.items() for arg in (f"--{role}-port", str(port))]
    secrets_dir = tempfile.TemporaryDirectory()
    keys_file, keys = tenant_keys(Path(secrets_dir.name))
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", *port_flags, "--api-keys-file", str(keys_file), *flags],
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
        # Read (and drop) its output from here on, which the services log to: a full pipe would block them.
        threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True).start()
        with grpc.insecure_channel(f"127.0.0.1:{ports['coordinator']}") as channel:
            yield Up(FreshTenants(coordinator_pb2_grpc.CoordinatorStub(channel), keys), proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        secrets_dir.cleanup()


TINY_UP_ENV = {"SPECD_DTYPE": "float64", "SPECD_THREADS": "1", "OMP_NUM_THREADS": "1"}  # the tiny pair's `specd up`


def specd_up_logged(argv: list[str], log: Path, env: dict[str, str], timeout_s: float = 300) -> subprocess.Popen:
    """`specd up <argv>` with its output in `log` and `env` added to ours, once it says it is up."""
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *argv], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + timeout_s
    while "specd is up" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"specd up did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc

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
        s.fallbacks, s.mode, list(reply.token_ids),
    )


def machine() -> dict:
    """Where a result was measured: figures from different CPUs are not comparable."""
    return {"platform": platform.platform(), "cpu": cpu_name(), "vector_extensions": vector_extensions(),
            "torch": torch.__version__, "cpu_threads": torch.get_num_threads()}


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is empty on Linux)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def vector_extensions() -> list[str]:
    """The SIMD extensions specd's kernels may use here (AVX2; AVX-512 with VNNI, BF16)."""
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]


def write(name: str, result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def runs_json(runs: list[Run]) -> list[dict]:
    return [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in runs]
