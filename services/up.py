"""`specd up`: the draft, target and coordinator (and a local Redis) as supervised children on
this machine, each replica on its own ports, ready when every one answers its health check."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import settings
from services.common.phoenix import PROJECT, LocalPhoenix
from services.common.redis_server import LocalRedis
from services.common.supervisor import Supervisor, describe

if TYPE_CHECKING:  # imported where used: `specd health` (every healthcheck) need not load cryptography
    from services.common.tls import EdgeTls, EdgeTrust

PORTS = {"coordinator": 50051, "draft": 50052, "target": 50053}
METRICS_PORTS = {"draft": 9101, "target": 9102}  # Prometheus /metrics of the model services
REPLICA_STRIDE = 100  # replica i of a model service listens on its ports + 100·i
READY_TIMEOUT_S = 600.0


def run(args: argparse.Namespace, paths: dict[str, Path]) -> int:
    """`specd up`: the services on this machine (and a Redis unless given one) until SIGTERM / Ctrl-C."""
    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url or stack.enter_context(local_redis()).url
        if args.tracing:
            _start_tracing(stack)
        run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specd-")))
        # Both model services open this file and take turns at the cores by locking it (services/common/worker.py).
        cores_lock = run_dir / "cores.lock" if args.core_turns == "on" else None
        tls_dir = tls_dir_of(args, run_dir)
        if tls_dir == run_dir / "tls":
            from services.common import certs

            certs.make(tls_dir, days=7)
        return _run_services(args, paths, redis_url, cores_lock, tls_dir)


def tls_dir_of(args: argparse.Namespace, run_dir: Path) -> Path | None:
    """The model services' certificates under `specd up`: none with --service-tls off, the set
    --tls-dir names, else one made for this run in its directory."""
    if args.service_tls == "off":
        return None
    return args.tls_dir or run_dir / "tls"


def edge_tls_of(args: argparse.Namespace) -> EdgeTls | None:
    """The coordinator's edge certificate under `specd up` (--edge-tls-cert and --edge-tls-key, checked
    once, before any child starts: `args.edge_tls`), or None: plaintext, on loopback unless --insecure."""
    from services.common.tls import EdgeTls

    return EdgeTls.from_flags(args.edge_tls_cert, args.edge_tls_key)


def local_redis() -> LocalRedis:
    """The session store when no URL is given: a Redis with its own random password."""
    return LocalRedis(appendonly=True, password=secrets.token_urlsafe(24))


def _start_tracing(stack: contextlib.ExitStack) -> None:
    """A local Phoenix for this run; the services inherit the OTLP settings that point at it."""
    phoenix = stack.enter_context(LocalPhoenix())
    os.environ.update(phoenix.otel_env())
    print(f"tracing: Phoenix UI at {phoenix.url} (project {PROJECT})", flush=True)


def _addresses(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each role's replica addresses (the coordinator is one)."""
    return {role: [f"{args.host}:{port}" for port in _ports(args, role, "port")] for role in PORTS}


def _ports(args: argparse.Namespace, role: str, kind: str) -> list[int]:
    """`kind` "port" or "metrics_port" of each replica of `role` (0 stays 0: off)."""
    base = getattr(args, f"{role}_{kind}")
    replicas = getattr(args, f"{role}_replicas", 1)
    return [base + REPLICA_STRIDE * i if base else 0 for i in range(replicas)]


def commands(
    args: argparse.Namespace, paths: dict[str, Path], cores_lock: Path | None, tls_dir: Path | None = None
) -> dict[str, list[str]]:
    """Each child's command line (after the Python executable), by name: draft-0, target-0, ..., coordinator."""
    addr = _addresses(args)
    commands = {}
    for role in METRICS_PORTS:
        for i, (port, metrics_port) in enumerate(zip(_ports(args, role, "port"), _ports(args, role, "metrics_port"))):
            cmd = [*_model_service(args, role, paths[role], port), "--metrics-port", str(metrics_port)]
            if role == "draft":
                cmd += ["--max-batch", str(args.draft_max_batch)]
                if args.draft_head_vocab is not None:
                    cmd += ["--head-vocab", str(args.draft_head_vocab)]
            if cores_lock:
                cmd += ["--cores-lock", str(cores_lock)]
            if args.batch_wait is not None:
                cmd += ["--batch-wait", str(args.batch_wait)]
            commands[f"{role}-{i}"] = cmd + (["--tls-dir", str(tls_dir)] if tls_dir else [])
    coordinator = [
        *("-m", "services.coordinator", "--model", str(paths["target"])),
        *("--host", args.host, "--port", str(args.coordinator_port), "--default-k", str(args.default_k)),
        *("--inject-rtt-ms", str(args.inject_rtt_ms)),
        *("--draft-addr", ",".join(addr["draft"]) or settings.NO_DRAFT),
        *("--target-addr", ",".join(addr["target"])),
        *("--http-port", str(args.http_port)),
    ]
    if args.api_keys_file:
        coordinator += ["--api-keys-file", str(args.api_keys_file)]
    if tls_dir:
        coordinator += ["--tls-dir", str(tls_dir)]
    if args.edge_tls_cert:
        coordinator += ["--edge-tls-cert", str(args.edge_tls_cert), "--edge-tls-key", str(args.edge_tls_key)]
    if args.draft_confidence is not None:
        coordinator += ["--draft-confidence", args.draft_confidence]
    if args.audit_rate is not None:
        coordinator += ["--audit-rate", args.audit_rate]
    commands |= {"coordinator": coordinator}
    if args.insecure:  # each child checks its own address (services/common/tls.py refuse_plaintext)
        commands = {name: [*cmd, "--insecure"] for name, cmd in commands.items()}
    return commands


def _run_services(
    args: argparse.Namespace, paths: dict[str, Path], redis_url: str, cores_lock: Path | None, tls_dir: Path | None
) -> int:
    """Start the children, wait until all serve, then keep them running (restarting any that
    dies) until SIGTERM / Ctrl-C."""
    addr = _addresses(args)
    # The coordinator reads the store's URL (and its password) from its environment, never argv.
    os.environ[settings.env_name("redis-url")] = redis_url
    children = Supervisor(commands(args, paths, cores_lock, tls_dir))
    edge = args.edge_tls  # checked by the command line (edge_tls_of)
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        children.start()
        _wait_ready([(a, role) for role in ("draft", "target", "coordinator") for a in addr[role]], children, tls_dir,
                    edge and edge.trusted_as_itself())
        print(
            f"specd is up: coordinator {addr['coordinator'][0]} (draft {','.join(addr['draft']) or settings.NO_DRAFT}, "
            f"target {','.join(addr['target'])}, sessions in {without_password(redis_url)})",
            flush=True,
        )
        if args.http_port >= 0:
            url = f"{'https' if edge else 'http'}://{args.host}:{args.http_port}"
            print(f"REST (OpenAI-compatible): {url}/v1, metrics at /metrics", flush=True)
        while not stopping:
            children.tend()
            time.sleep(0.2)
        return 0
    finally:
        children.stop()


def without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.split('@', 1)[1]}" if "@" in rest else url


def _model_service(args: argparse.Namespace, role: str, model: Path, port: int) -> list[str]:
    cmd = ["-m", f"services.{role}", "--model", str(model), "--host", args.host]
    cmd += ["--port", str(port), "--quantize", settings.launch_quantize(role, getattr(args, f"{role}_quantize"), model)]
    threads = getattr(args, f"{role}_threads")
    return cmd + (["--threads", str(threads)] if threads else [])


def _wait_ready(addresses: list[tuple[str, str]], children: Supervisor, tls_dir: Path | None,
                edge: EdgeTrust | None) -> None:
    """Every child (address, role) serves; one that exits before (a bad flag, a missing model) stops `specd up`.
    `edge`: how to verify the coordinator's edge with TLS."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    for address, role in addresses:
        mine = {"edge": edge} if role == "coordinator" else {"tls_dir": tls_dir, "role": role}
        while not serving(address, **mine):
            if exited := children.exited():
                name, code = next(iter(exited.items()))
                raise SystemExit(f"{name} exited before serving ({describe(code)})")
            if time.monotonic() > deadline:
                raise SystemExit(f"{address} not serving after {READY_TIMEOUT_S:.0f}s")
            time.sleep(0.5)


def serving(address: str, timeout_s: float = 1.0, tls_dir: Path | None = None, role: str | None = None,
            edge: EdgeTrust | None = None) -> bool:
    """The service at `address` answers SERVING (`not_serving`)."""
    return not_serving(address, timeout_s, tls_dir, role, edge) is None


def not_serving(address: str, timeout_s: float = 1.0, tls_dir: Path | None = None, role: str | None = None,
                edge: EdgeTrust | None = None) -> str | None:
    """None when the stock gRPC health service answers SERVING (the whole server, service ""), else
    why not (its status, or the call's error: a refused connection, a certificate that did not
    verify). `tls_dir`: a model service of `role` on mutual TLS, asked with the coordinator's
    certificate; `edge`: a coordinator's edge with TLS, verified so."""
    with _channel(address, tls_dir, role, edge) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return None if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _channel(address: str, tls_dir: Path | None, role: str | None, edge: EdgeTrust | None) -> grpc.Channel:
    if edge is not None:
        return edge.channel(address)
    if tls_dir is None:
        return grpc.insecure_channel(address)
    from services.common.tls import CALLER, TlsFiles, channel_options

    return grpc.secure_channel(address, TlsFiles(tls_dir, CALLER).channel_credentials(), options=channel_options(role))
