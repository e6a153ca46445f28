"""Verification of a draft: greedy and lossless rejection sampling (Leviathan et al., Chen et al.).

Vocabulary as in vLLM: *accepted* draft tokens, the *recovered* token drawn from the
residual norm(max(0, p - q)) at the first rejection, the *bonus* token drawn from p at
position K+1 when all K drafts are accepted. Pure functions on tensors.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specd.contracts import Verdict  # re-exported: the wire types live in specd/contracts.py
from specd.sampling import sample


def verify_greedy(draft_tokens: Sequence[int], target_tokens: Sequence[int]) -> Verdict:
    """Accept drafts while they equal the target's argmax. draft_tokens: [K]; target_tokens: [K+1],
    the target's argmax after each prefix."""
    num_accepted = 0
    for drafted, wanted in zip(draft_tokens, target_tokens):
        if drafted != wanted:
            break
        num_accepted += 1
    return Verdict(num_accepted, target_tokens[num_accepted])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over [vocab]; falls back to p when rounding leaves no mass."""
    r = (p.double() - q.double()).clamp_min(0.0)  # [vocab]
    total = r.sum()
    return r / total if total > 0 else p.double()


def verify(
    draft_tokens: Sequence[int],
    q: torch.Tensor,
    p: torch.Tensor,
    u_accept: Sequence[float],
    u_sample: Sequence[float],
) -> Verdict:
    """Lossless stochastic verification.

    draft_tokens: [K], each drawn from its row of q
    q: [K, vocab] draft probabilities (exactly those the drafts were sampled from)
    p: [K+1, vocab] target probabilities (already warped)
    u_accept: [K] uniforms for the accept tests; u_sample: [K+1] uniforms for recovered/bonus draws
    """
    K = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        # Accept with probability min(1, p(x)/q(x)); written without a division.
        accepted = u_accept[i] * float(q[i, x]) < float(p[i, x])
        if not accepted:
            recovered = sample(residual(p[i], q[i]), u_sample[i])
            return Verdict(i, recovered)
    bonus = sample(p[K], u_sample[K])
    return Verdict(K, bonus)
