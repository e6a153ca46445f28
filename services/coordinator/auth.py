"""API keys at the client edges (REST bearer token, gRPC `authorization` metadata).

Keys come from a secret file, one per line: `name:key` (the name is who owns the sessions that
key creates, and what logs and metrics may show) or a bare `key` (named by its hash). Blank
lines and `#` comments are skipped. With no file, the edge is open and every client is the
anonymous owner "" (a local deployment); `specd up` says so when it starts.

The file is read again when it changes (a rotated Secret: a key removed is refused from the next
request on, a key added works) or on SIGHUP (`reload`), with no restart.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from pathlib import Path

from services.common.watch import signature

MIN_KEY_CHARS = 16
CHECK_EVERY_S = 1.0  # a request looks at the file's signature (one stat) at most this often
log = logging.getLogger(__name__)


class Unauthenticated(Exception):
    """Missing, malformed or unknown API key."""


def read_keys(path: Path) -> dict[str, str]:
    """key -> owner name; ValueError (naming the line) for a file that is not a key file."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"{path}: cannot read the API keys ({error.strerror})") from error
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
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
    return keys


class ApiKeys:
    def __init__(self, keys: dict[str, str], path: Path | None = None, check_every_s: float = CHECK_EVERY_S):
        """`path`: the file `keys` came from, read again when it changes (looked at no more than
        once every `check_every_s`)."""
        self._keys = keys  # key -> owner name
        self._path, self.check_every_s = path, check_every_s
        self._seen = signature(path) if path else None
        self._looked_at = time.monotonic()

    @classmethod
    def open(cls) -> "ApiKeys":
        return cls({})

    @classmethod
    def from_file(cls, path: Path, check_every_s: float = CHECK_EVERY_S) -> "ApiKeys":
        """ValueError for a file that does not parse: at start-up there is no last good set."""
        seen = signature(path)  # before reading: a change while it is read is read again
        keys = cls(read_keys(path), path, check_every_s)
        keys._seen = seen
        return keys

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def reload(self) -> None:
        """Read the file again now (SIGHUP)."""
        self._refresh(force=True)

    def _refresh(self, force: bool = False) -> None:
        if self._path is None:
            return
        now = time.monotonic()
        if not force and now - self._looked_at < self.check_every_s:
            return
        self._looked_at, seen = now, signature(self._path)
        if seen == self._seen and not force:
            return
        self._seen = seen  # a broken file is reported once, and read again when it changes again
        try:
            keys = read_keys(self._path)
        except ValueError as error:
            # Keep the last good set: failing closed would lock every client out over a typo or a
            # half-written file, while a key removed from a broken file stays usable only until
            # the file is fixed; the error says what to fix.
            log.error("API keys: %s; keeping the %d keys read before", error, len(self._keys))
            return
        if keys != self._keys:
            log.info("API keys: %s read again: %d keys (%d added, %d removed)", self._path, len(keys),
                     len(keys.keys() - self._keys.keys()), len(self._keys.keys() - keys.keys()))
        self._keys = keys

    def owner(self, authorization: str | None) -> str:
        """The owner for an `Authorization: Bearer <key>` value; "" when the edge is open."""
        self._refresh()
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
