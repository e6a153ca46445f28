"""Shared gRPC server plumbing: stock health and reflection services, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.telemetry import server_interceptors
from services.common.tls import EdgeTls, OnlyCoordinator, TlsFiles

log = logging.getLogger(__name__)

# Between coordinator and model services: a round's largest message is K ≤ 32 sparse q rows of at
# most 24 KiB (specd/sparse.py) plus a resync's tokens (5 bytes each): under 2 MiB at a 128k context.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
STOP_GRACE_S = 5.0
_announcing: set[asyncio.Task] = set()  # health updates waiting for a server's warm-up
_health: dict[grpc.aio.Server, health.aio.HealthServicer] = {}  # each server's, to answer NOT_SERVING when stopping
_probes: dict[grpc.aio.Server, grpc.aio.Server] = {}  # a server's plaintext health-only server, stopped with it


async def start_server(
    register: Callable[[grpc.aio.Server], Iterable[str]],
    address: str,
    warm_up: Awaitable[None] | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    tls: TlsFiles | EdgeTls | None = None,
    health_address: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a server with the servicers `register` adds (it returns their full service names).
    Its health answers SERVING once `warm_up` (if any) is done: a readiness probe (k8s, `specd up`)
    then sends traffic to a warmed-up server, while calls that come earlier are still served.

    `max_message_bytes` bounds what a client may send (the coordinator: its REST body limit).
    `tls`: serve mutual TLS, to the coordinator only (TlsFiles), or TLS with no client certificate
    (EdgeTls: the coordinator's edge); either reads its files again for new connections when they
    change (services/common/tls.py). `health_address`:
    also answer health checks, and nothing else, in plaintext there (kubelet probes).
    Returns the server and the bound port (use port 0 in tests for a free one).
    """
    server = grpc.aio.server(
        interceptors=[*server_interceptors(), *([OnlyCoordinator(tls.role)] if isinstance(tls, TlsFiles) else [])],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max(max_message_bytes, MAX_MESSAGE_BYTES)),
        ]
    )
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    _health[server] = health_servicer
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    if warm_up is not None:  # the stock servicer starts out answering SERVING for the whole server
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    if health_address is not None:
        _probes[server] = await _start_probe_server(health_servicer, health_address)
    await server.start()

    async def announce() -> None:
        if warm_up is not None:
            try:
                await warm_up
            except BaseException:  # it failed (its owner reports why and stops): never SERVING
                return
        for name in ("", *names):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    if warm_up is None:
        await announce()
    else:
        task = asyncio.create_task(announce())
        _announcing.add(task)
        task.add_done_callback(_announcing.discard)
    return server, port


async def _start_probe_server(health_servicer: health.aio.HealthServicer, address: str) -> grpc.aio.Server:
    probe = grpc.aio.server(options=[("grpc.max_receive_message_length", 4096)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probe)
    if probe.add_insecure_port(address) == 0:
        raise OSError(f"cannot bind the health server to {address}")
    await probe.start()
    return probe


async def stop_server(server: grpc.aio.Server, grace_s: float | None) -> None:
    """Stop a server and its health-only companion, if it has one."""
    _health.pop(server, None)
    probe = _probes.pop(server, None)
    await asyncio.gather(server.stop(grace_s), *([probe.stop(grace_s)] if probe else []))


async def run_until_signalled(
    server: grpc.aio.Server, drain: Callable[[float], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set); then answer health checks NOT_SERVING
    (probes and clients stop sending), run `drain(grace_s)` (a model service finishes its queued
    calls and refuses new ones), and let in-flight calls finish for STOP_GRACE_S."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping (grace %.0fs)", STOP_GRACE_S)
    await _health[server].enter_graceful_shutdown()
    if drain is not None:
        await drain(STOP_GRACE_S)
    await stop_server(server, STOP_GRACE_S)
