"""benchmarks/round_parts.py: a round's parts from two requests' stats, and the engine decoding alone."""

from __future__ import annotations

import pytest

from benchmarks import round_parts
from benchmarks.bench import Prompt
from specd.engine import EngineConfig, ModelEngine
from tests.tiny_gguf import write_tiny

SHORT = {"wall_s": 0.1, "tokens": 1, "rounds": 1, "verify_compute_s": 0.03, "draft_wall_s": 0.0,
         "verify_wall_s": 0.032, "verify_queued_s": 0.001, "save_s": 0.002, "round_wall_s": 0.035,
         "accepted_tokens": 0}
# ten more plain rounds: a 30 ms pass, 1 ms queued, 1 ms of RPC, 1 ms of coordinator, 0.5 ms of delivery
LONG = SHORT | {"wall_s": 0.1 + 0.335, "tokens": 11, "rounds": 11, "verify_compute_s": 0.33, "verify_wall_s": 0.352,
                "verify_queued_s": 0.011, "save_s": 0.022, "round_wall_s": 0.365}


def test_a_plain_round_splits_into_its_parts_and_is_set_against_the_pass_and_the_engine_alone():
    summary = round_parts.summarise([round_parts.parts(LONG, SHORT)], engine_rate=1 / 0.031)
    assert summary["target_pass"] == pytest.approx(30.0)
    assert summary["fixed_ms"] == pytest.approx(3.5)  # queued, RPC, coordinator, delivery
    assert summary["tokens_per_s"] == pytest.approx(1 / 0.0335, abs=0.01)
    assert summary["plain_vs_pass"] == pytest.approx(0.030 / 0.0335, abs=1e-4)
    assert summary["vs_engine_alone"] == pytest.approx(0.031 / 0.0335, abs=1e-4)


def test_the_engine_alone_decodes_after_the_prompt_and_is_rolled_back(tmp_path, monkeypatch):
    monkeypatch.setattr(round_parts, "SETTLE_S", 0.0)
    engine = ModelEngine(EngineConfig(write_tiny(tmp_path / "tiny.gguf", "llama", vocab=2048), quantize="auto"))
    prompt = Prompt("p", "code", tuple(range(5, 25)))
    seconds = round_parts.engine_alone_s(engine, prompt, tokens=6)
    assert seconds > 0
    assert engine.position("s") == len(prompt.token_ids)  # the decoded tokens rolled back
