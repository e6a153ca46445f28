"""`specd keys init`: secrets made once, private, one directory per container, never printed and never
overwritten."""

from __future__ import annotations

import os
import stat

import pytest

from services.common import secrets_init
from services.common.tls import TlsFiles
from services.coordinator.auth import ApiKeys
from tests.procs import specd


def test_keys_init_makes_private_secrets_once(tmp_path, capsys):
    where = tmp_path / "secrets"
    assert specd(["keys", "init", "--dir", str(where)]) == 0
    first = capsys.readouterr().out
    coordinator, redis = where / "coordinator", where / "redis"
    keys, password = (coordinator / "api-keys").read_text(), (coordinator / "redis-password").read_text()
    # The key is never printed (logs are not secret): the output says where it is.
    assert keys.split(":", 1)[1].strip() not in first and password.strip() not in first
    assert str(coordinator / "api-keys") in first
    assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in (where, coordinator, redis))
    secret_files = [coordinator / "api-keys", coordinator / "redis-password", redis / "password", redis / "auth.conf"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in secret_files)
    assert ApiKeys.from_file(coordinator / "api-keys").required and len(password.strip()) >= 40
    # Redis reads the same password from a config file (never its command line), and its health check from a file.
    assert (redis / "auth.conf").read_text() == f'requirepass "{password.strip()}"\n'
    assert (redis / "password").read_text() == password
    assert sorted(p.name for p in where.iterdir()) == ["coordinator", "redis", "tls"]  # nothing loose at the top
    ca = (where / "tls" / "coordinator" / "ca.pem").read_bytes()
    for role in ("draft", "target", "coordinator", "redis"):  # each container mounts its own directory: no other's key
        assert sorted(p.name for p in (where / "tls" / role).iterdir()) == sorted(["ca.pem", f"{role}.pem", f"{role}-key.pem"])
        assert (where / "tls" / role / "ca.pem").read_bytes() == ca
        TlsFiles(where / "tls" / role, role).check()
    assert specd(["keys", "init", "--dir", str(where)]) == 0  # again: nothing changes
    assert "nothing changed" in capsys.readouterr().out
    assert (coordinator / "api-keys").read_text() == keys and (coordinator / "redis-password").read_text() == password
    assert (where / "tls" / "coordinator" / "ca.pem").read_bytes() == ca


def test_keys_init_keeps_the_key_and_password_of_the_old_layout(tmp_path):
    """A secrets directory from before coordinator/ (api-keys and redis-password at the top): both are
    moved, not replaced, so clients keep their key and Redis gets the password the coordinator has."""
    where = tmp_path / "secrets"
    where.mkdir(mode=0o700)
    (where / "api-keys").write_text("default:an-old-key-that-clients-hold-0123456789\n")
    (where / "redis-password").write_text("an-old-redis-password-0123456789abcdef\n")
    made = secrets_init.init(where)
    assert "api-keys" not in made and "redis-password" not in made
    assert (where / "coordinator" / "api-keys").read_text() == "default:an-old-key-that-clients-hold-0123456789\n"
    assert (where / "redis" / "auth.conf").read_text() == 'requirepass "an-old-redis-password-0123456789abcdef"\n'
    assert not (where / "api-keys").exists() and not (where / "redis-password").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root (compose's keys step runs as root)")
def test_keys_init_hands_each_directory_to_the_user_of_the_container_that_mounts_it(tmp_path):
    where = tmp_path / "secrets"
    secrets_init.init(where, owner=10001)
    owners = {p.relative_to(where).as_posix(): (p.stat().st_uid, p.stat().st_gid) for p in where.rglob("*")}
    for path, owner in owners.items():
        redis_own = path == "redis" or path.startswith(("redis/", "tls/redis"))
        assert owner == (secrets_init.REDIS_USER if redis_own else (10001, 10001)), path
