"""Generate docs/configuration.md from the programs' own argument parsers: every flag, its
environment variable and its one default. tests/test_config_reference.py fails when the file and
the code disagree; run `.venv/bin/python scripts/gen_config.py` after changing a flag."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "configuration.md"
HEADER = """# Configuration reference

Generated from the programs' argument parsers by `scripts/gen_config.py` (do not edit by hand;
`tests/test_config_reference.py` checks it). Every setting is a flag and an environment variable;
a flag given on the command line wins over the variable.
"""


from services.common import settings  # noqa: E402  (after the path insert)


def programs() -> list[tuple[str, Callable[[], argparse.ArgumentParser]]]:
    from services import cli
    from services.common import model_main
    from services.coordinator import root
    from services.draft.__main__ import DEFAULT_PORT as DRAFT_PORT
    from services.target.__main__ import DEFAULT_PORT as TARGET_PORT

    def command(name: str) -> Callable[[], argparse.ArgumentParser]:
        return lambda: cli.subcommand(cli.build_parser(), name)

    return [
        ("python -m services.coordinator", root.build_parser),
        ("python -m services.draft", lambda: model_main.build_parser("draft", DRAFT_PORT)),
        ("python -m services.target", lambda: model_main.build_parser("target", TARGET_PORT)),
        ("specd up", command("up")),
        ("specd serve-ray", command("serve-ray")),
    ]


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is None:
        return "—"
    return f"`{action.default}`"


def _row(action: argparse.Action) -> str:
    text = action.help or ""
    env = re.search(r"\[env (SPECD_[A-Z_]+); default .*\]$", text)
    # the flag its variable is named after (not an old alias), else the long one
    named = [f for f in action.option_strings if env and settings.env_name(f) == env.group(1)]
    flag = named[0] if named else max(action.option_strings, key=len)
    what = re.sub(r"\s*\[env SPECD_[A-Z_]+; default .*\]$", "", text).replace("|", "\\|").replace("\n", " ")
    return f"| `{flag}` | {f'`{env.group(1)}`' if env else '—'} | {_default(action)} | {what} |"


def render() -> str:
    """The document, built with no SPECD_* variable set (they would become the defaults)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    with mock.patch.dict(os.environ, clean, clear=True):
        parts = [HEADER]
        for name, build in programs():
            parser = build()
            parts += [f"\n## `{name}`\n", "| flag | variable | default | what it sets |", "|---|---|---|---|"]
            parts += [_row(a) for a in parser._actions if a.option_strings and a.dest != "help"]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)}")
