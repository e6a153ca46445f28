"""Per-key quotas against a real Redis and the real edges (REST and gRPC on loopback): requests
in flight, named sessions held, tokens per minute; each refusal a 429 / RESOURCE_EXHAUSTED with
Retry-After, and another key unaffected."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from services.coordinator.auth import ApiKeys
from services.coordinator.quotas import WINDOW_S, QuotaLimits
from services.protogen.specd.v1 import coordinator_pb2
from tests.cluster import MODEL_NAME, Cluster

KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef00"}


def make_cluster(tiny_pair, redis_url, tmp_path_factory, limits: QuotaLimits) -> Cluster:
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    keys_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    return Cluster(*tiny_pair, redis_url, keys=ApiKeys.from_file(keys_file), quotas=limits)


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_url, tmp_path_factory):
    c = make_cluster(tiny_pair, redis_url, tmp_path_factory, QuotaLimits(in_flight=2, sessions=3, tokens_per_minute=0))
    yield c
    c.close()


def http(cluster: Cluster, who: str) -> httpx.Client:
    return httpx.Client(base_url=cluster.base_url, headers={"Authorization": f"Bearer {KEYS[who]}"}, timeout=60)


def completion(client: httpx.Client, **fields) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4} | fields)


def auth(who: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS[who]}")]


def test_a_key_over_its_requests_in_flight_gets_resource_exhausted_with_retry_after(cluster):
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        stub = cluster.coordinator(channel)
        long = coordinator_pb2.GenerateRequest(text="Long", max_tokens=1000, ignore_eos=True)
        streams = [stub.Generate(long, metadata=auth("alice"), timeout=120) for _ in range(2)]
        for stream in streams:
            next(stream)  # admitted and generating
        with pytest.raises(grpc.RpcError) as refused:
            stub.Complete(coordinator_pb2.GenerateRequest(text="Hi", max_tokens=2), metadata=auth("alice"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in refused.value.details()
        trailers = dict(refused.value.trailing_metadata())
        assert 1 <= int(trailers["retry-after"]) <= 30 and int(trailers["grpc-retry-pushback-ms"]) >= 1000
        reply = completion(http(cluster, "alice"))
        assert reply.status_code == 429 and 1 <= int(reply.headers["retry-after"]) <= 30
        assert reply.json()["error"]["type"] == "rate_limit_error"
        too_large = http(cluster, "alice").post("/v1/completions", content=b"x" * (2 << 20))
        assert too_large.status_code == 429  # not 413: refused from its headers, before its body was read
        assert completion(http(cluster, "bob")).status_code == 200  # another key: its own budget
        for stream in streams:
            stream.cancel()
    deadline = time.monotonic() + 10  # a cancelled request gives its place back
    while completion(http(cluster, "alice")).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_key_over_its_request_rate_is_refused_before_its_body_is_read(tiny_pair, redis_url, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    names = {who: f"rate-{who}-{time.time_ns()}" for who in KEYS}  # rate cells of their own in the shared Redis
    keys_file.write_text("".join(f"{names[who]}:{key}\n" for who, key in KEYS.items()))
    cluster = Cluster(*tiny_pair, redis_url, keys=ApiKeys.from_file(keys_file),
                      quotas=QuotaLimits(requests_per_minute=6))  # one every 10 s, a burst of one
    try:
        alice = http(cluster, "alice")
        assert completion(alice).status_code == 200
        refused = completion(alice)
        assert refused.status_code == 429 and "requests a minute" in refused.json()["error"]["message"]
        assert 5 <= int(refused.headers["retry-after"]) <= 10
        assert alice.post("/v1/completions", content=b"x" * (2 << 20)).status_code == 429  # not 413: no body read
        with grpc.insecure_channel(cluster.address("coordinator")) as channel:
            with pytest.raises(grpc.RpcError) as over:
                cluster.coordinator(channel).Complete(coordinator_pb2.GenerateRequest(text="Hi", max_tokens=2),
                                                      metadata=auth("alice"), timeout=30)
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert completion(http(cluster, "bob")).status_code == 200  # another key: its own rate
    finally:
        cluster.close()


def test_a_key_cannot_hold_more_named_sessions_than_its_quota_nor_crowd_out_another(cluster):
    alice, bob = http(cluster, "alice"), http(cluster, "bob")
    ids = [f"q-{time.time_ns()}-{i}" for i in range(4)]
    for session in ids[:3]:
        assert completion(alice, session_id=session).status_code == 200
    refused = completion(alice, session_id=ids[3])
    assert refused.status_code == 429 and "sessions" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) > 60  # when the oldest expires (an hour), unless one is released
    assert completion(alice, session_id=ids[0], prompt=" again").status_code == 200  # a held one goes on
    for session in ids[:3]:  # the victim: bob's sessions (the same ids) are his own budget
        assert completion(bob, session_id=session).status_code == 200
    assert alice.delete(f"/v1/sessions/{ids[1]}").status_code == 200
    assert completion(alice, session_id=ids[3]).status_code == 200  # released: room again
    for who, sessions in ((alice, (ids[0], ids[2], ids[3])), (bob, ids[:3])):
        for session in sessions:
            assert who.delete(f"/v1/sessions/{session}").status_code == 200


def test_tokens_per_minute_reserve_max_tokens_and_give_back_what_was_not_generated(tiny_pair, redis_url,
                                                                                   tmp_path_factory):
    cluster = make_cluster(tiny_pair, redis_url, tmp_path_factory, QuotaLimits(tokens_per_minute=100))
    try:
        if WINDOW_S - time.time() % WINDOW_S < 15:  # the counts start anew each minute: not mid-test
            time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.5)
        alice = http(cluster, "alice")
        too_big = completion(alice, max_tokens=200)
        assert too_big.status_code == 400 and "per minute" in too_big.json()["error"]["message"]
        with grpc.insecure_channel(cluster.address("coordinator")) as channel:  # reserves 1 + 80, cancelled early
            stream = cluster.coordinator(channel).Generate(
                coordinator_pb2.GenerateRequest(text="Hi", max_tokens=80, ignore_eos=True), metadata=auth("alice"))
            next(stream)
            stream.cancel()
        time.sleep(0.5)
        # its unused tokens came back: 81 more fit in the minute's 100 (without the refund they would not)
        assert completion(alice, max_tokens=80, ignore_eos=True).status_code == 200
        refused = completion(alice, max_tokens=30)
        assert refused.status_code == 429 and "tokens" in refused.json()["error"]["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= WINDOW_S
        assert completion(http(cluster, "bob"), max_tokens=30).status_code == 200
    finally:
        cluster.close()
