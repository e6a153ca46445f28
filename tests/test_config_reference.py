"""docs/configuration.md is what the programs' parsers say: every flag, its variable, its default."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generator():
    spec = importlib.util.spec_from_file_location("gen_config", ROOT / "scripts" / "gen_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_the_code(monkeypatch):
    monkeypatch.setenv("SPECD_DEFAULT_K", "7")  # the environment must not leak into the defaults it shows
    rendered = generator().render()
    assert (ROOT / "docs" / "configuration.md").read_text() == rendered, (
        "docs/configuration.md is stale: run `.venv/bin/python scripts/gen_config.py`")
    assert "| `--default-k` | `SPECD_DEFAULT_K` | `4` |" in rendered
    for program in ("services.coordinator", "services.draft", "services.target", "specd up", "specd serve-ray"):
        assert f"## `{program}" in rendered or f"## `python -m {program}`" in rendered
