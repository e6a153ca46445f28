"""Idempotent turns with real processes: a coordinator killed mid-turn, the client's retry with the
same request id on another coordinator: the session holds the turn once, and the reply is the
whole turn as the target alone would have written it."""

from __future__ import annotations

import grpc
import pytest

from services.common.redis_server import LocalRedis
from services.protogen.specd.v1 import coordinator_pb2
from tests.procs import coordinator, model_service, stub

pytestmark = pytest.mark.slow  # a coordinator killed mid-turn

N = 300  # long enough that the kill lands mid-turn


def test_a_turn_retried_after_its_coordinator_died_is_held_once(procs, tiny_pair, tmp_path, model, target_alone):
    draft_dir, target_dir = tiny_pair
    with LocalRedis() as redis:
        draft, target = procs(model_service("draft", draft_dir, tmp_path), model_service("target", target_dir, tmp_path))
        first, second = procs(*(coordinator(target_dir, [draft.address], [target.address], redis.url, tmp_path)
                                for _ in range(2)))
        session = "idem-kill"

        def request(text: str, request_id: str) -> coordinator_pb2.GenerateRequest:
            return coordinator_pb2.GenerateRequest(text=text, max_tokens=N, session_id=session, ignore_eos=True,
                                                   num_draft_tokens=3, request_id=request_id)

        opening = stub(first).Complete(request("An opening turn.", "turn-1"), timeout=120)
        history = model.encode("An opening turn.") + list(opening.token_ids)
        streamed = []
        for chunk in stub(first).Generate(request(" Then a second.", "turn-2"), timeout=120):
            streamed += chunk.token_ids
            if len(streamed) >= 8:
                first.kill9()  # dies mid-turn: the prompt and some tokens are committed
                break
        history += model.encode(" Then a second.")
        held = stub(second).GetSession(coordinator_pb2.SessionRequest(session_id=session, include_tokens=True))
        assert len(history) + len(streamed) <= held.length < len(history) + N
        assert list(held.token_ids[:len(history)]) == history

        retried = stub(second).Complete(request(" Then a second.", "turn-2"), timeout=120)
        expected = target_alone(history, N)
        assert list(retried.token_ids) == expected and retried.finish_reason == "length"
        summary = stub(second).GetSession(coordinator_pb2.SessionRequest(session_id=session, include_tokens=True))
        assert list(summary.token_ids) == history + expected  # the turn's prompt once, its tokens once
        assert summary.requests == 2

        again = stub(second).Complete(request(" Then a second.", "turn-2"), timeout=120)  # finished: replayed
        assert list(again.token_ids) == expected and again.stats.rounds == 0
        assert stub(second).GetSession(coordinator_pb2.SessionRequest(session_id=session)).length == summary.length
        refused = None
        try:
            stub(second).Complete(request(" Something else.", "turn-2"), timeout=30)
        except grpc.RpcError as error:
            refused = error
        assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
