"""Runs model work off the event loop, one call at a time.

A model engine is not re-entrant and torch already uses every thread it is given, so the
servers funnel all engine calls through one worker thread while the event loop keeps
serving health checks and new requests. That thread also builds the engine (`call`) and is
the only one that ever runs torch: OpenMP keeps a thread pool per calling thread, and two
pools in one process (say, the model loaded on the main thread, run on the worker) make
every forward 40-80 % slower on a small CPU (benchmarks/threads.py). Calls that can share a model pass queue up in a
`Batcher` while the worker is busy and go through together.

Sessions served together stay together. A session that drifted half a round out of phase
(the first one in, or one whose draft stopped early) would otherwise take a pass of its own
every round, paying a whole pass's fixed cost for one row: so a turn that finds sessions of
the last turns missing waits for them, briefly (`Batching.wait`, as Triton's queue delay).

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
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, TypeVar

from specd.validation import validate_that

T = TypeVar("T")
R = TypeVar("R")
DEFAULT_MAX_BATCH = 8
GATHER_TURNS = 2  # a turn waits for the sessions the last this many turns took


@dataclass(frozen=True)
class Batching:
    max_batch: int = DEFAULT_MAX_BATCH  # calls one pass takes at most
    # A turn missing sessions of the last turns waits for them at most this fraction of a pass
    # (0: never): they are a few milliseconds behind, replies to the last pass that one coordinator
    # handles in turn (~1-1.5 ms a session: eight of them outlast a tenth of a pass, and the passes split).
    wait: float = 0.3

    def validate(self) -> None:
        validate_that(self.max_batch >= 1, f"max_batch must be >= 1, got {self.max_batch}")
        validate_that(0.0 <= self.wait <= 1.0, f"batch wait must be in [0, 1] (a fraction of a pass), got {self.wait}")


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
    max_batch) and hands them to `run_batch` together. A lone call starts at once: a turn waits
    only for keys the last GATHER_TURNS turns took and this one lacks (a key is `forget`-ten when
    its session ends), and for at most `Batching.wait` of a pass.

    `run_batch(items)` runs on the worker thread and returns one outcome per item, a result or the
    exception that item alone failed with, so one bad call never fails the others. Items with
    the same `key` never share a batch (a retry racing its original runs after it).
    """

    def __init__(
        self,
        worker: EngineWorker,
        run_batch: Callable[[list[T]], list[R | Exception]],
        key: Callable[[T], Hashable],
        batching: Batching = Batching(),
    ):
        batching.validate()
        self.worker, self.run_batch, self.key, self.batching = worker, run_batch, key, batching
        self.batches = 0  # worker turns taken
        self.largest = 0  # the most calls one turn took
        self.waits = 0  # turns that waited for missing keys
        self._queue: deque[tuple[T, asyncio.Future]] = deque()
        self._drainer: asyncio.Task | None = None
        self._arrived = threading.Condition()  # the worker thread waits on it for missing keys
        self._seen: dict[Hashable, int] = {}  # key -> the turn that last took it
        self._pass_s = 0.0  # recent run_batch time

    @property
    def waiting(self) -> int:
        """Calls queued for a coming worker turn."""
        return len(self._queue)

    def held_up(self) -> int:
        """The sessions the running pass holds up, whether or not they share it: those the last
        GATHER_TURNS turns took, the running one's included, and those that queued behind it. A
        pass that ran alone while others arrived held them all up, and a round priced as a session
        alone would draft into their next pass."""
        with self._arrived:
            return len(set(self._seen) | {self.key(item) for item, _ in self._queue})

    @property
    def idle(self) -> bool:
        """Nothing queued and no turn running."""
        return not self._queue and (self._drainer is None or self._drainer.done())

    async def submit(self, item: T) -> R:
        future = asyncio.get_running_loop().create_future()
        with self._arrived:
            self._queue.append((item, future))
            self._arrived.notify()
        if self._drainer is None or self._drainer.done():
            # A fresh context: the drainer serves many requests, it belongs to none of them.
            self._drainer = asyncio.create_task(self._drain(), context=contextvars.Context())
        return await future

    def forget(self, key: Hashable) -> None:
        """The key's session ended: turns stop waiting for it."""
        with self._arrived:
            self._seen.pop(key, None)
            self._arrived.notify()  # a turn waiting for it stops waiting

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
        taken: list[tuple[T, asyncio.Future]] = []
        with self._arrived:
            keys = self._take(taken, set())
            if taken:
                self._gather(taken, keys)
                self.batches += 1
                self._seen = {key: turn for key, turn in self._seen.items() if turn > self.batches - GATHER_TURNS}
                self._seen.update((key, self.batches) for key in keys)
        if not taken:
            return []
        self.largest = max(self.largest, len(taken))
        start = time.perf_counter()
        try:
            outcomes = self.run_batch([item for item, _ in taken])
        except Exception as error:
            outcomes = [error] * len(taken)
        self._pass_s = time.perf_counter() - start
        return [(future, outcome) for (_, future), outcome in zip(taken, outcomes, strict=True)]

    def _take(self, taken: list[tuple[T, asyncio.Future]], keys: set[Hashable]) -> set[Hashable]:
        """Move queued calls into `taken`, one per key, up to max_batch; the rest keep their place."""
        deferred = []
        while self._queue and len(taken) < self.batching.max_batch:
            item, future = self._queue.popleft()
            if future.cancelled():  # (read from this thread: a stale answer only costs a wasted row)
                continue
            if self.key(item) in keys:
                deferred.append((item, future))
                continue
            keys.add(self.key(item))
            taken.append((item, future))
        self._queue.extendleft(reversed(deferred))  # first in the next turn, in arrival order
        return keys

    def _gather(self, taken: list[tuple[T, asyncio.Future]], keys: set[Hashable]) -> None:
        """Wait (holding `_arrived`) for the keys the last turns took and this one lacks, until
        they come, are forgotten, or the wait is up."""
        deadline = time.monotonic() + self.batching.wait * self._pass_s

        def missing() -> bool:  # _seen holds the keys of the last GATHER_TURNS turns
            return bool(set(self._seen) - keys) and len(taken) < self.batching.max_batch

        if not missing() or time.monotonic() >= deadline:
            return
        self.waits += 1
        while missing():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._arrived.wait(remaining)
            self._take(taken, keys)
