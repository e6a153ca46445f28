"""Client-side helpers shared by the model service clients."""

from __future__ import annotations

from typing import Awaitable, TypeVar

import grpc

from services.common.errors import stale_session
from services.protogen.specd.v1 import common_pb2

R = TypeVar("R")


async def call(rpc: Awaitable[R]) -> R:
    """Await an RPC, turning a lost-session reply into StaleSession for the loop."""
    try:
        return await rpc
    except grpc.aio.AioRpcError as error:
        stale = stale_session(error)
        if stale is None:
            raise
        raise stale from error


def session_ref(session_id: str) -> common_pb2.SessionRef:
    return common_pb2.SessionRef(session_id=session_id)
