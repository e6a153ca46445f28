"""specd's C library (specd/csrc): the GGUF block kernels and the decoder, built once per source and CPU.

Compiled with the C compiler on PATH and `-march=native` (AVX-512 VNNI where the CPU has it, else
AVX2) into the kernel cache directory; `available()` says why not when it cannot be built, and the
engine then refuses the GGUF path with that reason. That directory and each library in it must
belong to this user and be writable by no one else, or nothing is built there or loaded from it.
`-ffp-contract=off` keeps every float sum in the order the source writes it: the kernels' batch
invariance rests on that.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("quants.c", "decoder.c")
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
NATIVE = "native"  # -march: this CPU's widest path; "haswell" builds the AVX2 path (tests run both)
MARCH_PATTERN = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")


def default_march() -> str:
    """SPECD_MARCH (e.g. "haswell": the AVX2 build on an AVX-512 host, or one build for a mixed fleet), else native."""
    march = os.environ.get("SPECD_MARCH", NATIVE)
    if not MARCH_PATTERN.fullmatch(march):
        raise RuntimeError(f"SPECD_MARCH must be a -march name such as haswell or native, not {march!r}")
    return march


def available() -> str | None:
    """None when the library builds and loads here, else why not."""
    try:
        library(default_march())
    except (OSError, RuntimeError) as error:
        return str(error)
    return None


@lru_cache(maxsize=1)
def loaded() -> ctypes.CDLL | None:
    """This host's library, or None where it cannot be built (callers then take torch's path)."""
    try:
        return library(default_march())
    except (OSError, RuntimeError):
        return None


def cache_dir() -> Path:
    env = os.environ.get("SPECD_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specd" / "kernels"


def cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


@lru_cache(maxsize=None)
def library(march: str = NATIVE) -> ctypes.CDLL:
    """The loaded library for `march`, built first when this source and CPU have no cached copy."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"specd's kernels are written for x86-64 (AVX2), not {platform.machine()}")
    if "avx2" not in cpu_flags() or "fma" not in cpu_flags():
        raise RuntimeError("specd's kernels need a CPU with AVX2 and FMA")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH to build specd's kernels: apt-get install gcc")
    sources = [CSRC / name for name in SOURCES]
    flags = [f"-march={march}", *FLAGS]
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, CSRC / "quants.h"]))
    digest.update((" ".join(flags) + cpu_flags()).encode())
    directory = cache_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = _private(directory.resolve()) / f"specd-{march}-{digest.hexdigest()[:16]}.so"
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            done = subprocess.run([compiler, *flags, *map(str, sources), "-lm", "-o", str(built)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building specd's kernels failed:\n{done.stderr[-2000:]}")
            built.chmod(0o644)
            built.replace(path)  # atomic: a concurrent builder finds a whole file or none
    import torch  # noqa: F401  (its OpenMP runtime, same soname, is the one the kernels join)

    return _declare(ctypes.CDLL(str(_private(path))))


class UntrustedCache(RuntimeError):
    """The kernel cache, or a library in it, is one that another user could have written."""


def _private(path: Path) -> Path:
    """`path`, if no other user can have written it: loading a library runs its code in this process.
    The cache directory may be reached through a link (its target is checked), a library may not."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link (the cache holds only files it built): remove it"
    elif info.st_uid != os.geteuid():
        problem = (f"belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}): remove it, or set "
                   "SPECD_KERNEL_CACHE to a directory of your own")
    elif info.st_mode & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(info.st_mode):o}): chmod go-w it"
    else:
        return path
    raise UntrustedCache(f"refusing specd's kernel cache, where another user could run code in this process: {path} "
                         f"{problem}")


class Linear(ctypes.Structure):
    """gg_linear (quants.h): a weight as stored, and its repacked panels (packed) or None."""

    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64),
                ("bias", ctypes.c_void_p), ("packed", ctypes.c_void_p)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    signatures = {
        "specd_act_of": ([size], ctypes.c_int),
        "specd_act_row_bytes": ([size, size], size),
        "specd_quantize_rows": ([pointer, size, size, size, pointer, ctypes.c_int], None),
        "specd_matmul": ([ctypes.POINTER(Linear), pointer, size, pointer, ctypes.c_int], None),
        "specd_dequantize_rows": ([ctypes.POINTER(Linear), pointer, size, pointer], None),
        "specd_repack_bytes": ([size, size, size], size),
        "specd_repack": ([ctypes.POINTER(Linear), pointer, ctypes.c_int], None),
        "specd_top1": ([pointer, size, size, pointer, pointer], None),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = args, result
    return lib
