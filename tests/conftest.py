from pathlib import Path

import pytest
import torch

from specd.tiny import build_tiny_pair
from services.common.redis_server import LocalRedis

# The tiny models are far too small to gain from intra-op threads, and on a 2-core machine
# shared with model services two OpenMP threads per matmul make each one ~100x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(draft_dir, target_dir) of the tiny seeded Qwen2 pair, built once per test run."""
    return build_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A real redis-server for the whole run (sessions of different tests have distinct ids)."""
    with LocalRedis() as server:
        yield server.url
