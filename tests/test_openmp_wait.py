"""specd bounds libgomp's active wait for its services (specd/__init__.py), and leaves a user's own setting
and llama-server's environment alone."""

from __future__ import annotations

import os
import subprocess
import sys

import specd
from benchmarks import llama_server

READ = "import os, specd; print(os.environ.get('GOMP_SPINCOUNT'), specd.SPIN_SET_BY_SPECD)"


def _imported_with(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return subprocess.run([sys.executable, "-c", READ], env=clean | env, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_importing_specd_bounds_the_spin_before_torch_loads_libgomp():
    assert _imported_with() == f"{specd.OMP_SPINCOUNT} True"


def test_a_users_own_openmp_wait_setting_wins():
    assert _imported_with(GOMP_SPINCOUNT="5") == "5 False"
    assert _imported_with(OMP_WAIT_POLICY="active") == "None False"


# Records GOMP_SPINCOUNT as it is when the model services' entry first imports torch (libgomp loads then).
AT_TORCH = """
import builtins, os
load, seen = builtins.__import__, []
def watch(name, *args, **kwargs):
    if name == "torch" and not seen:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
    return load(name, *args, **kwargs)
builtins.__import__ = watch
import services.common.model_main
print(seen)
"""


def test_the_spin_is_set_before_the_model_services_load_torch():
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", AT_TORCH], env=clean, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == repr([str(specd.OMP_SPINCOUNT)])


def test_llama_server_runs_with_its_own_openmp_defaults(monkeypatch):
    monkeypatch.setattr(specd, "SPIN_SET_BY_SPECD", True)
    monkeypatch.setenv("GOMP_SPINCOUNT", str(specd.OMP_SPINCOUNT))
    assert "GOMP_SPINCOUNT" not in llama_server.peer_environment()
    monkeypatch.setattr(specd, "SPIN_SET_BY_SPECD", False)  # the user's own: passed on
    assert llama_server.peer_environment()["GOMP_SPINCOUNT"] == str(specd.OMP_SPINCOUNT)
