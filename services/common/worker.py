"""Runs model work off the event loop, one call at a time.

A model engine is not re-entrant and torch already uses every thread it is given, so the
servers funnel all engine calls through one worker thread while the event loop keeps
serving health checks and new requests. That thread also builds the engine (`call`) and is
the only one that ever runs torch: OpenMP keeps a thread pool per calling thread, and two
pools in one process (say, the model loaded on the main thread, run on the worker) make
every forward 40-80 % slower on a small CPU (benchmarks/threads.py). Calls that can share a model pass queue up in a
`Batcher` while the worker is busy and go through together.

Services on one host share its cores. Two of them computing at once oversubscribe the cores
(each torch pool sized for all of them, spinning while the other runs): under concurrent
sessions a draft step took 10x its time alone. With `SharedCores` they take turns instead:
each worker turn holds an exclusive lock on a file the services share.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T")
R = TypeVar("R")
DEFAULT_MAX_BATCH = 8


class SharedCores:
    """The cores of one host, taken in turns by the services on it: an exclusive `flock` on a
    file they all open. Only the worker thread takes turns, so one descriptor per process does."""

    def __init__(self, path: str | os.PathLike):
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def turn(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)


class EngineWorker:
    def __init__(self, name: str, cores: SharedCores | None = None):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._cores = cores

    def call(self, fn: Callable[..., T], *args) -> T:
        """Run fn on the worker thread and wait for it (setup: building the engine)."""
        return self._executor.submit(self._in_turn, fn, *args).result()

    async def run(self, fn: Callable[..., T], *args) -> T:
        # The caller's context goes along, so spans started on the worker are children of the request's.
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor, context.run, self._in_turn, fn, *args)

    def _in_turn(self, fn: Callable[..., T], *args) -> T:
        if self._cores is None:
            return fn(*args)
        with self._cores.turn():
            return fn(*args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._cores is not None:
            self._cores.close()


class Batcher(Generic[T, R]):
    """Calls that arrive while the worker is busy wait; the next worker turn takes them all (up to
    max_batch) and hands them to `run_batch` together. A lone call starts at once: nothing ever
    waits for a batch to fill.

    `run_batch(items)` runs on the worker thread and returns one outcome per item, a result or the
    exception that item alone failed with, so one bad call never fails the others. Items with
    the same `key` never share a batch (a retry racing its original runs after it).
    """

    def __init__(
        self,
        worker: EngineWorker,
        run_batch: Callable[[list[T]], list[R | Exception]],
        key: Callable[[T], Hashable],
        max_batch: int = DEFAULT_MAX_BATCH,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.worker, self.run_batch, self.key, self.max_batch = worker, run_batch, key, max_batch
        self.batches = 0  # worker turns taken
        self.largest = 0  # the most calls one turn took
        self._queue: deque[tuple[T, asyncio.Future]] = deque()
        self._drainer: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        """Calls queued for a coming worker turn."""
        return len(self._queue)

    async def submit(self, item: T) -> R:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._drainer is None or self._drainer.done():
            # A fresh context: the drainer serves many requests, it belongs to none of them.
            self._drainer = asyncio.create_task(self._drain(), context=contextvars.Context())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            try:
                settled = await self.worker.run(self._take_and_run)
            except Exception as error:  # the worker is shut down: nothing queued will run
                settled = [(future, error) for _, future in self._queue]
                self._queue.clear()
            for future, outcome in settled:
                if future.done():  # the caller went away (cancelled)
                    continue
                if isinstance(outcome, Exception):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    def _take_and_run(self) -> list[tuple[asyncio.Future, R | Exception]]:
        """On the worker thread. The batch is taken when the worker is free, not when this turn was
        queued, so everything that arrived during the previous turn rides along."""
        taken, deferred, keys = [], [], set()
        while self._queue and len(taken) < self.max_batch:
            item, future = self._queue.popleft()
            if future.cancelled():  # (read from this thread: a stale answer only costs a wasted row)
                continue
            if self.key(item) in keys:
                deferred.append((item, future))
                continue
            keys.add(self.key(item))
            taken.append((item, future))
        self._queue.extendleft(reversed(deferred))  # first in the next turn, in arrival order
        if not taken:
            return []
        self.batches += 1
        self.largest = max(self.largest, len(taken))
        try:
            outcomes = self.run_batch([item for item, _ in taken])
        except Exception as error:
            outcomes = [error] * len(taken)
        return [(future, outcome) for (_, future), outcome in zip(taken, outcomes, strict=True)]
