"""Dependencies point one way: the core (specd/) imports no service, services import no
benchmark, and the coordinator process loads no torch (it runs no model)."""

from __future__ import annotations

import ast
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
