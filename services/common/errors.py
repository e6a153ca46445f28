"""One mapping from domain errors to gRPC status codes, and back for the clients."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any, AsyncIterator, Callable

import grpc

from specd.contracts import StaleSession
from specd.contracts import ContextTooLong, PositionMismatch, SessionsFull
from specd.validation import InvalidParams

POSITION_KEY = "specd-position"
log = logging.getLogger(__name__)


class Draining(Exception):
    """The service is stopping: it finishes the calls it has and takes no new ones."""


def grpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Servicer decorator, for unary and streamed replies: refused input -> INVALID_ARGUMENT, lost
    prefix -> FAILED_PRECONDITION, ...; any other ValueError is ours -> INTERNAL."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def streamed(self, request, context: grpc.aio.ServicerContext):
            async with _translated(method.__name__, context):
                async for reply in method(self, request, context):
                    yield reply

        return streamed

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        async with _translated(method.__name__, context):
            return await method(self, request, context)

    return wrapper


@contextlib.asynccontextmanager
async def _translated(name: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    try:
        yield
    except PositionMismatch as e:
        context.set_trailing_metadata(((POSITION_KEY, str(e.position)),))
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    except Draining as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    except SessionsFull as e:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except (InvalidParams, ContextTooLong) as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except ValueError:  # not a request we refused on purpose: a bug, which a client must not read as its own
        log.exception("%s failed", name)
        await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by the service)")


def stale_session(error: grpc.aio.AioRpcError) -> StaleSession | None:
    """The StaleSession a FAILED_PRECONDITION reply stands for, if it is one."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == POSITION_KEY:
            return StaleSession(int(value))
    return None
