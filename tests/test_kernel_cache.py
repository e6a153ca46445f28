"""The compiled kernel cache (specd/native.py) is trusted only when this user owns it and no one else
can write it: loading a library runs its code in the model service, so a library another user wrote,
or could swap, is refused before it is loaded (or built into)."""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from specd import native

OTHER_UID = 65534  # nobody


@pytest.fixture(autouse=True)
def fresh_library():
    """library() is cached per process: each test looks at its own cache directory, and the tests after
    these load the session's library again."""
    native.library.cache_clear()
    yield
    native.library.cache_clear()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A cache directory that library() created and built into (the only compile in this file)."""
    cache = tmp_path_factory.mktemp("cache") / "specd" / "kernels"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECD_KERNEL_CACHE", str(cache))
        native.library.cache_clear()
        try:
            native.library(native.default_march())
        except native.UntrustedCache:
            raise
        except RuntimeError as error:  # no x86-64 CPU with AVX2, or no C compiler: tests/test_quants.py skips too
            pytest.skip(f"specd's kernels cannot be built here: {error}")
        finally:
            native.library.cache_clear()
    return cache


def use(monkeypatch, cache: Path) -> None:
    """Point library() at `cache`, and fail the test if it builds or loads anything."""
    monkeypatch.setenv("SPECD_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("built into an untrusted cache"))
    monkeypatch.setattr(native.ctypes, "CDLL", lambda *a, **k: pytest.fail("loaded an untrusted library"))


def assert_refused(path: Path, why: str) -> None:
    """library() refuses the cache, naming `path` and `why` (a pattern)."""
    with pytest.raises(native.UntrustedCache, match=rf"{re.escape(str(path))}.*{why}"):
        native.library(native.default_march())


def copy_of(built: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(directory, library) of a copy of the built cache, modes kept."""
    cache = shutil.copytree(built, tmp_path.resolve() / "kernels")  # as library() names it in a refusal
    (library,) = cache.glob("specd-*.so")
    return cache, library


def test_a_clean_build_makes_a_private_directory_and_loads_again_without_building(built, monkeypatch):
    (library,) = built.glob("specd-*.so")
    assert stat.S_IMODE(built.stat().st_mode) == 0o700
    assert stat.S_IMODE(library.stat().st_mode) & 0o022 == 0
    assert [p.name for p in built.iterdir()] == [library.name]  # the build's temporary directory is gone
    monkeypatch.setenv("SPECD_KERNEL_CACHE", str(built))
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("built again"))
    assert native.library(native.default_march()).specd_matmul


@pytest.mark.parametrize("mode", [0o770, 0o707], ids=["group-writable", "world-writable"])
def test_a_cache_directory_others_can_write_is_refused_before_building(built, tmp_path, monkeypatch, mode):
    cache = tmp_path.resolve() / "kernels"
    cache.mkdir()
    cache.chmod(mode)
    use(monkeypatch, cache)
    assert_refused(cache, "writable by others")


def test_a_cache_directory_others_can_write_is_refused_with_a_library_in_it(built, tmp_path, monkeypatch):
    cache, _ = copy_of(built, tmp_path)
    cache.chmod(0o775)
    use(monkeypatch, cache)
    assert_refused(cache, "writable by others")


@pytest.mark.parametrize("mode", [0o664, 0o646], ids=["group-writable", "world-writable"])
def test_a_library_others_can_write_is_refused(built, tmp_path, monkeypatch, mode):
    cache, library = copy_of(built, tmp_path)
    library.chmod(mode)
    use(monkeypatch, cache)
    assert_refused(library, "writable by others")


def test_a_symbolic_link_in_place_of_the_library_is_refused(built, tmp_path, monkeypatch):
    """Even to a file that would pass: the cache only ever holds files it renamed into place."""
    cache, library = copy_of(built, tmp_path)
    elsewhere = shutil.copy2(library, tmp_path / "elsewhere.so")
    library.unlink()
    library.symlink_to(elsewhere)
    use(monkeypatch, cache)
    assert_refused(library, "symbolic link")


@pytest.mark.parametrize("what", ["library", "directory"])
def test_a_cache_of_another_user_is_refused(built, tmp_path, monkeypatch, what):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user (chown) needs root; the tests run as root in CI")
    cache, library = copy_of(built, tmp_path)
    owned = library if what == "library" else cache
    os.chown(owned, OTHER_UID, -1)
    use(monkeypatch, cache)
    assert_refused(owned, f"uid {OTHER_UID}")
