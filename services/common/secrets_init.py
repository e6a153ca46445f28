"""`specd keys init`: the deployment's secrets, made once and kept: an API key (`api-keys`, a
`name:key` line the coordinator reads), the session store's password (`redis-password`), each
a 0600 file in a 0700 directory, and the services' TLS certificates (`specd certs`), each
role's in `tls/<role>/` (what its container mounts).
Existing files are left as they are, so running it on every start (compose's `keys` service
does) changes nothing after the first time."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from services.common import certs
from services.common.tls import CA_FILE, CALLER

API_KEYS, REDIS_PASSWORD, TLS = "api-keys", "redis-password", "tls"
KEY_NAME = "default"


def init(directory: Path, owner: int | None = None) -> dict[str, str]:
    """Create what is missing; returns the new files' contents by name (nothing when all existed).
    `owner`: a uid to hand the files to (a root init container making them for the service user)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    made = {}
    for name, content in ((API_KEYS, f"{KEY_NAME}:{secrets.token_urlsafe(32)}\n"),
                          (REDIS_PASSWORD, secrets.token_urlsafe(32) + "\n")):
        path = directory / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as file:
            file.write(content)
        made[name] = content.strip()
    if owner is not None:
        for path in (directory, directory / API_KEYS, directory / REDIS_PASSWORD):
            os.chown(path, owner, owner)
    if not (directory / TLS / CALLER / CA_FILE).exists():
        certs.make(directory / TLS, owner=owner, per_role=True)
        made[TLS] = "a CA and the services' certificates"
    return made
