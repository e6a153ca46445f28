"""Verification math: greedy tables, and the lossless property of rejection sampling.

The statistical tests run the full multi-round speculative procedure on a Markov-chain
"model pair" whose exact marginals are known, so they check every position, not just
the first; the negative case shows the bound catches a classic bug (resampling from p
instead of the residual after a rejection).
"""

from __future__ import annotations

import pytest
import torch

from specd import verify as verify_mod
from specd.sampling import sample, uniforms
from specd.verify import Verdict, residual, verify, verify_greedy

V = 6


@pytest.mark.parametrize(
    "draft, target_argmax, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], Verdict(3, 4)),  # all accepted: bonus token
        ([1, 2, 3], [0, 2, 3, 4], Verdict(0, 0)),  # first rejected: recovered = target argmax
        ([1, 2, 3], [1, 2, 5, 4], Verdict(2, 5)),
        ([], [2], Verdict(0, 2)),  # K = 0 is a plain step
    ],
)
def test_greedy_table(draft, target_argmax, expected):
    assert verify_greedy(draft, target_argmax) == expected


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_accepts_when_p_dominates_and_rejects_impossible_tokens():
    q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0]])
    p = torch.tensor([[0.0, 1.0, 0, 0, 0, 0], [0, 0, 1.0, 0, 0, 0]])
    assert verify([1], q, p, [0.999], [0.5, 0.5]) == Verdict(1, 2)  # p(1) >= q(1): always accepted, bonus = 2
    assert verify([0], q, p, [0.0], [0.5, 0.5]) == Verdict(0, 1)  # p(0) = 0: rejected, recovered from residual


def test_sample_never_returns_zero_probability_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    assert {sample(probs, u) for u in [0.0, 0.25, 0.4999, 0.5, 0.75, 0.999999]} == {1, 3}


def test_uniforms_are_keyed_and_reproducible():
    a = uniforms(7, "draft", range(5))
    assert a == uniforms(7, "draft", range(5))
    assert a != uniforms(8, "draft", range(5)) and a != uniforms(7, "accept", range(5))
    assert all(0.0 <= u < 1.0 for u in a)


# --- the lossless property, end to end over several rounds -------------------------------


def markov_pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P and draft Q as next-token tables [V, V], deliberately different."""
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    Q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    return P.double(), Q.double()


def speculative_sequence(P, Q, first: int, length: int, K: int, seed: int) -> list[int]:
    """Run draft -> verify -> commit rounds, with randomness keyed by position as the services do."""
    seq = [first]
    while len(seq) < length + 1:
        n = len(seq)
        u_draft = uniforms(seed, "draft", range(n, n + K))
        drafts, q_rows = [], []
        for i in range(K):
            q_row = Q[(drafts or seq)[-1]]
            drafts.append(sample(q_row, u_draft[i]))
            q_rows.append(q_row)
        p_rows = [P[t] for t in [seq[-1], *drafts]]  # [K+1] target rows after each prefix
        verdict = verify(
            drafts,
            torch.stack(q_rows),
            torch.stack(p_rows),
            uniforms(seed, "accept", range(n, n + K)),
            uniforms(seed, "sample", range(n, n + K + 1)),
        )
        seq += drafts[: verdict.num_accepted] + [verdict.next_token]
    return seq[1 : length + 1]


def total_variation(samples: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=V).double()
    return 0.5 * float((counts / len(samples) - expected).abs().sum())


N_SAMPLES = 6000
TV_BOUND = 0.03  # sampling noise at N = 6000 over 6 tokens is about 0.01


def position_marginals(P: torch.Tensor, first: int, length: int) -> list[torch.Tensor]:
    state = torch.zeros(V, dtype=torch.float64)
    state[first] = 1.0
    out = []
    for _ in range(length):
        state = state @ P
        out.append(state)
    return out


def worst_tv(K: int) -> float:
    P, Q = markov_pair(seed=3)
    length = 4
    runs = [speculative_sequence(P, Q, first=0, length=length, K=K, seed=s) for s in range(N_SAMPLES)]
    expected = position_marginals(P, 0, length)
    return max(total_variation([r[i] for r in runs], expected[i]) for i in range(length))


@pytest.mark.parametrize("K", [1, 3])
def test_output_distribution_equals_target_at_every_position(K):
    assert worst_tv(K) < TV_BOUND


def test_bound_catches_resampling_from_p_instead_of_the_residual(monkeypatch):
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: p.double())
    assert worst_tv(3) > 2 * TV_BOUND
