"""Failures of real processes: model services killed with SIGKILL mid-stream (restarted on
the same port, or with a second replica already running), coordinators taking turns on one
session, and Redis restarted from its append-only file between turns.

Every service is a separate `python -m services.<role>` process on loopback; the session
store is a real redis-server. Output must equal the target alone (HF generate) every time.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from services.common.redis_server import LocalRedis
from services.protogen.specd.v1 import common_pb2, coordinator_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.procs import ServiceProcess, coordinator, model_service, stub

pytestmark = pytest.mark.slow  # processes killed with SIGKILL and restarted

N_TOKENS = 240


def holder(replicas: list[ServiceProcess], role: str, session_id: str) -> ServiceProcess:
    """The replica whose cache holds the session (the one whose death matters)."""
    stub_class = {"draft": draft_pb2_grpc.DraftServiceStub, "target": target_pb2_grpc.TargetServiceStub}[role]
    for replica in replicas:
        with grpc.insecure_channel(replica.address) as channel:
            info = stub_class(channel).GetSession(common_pb2.SessionRef(session_id=session_id), timeout=10)
        if info.position > 0:
            return replica
    raise AssertionError(f"no {role} replica holds {session_id}")


def turn(proc: ServiceProcess, session: str, text: str, n: int = 24) -> coordinator_pb2.CompleteResponse:
    request = coordinator_pb2.GenerateRequest(text=text, max_tokens=n, session_id=session, ignore_eos=True, num_draft_tokens=3)
    return stub(proc).Complete(request, timeout=120)


def test_two_coordinators_alternate_turns_of_one_session(procs, tiny_pair, tmp_path, model, target_alone):
    draft_dir, target_dir = tiny_pair
    with LocalRedis() as redis:
        draft, target = procs(model_service("draft", draft_dir, tmp_path), model_service("target", target_dir, tmp_path))
        c1, c2 = procs(
            coordinator(target_dir, [draft.address], [target.address], redis.url, tmp_path),
            coordinator(target_dir, [draft.address], [target.address], redis.url, tmp_path),
        )
        history: list[int] = []
        for via, text in [(c1, "First turn."), (c2, " Second turn."), (c1, " Third.")]:
            history += model.encode(text)
            reply = turn(via, "alternating", text)
            assert list(reply.token_ids) == target_alone(history, 24)
            history += list(reply.token_ids)
        summary = stub(c2).GetSession(coordinator_pb2.SessionRequest(session_id="alternating"))
        assert summary.length == len(history) and summary.requests == 3
        assert summary.stats.resyncs == 0  # each turn sent only its new tokens: no re-prefill anywhere


@pytest.mark.parametrize("role", ["draft", "target"])
@pytest.mark.parametrize("how", ["restarted on the same port", "second replica running"])
def test_kill9_of_a_model_service_mid_stream(procs, tiny_pair, tmp_path, model, target_alone, role, how):
    draft_dir, target_dir = tiny_pair
    dirs = {"draft": draft_dir, "target": target_dir}
    with LocalRedis() as redis:
        services = {r: [model_service(r, dirs[r], tmp_path)] for r in ("draft", "target")}
        if how == "second replica running":
            services[role].append(model_service(role, dirs[role], tmp_path))
        procs(*services["draft"], *services["target"])
        addresses = {r: [s.address for s in services[r]] for r in services}
        (coord,) = procs(coordinator(target_dir, addresses["draft"], addresses["target"], redis.url, tmp_path))

        prompt = "Once upon a time, in a land far away,"
        request = coordinator_pb2.GenerateRequest(
            text=prompt, max_tokens=N_TOKENS, session_id=f"kill-{role}", ignore_eos=True, num_draft_tokens=3
        )
        chunks, restart = [], None
        for chunk in stub(coord).Generate(request, timeout=180):
            chunks.append(chunk)
            if len(chunks) == 3:
                victim = holder(services[role], role, request.session_id)
                victim.kill9()
                if how == "restarted on the same port":
                    restart = threading.Thread(target=lambda: victim.start().wait_ready())
                    restart.start()
        if restart:
            restart.join()
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == target_alone(model.encode(prompt), N_TOKENS)  # nothing lost, nothing duplicated
        assert "".join(c.text for c in chunks) == model.decode(tokens)
        assert chunks[-1].finish_reason == "length"
        # another replica got the session resent, or (no draft left) it went on plainly meanwhile
        stats = chunks[-1].stats
        assert stats.resyncs + stats.outage_rounds >= 1, "the kill must have hit the stream while it ran"


def test_redis_restart_from_its_aof_between_turns(procs, tiny_pair, tmp_path, model, target_alone):
    draft_dir, target_dir = tiny_pair
    with LocalRedis(dir=tmp_path / "redis", appendonly=True) as redis:
        draft, target = procs(model_service("draft", draft_dir, tmp_path), model_service("target", target_dir, tmp_path))
        (coord,) = procs(coordinator(target_dir, [draft.address], [target.address], redis.url, tmp_path))
        history = model.encode("Persist me.")
        first = turn(coord, "durable", "Persist me.")
        history += list(first.token_ids)
        redis.kill9()
        redis.start()
        history += model.encode(" Again.")
        second = turn(coord, "durable", " Again.")
        assert list(second.token_ids) == target_alone(history, 24)
        summary = stub(coord).GetSession(coordinator_pb2.SessionRequest(session_id="durable"))
        assert summary.length == len(history) + 24 and summary.requests == 2
