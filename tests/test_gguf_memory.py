"""Serving a GGUF file holds its weights once, in their stored types: no float32 copy of a quantised
weight is made, and the process's memory grows by about the file's size, not the several times
that a dequantised model would take (the 1.5B target in float32: 7.1 GB for a 1.1 GB file)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.models import is_ready, model_path
from tests.tiny_gguf import write_tiny

PROBE = """
import json, sys, torch
from specd.gguf_model import GGUFModel
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
before = rss()
model = GGUFModel(sys.argv[1])
cache = model.new_cache()
model.forward([cache], [[1, 2, 3, 4, 5, 6, 7, 8]], [1])
model.forward([cache], [[9]], [1])
print(json.dumps({"grown": rss() - before, "kv": cache.nbytes, "weights": model.nbytes}))
"""


def grown(path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_quantised_tiny_model_grows_the_process_by_its_file_not_a_float32_copy(tmp_path):
    path = write_tiny(tmp_path / "wide.gguf", "qwen2", "Q4_K", layers=4, hidden=1024, intermediate=4096, heads=8,
                      kv_heads=2, head_dim=128, vocab=320)
    measured = grown(path)
    float32 = measured["weights"] * 32 / 4.5  # the same weights dequantised (Q4_K: 4.5 bits a weight)
    assert measured["weights"] > 2**20  # large enough that a copy would show
    bound = 1.25 * measured["weights"] + measured["kv"] + 40 * 2**20
    assert bound < 0.5 * float32  # a float32 copy of the weights would break it
    assert measured["grown"] < bound, measured


@pytest.mark.real
def test_the_real_target_grows_the_process_by_about_its_file_size():
    if not is_ready("target"):
        pytest.fail("the real target is not fetched: run `specd models fetch` (scripts/test does)")
    measured = grown(model_path("target"))
    size = model_path("target").stat().st_size
    assert measured["grown"] < 1.1 * size + measured["kv"] + 100 * 2**20, measured
