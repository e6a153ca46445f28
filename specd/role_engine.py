"""What the draft's and the target's engines share: a `ModelEngine` serving one role of a round,
a batch of requests at a time (specd/draft_engine.py, specd/target_engine.py).

A request first brings its session to the committed tokens (`SyncPoint`) and is checked alone,
so that its error is its own; the checked ones then share the model passes, which can only fail
them all. Services (gRPC, Ray Serve) call the role engines on the thread that runs the model.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from specd.contracts import SyncPoint
from specd.engine import ModelEngine, PositionMismatch

Q = TypeVar("Q")  # a request
C = TypeVar("C")  # a request, checked
R = TypeVar("R")  # its reply


class RoleEngine:
    def __init__(self, engine: ModelEngine):
        self.engine = engine

    def sync(self, session_id: str, sync: SyncPoint) -> int:
        """Bring the session to the committed tokens; returns its length, n."""
        self.check_instance(session_id, sync)
        return self.engine.sync(session_id, sync.start_pos, sync.tokens)

    def check_instance(self, session_id: str, sync: SyncPoint) -> None:
        """A prefix held by another process (a restart, another replica) is not ours to build on,
        even when this process holds a session of that name and length."""
        if sync.start_pos > 0 and sync.instance_id != self.engine.instance_id:
            raise PositionMismatch(
                f"this is instance {self.engine.instance_id}, not {sync.instance_id!r}: resend the session",
                position=self.engine.position(session_id),
            )

    def release(self, session_id: str) -> None:
        self.engine.release(session_id)


def checked_then_together(
    requests: Sequence[Q], check: Callable[[Q], C], run: Callable[[list[C]], list[R]]
) -> list[R | Exception]:
    """`check` each request alone (sync, and refuse what would fail), then `run` the checked ones
    together: one reply per request, or the error it failed with (its own, or the shared pass's)."""
    checked = [_attempt(check, request) for request in requests]
    ready = [c for c in checked if not isinstance(c, Exception)]
    try:
        replies = iter(run(ready))
    except Exception as error:  # a pass failed: every request in it fails
        return [c if isinstance(c, Exception) else error for c in checked]
    return [c if isinstance(c, Exception) else next(replies) for c in checked]


def _attempt(check: Callable[[Q], C], request: Q) -> C | Exception:
    try:
        return check(request)
    except Exception as error:
        return error
