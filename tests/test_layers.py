"""Dependencies point one way: the core (specd/) imports no service, services import no
benchmark, and the coordinator process loads no torch (it runs no model)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported(package: str) -> dict[str, set[str]]:
    """Each module file of `package` and the top-level packages it imports."""
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        if "protogen" in path.parts:
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_the_core_imports_no_service_and_services_no_benchmark():
    assert {f for f, names in imported("specd").items() if names & {"services", "benchmarks"}} == set()
    assert {f for f, names in imported("services").items() if "benchmarks" in names} == set()


def test_the_coordinator_process_imports_no_torch():
    modules = sorted(f"services.coordinator.{p.stem}" for p in (ROOT / "services" / "coordinator").glob("*.py"))
    code = "; ".join([*(f"import {m}" for m in modules), "import sys", "print('torch' in sys.modules)"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", f"importing {modules} loaded torch"


def test_every_default_comes_from_one_place(monkeypatch):
    """The policy's defaults are the request limits' and every flag's (the issue found them disagreeing)."""
    from services.common import model_main
    from services.coordinator import root
    from services.coordinator.requests import Limits
    from specd.engine import EngineConfig
    from specd.policy import PolicyConfig
    from tests.procs import up_commands, value

    for name in [n for n in os.environ if n.startswith("SPECD_")]:
        monkeypatch.delenv(name)
    policy, limits = PolicyConfig(), Limits()
    assert (limits.default_k, limits.max_k, limits.min_confidence) == (policy.default_k, policy.max_k,
                                                                        policy.min_confidence)
    coordinator = root.parse(["--model-dir", "m", "--redis-url", "redis://x"])
    assert (coordinator.default_k, coordinator.max_k, coordinator.draft_confidence) == (
        policy.default_k, policy.max_k, policy.min_confidence)
    assert int(value(up_commands(monkeypatch)["coordinator"], "--default-k")) == policy.default_k
    assert model_main.parse("draft", 1, ["--model-dir", "m"]).max_sessions == EngineConfig.max_sessions
