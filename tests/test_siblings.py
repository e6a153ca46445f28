"""Siblings: the draft's runner-up for the first position, scored by the target in a row its
pass pads to anyway (specd/verify.py, specd/ragged.py `Branch`, `TargetEngine.verify`)."""

from __future__ import annotations

import pytest
import torch

from specd import kernels
from specd.contracts import Proposal, SamplingParams, Verdict, VerifyRequest
from specd.engine import EngineConfig, ModelEngine
from specd.target_engine import TargetEngine
from specd.verify import verify_greedy
from tests.conftest import greedy_reference
from tests.engines import held, propose, verify_proposal

PROMPT = [3, 17, 250, 42, 99, 7, 7, 128, 64, 5, 200]
GREEDY = SamplingParams()


def engine(model_dir, **kwargs) -> ModelEngine:
    return ModelEngine(EngineConfig(model_dir, **kwargs))


def cached(e: ModelEngine, session: str, tokens=PROMPT) -> ModelEngine:
    e.sync(session, 0, tokens)
    e.forward(session)  # the prefix cached: a later verification may carry a sibling
    return e


def rows(*argmaxes: int, vocab: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).double()  # [len(argmaxes), vocab]


# -- the pure decision ---------------------------------------------------------------------------


def test_a_recovered_sibling_commits_the_token_after_it_too():
    drafts = [5, 6]
    won = verify_greedy(drafts, rows(7, 1, 2, 9), sibling=7)  # first draft rejected, the target wants 7
    assert won == Verdict(0, 7, after_sibling=9) and won.committed(drafts) == (7, 9)
    lost = verify_greedy(drafts, rows(7, 1, 2, 9), sibling=8)
    assert lost == Verdict(0, 7) and lost.committed(drafts) == (7,)
    accepted = verify_greedy([7, 6], rows(7, 1, 2, 9), sibling=8)  # the first draft itself was right
    assert accepted == Verdict(1, 1) and accepted.committed([7, 6]) == (7, 1)
    assert verify_greedy(drafts, rows(7, 1, 2)) == Verdict(0, 7)  # no sibling scored: as before
    with pytest.raises(ValueError, match="row"):
        verify_greedy(drafts, rows(7, 1, 2), sibling=7)  # a sibling needs its own row


# -- the engine: one more row, seen by nobody, kept by nobody ---------------------------------------


def test_free_rows_fill_the_block_a_pass_costs_anyway():
    assert {rows: kernels.free_rows(rows) for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17)} == {
        1: 0, 2: 2, 3: 1, 4: 0, 5: 0, 6: 0, 7: 1, 8: 0, 9: 7, 15: 1, 16: 0, 17: 7}


def test_a_sibling_row_sees_only_the_prefix_and_changes_nothing_else(tiny_pair):
    drafts, sibling = [11, 12], 13
    plain, branched, alone = (cached(engine(tiny_pair[1], dtype="float64"), "s") for _ in range(3))
    assert branched.spare_rows([("s", drafts)]) == 1  # the last token again + 2 drafts: 3 rows, padded to 4
    assert branched.spare_rows([("s", drafts[:1])]) == 2  # 2 rows cost what 4 do
    assert branched.spare_rows([("s", [])]) == 0  # a plain step is one row, and has no draft to stand beside
    without = plain.forward_many([("s", drafts)])[0]  # [3, vocab]
    with_sibling = branched.forward_many([("s", drafts)], siblings=[sibling])[0]  # [4, vocab]
    # the same rows (elementwise kernels round by the row count, as in any batch: float64 shows it is only that)
    torch.testing.assert_close(with_sibling[:3], without, rtol=1e-12, atol=1e-12)
    assert branched.tokens("s") == plain.tokens("s") and branched.kv_length("s") == plain.kv_length("s")
    torch.testing.assert_close(with_sibling[3], alone.forward("s", [sibling])[-1], rtol=1e-12, atol=1e-12)
    # its KV never entered the cache: the next pass is as if it had never been scored
    torch.testing.assert_close(branched.forward_many([("s", [])])[0], plain.forward_many([("s", [])])[0], rtol=1e-12, atol=1e-12)


def test_the_engine_refuses_a_sibling_it_cannot_score(tiny_pair):
    e = cached(engine(tiny_pair[1]), "s")
    for requests, siblings in ([("s", [11, 12])], [11]), ([("s", [])], [11]), ([("s", [11])], [e.vocab_size]):
        with pytest.raises(ValueError, match="sibling|token ids"):
            e.forward_many(requests, siblings=siblings)
    assert e.tokens("s") == tuple(PROMPT)
    assert engine(tiny_pair[0], quantize="int8").spare_rows([]) == 0  # no padded path: no spare rows


# -- one round through the target engine----------------------------------------------------------


def test_a_won_sibling_commits_the_targets_next_two_tokens(tiny_pair):
    y = greedy_reference(tiny_pair[1])(PROMPT, 2)  # the target alone: y[0], y[1]
    wrong = (y[0] + 1) % 256
    e = cached(engine(tiny_pair[1], dtype="float64"), "s")
    proposal = Proposal((wrong, 0), (), sibling=y[0])
    assert verify_proposal(e, "s", proposal, GREEDY) == Verdict(0, y[0], after_sibling=y[1])
    assert list(e.tokens("s")) == PROMPT + y and e.kv_length("s") == len(PROMPT)


def test_siblings_take_only_the_spare_rows_in_batch_order(tiny_pair):
    y = greedy_reference(tiny_pair[1])(PROMPT, 2)
    e = engine(tiny_pair[1], dtype="float64")
    for session in ("a", "b"):
        cached(e, session)
    wrong = (y[0] + 1) % 256
    proposals = {"a": Proposal((wrong, 0), (), y[0]), "b": Proposal((wrong, 0, 0), (), y[0])}
    # 3 + 4 rows, padded to 8: one spare row, for the first session that offers a sibling
    replies = TargetEngine(e).verify([VerifyRequest(s, held(e, s), p, GREEDY) for s, p in proposals.items()])
    assert [reply.verdict for reply in replies] == [Verdict(0, y[0], after_sibling=y[1]), Verdict(0, y[0])]


def test_bad_siblings_are_refused_before_any_work(tiny_pair):
    e = cached(engine(tiny_pair[1]), "s")
    sampled = SamplingParams(temperature=1.0, seed=1)
    q = propose(cached(engine(tiny_pair[0]), "s"), "s", 1, sampled).q
    for proposal, params in [(Proposal((5,), q, 6), sampled), (Proposal((5,), (), 5), GREEDY),
                             (Proposal((), (), 5), GREEDY), (Proposal((5,), (), e.vocab_size), GREEDY)]:
        with pytest.raises(ValueError, match="sibling"):
            verify_proposal(e, "s", proposal, params)
    assert e.tokens("s") == tuple(PROMPT)


# -- the draft offers its runner-up ----------------------------------------------------------------


def test_a_greedy_proposal_carries_the_runner_up_to_its_first_draft(tiny_pair):
    draft = cached(engine(tiny_pair[0]), "s")
    with torch.inference_mode():
        first = draft.model(torch.tensor([PROMPT])).logits[0, -1]  # [vocab]
    proposal = propose(draft, "s", 3, GREEDY)
    assert proposal.tokens[0] == int(first.argmax()) and proposal.sibling == int(first.topk(2).indices[1])
    draft.truncate("s", len(PROMPT))
    assert propose(draft, "s", 3, SamplingParams(temperature=1.0, seed=3)).sibling is None


def test_the_runner_up_is_another_token_when_the_top_logits_tie(tiny_pair, monkeypatch):
    draft, target = cached(engine(tiny_pair[0]), "s"), cached(engine(tiny_pair[1]), "s")
    real = draft.forward_many

    def tied(requests, **kwargs):  # the draft's logits tie at the top: argmax takes 5, topk lists 9 first
        logits = [rows.clone() for rows in real(requests, **kwargs)]
        for rows in logits:
            rows[:, [5, 9]] = rows.max() + 1
        return logits

    monkeypatch.setattr(draft, "forward_many", tied)
    proposal = propose(draft, "s", 2, GREEDY)
    assert proposal.tokens[0] == 5 and proposal.sibling == 9
    verify_proposal(target, "s", proposal, GREEDY)  # a sibling the target takes
