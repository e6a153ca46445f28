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

from specd import native
from specd.contracts import SamplingParams  # re-exported: the wire type lives in specd/contracts.py


def top1(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's greedy token and its probability (logits: [rows, vocab]): torch.argmax's choice (the
    first greatest; a NaN counts as greatest) and exp(max - logsumexp), without a softmax over the
    vocabulary. One pass of specd's C library over float32 rows (torch's reductions take 3-10x as long
    over a 152k vocabulary), torch's where there is none."""
    lib = native.loaded()
    if lib is None or logits.dtype != torch.float32:
        values, tokens = logits.max(-1)
        return tokens.tolist(), (values - logits.logsumexp(-1)).exp().tolist()
    rows = logits.contiguous()
    tokens = torch.empty(rows.shape[0], dtype=torch.int64)
    sums = torch.empty(rows.shape[0], dtype=torch.float64)
    lib.specd_top1(rows.data_ptr(), rows.shape[0], rows.shape[1], tokens.data_ptr(), sums.data_ptr())
    return tokens.tolist(), (1.0 / sums).tolist()


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
