"""What the target's passes said of the load a moment ago, for a turn about to start: a new session
prices its first rounds at the batch it will join (`policy.joined_at_load`) instead of learning it
over its first rounds. One per coordinator; the target counts every coordinator's sessions."""

from __future__ import annotations

from dataclasses import dataclass

FRESH_S = 2.0  # a pass older than this says nothing of now (at 16 sessions a 2-core host's pass is ~0.3 s)


@dataclass
class LoadSeen:
    sessions: int = 1  # what the latest pass reported: the sessions it held or held up
    at: float | None = None  # when (the loop's clock); None: no pass seen

    def saw(self, sessions: int, now: float) -> None:
        self.sessions, self.at = sessions, now

    def now(self, now: float) -> int:
        """Sessions sharing the target's passes now: the latest pass's, while fresh; else 1."""
        return self.sessions if self.at is not None and now - self.at <= FRESH_S else 1
