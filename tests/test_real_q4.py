"""The real Qwen2.5-Coder pair on `specd up`'s default numerics (auto: the q4 engine, on a CPU
that builds it): greedy speculation, fixed K and adaptive, gives exactly the deployment's own
plain greedy decoding through the real services."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from services.protogen.specd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, target_pb2_grpc
from tests.test_real_pair import N_TOKENS, PROMPTS, specd_up, target_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def deployment(target_dir) -> Iterator[dict[str, int]]:  # noqa: F811
    with specd_up() as ports:
        yield ports


def complete(deployment: dict[str, int], prompt: str, **fields) -> coordinator_pb2.CompleteResponse:
    with grpc.insecure_channel(f"127.0.0.1:{deployment['coordinator-port']}") as channel:
        request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N_TOKENS, ignore_eos=True, **fields)
        return coordinator_pb2_grpc.CoordinatorStub(channel).Complete(request, timeout=600)


def test_specd_up_runs_the_q4_target_by_default(deployment):
    with grpc.insecure_channel(f"127.0.0.1:{deployment['target-port']}") as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetEngineInfo(common_pb2.EngineInfoRequest(), timeout=30)
    assert (info.quantize, info.numerics, info.invariant) == ("auto", "q4", True)
    assert list(info.row_blocks) == []  # it runs the rows it is fed


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_q4_greedy_speculation_is_the_deployments_plain_decoding(deployment, prompt):
    plain = list(complete(deployment, prompt, speculation=False).token_ids)
    assert len(plain) == N_TOKENS
    fixed = complete(deployment, prompt, num_draft_tokens=4)
    assert list(fixed.token_ids) == plain
    assert fixed.stats.accepted_tokens > 0  # a verification's rows decided tokens, not only plain steps
    assert list(complete(deployment, prompt).token_ids) == plain  # adaptive K
