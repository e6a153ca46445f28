"""Command-line settings where every flag can also come from the environment.

`--max-sessions` reads SPECD_MAX_SESSIONS when not given: containers and manifests set
environment variables, people at a shell pass flags.
"""

from __future__ import annotations

import argparse
import os


def env_name(flag: str) -> str:
    return "SPECD_" + flag.lstrip("-").replace("-", "_").upper()


def add(parser: argparse.ArgumentParser, flag: str, *, type=str, default=None, help: str = "", choices=None) -> None:
    raw = os.environ.get(env_name(flag))
    value = type(raw) if raw is not None else default
    parser.add_argument(
        flag, type=type, default=value, choices=choices, help=f"{help} [env {env_name(flag)}; default {default}]"
    )
