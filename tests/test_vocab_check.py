"""The coordinator refuses a draft whose vocabulary is not the target's: each model service reports
its vocabulary digest in EngineInfo (specd/gguf_meta.py vocab_digest), and start-up compares them
(services/coordinator/root.py check_vocabularies). Fake pools, then a coordinator process against
two gRPC model services that answer only GetEngineInfo."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.common import convert
from services.coordinator import root
from services.coordinator.requests import Limits
from services.coordinator.root import VocabularyMismatch, check_vocabularies
from services.protogen.specd.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from specd import gguf_meta
from specd.contracts import EngineInfo
from tests import tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


def info(digest: str, model: str = "m.gguf") -> EngineInfo:
    return EngineInfo("id-" + model, "none", "none", True, "", digest, model)


class Pool:
    """A pool whose replicas answer `answers` (EngineInfo or an error) from call `up_after` on."""

    def __init__(self, *answers, up_after: int = 0):
        self.answers, self.up_after, self.calls = list(answers), up_after, 0

    async def engines(self):
        self.calls += 1
        if self.calls <= self.up_after:
            return [ConnectionError("not up yet")]
        return self.answers


def check(drafter, verifier, attempts: int = 3) -> None:
    asyncio.run(check_vocabularies(drafter, verifier, attempts=attempts, retry_s=0))


def test_a_draft_with_another_vocabulary_is_refused_naming_both_models():
    with pytest.raises(VocabularyMismatch) as refused:
        check(Pool(info("a" * 64, "gemma-3-270m.gguf")), Pool(info("b" * 64, "qwen2.5-coder-1.5b.gguf")))
    assert "gemma-3-270m.gguf" in str(refused.value) and "qwen2.5-coder-1.5b.gguf" in str(refused.value)
    assert "draft" in str(refused.value) and "target" in str(refused.value)


def test_replicas_must_agree_too():
    with pytest.raises(VocabularyMismatch):
        check(Pool(info("a" * 64)), Pool(info("a" * 64, "t1"), info("c" * 64, "t2")))


def test_equal_or_unknown_digests_pass():
    check(Pool(info("a" * 64)), Pool(info("a" * 64), info("a" * 64)))
    check(Pool(info("")), Pool(info("b" * 64)))  # an HF directory's engine reports none: not compared
    check(Pool(info("a" * 64), ConnectionError("one replica down")), Pool(info("a" * 64)))


def test_with_no_draft_model_only_the_target_replicas_are_compared():
    check(None, Pool(info("a" * 64), info("a" * 64)))
    with pytest.raises(VocabularyMismatch):
        check(None, Pool(info("a" * 64, "t1"), info("c" * 64, "t2")))


def test_it_waits_for_a_pool_that_comes_up_later():
    late = Pool(info("b" * 64), up_after=2)
    with pytest.raises(VocabularyMismatch):
        check(Pool(info("a" * 64)), late, attempts=5)
    assert late.calls == 3


def test_it_gives_up_waiting_and_lets_the_coordinator_start(caplog):
    with caplog.at_level(logging.WARNING):
        check(Pool(info("a" * 64)), Pool(up_after=99), attempts=2)
    assert "no answer from the target pool" in caplog.text


def test_a_pool_that_cannot_say_is_not_compared():
    check(object(), Pool(info("a" * 64)), attempts=1)


def test_the_digest_travels_in_engine_info():
    sent = info("d" * 64, "qwen.gguf")
    assert convert.engine_info_from_proto(convert.engine_info_to_proto(sent)) == sent


# --- a coordinator process -------------------------------------------------------------------


class EngineInfoOnly:
    def __init__(self, sent: EngineInfo):
        self.sent = sent

    def GetEngineInfo(self, request, context):
        return convert.engine_info_to_proto(self.sent)


class Draft(EngineInfoOnly, draft_pb2_grpc.DraftServiceServicer):
    pass


class Target(EngineInfoOnly, target_pb2_grpc.TargetServiceServicer):
    pass


def serve(servicer, add) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_the_coordinator_exits_when_draft_and_target_vocabularies_differ(tmp_path):
    target_file = tiny_gguf.write_tiny(tmp_path / "target.gguf", "qwen2")
    other = tiny_gguf.write_tiny(tmp_path / "draft.gguf", "qwen2", vocab=300)
    digests = [gguf_meta.vocab_digest(gguf_meta.read(p)) for p in (other, target_file)]
    assert digests[0] != digests[1]
    draft, draft_addr = serve(Draft(info(digests[0], "draft.gguf")), draft_pb2_grpc.add_DraftServiceServicer_to_server)
    target, target_addr = serve(Target(info(digests[1], "target.gguf")),
                                target_pb2_grpc.add_TargetServiceServicer_to_server)
    try:
        command = [sys.executable, "-m", "services.coordinator", "--model", str(target_file), "--port", "0",
                   "--http-port", "-1", "--draft-addr", draft_addr, "--target-addr", target_addr,
                   "--redis-url", "redis://127.0.0.1:1/0", "--calibrate", "off", "--require-durable-store", "off"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        draft.stop(None)
        target.stop(None)
    assert done.returncode == 1, done.stderr  # a clean stop (SystemExit), not a signal
    assert "vocabularies differ" in done.stderr
    assert "draft.gguf" in done.stderr and "target.gguf" in done.stderr


def test_start_up_checks_before_calibrating(monkeypatch):
    """The check runs with calibration off too, and a mismatch stops start-up before calibration."""
    calls = []

    class Frontend:
        class services:
            drafter, verifier = Pool(info("a" * 64)), Pool(info("b" * 64))

        limits = Limits()

        async def seed_prior(self):
            calls.append("calibrate")

    with pytest.raises(VocabularyMismatch):
        asyncio.run(root.start_up(Frontend(), calibrate=True))
    assert calls == []
    Frontend.services.verifier = Pool(info("a" * 64))
    asyncio.run(root.start_up(Frontend(), calibrate=False))
    assert calls == []
