"""GGUF files through the real services, for every architecture in specd/archs.py: greedy
speculation (fixed K and adaptive) gives exactly the deployment's plain greedy decoding.

Each deployment is real processes on loopback (draft, target, coordinator, redis-server). The
target is a tiny random-weight file stored in Q6_K, its draft the same weights in Q4_K (a
quantised copy of the target, as real pairs are smaller cousins): they agree often, not always,
so verification both accepts and rejects drafts.
"""

from __future__ import annotations

import pytest

from services.protogen.specd.v1 import coordinator_pb2
from specd import archs
from tests.procs import coordinator, model_service, stub
from tests.tiny_gguf import write_tiny

N_TOKENS = 40
PROMPTS = ("def add(a, b):", "Once upon a time")


@pytest.mark.parametrize("arch", sorted(archs.ARCHS))
def test_greedy_speculation_is_plain_decoding_through_the_services(procs, redis_url, tmp_path, arch):
    target = write_tiny(tmp_path / "target.gguf", arch, "Q6_K")
    draft = write_tiny(tmp_path / "draft.gguf", arch, "Q4_K")
    services = procs(model_service("draft", draft, tmp_path), model_service("target", target, tmp_path))
    (coord,) = procs(coordinator(target, [services[0].address], [services[1].address], redis_url, tmp_path,
                                 "--calibrate", "off"))
    accepted = 0
    for prompt in PROMPTS:
        def complete(**fields) -> coordinator_pb2.CompleteResponse:
            request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N_TOKENS, ignore_eos=True, **fields)
            return stub(coord).Complete(request, timeout=120)

        plain = list(complete(speculation=False).token_ids)
        assert len(plain) == N_TOKENS
        fixed = complete(num_draft_tokens=4)
        assert list(fixed.token_ids) == plain
        assert list(complete().token_ids) == plain  # adaptive K
        accepted += fixed.stats.accepted_tokens
    assert accepted > 0  # verification rows decided tokens, not only plain steps


def test_a_gguf_target_alone_drafts_from_the_tokens_at_hand_through_the_services(procs, redis_url, tmp_path):
    """No draft model (`--draft-addr none`, what `specd up --draft-replicas 0` starts): the coordinator
    drafts from text already seen, with calibration on, and the output is the target's own."""
    target = write_tiny(tmp_path / "target.gguf", "llama", "Q6_K")
    (service,) = procs(model_service("target", target, tmp_path))
    (coord,) = procs(coordinator(target, "none", [service.address], redis_url, tmp_path))
    prompt = "abcabcabcabcabcabcabcabcabcabc"

    def complete(**fields) -> coordinator_pb2.CompleteResponse:
        request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N_TOKENS, ignore_eos=True, **fields)
        return stub(coord).Complete(request, timeout=120)

    plain = complete(speculation=False)
    for drafter in ("auto", "ngram"):
        reply = complete(drafter=drafter)
        assert reply.token_ids == plain.token_ids, drafter
        assert reply.stats.model_free_drafted_tokens == reply.stats.drafted_tokens and reply.stats.draft_compute_s == 0
    assert complete(drafter="ngram").stats.drafted_tokens > 0
