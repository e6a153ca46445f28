"""The load a turn is about to join: its coordinator's turns in flight, and what the target's passes
reported a moment ago (they count every coordinator's sessions). A new session prices its first
rounds at that batch (`policy.joined_at_load`) instead of learning it over its first rounds."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

FRESH_S = 2.0  # a pass older than this says nothing of now (at 16 sessions a 2-core host's pass is ~0.3 s)


@dataclass
class LoadSeen:
    turns: int = 0  # this coordinator's turns in flight
    sessions: int = 1  # what the latest pass reported: the sessions it held or held up
    at: float | None = None  # when (the loop's clock); None: no pass seen

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        self.turns += 1
        try:
            yield
        finally:
            self.turns -= 1

    def saw(self, sessions: int, now: float) -> None:
        self.sessions, self.at = sessions, now

    def now(self, now: float) -> int:
        """Sessions sharing the target's passes now: the turns in flight here, or the latest pass's
        count while it is fresh, whichever is more (a burst of requests starts before any pass)."""
        seen = self.sessions if self.at is not None and now - self.at <= FRESH_S else 1
        return max(self.turns, seen)
