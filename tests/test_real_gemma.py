"""A second real architecture: Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors, sliding
window layers, GeGLU, q/k norms, post-norms, a start token) served as the target through the real
services, exactly as the file's own greedy decoding in this process. No other model shares its
vocabulary, so it drafts for itself here: the draft service runs the same file.

Needs `specd models fetch gemma3-270m` (scripts/test fetches it); missing, it is a failure.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.coordinator.model_info import load_model_info
from services.models import is_ready, model_path
from services.protogen.specd.v1 import common_pb2, coordinator_pb2, target_pb2_grpc
from specd.gguf_model import GGUFModel
from tests.procs import coordinator, model_service, stub
from tests.test_real_pair import greedy

pytestmark = pytest.mark.real

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
N_TOKENS = 24


@pytest.fixture(scope="module")
def gemma() -> Path:
    if not is_ready("gemma3-270m"):
        pytest.fail("Gemma 3 270M is not fetched: run `specd models fetch gemma3-270m` (scripts/test does)")
    return model_path("gemma3-270m")


@pytest.fixture(scope="module")
def reference(gemma) -> dict[str, list[int]]:
    info, model = load_model_info(gemma), GGUFModel(gemma)
    assert info.bos_token_id == 2  # Gemma asks for its <bos>: a text prompt starts with it
    return {p: greedy(model, [info.bos_token_id, *info.encode(p)], N_TOKENS) for p in PROMPTS}


def test_gemma_is_served_as_the_target_exactly_as_the_file_decodes(procs, gemma, reference, redis_url, tmp_path):
    draft, target = procs(model_service("draft", gemma, tmp_path, None, "127.0.0.1", "--threads", "2"),
                          model_service("target", gemma, tmp_path, None, "127.0.0.1", "--threads", "2"))
    (coord,) = procs(coordinator(gemma, [draft.address], [target.address], redis_url, tmp_path, "--calibrate", "off"))
    with grpc.insecure_channel(target.address) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetEngineInfo(common_pb2.EngineInfoRequest(), timeout=30)
    assert info.numerics == "gguf" and all(t in info.reason for t in ("Q5_0", "Q4_K", "Q6_K", "Q8_0"))
    for prompt in PROMPTS:
        def complete(**fields) -> coordinator_pb2.CompleteResponse:
            request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N_TOKENS, **fields)
            return stub(coord).Complete(request, timeout=300)

        assert list(complete(speculation=False).token_ids) == reference[prompt]
        speculative = complete(num_draft_tokens=4)
        assert list(speculative.token_ids) == reference[prompt]
        assert speculative.stats.accepted_tokens > 0
