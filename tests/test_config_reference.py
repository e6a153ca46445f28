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


def test_renamed_flags_and_variables_still_work(monkeypatch):
    """--model (SPECD_MODEL) was --model-dir (SPECD_MODEL_DIR), and `specd up`'s --draft-model was
    --draft-model-dir: the old names are aliases; the reference shows the new ones; a new variable
    wins over an old one."""
    from pathlib import Path

    from services import cli
    from services.common import model_main
    from services.coordinator import root

    for name in [n for n in __import__("os").environ if n.startswith("SPECD_")]:
        monkeypatch.delenv(name)
    assert model_main.parse("draft", 1, ["--model-dir", "d.gguf"]).model == Path("d.gguf")
    assert root.parse(["--model-dir", "t.gguf", "--redis-url", "redis://x"]).model == Path("t.gguf")
    up = cli.subcommand(cli.build_parser(), "up").parse_args(["--draft-model-dir", "d", "--target-model", "t"])
    assert (up.draft_model, up.target_model) == (Path("d"), Path("t"))
    monkeypatch.setenv("SPECD_MODEL_DIR", "old.gguf")
    assert model_main.parse("target", 1, []).model == Path("old.gguf")
    monkeypatch.setenv("SPECD_MODEL", "new.gguf")
    assert model_main.parse("target", 1, []).model == Path("new.gguf")
    rendered = generator().render()
    assert "| `--model` | `SPECD_MODEL` |" in rendered and "| `--draft-model` | `SPECD_DRAFT_MODEL` |" in rendered
