"""Compact, exact wire encoding of draft distributions.

A draft row q [vocab] is sent as its top tokens (int32 ids) with float16 probabilities,
keeping the smallest prefix that covers all but `TAIL_MASS` of the mass (at most
`MAX_SUPPORT` entries). The draft then *samples from the decoded row*, so the q the
target verifies against is exactly the q the draft token came from: verification stays
lossless; the truncation only lowers acceptance by at most the dropped tail.

Size: 6 bytes per kept entry, at most 6 * MAX_SUPPORT = 24 KiB per draft token
(a dense float32 row of the 151,936-token Qwen vocabulary is 594 KiB). Greedy rounds
send no distributions at all: only K token ids.
"""

from __future__ import annotations

import numpy as np
import torch

from specd.contracts import SparseDist  # re-exported: the wire type lives in specd/contracts.py
from specd.validation import InvalidParams

MAX_SUPPORT = 4096
TAIL_MASS = 1e-4


def encode(q: torch.Tensor) -> SparseDist:
    """q: [vocab] probabilities -> SparseDist of its top mass."""
    values, ids = torch.sort(q.float(), descending=True)  # [vocab]
    covered = values.cumsum(0) - values < 1.0 - TAIL_MASS  # entries needed before the tail
    n = max(1, min(int(covered.sum()), MAX_SUPPORT))
    probs16 = values[:n].numpy().astype("<f2")
    keep = probs16 > 0  # float16 underflow: a zero entry would be a dead weight on the wire
    keep[0] = True
    return SparseDist(ids[:n].numpy()[keep].astype("<i4").tobytes(), probs16[keep].tobytes())


def decode(dist: SparseDist, vocab_size: int) -> torch.Tensor:
    """SparseDist -> q: [vocab] float64, normalised. Deterministic: both services call this."""
    ids = np.frombuffer(dist.token_ids, dtype="<i4")
    probs = np.frombuffer(dist.probs, dtype="<f2").astype(np.float64)
    if ids.shape != probs.shape or ids.size == 0:
        raise InvalidParams("draft distribution: token_ids and probs must be non-empty and the same length")
    if np.unique(ids).size != ids.size:
        raise InvalidParams("draft distribution: token ids must be distinct")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise InvalidParams(f"draft distribution: token id outside [0, {vocab_size})")
    if not np.isfinite(probs).all() or (probs < 0).any() or probs.sum() <= 0:
        raise InvalidParams("draft distribution: probabilities must be finite, >= 0 and not all zero")
    q = torch.zeros(vocab_size, dtype=torch.float64)
    q[torch.from_numpy(ids.astype(np.int64))] = torch.from_numpy(probs)
    return q / q.sum()
