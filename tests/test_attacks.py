"""The attacks of a security review, played against one deployment of real processes (mutual TLS
between the services, API keys and quotas at the edge, Redis over TLS with a password): each is refused
or answered with its status, and the victim's session goes on exactly as if nothing happened."""

from __future__ import annotations

import concurrent.futures

import grpc
import httpx
import pytest

from services.common import certs
from services.common.redis_server import LocalRedis, free_port
from services.common.tls import CA_FILE, TlsFiles, channel_options
from services.protogen.specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.procs import coordinator, tls_model_service

pytestmark = pytest.mark.slow  # a TLS-built Redis (redis-tools) and a full deployment

KEYS = {"alice": "alice-key-0123456789abcdef", "mallory": "mallory-key-0123456789abcd"}
MAX_SESSIONS = 3
N = 8


def test_attacks_are_refused_and_the_victim_loses_nothing(procs, tiny_pair, tmp_path, model, target_alone,
                                                         tls_redis_binary):
    draft_dir, target_dir = tiny_pair
    tls_dir = tmp_path / "tls"
    certs.make(tls_dir)
    keys_file = tmp_path / "api-keys"
    keys_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    http_port = free_port()
    with LocalRedis(password="redis-secret-for-the-test", tls_dir=tls_dir, binary=tls_redis_binary) as redis:
        draft, target = procs(tls_model_service("draft", draft_dir, tmp_path, tls_dir),
                              tls_model_service("target", target_dir, tmp_path, tls_dir))
        procs(coordinator(target_dir, [draft.address], [target.address], redis.url, tmp_path,
                          "--tls-dir", str(tls_dir), "--api-keys-file", str(keys_file), "--http-port", str(http_port),
                          "--key-max-sessions", str(MAX_SESSIONS), "--key-max-in-flight", "4"))
        base = f"http://127.0.0.1:{http_port}"
        alice, mallory = (httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEYS[who]}"}, timeout=60)
                          for who in ("alice", "mallory"))

        def turn(client: httpx.Client, session: str, prompt: str, **fields) -> httpx.Response:
            return client.post("/v1/completions", json={
                "model": target_dir.name, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
                "session_id": session} | fields)

        victim = "alice-chat"
        assert turn(alice, victim, "The victim's first turn.").status_code == 200
        history = alice.get(f"/v1/sessions/{victim}", params={"include_tokens": "true"}).json()["token_ids"]
        coordinator_view = target_pb2_grpc.TargetServiceStub(grpc.secure_channel(
            target.address, TlsFiles(tls_dir, "coordinator").channel_credentials(), options=channel_options("target")))
        victims_cache = coordinator_view.GetSession(common_pb2.SessionRef(session_id=stored_id(alice, victim)), timeout=5)

        # 1. Straight to the model services, around the coordinator: GetSession, a Verify whose crafted
        #    SyncPoint would rewrite the victim's cache, Release, Propose. No client certificate: the
        #    TLS handshake fails, no call reaches a service.
        ref = common_pb2.SessionRef(session_id=victim)
        sync = common_pb2.SyncPoint(start_pos=0, tokens=[5] * 10)
        without = grpc.ssl_channel_credentials((tls_dir / CA_FILE).read_bytes())
        for address, role in ((target.address, "target"), (draft.address, "draft")):
            for credentials in (None, without):
                channel = (grpc.insecure_channel(address) if credentials is None
                           else grpc.secure_channel(address, credentials, options=channel_options(role)))
                if role == "target":
                    service = target_pb2_grpc.TargetServiceStub(channel)
                    calls = [(service.Verify, target_pb2.VerifyRequest(session_id=victim, sync=sync, draft_tokens=[1]))]
                else:
                    service = draft_pb2_grpc.DraftServiceStub(channel)
                    calls = [(service.Propose, draft_pb2.ProposeRequest(session_id=victim, sync=sync, k=2))]
                for rpc, message in [(service.GetSession, ref), (service.Release, ref), *calls]:
                    with pytest.raises(grpc.RpcError) as refused:
                        rpc(message, timeout=5)
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert coordinator_view.GetSession(common_pb2.SessionRef(session_id=stored_id(alice, victim)),
                                           timeout=5) == victims_cache

        # 2. Through the edge with another key: the victim's id is not Mallory's to see, end or continue.
        assert mallory.get(f"/v1/sessions/{victim}").status_code == 404
        assert mallory.delete(f"/v1/sessions/{victim}").status_code == 404
        assert turn(mallory, victim, "Mallory's text.").status_code == 200  # Mallory's own session of that name

        # 3. Racing: both keys on one new id at once: two sessions, each its owner's.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            raced = list(pool.map(lambda who: turn(who, "raced", "Both at once."), (alice, mallory)))
        assert [r.status_code for r in raced] == [200, 200]
        assert alice.get("/v1/sessions/raced").json()["requests"] == 1 == mallory.get("/v1/sessions/raced").json()["requests"]

        # 4. Slot exhaustion: Mallory opens sessions until her quota says no; Alice still opens hers.
        opened = [turn(mallory, f"grab-{i}", "x").status_code for i in range(MAX_SESSIONS)]
        assert opened.count(429) >= 1 and opened[0] == 200  # she holds 2 already (victim's name, raced)
        refused = turn(mallory, "grab-more", "x")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert turn(alice, "alice-second", "Still room for me.").status_code == 200

        # 5. Bad input: a lone surrogate, a turn that would outgrow the context: 400, nothing stored.
        surrogate = mallory.post("/v1/completions", content=b'{"model": "%s", "prompt": "\\ud800"}' % target_dir.name.encode(),
                                 headers={"Content-Type": "application/json"})
        assert surrogate.status_code == 400 and "prompt" in surrogate.json()["error"]["message"]
        held = mallory.get(f"/v1/sessions/{victim}").json()["length"]
        overflow = turn(mallory, victim, "y", max_tokens=model.max_context - held)
        assert overflow.status_code == 400 and "context" in overflow.json()["error"]["message"]
        assert mallory.get(f"/v1/sessions/{victim}").json()["length"] == held

        # The victim: her session holds exactly her turns, and the next is the target alone's.
        summary = alice.get(f"/v1/sessions/{victim}", params={"include_tokens": "true"}).json()
        assert summary["token_ids"] == history and summary["requests"] == 1
        assert turn(alice, victim, " And her second.").status_code == 200
        history += model.encode(" And her second.")
        after = alice.get(f"/v1/sessions/{victim}", params={"include_tokens": "true"}).json()
        assert after["token_ids"] == history + target_alone(history, N) and after["stats"]["resyncs"] == 0


def stored_id(client: httpx.Client, session: str) -> str:
    """The id the store and the model services know a key's session by (services/coordinator/frontend.py)."""
    from services.coordinator.frontend import scoped

    owner = next(name for name, key in KEYS.items() if client.headers["Authorization"].endswith(key))
    return scoped(session, owner)
