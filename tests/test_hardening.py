"""Issue 31's tenant-facing bugs, each reproduced against real servers on loopback (draft, target,
coordinator with its REST gateway, a real Redis; the tiny pair in float64) and each now answered as a
client should be: a session never locks out its owner, a retried turn is not refused for its own
tokens, and what is not the client's fault is not a 4xx (nor a client's fault a 500)."""

from __future__ import annotations

import time

import httpx
import pytest

from services.coordinator.auth import ApiKeys
from services.coordinator.quotas import QuotaLimits
from tests.cluster import MODEL_NAME, Cluster

ALICE = "alice-key-0123456789abcdef"


def keys(tmp_path_factory) -> ApiKeys:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"hardening-alice:{ALICE}\n")  # an owner of its own: quota counts live in the shared Redis
    return ApiKeys.from_file(path)


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_url, tmp_path_factory):
    c = Cluster(*tiny_pair, redis_url, keys=keys(tmp_path_factory))
    yield c
    c.close()


def http(cluster: Cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.base_url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=60)


def turn(session: str, prompt, max_tokens: int = 4) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "session_id": session,
            "temperature": 0, "ignore_eos": True}


def test_a_session_whose_first_turn_failed_is_still_its_owners(tiny_pair, redis_url, tmp_path_factory):
    """The target is down for a named session's first turn: 503, and the session it began is still the
    owner's to retry (503 again, not 404), to read and to release, which frees its session slot."""
    c = Cluster(*tiny_pair, redis_url, keys=keys(tmp_path_factory), quotas=QuotaLimits(sessions=1),
                target_wait_s=0.5)
    try:
        c._run(c.servers[1].stop(0))  # the target's server: no replica answers from now on
        session = f"first-fails-{time.time_ns()}"
        with http(c) as client:
            for _ in range(2):
                failed = client.post("/v1/completions", json=turn(session, "Hello"))
                assert failed.status_code == 503, failed.text
                message = failed.json()["error"]["message"]  # stable words and an id; no address, no Redis
                assert "error id" in message and "127.0.0.1" not in message and "target" not in message
            assert client.get(f"/v1/sessions/{session}").json()["length"] == 0
            assert client.delete(f"/v1/sessions/{session}").status_code == 200
            other = client.post("/v1/completions", json=turn(f"{session}-b", "Hello"))
            assert other.status_code == 503, other.text  # the slot came back: not a 429 for the quota
            assert client.delete(f"/v1/sessions/{session}-b").status_code == 200
    finally:
        c.close()


def test_an_idempotent_retry_near_the_context_limit_is_served(cluster):
    """A turn that fits is admitted; its retry (same Idempotency-Key) is the same turn, not one more:
    the session already holding it does not make the retry outgrow the context."""
    session = f"near-limit-{time.time_ns()}"
    context = cluster.model.max_context
    with http(cluster) as client:
        assert client.post("/v1/completions", json=turn(session, [7] * (context // 2))).status_code == 200
        retried = turn(session, [8] * (context // 2 - 16), max_tokens=8)
        first = client.post("/v1/completions", json=retried, headers={"Idempotency-Key": "turn-2"})
        again = client.post("/v1/completions", json=retried, headers={"Idempotency-Key": "turn-2"})
        assert first.status_code == 200 and again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        too_long = client.post("/v1/completions", json=turn(session, [9] * 16))  # a new turn still is refused
        assert too_long.status_code == 400 and "outgrow the model's context" in too_long.json()["error"]["message"]


def test_a_model_services_own_bug_is_internal_and_a_refusal_is_invalid_argument():
    """A bare ValueError below a model service's edge is a bug (INTERNAL, its text kept in the log);
    only what the service refused on purpose (InvalidParams, an outgrown context) is the caller's."""
    import asyncio

    import grpc

    from services.common.errors import grpc_errors
    from specd.contracts import ContextTooLong
    from specd.validation import InvalidParams

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details):
            self.code, self.details = code, details
            raise Aborted

    @grpc_errors
    async def method(self, error, context):
        raise error

    def status(error: Exception) -> tuple[grpc.StatusCode, str]:
        context = Context()
        with pytest.raises(Aborted):
            asyncio.run(method(None, error, context))
        return context.code, context.details

    assert status(ValueError("operands could not be broadcast together")) == (
        grpc.StatusCode.INTERNAL, "internal error (logged by the service)")
    assert status(InvalidParams("k must be in [1, 32]")) == (grpc.StatusCode.INVALID_ARGUMENT, "k must be in [1, 32]")
    assert status(ContextTooLong("300 tokens exceed max_context=256"))[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_chat_messages_are_bounded_in_characters_before_they_are_rendered(cluster):
    """A chat body under the body limit but with more characters than a prompt may have is refused
    by its size, before the chat template or the tokenizer spend time on it."""
    rendered = []
    model = cluster.frontend.model
    original = model.chat_prompt
    object.__setattr__(model, "chat_prompt", lambda messages: rendered.append(1) or original(messages))
    try:
        half = "word " * (cluster.limits.max_prompt_chars // 10 + 1)
        body = {"model": MODEL_NAME, "max_tokens": 2,
                "messages": [{"role": "user", "content": half}, {"role": "user", "content": half}]}
        with http(cluster) as client:
            refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400 and "characters in all" in refused.json()["error"]["message"]
        assert rendered == []
    finally:
        object.__delattr__(model, "chat_prompt")



def test_what_the_edge_says_of_itself_needs_a_key_and_probes_do_not(cluster):
    """With API keys, the metrics, the OpenAPI spec and its docs pages need one (a scraper uses the
    coordinator's --metrics-port); the liveness probe never does."""
    with httpx.Client(base_url=cluster.base_url, timeout=30) as anonymous, http(cluster) as alice:
        assert anonymous.get("/health").status_code == 200
        for path in ("/metrics", "/openapi.json"):
            assert anonymous.get(path).status_code == 401, path
            assert alice.get(path).status_code == 200, path
        for path in ("/docs", "/redoc"):
            assert anonymous.get(path).status_code == 404 and alice.get(path).status_code == 404, path


def test_a_request_past_the_time_limit_ends_and_gives_its_slot_back(tiny_pair, redis_url, tmp_path_factory):
    """A streamed and a plain request that would run past the edge's time limit end (an error event,
    a 504), and the key's one in-flight slot is free again at once."""
    from services.coordinator.requests import Limits

    c = Cluster(*tiny_pair, redis_url, keys=keys(tmp_path_factory), quotas=QuotaLimits(in_flight=1),
                limits=Limits(request_timeout_s=0.3))
    try:
        long = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": c.model.max_context - 8, "temperature": 0,
                "ignore_eos": True, "speculation": False}  # a round a token, each saved: well past 0.3 s
        with http(c) as client:
            start = time.monotonic()
            with client.stream("POST", "/v1/completions", json=long | {"stream": True}) as streamed:
                events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
            assert '"code":"timeout"' in events[-2] and events[-1] == "data: [DONE]"
            plain = client.post("/v1/completions", json=long)  # the slot came back before the stream's last word
            assert plain.status_code == 504 and plain.json()["error"]["code"] == "timeout"
            short = client.post("/v1/completions", json=long | {"max_tokens": 2})
            assert short.status_code == 200, short.text
            assert time.monotonic() - start < 20  # long before the slot's lease (30 s) would have run out
    finally:
        c.close()


def test_a_stream_whose_client_stops_reading_ends_and_closes_its_generation():
    """A write that waits on a client past the stall limit ends the stream and closes the generator
    (in the gateway: the loop's generation, its quota slot with it)."""
    import asyncio

    from services.coordinator.gateway import BoundedStream
    from services.coordinator.requests import Limits

    closed = []

    async def tokens():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def stalled_client(message):
        if message.get("body"):  # the first chunk fills the socket; the rest never leaves
            await asyncio.Event().wait()

    async def serve():
        deadline = asyncio.get_running_loop().time() + 60
        stream = BoundedStream(tokens(), Limits(stream_stall_s=0.2), deadline, media_type="text/event-stream")
        await asyncio.wait_for(stream.stream_response(stalled_client), 5)

    asyncio.run(serve())
    assert closed == [True]



@pytest.mark.parametrize("client_leaves", [False, True], ids=["past-deadline", "client-left"])
def test_a_streams_generation_is_closed_to_the_end_when_the_server_stops_listening(client_leaves):
    """Starlette runs a stream beside a disconnect listener and cancels both as one ends; uvicorn's
    receive says "disconnected" once the last byte is sent. The generation's clean-up (the loop's
    lease, the quota slot: awaits) still runs to its end, past the deadline and when the client leaves."""
    import asyncio

    from services.coordinator.gateway import BoundedStream
    from services.coordinator.requests import Limits

    cleaned = []

    async def tokens():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            for _ in range(3):  # a Redis call or an RPC: each await a point a cancel can land on
                await asyncio.sleep(0.01)
            cleaned.append(True)

    async def serve():
        loop = asyncio.get_running_loop()
        over = asyncio.Event()

        async def send(message):  # a client reading slowly: the stream waits on its writes
            await asyncio.sleep(0.01)
            if not message.get("more_body", True):
                over.set()

        async def receive():  # uvicorn 0.54's RequestResponseCycle.receive, in short
            if client_leaves:
                await asyncio.sleep(0.05)
            else:
                await over.wait()
            return {"type": "http.disconnect"}

        deadline = loop.time() + (60 if client_leaves else 0.05)
        stream = BoundedStream(tokens(), Limits(stream_stall_s=5), deadline, media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await asyncio.wait_for(stream(scope, receive, send), 5)
        await asyncio.sleep(0.2)  # nothing left to run in the background either

    asyncio.run(serve())
    assert cleaned == [True]


def test_a_coordinator_refuses_a_store_that_may_lose_what_clients_received(tiny_pair, redis_url):
    """The test suite's Redis keeps no append-only file: a coordinator asked to use it does not start,
    and says which setting to change or which flag accepts the loss."""
    import subprocess
    import sys

    from tests.procs import ROOT

    command = [sys.executable, "-m", "services.coordinator", "--model", str(tiny_pair[1]), "--port", "0",
               "--http-port", "-1", "--draft-addr", "127.0.0.1:1", "--target-addr", "127.0.0.1:1",
               "--redis-url", redis_url, "--calibrate", "off"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "not durable" in done.stderr and "appendfsync" in done.stderr and "--require-durable-store off" in done.stderr


@pytest.mark.parametrize("flags", [["--max-k", "33"], ["--default-k", "0"], ["--max-k", "0"],
                                   ["--request-timeout-s", "0"], ["--stream-stall-s", "-1"], ["--max-connections", "0"]])
def test_a_coordinator_refuses_bounds_its_model_services_or_itself_cannot_keep(flags, tiny_pair, capsys):
    """A K above the model services' limit used to start and fail inside every request that asked for it."""
    from services.coordinator import root

    base = ["--model", str(tiny_pair[1]), "--redis-url", "redis://127.0.0.1:1/0", "--draft-addr", "127.0.0.1:1",
            "--target-addr", "127.0.0.1:1"]
    root.parse(base)  # the defaults are fine
    root.parse([*base, "--max-k", "2"])  # a default K above it is capped, as before
    with pytest.raises(SystemExit):
        root.parse([*base, *flags])
    assert flags[-2] in capsys.readouterr().err


def test_a_grpc_stream_whose_client_stops_reading_ends_and_gives_its_slot_back(redis_url, tmp_path_factory):
    """gRPC's flow control holds a write to a client that reads nothing; past the stall limit the
    stream ends (DEADLINE_EXCEEDED) and its generation closes: the key's one slot is free at once."""
    import grpc

    from services.coordinator.requests import Limits
    from services.protogen.specd.v1 import coordinator_pb2
    from tests.tiny import build_tiny_pair

    pair = build_tiny_pair(tmp_path_factory.mktemp("long_pair"), max_positions=8192)
    c = Cluster(*pair, redis_url, keys=keys(tmp_path_factory), quotas=QuotaLimits(in_flight=1),
                limits=Limits(stream_stall_s=0.5))
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    metadata = [("authorization", f"Bearer {ALICE}")]
    long = coordinator_pb2.GenerateRequest(text="Once", max_tokens=4096, ignore_eos=True, speculation=False)
    try:
        with grpc.insecure_channel(c.address("coordinator"), options=small_window) as channel:
            stream = c.coordinator(channel).Generate(long, metadata=metadata, timeout=120)
            next(stream)  # admitted; then it reads nothing while the server's writes fill the window
            time.sleep(5)
            with pytest.raises(grpc.RpcError) as ended:
                for _ in stream:  # what was buffered, then the end
                    pass
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "read nothing" in ended.value.details()
        with http(c) as client:  # the slot came back when the stream ended
            assert client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
                               ).status_code == 200
    finally:
        c.close()
