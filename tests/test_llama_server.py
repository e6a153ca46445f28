"""benchmarks/llama_server.serve with a stand-in binary that logs as much as the real one does on a long run."""

from __future__ import annotations

import sys
import time

import pytest

from benchmarks import llama_server

LOG_BYTES = 300_000  # well past a pipe's 64 KiB, which the old serve() never drained

STAND_IN = f"""#!{sys.executable}
import argparse, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--host")
parser.add_argument("-m")
args, _ = parser.parse_known_args()
sys.stderr.write("log line\\n" * ({LOG_BYTES} // 9))
sys.stderr.write("LAST WORDS\\n")
sys.stderr.flush()
if args.m.endswith("missing.gguf"):  # as llama-server fails to load a model
    sys.exit(3)


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


HTTPServer((args.host, args.port), Health).serve_forever()
"""


@pytest.fixture
def binary(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return path


def test_a_server_that_logs_a_lot_becomes_ready_and_stops(binary, tmp_path):
    start = time.monotonic()
    with llama_server.serve(binary, tmp_path / "target.gguf", threads=1, timeout_s=20) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.pid > 0
    assert time.monotonic() - start < 15


def test_an_early_exit_says_the_end_of_its_log(binary, tmp_path):
    with pytest.raises(RuntimeError, match="exited with 3") as raised:
        with llama_server.serve(binary, tmp_path / "missing.gguf", threads=1, timeout_s=20):
            pass
    message = str(raised.value)
    assert message.rstrip().endswith("LAST WORDS") and len(message) < 2100
