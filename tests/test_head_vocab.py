"""A draft whose output layer scores part of the vocabulary (`--head-vocab`): which ids it scores,
that those ids' logits are the full layer's bit for bit and every other id is -inf, that its drafts
stay inside the head, and that greedy speculation with it through the real services is still plain
decoding."""

from __future__ import annotations

import math

import pytest
import torch

from specd import native
from specd.contracts import ProposeRequest, SamplingParams, SyncPoint
from specd.draft_engine import DraftEngine
from specd.engine import EngineConfig, ModelEngine
from specd.gguf_meta import eog_ids
from specd.gguf_model import GGUFModel, head_ids
from tests.procs import coordinator, drafted_as_plain, model_service
from tests.tiny_gguf import write_tiny

HEAD = 100  # of the tiny vocabulary's 320 ids; its 3 special tokens sit at the end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("head") / "draft.gguf", "qwen2", "Q4_K")


def test_the_head_scores_the_first_ids_and_every_special_one(tiny):
    model = GGUFModel(tiny)
    ids = head_ids(model.meta, model.vocab_size, HEAD).tolist()
    types = model.meta.get("tokenizer.ggml.token_type")
    special = {i for i, t in enumerate(types) if t in (3, 4)}
    assert special and min(special) >= HEAD  # the test means something: specials beyond the first ids
    assert ids == sorted(set(range(HEAD)) | special | eog_ids(model.meta))
    assert head_ids(model.meta, model.vocab_size, 0) is None
    assert head_ids(model.meta, model.vocab_size, model.vocab_size) is None


def test_the_heads_logits_are_the_full_layers_and_minus_infinity_elsewhere(tiny):
    full, pruned = GGUFModel(tiny), GGUFModel(tiny, head_vocab=HEAD)
    prompt = [5, 77, 140, 9, 250, 31]
    want = full.forward([full.new_cache()], [prompt], [len(prompt)])[0]
    got = pruned.forward([pruned.new_cache()], [prompt], [len(prompt)])[0]
    ids = pruned.head_ids
    assert torch.equal(got[:, ids], want[:, ids])
    outside = torch.ones(full.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.all(got[:, outside] == -math.inf))
    assert not bool(torch.all(want[:, outside] == -math.inf))


@pytest.mark.parametrize("greedy", [True, False])
def test_its_drafts_and_their_q_stay_inside_the_head(tiny, greedy):
    """Sampled, q (what the target verifies against) puts no mass outside the head: the draft samples
    from exactly the q it sends, so rejection sampling stays exact."""
    engine = DraftEngine(ModelEngine(EngineConfig(tiny, quantize="auto", head_vocab=HEAD)))
    params = SamplingParams() if greedy else SamplingParams(temperature=1.0, seed=7)
    inside = set(engine.engine._native.head_ids.tolist())
    for start in ([5, 77, 140], [250, 251, 252, 9], [300, 12]):
        (reply,) = engine.propose([ProposeRequest("s" + str(start), SyncPoint(0, tuple(start), ""), 8, params)])
        assert reply.proposal.tokens and set(reply.proposal.tokens) <= inside
        for row in reply.proposal.q:
            ids = torch.frombuffer(bytearray(row.token_ids), dtype=torch.int32).tolist()
            assert set(ids) <= inside


def test_greedy_speculation_with_a_partial_head_is_plain_decoding_through_the_services(procs, redis_url, tmp_path):
    target = write_tiny(tmp_path / "target.gguf", "qwen2", "Q6_K")
    draft = write_tiny(tmp_path / "draft.gguf", "qwen2", "Q4_K")
    services = procs(model_service("draft", draft, tmp_path, None, "127.0.0.1", "--head-vocab", str(HEAD)),
                     model_service("target", target, tmp_path))
    (coord,) = procs(coordinator(target, [services[0].address], [services[1].address], redis_url, tmp_path,
                                 "--calibrate", "off"))
    assert drafted_as_plain(coord) > 0


def test_a_negative_head_is_refused_at_start(capsys):
    from services.common import model_main

    with pytest.raises(SystemExit):
        model_main.parse("draft", 1, ["--model-dir", "m", "--head-vocab", "-1", "--insecure"])
    assert "head vocabulary must be >= 0" in capsys.readouterr().err


def test_a_packed_heads_gathered_rows_are_not_kept(tiny):
    """The kernels read a packed head's panels only: the rows gathered to pack it are let go, so a
    draft's head costs its panels and no more (the full head costs its panels alone too)."""
    full, pruned = GGUFModel(tiny), GGUFModel(tiny, head_vocab=HEAD)
    tensors = full.meta.tensors
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    K, N = head.dims
    panels = native.library(native.default_march()).specd_repack_bytes
    assert panels(head.ggml_type, N, K) > 0  # the test means something: this build packs the head
    assert full.held_bytes - pruned.held_bytes == panels(head.ggml_type, N, K) - panels(head.ggml_type, len(pruned.head_ids), K)
