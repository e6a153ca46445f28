"""Serving a GGUF file holds its weights once, in their stored types: no float32 copy of a quantised
weight is made, and the process's memory grows by about the file's size, not the several times
that a dequantised model would take (the 1.5B target in float32: 7.1 GB for a 1.1 GB file)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.common.settings import DRAFT_HEAD_VOCAB
from services.models import is_ready, model_path
from tests.tiny_gguf import write_tiny

PROBE = """
import json, sys, torch
from specd import quants
from specd.gguf_model import GGUFModel
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
before = rss()
model = GGUFModel(sys.argv[1], head_vocab=int(sys.argv[2]), requantize=quants.Q4_0 if sys.argv[3] == "q4_0" else None)
cache = model.new_cache()
model.forward([cache], [[1, 2, 3, 4, 5, 6, 7, 8]], [1])
model.forward([cache], [[9]], [1])
print(json.dumps({"grown": rss() - before, "kv": cache.nbytes, "weights": model.nbytes}))
"""


def grown(path, head_vocab: int = 0, quantize: str = "auto") -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(path), str(head_vocab), quantize], capture_output=True,
                          text=True, timeout=600)
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


@pytest.mark.real
def test_the_real_draft_as_q4_0_grows_the_process_by_less_than_as_stored():
    """Requantizing at load makes and drops float32 and Q4_0 temporaries: the heap they leave must go
    back to the system, or a smaller draft would take more memory than the file as stored."""
    if not is_ready("draft"):
        pytest.fail("the real draft is not fetched: run `specd models fetch` (scripts/test does)")
    stored = grown(model_path("draft"), DRAFT_HEAD_VOCAB)
    q4_0 = grown(model_path("draft"), DRAFT_HEAD_VOCAB, "q4_0")
    assert q4_0["grown"] < 0.9 * stored["grown"], (q4_0, stored)
