"""Logits warping and seeded position-keyed randomness, for the `SamplingParams` a request carries.

Both models' logits go through the same `warp` so that verification compares the
distributions the user asked for. Randomness is keyed by (seed, stream, absolute
position): a retried or re-routed round draws the same numbers, and a uniform is
never consulted twice for a decision that reached the committed output.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from specd.contracts import SamplingParams  # re-exported: the wire type lives in specd/contracts.py


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order HF uses); returns probabilities.

    logits: [n, vocab] -> probs: [n, vocab] float32 (each row sums to 1).
    """
    scores = logits.float() / params.temperature  # [n, vocab]
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [n, vocab]
        sorted_probs = sorted_scores.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first one always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # explicitly: a top_p below float32's range compares as 0
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one token. probs: [vocab] (need not be normalised); u in [0, 1).

    A zero-probability token is never returned: its CDF step is empty.
    """
    cdf = probs.double().cumsum(0)  # [vocab]
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return min(index, probs.shape[0] - 1)


def uniforms(seed: int, stream: str, positions: Sequence[int]) -> list[float]:
    """One uniform in [0, 1) per absolute position, from a keyed hash (same on every machine)."""
    out = []
    for pos in positions:
        digest = hashlib.blake2b(f"{stream}:{pos}".encode(), digest_size=8, key=seed.to_bytes(8, "little")).digest()
        out.append((int.from_bytes(digest, "little") >> 11) / float(1 << 53))
    return out
