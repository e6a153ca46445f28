"""`specd keys init`: secrets made once, private, and never overwritten."""

from __future__ import annotations

import stat

from services.common.tls import TlsFiles
from services.coordinator.auth import ApiKeys
from tests.procs import specd


def test_keys_init_makes_private_secrets_once(tmp_path, capsys):
    where = tmp_path / "secrets"
    assert specd(["keys", "init", "--dir", str(where)]) == 0
    first = capsys.readouterr().out
    keys, password = (where / "api-keys").read_text(), (where / "redis-password").read_text()
    assert "API key" in first and keys.split(":", 1)[1].strip() in first
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert all(stat.S_IMODE((where / f).stat().st_mode) == 0o600 for f in ("api-keys", "redis-password"))
    assert ApiKeys.from_file(where / "api-keys").required and len(password.strip()) >= 40
    ca = (where / "tls" / "coordinator" / "ca.pem").read_bytes()
    for role in ("draft", "target", "coordinator"):  # each container mounts its own directory: no other's key
        assert sorted(p.name for p in (where / "tls" / role).iterdir()) == sorted(["ca.pem", f"{role}.pem", f"{role}-key.pem"])
        assert (where / "tls" / role / "ca.pem").read_bytes() == ca
        TlsFiles(where / "tls" / role, role).check()
    assert specd(["keys", "init", "--dir", str(where)]) == 0  # again: nothing changes
    assert "nothing changed" in capsys.readouterr().out
    assert (where / "api-keys").read_text() == keys and (where / "redis-password").read_text() == password
    assert (where / "tls" / "coordinator" / "ca.pem").read_bytes() == ca

