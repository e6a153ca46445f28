"""Which replica serves a session: rendezvous (highest-random-weight) hashing of the session id
over the replicas' addresses. Every coordinator computes the same order without talking to the
others; adding a replica moves only the sessions it now ranks first for (about 1/(N+1) of them)
and losing one moves only its own."""

from __future__ import annotations

import hashlib
from typing import Iterable


def score(session_id: str, address: str) -> int:
    digest = hashlib.blake2b(f"{address}\0{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(session_id: str, addresses: Iterable[str]) -> list[str]:
    """The addresses, the session's first choice first."""
    return sorted(addresses, key=lambda address: (score(session_id, address), address), reverse=True)
