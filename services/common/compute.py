"""What a model service computes on, and whether a draft and a target contend for it.

A draft step that runs on the cores (or the GPU) the target's passes use takes its time from every
session in those passes, not only from the session it drafts for; the policy prices that
(`PolicyConfig.draft_contends`). Each engine names its compute units: this host's boot id with
each CPU it may run on (containers on one host share the boot id), or a GPU's UUID.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from specd.contracts import EngineInfo

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def units(device: str) -> tuple[str, ...]:
    """The compute units of an engine on `device` ("cpu", "cuda:0", ...); () where they cannot be told."""
    if device.startswith("cuda"):
        import torch  # only a model service on a GPU gets here

        index = torch.device(device).index
        uuid = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid
        return (f"gpu/{uuid}",)
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return ()
    return tuple(f"{boot}/cpu{n}" for n in sorted(os.sched_getaffinity(0)))


def threads() -> int:
    """The threads this thread's torch (and so the engine's passes) uses: ask on the engine's worker."""
    import torch

    return torch.get_num_threads()


def contends(drafts: Iterable[EngineInfo], targets: Iterable[EngineInfo]) -> bool:
    """Some draft replica and target replica share a GPU, or share fewer CPUs than their threads
    together (then one's passes wait for the other's). Replicas that do not say what they run on
    are taken as not contending: a draft on compute of its own is what a deployment plans for."""
    targets = list(targets)
    for draft in drafts:
        for target in targets:
            shared = set(draft.compute) & set(target.compute)
            if any(unit.startswith("gpu/") for unit in shared) or 0 < len(shared) < draft.threads + target.threads:
                return True
    return False
