"""A GGUF draft run with `--quantize q4_0`: its Q5_0 and Q8_0 weights requantized to Q4_0 at load
(fewer bytes a step; a draft's numbers change acceptance only). The requantized bytes are gguf's
reference quantiser's, the model stays close to the stored one, the target refuses the setting, and
greedy speculation with such a draft through the real services is still plain decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from services.common import settings
from specd import quants
from specd.engine import EngineConfig, ModelEngine
from specd.gguf_model import GGUFModel
from tests.procs import coordinator, drafted_as_plain, model_service
from tests.tiny_gguf import write_tiny


@pytest.mark.parametrize("stored", ["Q5_0", "Q8_0"])
def test_requantized_rows_are_the_reference_quantisers_of_the_stored_values(stored):
    values = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    raw = gguf_quants.quantize(values, GGMLQuantizationType[stored])
    smaller = quants.requantize(raw, int(GGMLQuantizationType[stored]), 4, 64, quants.Q4_0)
    exact = gguf_quants.dequantize(raw, GGMLQuantizationType[stored])
    assert smaller.tobytes() == gguf_quants.quantize(exact, GGMLQuantizationType.Q4_0).tobytes()
    assert smaller.nbytes < raw.nbytes
    again = gguf_quants.dequantize(smaller, GGMLQuantizationType.Q4_0)
    assert np.abs(again - exact).max() < 0.15 * np.abs(exact).max()  # within Q4_0's step


@pytest.mark.parametrize("stored", ["Q5_0", "Q8_0"])
def test_a_requantized_draft_stays_close_to_the_stored_one(tmp_path, stored):
    path = write_tiny(tmp_path / "draft.gguf", "qwen2", stored)
    other = write_tiny(tmp_path / "other.gguf", "qwen2", stored, seed=1)
    prompt = [5, 77, 140, 9, 250, 31]

    def logits(model: GGUFModel) -> torch.Tensor:
        return model.forward([model.new_cache()], [prompt], [len(prompt)])[0]

    want, got = logits(GGUFModel(path)), logits(GGUFModel(path, requantize=quants.Q4_0))
    assert not torch.equal(got, want)  # the setting took: other numbers
    close = torch.nn.functional.cosine_similarity(got, want, dim=-1).mean()
    unrelated = torch.nn.functional.cosine_similarity(logits(GGUFModel(other)), want, dim=-1).mean()
    assert close > 0.9 and close > unrelated + 0.5  # a random tiny model's logits: Q4_0's noise, not another model


def test_only_a_gguf_draft_runs_q4_0(tmp_path):
    with pytest.raises(ValueError, match="draft-only"):
        settings.check_quantize("target", "q4_0")
    assert settings.check_quantize("draft", "q4_0") == "q4_0"
    with pytest.raises(ValueError, match="GGUF"):
        ModelEngine(EngineConfig(tmp_path, quantize="q4_0"))  # a directory: a Hugging Face checkpoint


def test_greedy_speculation_with_a_q4_0_draft_is_plain_decoding_through_the_services(procs, redis_url, tmp_path):
    target = write_tiny(tmp_path / "target.gguf", "qwen2", "Q6_K")
    draft = write_tiny(tmp_path / "draft.gguf", "qwen2", "Q8_0")
    services = procs(model_service("draft", draft, tmp_path, None, "127.0.0.1", "--quantize", "q4_0"),
                     model_service("target", target, tmp_path))
    (coord,) = procs(coordinator(target, [services[0].address], [services[1].address], redis_url, tmp_path,
                                 "--calibrate", "off"))
    assert drafted_as_plain(coord) > 0
