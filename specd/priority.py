"""Short requests first: once a request has generated `after_tokens`, each of its rounds first
waits while shorter requests are in flight, at most `max_wait_s`, so a long request still moves
under any load. Least attained service, the classic answer when job sizes are not known: an
interactive reply is not slowed much by a long one beside it; a long one loses what the short ones
use. Only timing changes: which tokens a request gets never depends on it."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Background:
    after_tokens: int = 0  # a request is background from this many generated tokens on (0: never)
    max_wait_s: float = 0.05  # the longest one background round waits for short requests


class RoundGate:
    """One per coordinator: counts the short requests in flight."""

    def __init__(self, background: Background = Background()):
        self.background = background
        self.short = 0  # short requests in flight
        self.deferred = 0  # background rounds that waited
        self._quiet = asyncio.Event()
        self._quiet.set()

    @contextlib.contextmanager
    def request(self) -> Iterator["Priority"]:
        """Around one request: it starts short."""
        priority = Priority(self)
        self._count(+1)
        try:
            yield priority
        finally:
            priority.background()

    def _count(self, change: int) -> None:
        self.short += change
        if self.short:
            self._quiet.clear()
        else:
            self._quiet.set()


class Priority:
    """A request's place: short until it has generated the gate's `after_tokens`."""

    def __init__(self, gate: RoundGate):
        self.gate, self.short = gate, True

    async def before_round(self, generated: int) -> None:
        background = self.gate.background
        if not background.after_tokens or generated < background.after_tokens:
            return
        self.background()
        if self.gate.short:
            self.gate.deferred += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(background.max_wait_s):
                    await self.gate._quiet.wait()

    def background(self) -> None:
        if self.short:
            self.short = False
            self.gate._count(-1)
