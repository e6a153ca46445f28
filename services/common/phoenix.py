"""A local Phoenix tracing UI on 127.0.0.1 for `specd up --tracing` and for tests.

Phoenix (`arize-phoenix`, ≈855 MB) lives in a venv of its own: its dependencies clash with
ours, and only its `phoenix serve` process is used. The venv is created on first use
(≈3 min), in ~/.cache/specd/phoenix-venv unless SPECD_PHOENIX_VENV says otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from services.common.local_process import LocalProcess
from services.common.redis_server import free_port

PHOENIX_VERSION = "20.26.1"
PROJECT = "specd"  # every service's spans land in this Phoenix project
INSTALL_TIMEOUT_S = 900.0


def phoenix_venv() -> Path:
    return Path(os.environ.get("SPECD_PHOENIX_VENV") or Path.home() / ".cache" / "specd" / "phoenix-venv")


def ensure_phoenix(venv: Path | None = None) -> Path:
    """The `phoenix` executable of the pinned version, installing it into `venv` if missing."""
    venv = venv or phoenix_venv()
    executable = venv / "bin" / "phoenix"
    if executable.is_file() and list(venv.glob(f"lib/python*/site-packages/arize_phoenix-{PHOENIX_VERSION}.dist-info")):
        return executable
    print(f"installing arize-phoenix=={PHOENIX_VERSION} into {venv} (once, ≈3 min)", file=sys.stderr, flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / "phoenix-install.log"
    with open(log, "w") as out:
        for cmd in ([sys.executable, "-m", "venv", str(venv)],
                    [str(venv / "bin" / "pip"), "install", "-q", f"arize-phoenix=={PHOENIX_VERSION}"]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S).returncode:
                raise RuntimeError(f"installing Phoenix failed ({' '.join(cmd)}); log: {log}")
    return executable


def answers_ok(url: str) -> bool:
    """GET `url` answers 200 (a health endpoint)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


class LocalPhoenix(LocalProcess):
    """One `phoenix serve` process with its database in a temp dir (traces go with it)."""

    name = "phoenix"
    start_timeout_s = 120.0  # ≈20–35 s on a 2-core machine
    stop_timeout_s = 15.0
    poll_s = 0.25
    log_lines = 30

    def __init__(self, port: int | None = None, grpc_port: int | None = None):
        super().__init__(port or free_port(), None, "phoenix.log")
        self.grpc_port = grpc_port or free_port()

    @property
    def url(self) -> str:
        """The UI and the REST API (`/v1/projects/specd/spans`)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def otlp_endpoint(self) -> str:
        """OTLP over gRPC (the Python exporters' default protocol)."""
        return f"http://127.0.0.1:{self.grpc_port}"

    def otel_env(self) -> dict[str, str]:
        """What a service's environment needs to send its spans here, into the specd project."""
        resource = ",".join(filter(None, [os.environ.get("OTEL_RESOURCE_ATTRIBUTES"),
                                          f"openinference.project.name={PROJECT}"]))
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_RESOURCE_ATTRIBUTES": resource}

    def launch(self) -> subprocess.Popen:
        env = {**os.environ, "PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(self.port),
               "PHOENIX_GRPC_PORT": str(self.grpc_port), "PHOENIX_WORKING_DIR": str(self.dir),
               "PHOENIX_TELEMETRY_ENABLED": "false"}
        with open(self.log_path, "w") as log:
            return subprocess.Popen([str(ensure_phoenix()), "serve"], env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        return answers_ok(f"{self.url}/healthz")
