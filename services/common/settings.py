"""Command-line settings where every flag can also come from the environment.

`--max-sessions` reads SPECD_MAX_SESSIONS when not given: containers and manifests set
environment variables, people at a shell pass flags.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def env_name(flag: str) -> str:
    return "SPECD_" + flag.lstrip("-").replace("-", "_").upper()


def add(parser: argparse.ArgumentParser, flag: str, *, type=str, default=None, help: str = "", choices=None,
        aliases: tuple[str, ...] = ()) -> None:
    """`aliases`: old names of the flag, still accepted, as flags and as variables (the new
    variable wins when both are set)."""
    raw = next((os.environ[name] for name in map(env_name, (flag, *aliases)) if name in os.environ), None)
    value = type(raw) if raw is not None else default
    old = f" (formerly {', '.join(aliases)} / {', '.join(map(env_name, aliases))})" if aliases else ""
    parser.add_argument(
        flag, *aliases, type=type, default=value, choices=choices,
        help=f"{help}{old} [env {env_name(flag)}; default {default}]"
    )


SWITCH_VALUES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                 "off": False, "": False}


def add_switch(parser: argparse.ArgumentParser, flag: str, *, help: str = "") -> None:
    """A flag that turns something on (`--insecure`), or its variable set to 1 (true, yes, on; 0,
    false, no, off or unset: off). Any other value is an error, not off: these guard security."""
    raw = os.environ.get(env_name(flag))
    if raw is not None and raw.strip().lower() not in SWITCH_VALUES:
        raise ValueError(f"{env_name(flag)}={raw!r}: set it to 1 (on) or 0 (off)")
    on = raw is not None and SWITCH_VALUES[raw.strip().lower()]
    parser.add_argument(flag, action="store_true", default=on, help=f"{help} [env {env_name(flag)}; default off]")


# The weights a model service runs (specd/numerics.py's MODES; this module imports no torch):
# every default in one place.
QUANTIZE_MODES = ("none", "int8", "auto", "q4_0")
# A GGUF draft's output layer scores the first this many token ids and the special ones (0: all): on the
# Qwen pair's 151 936 ids a draft step 0.89x the time, and the draft's greedy agreement with the target
# unchanged on the repo's prompts (benchmarks/results/head_vocab.json).
DRAFT_HEAD_VOCAB = 98304
NO_DRAFT = "none"  # the coordinator's --draft-addr for a deployment with no draft model
SERVICE_QUANTIZE = "none"  # `python -m services.draft|target` and Ray's build_app: the checkpoint's weights
# What `specd up` and `specd serve-ray` start each with: a GGUF file as stored, a Hugging Face
# checkpoint's dense weights, each with its batch-invariance self-check (specd/numerics.py)...
LAUNCH_QUANTIZE = {"draft": "auto", "target": "auto"}
# ...but a GGUF draft's Q5_0 / Q8_0 linears run as Q4_0: on the fetched pair a step 0.76x the time at a
# greedy agreement 1-4 % lower, adaptive +11 % on code and chat in the replay, the rest within 2 %
# (benchmarks/README.md, "A Q4_0 draft"). A draft never changes the output.
LAUNCH_QUANTIZE_GGUF = {"draft": "q4_0", "target": "auto"}


def launch_quantize(role: str, mode: str | None, model: Path) -> str:
    """What `specd up` starts `role` with: `mode` if one was given, else its default for `model`'s kind,
    told as the engine tells it (a GGUF file by its magic, whatever its name)."""
    if mode:
        return mode
    from specd.gguf_meta import is_gguf  # torch-free, as this module

    return (LAUNCH_QUANTIZE_GGUF if is_gguf(model) else LAUNCH_QUANTIZE)[role]


def check_head_vocab(ids: int) -> int:
    """A draft's head size (`DRAFT_HEAD_VOCAB`), if it is one; else ValueError."""
    if ids < 0:
        raise ValueError(f"the draft's head vocabulary must be >= 0 ids (0: all), got {ids}")
    return ids


def check_quantize(role: str, mode: str) -> str:
    """The mode, if `role` ("draft" or "target") may run it; else ValueError saying what to change."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"{role} quantize must be one of {', '.join(QUANTIZE_MODES)}; got {mode!r}")
    if role == "target" and mode == "int8":
        raise ValueError(
            "quantize int8 is a draft-only setting: its activation scales span a whole pass, so a target's "
            "verification rows would depend on the rows beside them and greedy output would no longer be "
            "the target's own; start the target with none or auto"
        )
    if role == "target" and mode == "q4_0":
        raise ValueError("quantize q4_0 is a draft-only setting: a target serves its file's weights as stored, "
                         "so the output is that model's; start the target with none or auto")
    return mode
