"""Fuzzing the edges with real servers on loopback (tiny pair, real Redis): the REST API from
its own OpenAPI spec (schemathesis, valid and invalid bodies) and the gRPC request fields of
all three services (hypothesis). Every answer is a success or a clear client error — never
a 5xx, INTERNAL/UNKNOWN, or a dead server."""

from __future__ import annotations

import grpc
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.coordinator.auth import ApiKeys
from services.coordinator.requests import Limits
from services.protogen.specd.v1 import (
    common_pb2,
    coordinator_pb2,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from tests.cluster import Cluster

KEY = "fuzz-key-0123456789abcdef"
OTHER_KEY = "other-key-0123456789abcdef"  # a second client, for session lifecycles across keys
AUTH = {"Authorization": f"Bearer {KEY}"}
# Small generations so that the valid requests the fuzzer finds stay quick.
LIMITS = Limits(default_max_tokens=4, max_tokens=8, max_prompt_tokens=256, max_prompt_chars=1024)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_url, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    keys_file.write_text(f"fuzz:{KEY}\nother:{OTHER_KEY}\n")
    c = Cluster(*tiny_pair, redis_url, dtype="float32", limits=LIMITS, keys=ApiKeys.from_file(keys_file))
    yield c
    c.close()


# --- REST, from the OpenAPI spec -------------------------------------------------------------


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_rest_api_never_answers_5xx(cluster, mode):
    schema = schemathesis.openapi.from_url(cluster.base_url + "/openapi.json", headers=AUTH)  # behind the key

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(FUZZ, max_examples=150)
    def call(case):
        response = case.call(headers=AUTH, timeout=60)
        assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
        if response.status_code >= 400:
            assert response.json()["error"]["message"], response.text

    call()


# Any code point, lone surrogates and NUL included; sometimes far past the prompt limit.
unicode_text = st.one_of(
    st.text(st.characters(codec=None, categories=["Cs", "Cc", "L", "N", "P", "S", "Z"]), max_size=64),
    st.builds(lambda c, n: c * n, st.sampled_from(["\0", "\ud800", "é", "𝔘"]), st.integers(1, 3000)),
)


@given(prompt=unicode_text, stop=st.lists(unicode_text, max_size=3), chat=st.booleans())
@FUZZ
def test_rest_text_fields_with_any_code_points_never_answer_5xx(cluster, prompt, stop, chat):
    import json

    import httpx

    fields = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    body = json.dumps({"model": "tiny-target", "max_tokens": 2, "stop": stop} | fields)  # "\ud800" escapes
    path = "/v1/chat/completions" if chat else "/v1/completions"
    reply = httpx.post(cluster.base_url + path, content=body, headers=AUTH | {"content-type": "application/json"},
                       timeout=60)
    assert reply.status_code < 500, reply.text
    if reply.status_code >= 400:
        assert reply.json()["error"]["message"], reply.text


lifecycle_ops = st.lists(st.tuples(
    st.sampled_from(["turn", "get", "delete", "retry"]), st.sampled_from([KEY, OTHER_KEY]), st.sampled_from("abc"),
    st.sampled_from([" one", " two", "\ud800", "x" * 2000]), st.booleans(),
), min_size=1, max_size=12)


@given(ops=lifecycle_ops)
@settings(FUZZ, max_examples=25)
def test_session_lifecycles_across_two_keys_stay_consistent_and_never_answer_5xx(cluster, ops):
    """Turns (some with an Idempotency-Key, some retried), reads and releases in any order, by two
    keys over the same few ids: each key sees exactly its own sessions, a retry never appends."""
    import json
    import uuid

    import httpx

    run = uuid.uuid4().hex[:8]
    held: dict[tuple[str, str], int] = {}  # (key, id) -> committed length, as the client should see it
    last: dict[tuple[str, str], tuple[str, dict]] = {}  # the last turn's Idempotency-Key and body
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        for op, key, name, prompt, keyed in ops:
            auth, session = {"Authorization": f"Bearer {key}"}, f"{run}-{name}"
            where = (key, session)
            if op in ("turn", "retry"):
                idem, body = last.get(where, (None, None)) if op == "retry" else (None, None)
                if body is None:
                    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": 3, "session_id": session}
                    idem = uuid.uuid4().hex if keyed else None
                headers = auth | {"content-type": "application/json"} | ({"Idempotency-Key": idem} if idem else {})
                reply = client.post("/v1/completions", content=json.dumps(body), headers=headers)  # "\ud800" escapes
                assert reply.status_code in (200, 400), reply.text
                if reply.status_code == 200:
                    length = client.get(f"/v1/sessions/{session}", headers=auth).json()["length"]
                    repeated = op == "retry" and idem is not None and where in held
                    assert length == held[where] if repeated else length > held.get(where, 0)
                    held[where] = length
                    last[where] = (idem, body)
            elif op == "get":
                reply = client.get(f"/v1/sessions/{session}", headers=auth)
                assert reply.status_code == (200 if where in held else 404), reply.text
                if where in held:
                    assert reply.json()["length"] == held[where] and reply.json()["session_id"] == session
            else:
                reply = client.delete(f"/v1/sessions/{session}", headers=auth)
                assert reply.status_code == (200 if where in held else 404), reply.text
                held.pop(where, None)
                last.pop(where, None)
            if reply.status_code >= 400:
                assert reply.json()["error"]["message"], reply.text
        for key, session in held:
            assert client.delete(f"/v1/sessions/{session}", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_rest_server_still_serves_after_the_fuzzing(cluster):
    import httpx

    reply = httpx.post(
        cluster.base_url + "/v1/completions", json={"model": "tiny-target", "prompt": "hi", "max_tokens": 2}, headers=AUTH
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


# --- gRPC fields ------------------------------------------------------------------------------

CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,  # a model service that does not hold the claimed prefix
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

ints = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, 1, -1, 2**31 - 1]))
uints = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 300))
floats = st.floats(allow_nan=True, allow_infinity=True)
texts = st.text(max_size=64)
token_lists = st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 263), max_size=12)
session_ids = st.one_of(st.text(max_size=20), st.from_regex(r"fuzz-[a-z0-9]{1,8}", fullmatch=True))


def optional(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def generate_requests(draw) -> coordinator_pb2.GenerateRequest:
    fields = {
        "max_tokens": draw(optional(ints)),
        "stop": draw(st.lists(texts, max_size=10)),
        "temperature": draw(optional(floats)),
        "top_k": draw(optional(ints)),
        "top_p": draw(optional(floats)),
        "seed": draw(optional(st.integers(0, 2**64 - 1))),
        "num_draft_tokens": draw(optional(ints)),
        "ignore_eos": draw(st.booleans()),
        "session_id": draw(st.one_of(st.just(""), session_ids)),
        "speculation": draw(optional(st.booleans())),
        "max_draft_tokens": draw(optional(ints)),
    }
    prompt = draw(st.one_of(st.none(), texts.map(lambda t: {"text": t}),
                            st.lists(ints, max_size=8).map(lambda ids: {"token_ids": coordinator_pb2.TokenIds(ids=ids)})))
    return coordinator_pb2.GenerateRequest(**(prompt or {}), **{k: v for k, v in fields.items() if v is not None})


def sampling() -> st.SearchStrategy[common_pb2.SamplingParams]:
    return st.builds(common_pb2.SamplingParams, temperature=floats, top_k=uints, top_p=floats,
                     seed=st.integers(0, 2**64 - 1))


def sync_points() -> st.SearchStrategy[common_pb2.SyncPoint]:
    return st.builds(common_pb2.SyncPoint, start_pos=uints, tokens=token_lists, instance_id=texts)


def sparse_rows() -> st.SearchStrategy[common_pb2.SparseDist]:
    return st.builds(common_pb2.SparseDist, token_ids=st.binary(max_size=40), probs=st.binary(max_size=20))


def expect_ok_or_client_error(call) -> None:
    try:
        call()
    except grpc.RpcError as error:
        assert error.code() in CLIENT_ERRORS, f"{error.code()}: {error.details()}"
        assert error.details()


@given(request=generate_requests())
@FUZZ
def test_coordinator_fields(cluster, request):
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        stub = cluster.coordinator(channel)
        expect_ok_or_client_error(lambda: stub.Complete(request, timeout=60, metadata=[("authorization", AUTH["Authorization"])]))


@given(session=session_ids, sync=sync_points(), k=uints, params=sampling())
@FUZZ
def test_draft_service_fields(cluster, session, sync, k, params):
    with grpc.insecure_channel(cluster.address("draft")) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        request = draft_pb2.ProposeRequest(session_id=session, sync=sync, k=k, sampling=params)
        expect_ok_or_client_error(lambda: stub.Propose(request, timeout=60))
        expect_ok_or_client_error(lambda: stub.Release(common_pb2.SessionRef(session_id=session), timeout=60))


@given(session=session_ids, sync=sync_points(), drafts=token_lists, q=st.lists(sparse_rows(), max_size=4),
       params=sampling(), step=st.booleans())
@FUZZ
def test_target_service_fields(cluster, session, sync, drafts, q, params, step):
    with grpc.insecure_channel(cluster.address("target")) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        if step:
            call = lambda: stub.Step(target_pb2.StepRequest(session_id=session, sync=sync, sampling=params), timeout=60)  # noqa: E731
        else:
            request = target_pb2.VerifyRequest(session_id=session, sync=sync, draft_tokens=drafts, q=q, sampling=params)
            call = lambda: stub.Verify(request, timeout=60)  # noqa: E731
        expect_ok_or_client_error(call)
        expect_ok_or_client_error(lambda: stub.GetSession(common_pb2.SessionRef(session_id=session), timeout=60))
