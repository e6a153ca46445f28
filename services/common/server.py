"""Shared gRPC server plumbing: stock health and reflection services, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.telemetry import server_interceptors

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
STOP_GRACE_S = 5.0


async def start_server(
    register: Callable[[grpc.aio.Server], Iterable[str]],
    address: str,
) -> tuple[grpc.aio.Server, int]:
    """Start a server with the servicers `register` adds (it returns their full service names).

    Returns the server and the bound port (use port 0 in tests for a free one).
    """
    server = grpc.aio.server(
        interceptors=server_interceptors(),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    await server.start()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port


async def run_until_signalled(server: grpc.aio.Server) -> None:
    """Serve until SIGTERM/SIGINT, then let in-flight calls finish for STOP_GRACE_S."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping (grace %.0fs)", STOP_GRACE_S)
    await server.stop(STOP_GRACE_S)
