"""`specd up`'s children, kept running: a child that dies is started again (with a log line,
after a backoff that doubles from BACKOFF_MIN_S to BACKOFF_MAX_S and starts over once the child
has run STABLE_S), instead of taking the whole stack down. The others keep serving meanwhile:
the coordinator decodes plainly without a draft and waits (bounded) for a target."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 30.0
STABLE_S = 60.0  # a child that ran this long before dying is restarted after the shortest backoff
STOP_TIMEOUT_S = 15.0


@dataclass
class Child:
    name: str
    command: list[str]  # after the Python executable
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff_s: float = BACKOFF_MIN_S
    restart_at: float | None = None  # it died: start it again then
    restarts: int = 0


def describe(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


class Supervisor:
    def __init__(self, commands: dict[str, list[str]], log: Callable[[str], None] | None = None):
        self.children = {name: Child(name, command) for name, command in commands.items()}
        self._log = log or (lambda line: print(f"specd: {line}", flush=True))

    def start(self) -> None:
        for child in self.children.values():
            self._launch(child)

    def exited(self) -> dict[str, int]:
        """Children not running now, with their return codes."""
        return {c.name: c.proc.returncode for c in self.children.values() if c.proc.poll() is not None}

    def tend(self) -> None:
        """Schedule a restart for each child that died; start those whose backoff has passed."""
        now = time.monotonic()
        for child in self.children.values():
            if child.restart_at is None and child.proc.poll() is not None:
                if now - child.started_at >= STABLE_S:
                    child.backoff_s = BACKOFF_MIN_S
                child.restart_at = now + child.backoff_s
                self._log(f"{child.name} (pid {child.proc.pid}) died ({describe(child.proc.returncode)}); "
                          f"restarting it in {child.backoff_s:g}s")
                child.backoff_s = min(2 * child.backoff_s, BACKOFF_MAX_S)
            elif child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._launch(child)
                self._log(f"{child.name} restarted (pid {child.proc.pid}, restart {child.restarts})")

    def _launch(self, child: Child) -> None:
        child.proc = subprocess.Popen([sys.executable, *child.command])
        child.started_at, child.restart_at = time.monotonic(), None

    def stop(self) -> None:
        procs = [c.proc for c in self.children.values() if c.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
