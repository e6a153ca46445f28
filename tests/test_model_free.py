"""The model-free drafter (specd/model_free.py): matches, continuations and their scores, bounded
memory and eviction, and no text crossing from one session or owner to another."""

from __future__ import annotations

import random

import pytest

from specd.model_free import MATCH_PRIOR, NO_DRAFT, SEPARATOR, SuffixDrafter, SuffixIndex

TEXT = [10, 11, 12, 13, 14, 15, 16, 17]


def index_of(tokens: list[int], capacity: int = 1000) -> SuffixIndex:
    index = SuffixIndex(capacity)
    index.extend(tokens)
    return index


def continuing(match: int, n: int) -> tuple[float, ...]:
    """The scores of n drafts with one continuation each after a `match`-token match: the i-th draft
    continues a match of match + i tokens, which goes on with odds (match + i) : MATCH_PRIOR."""
    scores, score = [], 1.0
    for i in range(n):
        score *= (match + i) / (match + i + MATCH_PRIOR)
        scores.append(score)
    return tuple(scores)


def test_a_repeated_passage_is_drafted_from_where_it_occurred_before():
    context = [*TEXT, 1, 2, 10, 11, 12]
    draft = index_of(context).draft(context, k=4, spec_factor=2)
    assert draft.tokens == (13, 14, 15, 16) and draft.match == 3
    assert draft.scores == pytest.approx(continuing(3, 4)) and draft.scores[0] == pytest.approx(3 / 5)


def test_a_longer_match_is_trusted_more():
    """A one-token match predicts little (offline, its first drafts were accepted 21-29 %), a long one
    a copy: the same single continuation scores by the match's length."""
    short = [*TEXT, 1, 15]
    long = [*TEXT, 1, *TEXT[:7]]
    (s,), (l,) = index_of(short).draft(short, k=1).scores, index_of(long).draft(long, k=1).scores
    assert s == pytest.approx(1 / 3) and l == pytest.approx(7 / 9)


def test_the_longest_match_decides_and_the_most_frequent_continuation_wins():
    # after "5 6" came 7 twice and 8 once; after "4 5 6" only 8
    context = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 8, 3, 5, 6]
    draft = index_of(context).draft(context, k=1, spec_factor=4)
    assert draft.tokens == (7,) and draft.match == 2 and draft.scores[0] == pytest.approx(2 / 4 * 2 / 3)
    longer = [4, 5, 6, 8, 0, *context[:-2], 4, 5, 6]
    assert index_of(longer).draft(longer, k=1).tokens == (8,) and index_of(longer).draft(longer, k=1).match == 3


def test_drafting_stops_where_the_text_is_unsure_and_at_the_match_length():
    branching = [1, 2, 3, 7, 1, 2, 4, 8, 1, 2, 5, 9, 1, 2]  # after "1 2": 3, 4, 5 once each
    # a 2-token match (1/2) of which the continuation is one of three (1/3): 1/6
    assert index_of(branching).draft(branching, k=4, spec_factor=4, min_score=0.2) == NO_DRAFT
    assert index_of(branching).draft(branching, k=1, min_score=0.15).tokens == (5,)  # ties: the latest
    # then 9, 1, 2 for sure, each continuing a match one token longer: 1/6 * 3/5 * 4/6 * 5/7
    assert index_of(branching).draft(branching, k=4, spec_factor=4, min_score=0.05).tokens == (5, 9, 1)
    assert index_of(branching).draft(branching, k=4, spec_factor=4, min_score=0.04).tokens == (5, 9, 1, 2)
    context = [*TEXT, 9, 12, 13]  # a 2-token match
    assert index_of(context).draft(context, k=8).tokens == (14, 15)  # spec_factor 1: at most 2 tokens
    assert index_of(context).draft(context, k=8, spec_factor=3, min_score=0.0).tokens == (14, 15, 16, 17, 9, 12)
    assert index_of(context).draft(context, k=8, spec_factor=3).tokens == (14, 15, 16, 17, 9)  # 6th: 1/12


def test_a_match_that_runs_into_the_end_of_another_text_is_drafted_to_there():
    # an owner's store ends "2 2 2": after "2" came 2 twice, after "2 2" once and then the end of the text
    assert index_of([1, 2, 2, 2]).draft([0, 2], k=8, spec_factor=8, min_score=0.0).tokens == (2, 2)


def test_nothing_matched_drafts_nothing():
    assert index_of(TEXT).draft([*TEXT, 99], k=4) == NO_DRAFT
    assert index_of(TEXT).draft(TEXT, k=4) == NO_DRAFT  # its own last token: nothing follows it
    assert index_of([]).draft([3], k=4) == NO_DRAFT


def test_an_index_keeps_its_latest_tokens_in_bounded_memory():
    index = SuffixIndex(capacity=64)
    for start in range(0, 10_000, 7):
        index.extend(range(start, start + 7))
        assert len(index) <= 64
    assert sum(len(positions) for positions in index._at.values()) == len(index)
    recent = index.tokens[-10:]
    context = [*index.tokens, *recent[:3]]
    assert index.draft(context, k=3, spec_factor=1).tokens == tuple(recent[3:6])


def test_sessions_draft_from_their_own_tokens_only():
    drafter = SuffixDrafter()
    assert drafter.propose("a", "key", [*TEXT, 10, 11], k=3).tokens == (12, 13)  # a 2-token match
    assert drafter.propose("b", "key", [7, 10, 11], k=3) == NO_DRAFT  # a's text is not b's


def test_an_owner_store_drafts_for_that_owner_and_never_for_another():
    drafter = SuffixDrafter()
    drafter.finished("alice", [*TEXT])
    context = [1, 10, 11, 12]
    assert drafter.propose("s1", "alice", context, k=3).tokens == (13, 14, 15)
    assert drafter.propose("s2", "bob", context, k=3) == NO_DRAFT


def test_no_match_runs_across_two_outputs_of_an_owner():
    drafter = SuffixDrafter()
    drafter.finished("alice", [1, 2, 3])
    drafter.finished("alice", [4, 5, 6])
    assert list(drafter._owners["alice"].tokens) == [1, 2, 3, SEPARATOR, 4, 5, 6, SEPARATOR]
    assert drafter.propose("s", "alice", [9, 3], k=2) == NO_DRAFT  # 3 ended an output: what followed is no text


def test_a_session_index_is_rebuilt_when_its_history_is_not_what_it_took_in():
    drafter = SuffixDrafter()
    drafter.propose("s", "key", [*TEXT, 10], k=2)  # indexed TEXT + [10]
    other = [20, 21, 22, 20, 21]  # the same id, another history (e.g. another coordinator's)
    assert drafter.propose("s", "key", other, k=2).tokens == (22, 20)
    assert 10 not in drafter._sessions["s"][1].tokens


def test_sessions_and_owners_are_evicted_least_recently_used_first():
    drafter = SuffixDrafter(max_sessions=2, max_owners=2)
    for session in ("a", "b", "c"):
        drafter.propose(session, "key", TEXT, k=1)
    assert list(drafter._sessions) == ["b", "c"]
    for owner in ("x", "y", "x", "z"):
        drafter.finished(owner, TEXT)
    assert list(drafter._owners) == ["x", "z"]
    drafter.release("b")
    assert list(drafter._sessions) == ["c"]


def test_random_texts_and_contexts_give_drafts_that_occurred_after_the_match():
    rng = random.Random(0)
    for _ in range(3000):
        text = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        index = SuffixIndex(capacity=rng.choice([8, 16, 1000]))
        index.extend(text)
        draft = index.draft(context, k=8, spec_factor=8, min_score=0.0)
        held = list(index.tokens)
        wanted = [*context[-draft.match:], *draft.tokens] if draft.tokens else []
        assert not wanted or any(held[i:i + len(wanted)] == wanted for i in range(len(held))), (text, context)
        assert list(draft.scores) == sorted(draft.scores, reverse=True)
