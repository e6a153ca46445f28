"""API keys at the client edges (REST bearer token, gRPC `authorization` metadata).

Keys come from a secret file, one per line: `name:key` (the name is who owns the sessions that
key creates, and what logs and metrics may show) or a bare `key` (named by its hash). Blank
lines and `#` comments are skipped. With no file, the edge is open and every client is the
anonymous owner "" (a local deployment); `specd up` says so when it starts.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

MIN_KEY_CHARS = 16


class Unauthenticated(Exception):
    """Missing, malformed or unknown API key."""


class ApiKeys:
    def __init__(self, keys: dict[str, str]):
        self._keys = keys  # key -> owner name

    @classmethod
    def open(cls) -> "ApiKeys":
        return cls({})

    @classmethod
    def from_file(cls, path: Path) -> "ApiKeys":
        keys: dict[str, str] = {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, key = line.rpartition(":")
            key = key.strip()
            if len(key) < MIN_KEY_CHARS:
                raise ValueError(f"{path}:{number}: an API key needs at least {MIN_KEY_CHARS} characters")
            keys[key] = name.strip() or "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        if not keys:
            raise ValueError(f"{path}: no API keys in the file")
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def owner(self, authorization: str | None) -> str:
        """The owner for an `Authorization: Bearer <key>` value; "" when the edge is open."""
        if not self.required:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>`")
        owner = None
        for key, name in self._keys.items():  # compare with every key: timing says nothing of which
            if hmac.compare_digest(key.encode(), token.strip().encode()):
                owner = name
        if owner is None:
            raise Unauthenticated("invalid API key")
        return owner
