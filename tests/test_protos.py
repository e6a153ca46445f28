"""The committed generated code is exactly what scripts/gen_protos.py produces from protos/."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sources(root: Path) -> dict[Path, str]:
    return {p.relative_to(root): p.read_text() for p in root.rglob("*") if p.suffix in (".py", ".pyi")}


def test_generated_code_is_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    committed = gen.OUT
    fresh, current = sources(tmp_path), sources(committed)
    assert fresh.keys() == current.keys()
    stale = [str(name) for name in fresh if fresh[name] != current[name]]
    assert not stale, f"run `python scripts/gen_protos.py`: stale {stale}"
