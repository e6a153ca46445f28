"""Sampling is lossless on real (tiny) models: the tokens that speculative decoding emits
follow the target's warped distribution, at the first and the second generated position, with
and without a confidence stop in drafting.

Runs the services' own role engines (`DraftEngine`, `TargetEngine`, one session at a time) on
two model engines, over many seeds, and compares with the exact distributions computed from the
target alone with a chi-square test; for each target numerics a deployment may run (a Hugging
Face checkpoint's dense weights, a GGUF file as stored).
The negative case swaps the residual for p and must fail.
"""

from __future__ import annotations

import pytest
import torch

from specd import verify as verify_mod
from specd.engine import EngineConfig, ModelEngine
from specd.sampling import SamplingParams, warp
from specd.model_free import proposal as point_mass_proposal
from tests.engines import propose, verify_proposal
from tests.tiny_gguf import write_tiny

pytestmark = pytest.mark.slow  # thousands of sampled rounds per case (~3 min)

PARAMS = dict(temperature=1.0, top_k=6, top_p=1.0)
N_SAMPLES = 2500
K = 3


@pytest.fixture(scope="module", params=["dense", "gguf"], ids=lambda kind: f"{kind}-target")
def engines(tiny_pair, tmp_path_factory, request):
    """A draft and a target of each kind a deployment serves; the GGUF draft has weights of its own
    (another seed), so that it is often rejected."""
    if request.param == "dense":
        return ModelEngine(EngineConfig(tiny_pair[0])), ModelEngine(EngineConfig(tiny_pair[1]))
    out = tmp_path_factory.mktemp("distribution")
    draft = write_tiny(out / "draft.gguf", "qwen2", "Q4_K", seed=1)
    return ModelEngine(EngineConfig(draft)), ModelEngine(EngineConfig(write_tiny(out / "target.gguf", "qwen2", "Q6_K")))


PROMPT = [72, 101, 108, 108, 111]


def exact_marginals(target: ModelEngine) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x1) and p(x2) = sum_t p(t) p(x2 | t) from the target alone."""
    params = SamplingParams(**PARAMS, seed=0)
    target.sync("exact", 0, PROMPT)
    first = warp(target.forward("exact")[-1:], params)[0].double()  # [vocab]
    second = torch.zeros_like(first)
    for t in first.nonzero().flatten().tolist():
        target.sync("exact", len(PROMPT), [t])
        second += first[t] * warp(target.forward("exact")[-1:], params)[0].double()
    target.release("exact")
    return first, second


def speculative_first_two(
    draft: ModelEngine, target: ModelEngine, seed: int, min_confidence: float = 0.0, lengths: list[int] | None = None
) -> list[int]:
    params = SamplingParams(**PARAMS, seed=seed)
    committed = list(PROMPT)
    draft.sync("s", 0, committed)
    target.sync("s", 0, committed)
    while len(committed) < len(PROMPT) + 2:
        n = len(committed)
        proposal = propose(draft, "s", K, params, min_confidence)
        if lengths is not None:
            lengths.append(len(proposal.tokens))
        verdict = verify_proposal(target, "s", proposal, params)
        committed += list(proposal.tokens[: verdict.num_accepted]) + [verdict.next_token]
        draft.sync("s", n + verdict.num_accepted, [verdict.next_token])
    draft.release("s")
    target.release("s")
    return committed[len(PROMPT) : len(PROMPT) + 2]


def chi_square_p_value(samples: list[int], expected: torch.Tensor) -> float:
    support = expected > 1e-9
    counts = torch.bincount(torch.tensor(samples), minlength=expected.numel()).double()
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    e = expected[support] * len(samples)
    statistic = float(((counts[support] - e) ** 2 / e).sum())
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def p_values(engines, min_confidence: float = 0.0, lengths: list[int] | None = None) -> tuple[float, float]:
    draft, target = engines
    first, second = exact_marginals(target)
    runs = [speculative_first_two(draft, target, seed, min_confidence, lengths) for seed in range(N_SAMPLES)]
    return chi_square_p_value([r[0] for r in runs], first), chi_square_p_value([r[1] for r in runs], second)


@pytest.mark.parametrize("min_confidence", [0.0, 0.3])
def test_first_and_second_tokens_follow_the_target_distribution(engines, min_confidence):
    lengths: list[int] = []
    p_first, p_second = p_values(engines, min_confidence, lengths)
    assert p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)
    # a confidence stop ends drafting where the draft is unsure; without one, K is drafted
    assert (set(lengths) == {K}) == (min_confidence == 0.0) and min(lengths) >= 1


def test_the_test_catches_resampling_from_p_after_a_rejection(engines, monkeypatch):
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: p.double())
    p_first, p_second = p_values(engines)
    assert min(p_first, p_second) < 1e-6, (p_first, p_second)


# -- model-free drafts: a point mass (q one-hot) -------------------------------------------------


def point_mass_first_two(target: ModelEngine, guesses: tuple[int, ...], seed: int) -> list[int]:
    """Two tokens from rounds whose drafts are fixed guesses with q one-hot (a model-free drafter's)."""
    params = SamplingParams(**PARAMS, seed=seed)
    committed = list(PROMPT)
    target.sync("m", 0, committed)
    while len(committed) < len(PROMPT) + 2:
        draft = point_mass_proposal(guesses, greedy=False)
        verdict = verify_proposal(target, "m", draft, params)
        committed += list(guesses[: verdict.num_accepted]) + [verdict.next_token]
    target.release("m")
    return committed[len(PROMPT) : len(PROMPT) + 2]


def point_mass_p_values(target: ModelEngine) -> tuple[float, float]:
    first, second = exact_marginals(target)
    top = torch.argsort(first, descending=True)[:2].tolist()  # a likely guess, then a less likely one
    runs = [point_mass_first_two(target, (top[0], top[1], top[0]), seed) for seed in range(N_SAMPLES)]
    return chi_square_p_value([r[0] for r in runs], first), chi_square_p_value([r[1] for r in runs], second)


def test_point_mass_drafts_follow_the_target_distribution(engines):
    p_first, p_second = point_mass_p_values(engines[1])
    assert p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)


def test_the_test_catches_a_point_mass_rejection_resampled_from_p(engines, monkeypatch):
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: p.double())  # x not taken out of p
    p_first, p_second = point_mass_p_values(engines[1])
    assert min(p_first, p_second) < 1e-6, (p_first, p_second)
