"""Whether the draft contends for the target's compute (services/common/compute.py), found at the
coordinator's start-up from what each replica says it runs on, and handed to the policy."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

from services.common import compute
from services.coordinator import root
from services.coordinator.requests import Limits, policy_config
from specd.contracts import EngineInfo

BLANK = EngineInfo("id", "gguf", "auto", True, "", "d" * 64, "m.gguf")


def on(units: list[str], threads: int) -> EngineInfo:
    return replace(BLANK, compute=tuple(units), threads=threads)


def cpus(host: str, *ns: int) -> list[str]:
    return [f"{host}/cpu{n}" for n in ns]


def test_a_draft_on_the_targets_cores_contends_and_one_with_cores_of_its_own_does_not():
    two_cores = cpus("boot-a", 0, 1)
    assert compute.contends([on(two_cores, 2)], [on(two_cores, 2)])  # specd up on a 2-core host
    assert compute.contends([on(cpus("boot-a", *range(4)), 2)], [on(cpus("boot-a", *range(4)), 4)])  # 4 < 2 + 4
    assert not compute.contends([on(cpus("boot-a", *range(16)), 2)], [on(cpus("boot-a", *range(16)), 8)])
    assert not compute.contends([on(cpus("boot-a", 0, 1), 2)], [on(cpus("boot-a", 2, 3), 2)])  # pinned apart
    assert not compute.contends([on(two_cores, 2)], [on(cpus("boot-b", 0, 1), 2)])  # another host


def test_a_shared_gpu_contends_and_separate_gpus_do_not():
    assert compute.contends([on(["gpu/GPU-1"], 1)], [on(["gpu/GPU-1"], 1)])
    assert not compute.contends([on(["gpu/GPU-1"], 1)], [on(["gpu/GPU-2"], 1)])


def test_any_pair_of_replicas_that_contends_counts_and_replicas_that_do_not_say_do_not():
    two_cores = cpus("boot-a", 0, 1)
    targets = [on(cpus("boot-b", 0, 1), 2), on(two_cores, 2)]
    assert compute.contends([on(two_cores, 2)], targets)
    assert not compute.contends([BLANK], [BLANK])  # an older service: no compute reported
    assert not compute.contends([], targets)  # no draft pool


def test_this_hosts_cpu_units_are_its_boot_id_and_the_cpus_it_may_run_on():
    units = compute.units("cpu")
    boot = compute.BOOT_ID.read_text().strip()
    assert units == tuple(f"{boot}/cpu{n}" for n in sorted(os.sched_getaffinity(0)))
    assert compute.contends([on(list(units), 1)], [on(list(units), len(units))])


class Pool:
    def __init__(self, *answers):
        self.answers = list(answers)

    async def engines(self):
        return self.answers


def test_start_up_hands_the_policy_whether_the_draft_contends():
    class Frontend:
        limits = Limits()

        class services:
            drafter = verifier = Pool(on(cpus("boot-a", 0, 1), 2))

    frontend = Frontend()
    asyncio.run(root.start_up(frontend, calibrate=False))
    assert frontend.limits.draft_contends and policy_config(frontend.limits, 4).draft_contends
    frontend.services.verifier = Pool(on(cpus("boot-b", 0, 1), 2))
    asyncio.run(root.start_up(frontend, calibrate=False))
    assert not frontend.limits.draft_contends and not policy_config(frontend.limits, 4).draft_contends
