"""specd services as real processes (`python -m services.<role>`) for failure tests."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import cli, up
from services.common.redis_server import free_port
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 120.0


class ServiceProcess:
    def __init__(self, role: str, args: list[str], log_dir: Path, port: int | None = None, host: str = "127.0.0.1"):
        self.role, self.args, self.host = role, args, host
        self.port = port or free_port()
        self.health_port = self.port  # a model service on mutual TLS: its plaintext --health-port
        self.log_path = log_dir / f"{role}-{host}-{self.port}.log"
        self.env: dict[str, str] = {}  # added to this process's environment (tracing settings)
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "ServiceProcess":
        """Launch without waiting (start several, then `wait_ready` each: they boot in parallel)."""
        cmd = [sys.executable, "-m", f"services.{self.role}", "--host", self.host, "--port", str(self.port), *self.args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self) -> "ServiceProcess":
        deadline = time.monotonic() + READY_TIMEOUT_S
        with grpc.insecure_channel(f"{self.host}:{self.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.role} exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    time.sleep(0.2)
        raise TimeoutError(f"{self.role} on {self.address} not ready:\n{self.log_path.read_text()[-3000:]}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill9()


def stub(proc: ServiceProcess) -> coordinator_pb2_grpc.CoordinatorStub:
    """A coordinator process's client."""
    return coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(proc.address))


def drafted_as_plain(coord: ServiceProcess) -> int:
    """Greedy speculation at K = 4 with the draft model gives plain decoding's tokens on two prompts
    (asserted); the drafts accepted, which say the draft took part."""
    accepted = 0
    for prompt in ("def add(a, b):", "Once upon a time"):
        def complete(**fields) -> coordinator_pb2.CompleteResponse:
            request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=40, ignore_eos=True, **fields)
            return stub(coord).Complete(request, timeout=120)

        plain = list(complete(speculation=False).token_ids)
        fixed = complete(num_draft_tokens=4, drafter="model")
        assert list(fixed.token_ids) == plain
        accepted += fixed.stats.accepted_tokens
    return accepted


def model_service(
    role: str, model_dir: Path, log_dir: Path, port: int | None = None, host: str = "127.0.0.1", *extra: str
) -> ServiceProcess:
    args = ["--model", str(model_dir), "--dtype", "float64", "--threads", "1", *extra]
    return ServiceProcess(role, args, log_dir, port, host)


def tls_model_service(role: str, model_dir: Path, log_dir: Path, tls_dir: Path) -> ServiceProcess:
    """A model service on mutual TLS, probed on its plaintext health port."""
    health_port = free_port()
    proc = model_service(role, model_dir, log_dir, None, "127.0.0.1", "--tls-dir", str(tls_dir),
                         "--health-port", str(health_port))
    proc.health_port = health_port
    return proc


def coordinator(
    target_dir: Path, drafts: list[str] | str, targets: list[str] | str, redis_url: str, log_dir: Path, *extra: str
) -> ServiceProcess:
    """`drafts`, `targets`: addresses, or a pool spec (`file:///...`, `dns:///...`)."""
    pools = [",".join(p) if isinstance(p, list) else p for p in (drafts, targets)]
    args = ["--model", str(target_dir), "--draft-addr", pools[0], "--target-addr", pools[1]]
    durable = [] if "--require-durable-store" in extra else ["--require-durable-store", "off"]  # tests' throwaway Redis
    return ServiceProcess("coordinator", [*args, "--redis-url", redis_url, "--http-port", "0", *durable, *extra], log_dir)


def specd(argv: list[str]) -> int:
    """`specd <argv>` in this process; its exit code."""
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    return exit.value.code


def up_commands(monkeypatch, *argv: str, models: tuple[str, str] = ("d", "t")) -> dict[str, list[str]]:
    """The service command lines `specd up` would start with these flags, on these (draft, target) models."""
    parsed = []
    monkeypatch.setattr(cli, "cmd_up", lambda args: parsed.append(args) or 0)
    with pytest.raises(SystemExit):
        cli.main(["up", *argv])
    args = parsed[0]
    paths = {"draft": Path(models[0]), "target": Path(models[1])}
    return up.commands(args, paths, None, up.tls_dir_of(args, Path(".")))


def value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def edge_coordinator(target_dir: Path, redis_url: str, log_dir: Path, *extra: str) -> ServiceProcess:
    """A coordinator for its client edges alone (keys, TLS): no draft, a target pool nobody answers,
    no calibration. Its gRPC health stays NOT_SERVING (start-up waits for the target), so wait on
    its REST /health (`wait_rest`); `http_port` is set."""
    http_port = free_port()
    proc = coordinator(target_dir, "none", [f"127.0.0.1:{free_port()}"], redis_url, log_dir,
                       "--calibrate", "off", "--http-port", str(http_port), *extra)
    proc.http_port = http_port
    return proc


def rest(proc: ServiceProcess, path: str, key: str | None = None, context: ssl.SSLContext | None = None,
         method: str = "GET") -> int:
    """A REST request's status to a coordinator process (https with `context`)."""
    scheme = "https" if context else "http"
    request = urllib.request.Request(f"{scheme}://{proc.host}:{proc.http_port}{path}", method=method,
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code
    except urllib.error.URLError as error:  # the connection's own error (refused, a failed TLS handshake)
        raise error.reason if isinstance(error.reason, OSError) else error


def wait_rest(proc: ServiceProcess, context: ssl.SSLContext | None = None) -> ServiceProcess:
    """Until the coordinator's REST /health answers 200 (it is started and its edge serves)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"coordinator exited {proc.proc.returncode}:\n{proc.log_path.read_text()[-3000:]}")
        try:
            if rest(proc, "/health", context=context) == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    log = proc.log_path.read_text()[-3000:]
    raise TimeoutError(f"coordinator REST on {proc.host}:{proc.http_port} not ready:\n{log}")
