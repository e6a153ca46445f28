"""A model service's replicas as one client: sticky to the instance that holds a session's
cache, skipping a dead replica, and waiting (bounded) for a restarted one to come back.

Retrying is safe because every call carries its SyncPoint: the service first rolls the
session back to that point, so running a round again gives the same result.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

import grpc

from services.common.client import timeout
from services.common.server import MAX_MESSAGE_BYTES
from services.common.telemetry import client_interceptors

S = TypeVar("S")
R = TypeVar("R")

# Reconnect quickly: the default backoff (1 s growing to 120 s) would stall recovery after a restart.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
DOWN_FOR_S = 2.0  # a replica that failed is tried last for this long


@dataclass
class _Replica(Generic[S]):
    address: str
    channel: grpc.aio.Channel
    stub: S
    instance_id: str = ""
    down_until: float = 0.0


class Replicas(Generic[S]):
    def __init__(self, addresses: Sequence[str], make_stub: Callable[[grpc.aio.Channel], S], retry_s: float = 60.0):
        if not addresses:
            raise ValueError("at least one replica address is required")
        self._replicas = []
        interceptors = client_interceptors()  # propagate the caller's trace context to the service
        for address in addresses:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
            self._replicas.append(_Replica(address, channel, make_stub(channel)))
        self.retry_s = retry_s

    async def call(self, instance_id: str, session_id: str, rpc: Callable[[S], Awaitable[R]]) -> R:
        """Run `rpc` on the best replica; on UNAVAILABLE try the others, then wait and retry."""
        deadline = time.monotonic() + timeout(self.retry_s)  # no retries past the client's deadline
        delay = 0.05
        while True:
            for replica in self._order(instance_id, session_id):
                try:
                    reply = await rpc(replica.stub)
                except grpc.aio.AioRpcError as error:
                    if error.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    replica.down_until = time.monotonic() + DOWN_FOR_S
                    last_error = error
                    continue
                replica.instance_id, replica.down_until = reply.instance_id, 0.0
                return reply
            if time.monotonic() > deadline:
                raise last_error
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _order(self, instance_id: str, session_id: str) -> list[_Replica[S]]:
        """Live replicas first; among them the one holding the session's cache, then a stable
        per-session rotation (spreads sessions, keeps each on one replica)."""
        start = zlib.crc32(session_id.encode()) % len(self._replicas)
        rotated = self._replicas[start:] + self._replicas[:start]
        now = time.monotonic()
        return sorted(rotated, key=lambda r: (r.down_until > now, not instance_id or r.instance_id != instance_id))

    async def broadcast(self, rpc: Callable[[S], Awaitable[R]]) -> list[R | BaseException]:
        """Best effort on every replica (releasing a session: any of them may hold a copy): each
        one's reply or error, in the order of the addresses."""
        return await asyncio.gather(*(rpc(r.stub) for r in self._replicas), return_exceptions=True)

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self._replicas))
