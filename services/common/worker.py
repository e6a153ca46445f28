"""Runs model work off the event loop, one call at a time.

A model engine is not re-entrant and torch already uses every thread it is given, so the
servers funnel all engine calls through one worker thread while the event loop keeps
serving health checks and new requests.
"""

from __future__ import annotations

import asyncio
import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class EngineWorker:
    def __init__(self, name: str):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        # The caller's context goes along, so spans started on the worker are children of the request's.
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor, context.run, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
