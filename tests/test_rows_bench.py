"""benchmarks/rows.py: pass times by rows, and `--against REV`: another revision's kernels timed in the same run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks import rows
from benchmarks.common import cpu_seconds, descendants
from tests.tiny_gguf import write_tiny


def test_every_pass_function_times_every_row_count_in_alternating_turns():
    calls = []
    times = rows.sweep({"a": lambda r: calls.append(("a", r)) or 0.1 * r, "b": lambda r: calls.append(("b", r)) or 0.2},
                       max_rows=2, repeats=2)
    assert calls == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("b", 1), ("a", 1), ("b", 2), ("a", 2)]
    assert times == {"a": {1: 0.1, 2: 0.2}, "b": {1: 0.2, 2: 0.2}}
    assert rows.extra_row_s({1: 0.04, 5: 0.08}) == 0.01


def test_another_programs_timing_is_taken_after_every_repeat_of_the_passes():
    calls = []
    rows.sweep({"a": lambda r: calls.append(("a", r)) or 0.1}, max_rows=2, repeats=3,
               after_repeat=lambda: calls.append("llama"))
    assert calls == [("a", 1), ("a", 2), "llama"] * 3


def test_side_by_side_decoding_alternates_which_of_the_two_goes_first():
    calls, decoded = [], []

    class Ours:
        def decode_s(self):
            calls.append("ours")
            return 0.03

    class Llama:
        def take(self):
            calls.append("llama")

    for _ in range(3):
        rows.side_by_side(Ours(), Llama(), decoded)
    assert calls == ["ours", "llama", "llama", "ours", "ours", "llama"]
    assert decoded == [0.03] * 3


def test_against_a_revision_times_both_builds_and_names_the_commit(tmp_path, monkeypatch):
    model = write_tiny(tmp_path / "llama.gguf", "llama", "Q4_K", vocab=20200)  # the ids rows.py feeds
    written = {}
    monkeypatch.setattr(rows, "write", lambda name, result: written.update({name: result}) or tmp_path / name)
    monkeypatch.setattr(sys, "argv", ["rows", "--model", str(model), "--max-rows", "5", "--repeats", "1",
                                      "--against", "HEAD", "--name", "tiny"])
    rows.main()
    result = written["tiny"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=rows.ROOT, capture_output=True, text=True).stdout.strip()
    assert result["against"] == {"rev": "HEAD", "commit": head}
    for table in ("pass_s", "against_pass_s"):
        assert sorted(result[table]) == [1, 2, 3, 4, 5] and all(t > 0 for t in result[table].values())
    assert set(result["extra_row_s"]) == {"this", "against"}
    assert "Q4_K" in result["numerics"]


@pytest.mark.parametrize("quantize", ["auto", "q4_0"])
def test_a_draft_is_timed_with_the_weights_it_is_served_with(tmp_path, monkeypatch, quantize):
    model = write_tiny(tmp_path / "draft.gguf", "qwen2", "Q8_0", vocab=20200)
    written = {}
    monkeypatch.setattr(rows, "write", lambda name, result: written.update({name: result}) or tmp_path / name)
    monkeypatch.setattr(sys, "argv", ["rows", "--model", str(model), "--max-rows", "2", "--repeats", "1",
                                      "--quantize", quantize, "--name", "tiny"])
    rows.main()
    result = written["tiny"]
    assert result["quantize"] == quantize
    assert ("Q4_0" in result["numerics"]) == (quantize == "q4_0")  # the pass server's own start-up check says


def test_a_revision_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(subprocess.CalledProcessError):
        rows.kernel_sources("no-such-revision-anywhere", tmp_path)


def test_busy_keeps_another_process_on_a_core_only_while_the_passes_run():
    def interferers() -> list[int]:
        return [pid for pid, command in descendants(os.getpid()).items() if "perf_counter" in command]

    assert interferers() == []
    with rows.interference(0.5):
        (pid,) = interferers()
        time.sleep(0.5)
        assert cpu_seconds(pid) > 0.1  # it spent time on a core
    assert interferers() == [] and cpu_seconds(pid) == 0.0  # gone: nothing to read
    with rows.interference(0.0):
        assert interferers() == []


@pytest.mark.parametrize("share", ["-0.1", "1.0"])
def test_busy_outside_a_share_of_a_core_is_refused(share, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rows", "--busy", share])
    with pytest.raises(SystemExit):
        rows.main()
