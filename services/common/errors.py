"""One mapping from domain errors to gRPC status codes, and back for the clients."""

from __future__ import annotations

import functools
from typing import Awaitable, Callable, TypeVar

import grpc

from specd.contracts import StaleSession
from specd.contracts import ContextTooLong, PositionMismatch, SessionsFull

POSITION_KEY = "specd-position"
R = TypeVar("R")


class Draining(Exception):
    """The service is stopping: it finishes the calls it has and takes no new ones."""


def grpc_errors(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Servicer decorator: bad input -> INVALID_ARGUMENT, lost prefix -> FAILED_PRECONDITION, ..."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except PositionMismatch as e:
            context.set_trailing_metadata(((POSITION_KEY, str(e.position)),))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Draining as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except SessionsFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (ValueError, ContextTooLong) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return wrapper


def stale_session(error: grpc.aio.AioRpcError) -> StaleSession | None:
    """The StaleSession a FAILED_PRECONDITION reply stands for, if it is one."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == POSITION_KEY:
            return StaleSession(int(value))
    return None
