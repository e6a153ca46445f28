"""`specd up` supervising the real Qwen2.5-Coder pair: a model service killed mid-stream is
restarted and the stream completes with the uninterrupted text."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common import certs
from tests.test_real_pair import PROMPTS, specd_up, target_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def deployment(target_dir, tmp_path_factory) -> Iterator[dict]:  # noqa: F811
    log: list[str] = []
    tls_dir = tmp_path_factory.mktemp("tls")
    certs.make(tls_dir)
    with specd_up("--tls-dir", str(tls_dir), log=log) as ports:
        yield ports | {"log": log, "tls": tls_dir}


def child_pid(role: str, port: int) -> int | None:
    """The pid of `specd up`'s `python -m services.<role> ... --port <port>` child, if it runs."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if f"services.{role}" in argv and "--port" in argv and argv[argv.index("--port") + 1] == str(port):
            return int(entry.name)
    return None


def stream_text(deployment: dict[str, int], prompt: str, on_event=lambda n: None) -> str:
    """A streamed greedy REST completion's text (each SSE event is checked for errors)."""
    with httpx.Client(base_url=f"http://127.0.0.1:{deployment['http-port']}", timeout=600) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
        text, events = "", 0
        with client.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    assert "error" not in event, event
                    text += event["choices"][0]["text"]
                    events += 1
                    on_event(events)
    return text


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_child_killed_mid_stream_is_restarted_and_the_stream_completes_unchanged(deployment, role):
    """kill -9 of a model service under `specd up` during a streamed REST completion: the
    supervisor restarts it, the coordinator waits for the target (or decodes plainly without a
    draft), and the text is the uninterrupted run's."""
    port = deployment[f"{role}-port"]
    uninterrupted = stream_text(deployment, PROMPTS[1])
    victim = child_pid(role, port)
    killed = []

    def kill(events: int) -> None:
        if events == 4 and not killed:
            os.kill(victim, signal.SIGKILL)
            killed.append(time.monotonic())

    assert stream_text(deployment, PROMPTS[1], kill) == uninterrupted
    assert killed
    deadline = time.monotonic() + 300
    while child_pid(role, port) in (None, victim):
        assert time.monotonic() < deadline, f"{role} was not restarted"
        time.sleep(0.5)
    assert any(f"{role}-0 (pid {victim}) died (killed by SIGKILL)" in line for line in deployment["log"])
