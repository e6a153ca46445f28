"""Client-side helpers shared by the model service clients."""

from __future__ import annotations

import asyncio
import inspect
import time
from contextvars import ContextVar
from typing import Any, Awaitable, TypeVar

import grpc

from services.common.errors import stale_session

R = TypeVar("R")

# When the client's request must be done (time.monotonic()), set by the edge for its request's
# task: a model-service call never waits past the client's own deadline.
_request_deadline: ContextVar[float | None] = ContextVar("specd_request_deadline", default=None)


def set_request_deadline(seconds_left: float | None) -> None:
    """For the calling task (one per RPC): calls made from here on end by then."""
    _request_deadline.set(None if seconds_left is None else time.monotonic() + seconds_left)


def timeout(default_s: float) -> float:
    """A call's timeout: `default_s`, or less when the client's deadline comes sooner."""
    deadline = _request_deadline.get()
    return default_s if deadline is None else max(0.0, min(default_s, deadline - time.monotonic()))


async def call(rpc: Awaitable[R]) -> R:
    """Await an RPC, turning a lost-session reply into StaleSession for the loop."""
    try:
        return await rpc
    except grpc.aio.AioRpcError as error:
        stale = stale_session(error)
        if stale is None:
            raise
        raise stale from error


class NetworkDelay:
    """A Drafter or Verifier behind an injected network delay: half the round trip before each
    call, half after (benchmarks: a real network's RTT on loopback). Other attributes pass through."""

    def __init__(self, inner: Any, rtt_s: float):
        self._inner, self._half_s = inner, rtt_s / 2

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def delayed(*args, **kwargs):
            await asyncio.sleep(self._half_s)
            try:
                return await attr(*args, **kwargs)
            finally:
                await asyncio.sleep(self._half_s)

        return delayed
