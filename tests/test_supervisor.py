"""specd up's supervisor on real child processes (sleepers and crashers, no models): a child
that dies is restarted after its backoff with a log line, a crash loop backs off, stop ends all."""

from __future__ import annotations

import os
import signal
import time

from services.common.supervisor import Supervisor
from tests.procs import up_commands, value

SLEEPER = ["-c", "import time; time.sleep(600)"]
CRASHER = ["-c", "raise SystemExit(3)"]


def tend_until(children: Supervisor, done, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        children.tend()
        time.sleep(0.02)


def test_a_killed_child_is_restarted_with_a_log_line_and_the_others_keep_running():
    lines: list[str] = []
    children = Supervisor({"draft-0": SLEEPER, "target-0": SLEEPER}, lines.append)
    children.start()
    try:
        target, draft = children.children["target-0"], children.children["draft-0"]
        first_pid, draft_pid = target.proc.pid, draft.proc.pid
        os.kill(first_pid, signal.SIGKILL)
        tend_until(children, lambda: target.restarts == 1)
        assert target.proc.poll() is None and target.proc.pid != first_pid
        assert draft.proc.pid == draft_pid and draft.proc.poll() is None
        assert lines[0].startswith(f"target-0 (pid {first_pid}) died (killed by SIGKILL); restarting it in")
        assert lines[1].startswith("target-0 restarted (pid")
    finally:
        children.stop()
    assert all(c.proc.poll() is not None for c in children.children.values())


def test_a_crash_loop_backs_off_doubling():
    lines: list[str] = []
    children = Supervisor({"coordinator": CRASHER}, lines.append)
    child = children.children["coordinator"]
    child.backoff_s = 0.05
    children.start()
    try:
        tend_until(children, lambda: child.restarts == 3)
    finally:
        children.stop()
    waits = [float(line.split("restarting it in ")[1].rstrip("s")) for line in lines if "died" in line]
    assert waits[:3] == [0.05, 0.1, 0.2]
    assert all("exit code 3" in line for line in lines if "died" in line)


def test_specd_up_runs_local_pools_through_the_coordinators_pool_flags(monkeypatch):
    commands = up_commands(monkeypatch, "--draft-replicas", "2", "--target-replicas", "3", "--target-port", "6000",
                           "--target-metrics-port", "0")
    assert sorted(commands) == ["coordinator", "draft-0", "draft-1", "target-0", "target-1", "target-2"]
    assert [value(commands[f"target-{i}"], "--port") for i in range(3)] == ["6000", "6100", "6200"]
    assert {value(commands[f"target-{i}"], "--metrics-port") for i in range(3)} == {"0"}
    assert value(commands["draft-1"], "--metrics-port") == "9201"
    coordinator = commands["coordinator"]
    assert value(coordinator, "--target-addr") == "127.0.0.1:6000,127.0.0.1:6100,127.0.0.1:6200"
    assert value(coordinator, "--draft-addr") == "127.0.0.1:50052,127.0.0.1:50152"
