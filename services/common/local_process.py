"""A server process on loopback, for `specd up` and the tests: started in a directory of its own
(a temporary one unless given), waited for until it answers, stopped; its log's tail goes into
the error when it does not come up."""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self


class LocalProcess:
    name = "server"
    start_timeout_s = 10.0
    stop_timeout_s = 10.0
    poll_s = 0.02  # between readiness checks
    log_lines = 20  # of the log, in the error when it does not come up

    def __init__(self, port: int, dir: str | Path | None, log_name: str):
        self.port = port
        self._tmp = tempfile.TemporaryDirectory(prefix=f"specd-{self.name}-") if dir is None else None
        self.dir = Path(dir if dir is not None else self._tmp.name).resolve()
        self.log_path = self.dir / log_name
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def launch(self) -> subprocess.Popen:
        """Start the process (writing its log to `log_path`)."""
        raise NotImplementedError

    def ready(self) -> bool:
        """It answers (a ping, a health endpoint)."""
        raise NotImplementedError

    def start(self) -> Self:
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already running on port {self.port}")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._proc = self.launch()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.ready():
            exited = self._proc.poll() is not None
            if exited or time.monotonic() > deadline:
                self.kill9()
                why = "exited" if exited else f"did not answer within {self.start_timeout_s:.0f}s"
                raise RuntimeError(f"{self.name} on port {self.port} {why}; log:\n{self._log_tail()}")
            time.sleep(self.poll_s)
        return self

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-self.log_lines:])
        except OSError:
            return "(no log)"

    def _end(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
            try:
                self._proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def stop(self) -> None:
        """Graceful: SIGTERM (Redis flushes its AOF before exiting)."""
        self._end(signal.SIGTERM)

    def kill9(self) -> None:
        """A crash: SIGKILL, nothing flushed beyond what was already on disk."""
        self._end(signal.SIGKILL)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
