"""Model-free drafting: draft tokens taken from text already seen, with no model pass.

Where output repeats its context (code edited in place, answers quoting a given document, chat
that refers back, tool output re-emitted), the continuation of the longest earlier match of the
latest tokens is a good guess, and it costs nothing to make. Two sources, as SuffixDecoding
(Oliaro et al., 2024) has them:

- the session's own tokens (prompt and output), and
- a bounded store of recent outputs of the same owner (API key): never another owner's, so one
  tenant's text neither shapes nor times another's drafts.

Each is a `SuffixIndex`: the longest suffix of the context (up to `max_depth` tokens) that occurred
before, then, position by position, the most frequent next token among those occurrences. A draft
token's score is the chance that the copy goes on to it: each draft token continues a match one
token longer than the last, and an L-token match goes on with odds L : MATCH_PRIOR; times the product
of those frequencies (how sure the text is). Drafting stops below `min_score`, and at
`spec_factor` × the match length (a short match predicts little).

Exactness does not depend on any of this: a model-free draft is a point mass (q one-hot), which
the target's verification accepts with probability p(x) and otherwise resamples from p without x
(`specd/verify.py`: the residual of a one-hot q).
"""

from __future__ import annotations

import struct
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from specd.contracts import Proposal, SparseDist

MAX_DEPTH = 32  # longest suffix matched, tokens
MAX_CANDIDATES = 256  # most recent occurrences of the last token examined (bounds a round's work)
SPEC_FACTOR = 1.0  # tokens drafted per matched token, at most
MIN_SCORE = 0.1  # a draft token's score must reach this
# An L-token match goes on with odds L : MATCH_PRIOR. The frequencies alone scored the first draft after
# a one-token match 0.71 on the repo's prompts' greedy outputs where the target accepted 21-29 %, and
# after 16 or more 1.0 where it accepted 96-99 %; L / (L + 2) tracks the rates between (0.42-0.63 at 2,
# 0.56-0.77 at 3, 0.72-0.92 at 4-15).
MATCH_PRIOR = 2.0
# Memory: ~8 bytes a token held (the token and its position, 32-bit), so at most ~0.2 GB in all.
SESSION_TOKENS = 8192  # a session's index keeps its latest tokens
OWNER_TOKENS = 32768  # an owner's store of recent outputs
MAX_SESSIONS = 2048  # indexes kept (least recently used dropped: rebuilt from the tokens if needed)
MAX_OWNERS = 256
SEPARATOR = -1  # between outputs in an owner's store: no match runs across two of them


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]  # [<= K] the drafted continuation
    scores: tuple[float, ...]  # [<= K] each token's score, non-increasing
    match: int  # the matched suffix's length (0: nothing matched)


NO_DRAFT = Draft((), (), 0)


def point_mass(token: int) -> SparseDist:
    """q for a token drafted with certainty: one-hot, exact on the wire (float16 1.0)."""
    return SparseDist(struct.pack("<i", token), struct.pack("<e", 1.0))


def proposal(tokens: Sequence[int], greedy: bool) -> Proposal:
    """Drafted tokens as the target verifies them: a sampled request sends each one's one-hot q."""
    return Proposal(tuple(tokens), () if greedy else tuple(point_mass(t) for t in tokens))


class SuffixIndex:
    """The positions of every token of a sequence, for finding where a suffix occurred before and
    what followed it. Appending is O(1) a token; the sequence keeps its latest `capacity` tokens
    (older ones go in halves, the index rebuilt: amortised O(1))."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tokens = array("i")
        self._at: dict[int, array] = {}  # token -> its positions, increasing

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            positions = self._at.get(token)
            if positions is None:
                positions = self._at[token] = array("i")
            positions.append(len(self.tokens))
            self.tokens.append(token)
        if len(self.tokens) > self.capacity:
            self._rebuild(self.tokens[len(self.tokens) - self.capacity // 2:])

    def _rebuild(self, tokens: array) -> None:
        self.tokens, self._at = array("i"), {}
        self.extend(tokens)

    def draft(self, context: Sequence[int], k: int, max_depth: int = MAX_DEPTH, spec_factor: float = SPEC_FACTOR,
              min_score: float = MIN_SCORE) -> Draft:
        """What followed the longest earlier occurrence of `context`'s suffix, up to k tokens."""
        ends, match = self._matches(context, max_depth)
        limit = min(k, int(spec_factor * match))
        tokens, scores, score = [], [], 1.0
        while ends and len(tokens) < limit:
            following = Counter(self.tokens[e + 1] for e in ends if e + 1 < len(self.tokens))
            following.pop(SEPARATOR, None)
            if not following:
                break
            token, count = max(following.items(), key=lambda kv: (kv[1], self._latest(ends, kv[0])))
            depth = match + len(tokens)  # the match, extended by the drafts so far
            score *= depth / (depth + MATCH_PRIOR) * count / sum(following.values())
            if score < min_score:
                break
            tokens.append(token)
            scores.append(score)
            ends = [e + 1 for e in ends if e + 1 < len(self.tokens) and self.tokens[e + 1] == token]
        return Draft(tuple(tokens), tuple(scores), match) if tokens else NO_DRAFT

    def _matches(self, context: Sequence[int], max_depth: int) -> tuple[list[int], int]:
        """The end positions of the longest suffix of `context` (up to max_depth) found here with a
        token after it, and its length. Positions where the index's own last tokens are the context
        itself (a session's index holds its context) are not matches: nothing follows them."""
        if not context or context[-1] == SEPARATOR:
            return [], 0
        ends = [e for e in self._at.get(context[-1], ())[-MAX_CANDIDATES:] if e + 1 < len(self.tokens)]
        depth = 1
        while ends and depth < min(max_depth, len(context)):
            wanted = context[-1 - depth]
            longer = [e for e in ends if e - depth >= 0 and self.tokens[e - depth] == wanted]
            if not longer:
                break
            ends, depth = longer, depth + 1
        return ends, depth if ends else 0

    def _latest(self, ends: list[int], token: int) -> int:
        """The latest end followed by `token`: ties go to the most recent text."""
        return max(e for e in ends if e + 1 < len(self.tokens) and self.tokens[e + 1] == token)


class SuffixDrafter:
    """Drafts for many sessions from their own tokens and their owner's recent outputs, in bounded
    memory. The indexes are a cache: a session's is rebuilt from its committed tokens whenever they
    are not what it holds (another coordinator served it, a rollback, an eviction)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_owners: int = MAX_OWNERS,
                 session_tokens: int = SESSION_TOKENS, owner_tokens: int = OWNER_TOKENS):
        self.max_sessions, self.max_owners = max_sessions, max_owners
        self.session_tokens, self.owner_tokens = session_tokens, owner_tokens
        self._sessions: OrderedDict[str, tuple[int, SuffixIndex]] = OrderedDict()  # id -> (committed, index)
        self._owners: OrderedDict[str, SuffixIndex] = OrderedDict()

    def propose(self, session_id: str, owner: str, tokens: Sequence[int], k: int) -> Draft:
        """Up to k draft tokens after `tokens` (the session's committed tokens): the better-scored
        of the session's own continuation and its owner's."""
        if k <= 0 or not tokens:
            return NO_DRAFT
        own = self._session(session_id, tokens).draft(tokens, k)
        store = self._owners.get(owner)
        theirs = store.draft(tokens, k) if store is not None else NO_DRAFT
        return max(own, theirs, key=_worth)

    def finished(self, owner: str, output: Sequence[int]) -> None:
        """A request's output joins its owner's store of recent outputs."""
        if not output:
            return
        store = self._owners.pop(owner, None) or SuffixIndex(self.owner_tokens)
        store.extend([*output, SEPARATOR])
        self._owners[owner] = store
        while len(self._owners) > self.max_owners:
            self._owners.popitem(last=False)

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def _session(self, session_id: str, tokens: Sequence[int]) -> SuffixIndex:
        seen, index = self._sessions.pop(session_id, (0, None))
        if index is None or seen > len(tokens) or not _extends(index, tokens, seen):
            seen, index = 0, SuffixIndex(self.session_tokens)
        index.extend(tokens[seen:])
        self._sessions[session_id] = (len(tokens), index)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return index


def _extends(index: SuffixIndex, tokens: Sequence[int], seen: int) -> bool:
    """Whether `tokens` continue what the index took in (checked at its last token: a session's
    committed tokens only grow, so a different last token means another history)."""
    return seen == 0 or (len(index) > 0 and tokens[seen - 1] == index.tokens[-1])


def _worth(draft: Draft) -> tuple[float, int]:
    """Expected accepted tokens (the scores' sum), then the longer match."""
    return sum(draft.scores), draft.match
