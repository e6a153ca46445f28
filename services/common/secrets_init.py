"""`specd keys init`: the deployment's secrets, made once and kept, in one directory per container
that reads them (each container mounts its own directory and sees nothing else):

    coordinator/api-keys         an API key, a `name:key` line the coordinator reads
    coordinator/redis-password   the session store's password, as the coordinator reads it
    redis/password               the same password, for Redis's own health check
    redis/auth.conf              the same password as a redis.conf line (`requirepass`): Redis reads
                                 it from this file, never from its command line
    tls/<role>/                  the services' TLS certificates (`specd certs`), each role's own;
                                 tls/edge/ the coordinator's client edge's (clients trust its ca.pem)

Every key file is 0600 in a 0700 directory. Existing files are left as they are, so running it on
every start (compose's `keys` service does) changes nothing after the first time; a directory made
before this layout (api-keys and redis-password at the top) has them moved into coordinator/.
Nothing secret is returned or printed: the caller learns which files were made."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from services.common import certs
from services.common.tls import CA_FILE, CALLER

API_KEYS, REDIS_PASSWORD, TLS = "api-keys", "redis-password", "tls"
COORDINATOR, REDIS = CALLER, "redis"  # the directories: each container mounts its own
REDIS_OWN_PASSWORD, REDIS_AUTH_CONF = "password", "auth.conf"
# compose runs Redis as the official image's `redis` user (compose.yaml: `user: "999:1000"`);
# with `owner` given, Redis's files are handed to it, everything else to `owner`.
REDIS_USER = (999, 1000)
KEY_NAME = "default"


def init(directory: Path, owner: int | None = None) -> dict[str, Path]:
    """Create what is missing; returns what was made, name -> path (nothing when all existed).
    `owner`: a uid to hand the files to (a root init container making them for the service user)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    coordinator, redis = _private_dir(directory / COORDINATOR), _private_dir(directory / REDIS)
    _move_old_layout(directory, coordinator)
    made: dict[str, Path] = {}
    if _create(coordinator / API_KEYS, f"{KEY_NAME}:{secrets.token_urlsafe(32)}\n"):
        made[API_KEYS] = coordinator / API_KEYS
    if _create(coordinator / REDIS_PASSWORD, secrets.token_urlsafe(32) + "\n"):
        made[REDIS_PASSWORD] = coordinator / REDIS_PASSWORD
    password = (coordinator / REDIS_PASSWORD).read_text().strip()
    for name, content in ((REDIS_OWN_PASSWORD, password + "\n"), (REDIS_AUTH_CONF, redis_auth_conf(password))):
        if _create(redis / name, content):
            made[f"{REDIS}/{name}"] = redis / name
    # A set from before the edge's certificate (tls/edge/) is replaced as a whole: its CA's key is gone.
    if not all((directory / TLS / role / CA_FILE).exists() for role in (CALLER, certs.EDGE)):
        certs.make(directory / TLS, owner=owner, per_role=True)
        made[TLS] = directory / TLS
    if owner is not None:
        _chown_tree(directory, (owner, owner), recursive=False)
        _chown_tree(coordinator, (owner, owner))
        _chown_tree(redis, REDIS_USER)
        _chown_tree(directory / TLS / REDIS, REDIS_USER)  # Redis's certificate and key, for its TLS port
    return made


def redis_auth_conf(password: str) -> str:
    """The redis.conf line that sets the password (token_urlsafe: nothing to escape)."""
    return f'requirepass "{password}"\n'


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # compose may have made it first (0755), to mount it
    return path


def _create(path: Path, content: str) -> bool:
    """Write a new 0600 file; False when it exists already (never overwritten)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        file.write(content)
    return True


def _move_old_layout(directory: Path, coordinator: Path) -> None:
    """api-keys and redis-password at the top (the layout before coordinator/): moved, so the key
    and the password the clients and Redis already have stay in force."""
    for name in (API_KEYS, REDIS_PASSWORD):
        old, new = directory / name, coordinator / name
        if old.is_file() and not new.exists():
            os.replace(old, new)


def _chown_tree(path: Path, user: tuple[int, int], recursive: bool = True) -> None:
    if not path.exists():
        return
    os.chown(path, *user)
    if recursive:
        for child in path.rglob("*"):
            os.chown(child, *user)
