"""One mapping from domain errors to gRPC status codes, and back for the clients."""

from __future__ import annotations

import functools
import logging
from typing import Awaitable, Callable, TypeVar

import grpc

from specd.contracts import StaleSession
from specd.contracts import ContextTooLong, PositionMismatch, SessionsFull
from specd.validation import InvalidParams

POSITION_KEY = "specd-position"
log = logging.getLogger(__name__)
R = TypeVar("R")


class Draining(Exception):
    """The service is stopping: it finishes the calls it has and takes no new ones."""


def grpc_errors(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Servicer decorator: refused input -> INVALID_ARGUMENT, lost prefix -> FAILED_PRECONDITION, ...;
    any other ValueError is ours -> INTERNAL."""

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
        except (InvalidParams, ContextTooLong) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ValueError:  # not a request we refused on purpose: a bug, which a client must not read as its own
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by the service)")

    return wrapper


def stale_session(error: grpc.aio.AioRpcError) -> StaleSession | None:
    """The StaleSession a FAILED_PRECONDITION reply stands for, if it is one."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == POSITION_KEY:
            return StaleSession(int(value))
    return None
