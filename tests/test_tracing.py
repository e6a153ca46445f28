"""Tracing: the loop's round spans (in memory, scripted fakes), and one request's trace across
real processes (REST gateway / gRPC coordinator, draft, target) as a real Phoenix receives it.

The end-to-end test installs Phoenix into its own venv when it is missing (≈3 min once;
`scripts/test` does that up front) and never skips.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specd import loop
from specd.loop import Finished, RoundRecord, Services, generate
from services.common import telemetry
from services.common.phoenix import PROJECT, LocalPhoenix, answers_ok
from services.common.redis_server import free_port
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.fakes import FakeDrafter, FakeStore, FakeVerifier, draft_rule, target_rule
from tests.procs import coordinator, model_service
from tests.test_loop import decode, request

pytestmark = pytest.mark.slow  # a Phoenix server in its own venv

# --- the loop's spans, in memory --------------------------------------------------------------


def current_span_id() -> int:
    return trace.get_current_span().get_span_context().span_id


@dataclass
class SpyDrafter(FakeDrafter):
    under: list[int] = field(default_factory=list)  # the span current during each call

    async def propose(self, *args):
        self.under.append(current_span_id())
        return await super().propose(*args)


@dataclass
class SpyVerifier(FakeVerifier):
    under: list[int] = field(default_factory=list)

    async def verify(self, *args):
        self.under.append(current_span_id())
        return await super().verify(*args)


@pytest.fixture
def tracer(monkeypatch) -> tuple[trace.Tracer, InMemorySpanExporter]:
    """An SDK tracer for the loop only: the process's global provider stays untouched."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(loop, "tracer", provider.get_tracer("test"))
    return provider.get_tracer("test"), exporter


def test_one_round_span_per_round_with_its_numbers_and_the_rpcs_inside(tracer):
    outer, exporter = tracer
    drafter, verifier = SpyDrafter(draft_rule(3)), SpyVerifier(target_rule)
    records: list[RoundRecord] = []
    services = Services(drafter, verifier, FakeStore())

    async def run() -> list:
        with outer.start_as_current_span("coordinator.generate"):
            events = [e async for e in generate(request(max_tokens=30, k=4), "s1", services, decode, True, records.append)]
        assert not trace.get_current_span().get_span_context().is_valid  # nothing left current
        return events

    done = asyncio.run(run())[-1]
    spans = exporter.get_finished_spans()
    request_span = next(s for s in spans if s.name == "coordinator.generate")
    rounds = sorted((s for s in spans if s.name == "speculation.round"), key=lambda s: s.attributes["specd.round"])
    assert isinstance(done, Finished) and len(rounds) == len(records) == done.stats.rounds > 1
    for i, (span, record) in enumerate(zip(rounds, records)):
        assert span.parent.span_id == request_span.context.span_id
        a = span.attributes
        assert (a["specd.round"], a["specd.k"], a["specd.accepted"]) == (i, record.k, record.num_accepted)
        assert (a["specd.committed_length"], a["specd.mode"]) == (record.committed_length, record.mode)
        assert a["specd.draft_s"] == pytest.approx(drafter.compute_s * record.k)
        assert a["specd.verify_s"] == pytest.approx(verifier.compute_s)
        assert a["specd.rtt_s"] >= 0
    # every service call ran inside its round's span: that is what parents the gRPC client spans
    round_ids = [s.context.span_id for s in rounds]
    assert verifier.under == round_ids
    assert drafter.under == [s.context.span_id for s, r in zip(rounds, records) if r.k > 0]


@pytest.mark.parametrize(
    "env, on",
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, False),
    ],
)
def test_tracing_is_on_only_when_an_exporter_is_configured(monkeypatch, env, on):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert telemetry.tracing_configured() is on


# --- one request across real processes, as Phoenix shows it -----------------------------------

MODEL = "tiny"
N_TOKENS, K = 12, 3
COORDINATOR = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
PROPOSE = "/specd.v1.DraftService/Propose"
TARGET_WORK = {"target.verify": "/specd.v1.TargetService/Verify", "target.step": "/specd.v1.TargetService/Step"}


@pytest.fixture(scope="session")
def phoenix():
    with LocalPhoenix() as server:
        yield server


@pytest.fixture(scope="module")
def traced(phoenix, tiny_pair, redis_url, tmp_path_factory):
    """Draft, target and coordinator (gRPC + REST) as processes exporting to Phoenix."""
    log_dir = tmp_path_factory.mktemp("traced")
    draft_dir, target_dir = tiny_pair
    draft, target = model_service("draft", draft_dir, log_dir), model_service("target", target_dir, log_dir)
    coord = coordinator(target_dir, [draft.address], [target.address], redis_url, log_dir)
    http_port = free_port()
    coord.args += ["--http-port", str(http_port), "--served-model-name", MODEL]
    procs = [draft, target, coord]
    for p in procs:
        # a short batch delay: the spans reach Phoenix within the test's patience
        p.env = {**phoenix.otel_env(), "OTEL_SERVICE_NAME": f"specd-{p.role}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        http_url = f"http://127.0.0.1:{http_port}"
        _wait_until(lambda: answers_ok(f"{http_url}/health"), 30, "the REST gateway did not come up")
        yield SimpleNamespace(http_url=http_url, grpc_address=coord.address)
    finally:
        for p in procs:
            p.stop()


def _wait_until(condition, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.2)


def complete_over_rest(url: str, session_id: str) -> None:
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": N_TOKENS, "temperature": 0,
            "ignore_eos": True, "num_draft_tokens": K, "session_id": session_id}
    call = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                  {"Content-Type": "application/json"})
    with urllib.request.urlopen(call, timeout=120) as reply:
        assert json.load(reply)["usage"]["completion_tokens"] == N_TOKENS


def complete_over_grpc(address: str, session_id: str) -> None:
    ask = coordinator_pb2.GenerateRequest(text="def add(a, b):", max_tokens=N_TOKENS, ignore_eos=True,
                                          num_draft_tokens=K, session_id=session_id)
    with grpc.insecure_channel(address) as channel:
        assert len(coordinator_pb2_grpc.CoordinatorStub(channel).Complete(ask, timeout=120).token_ids) == N_TOKENS


def stream_over_grpc(address: str, session_id: str) -> None:
    ask = coordinator_pb2.GenerateRequest(text="def add(a, b):", max_tokens=N_TOKENS, ignore_eos=True,
                                          num_draft_tokens=K, session_id=session_id)
    with grpc.insecure_channel(address) as channel:
        replies = list(coordinator_pb2_grpc.CoordinatorStub(channel).Generate(ask, timeout=120))
    assert sum(len(r.token_ids) for r in replies) == N_TOKENS and replies[-1].finish_reason == "length"


def phoenix_spans(phoenix: LocalPhoenix) -> list[dict]:
    """Every span of the project so far (404 until the first span has created the project)."""
    spans, cursor = [], ""
    while True:
        query = f"limit=1000&cursor={cursor}" if cursor else "limit=1000"
        try:
            with urllib.request.urlopen(f"{phoenix.url}/v1/projects/{PROJECT}/spans?{query}", timeout=10) as reply:
                page = json.load(reply)
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return []
            raise
        spans += page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            return spans


def request_trace(phoenix: LocalPhoenix, session_id: str, timeout_s: float = 60.0) -> dict[str, dict]:
    """The spans (by span id) of the trace whose coordinator.generate served `session_id`, once
    every process's spans are in: all parents resolve and each round's model spans arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = phoenix_spans(phoenix)
        roots = [s for s in spans if s["name"] == "coordinator.generate"
                 and s["attributes"].get("specd.session_id") == session_id]
        if roots:
            trace_id = roots[0]["context"]["trace_id"]
            found = {s["context"]["span_id"]: s for s in spans if s["context"]["trace_id"] == trace_id}
            if _complete(found):
                return found
        if time.monotonic() > deadline:
            raise AssertionError(f"no complete trace for {session_id} in Phoenix: {sorted(s['name'] for s in spans)}")
        time.sleep(0.5)


def _complete(spans: dict[str, dict]) -> bool:
    rounds = named(spans, "speculation.round")
    drafting = [r for r in rounds if r["attributes"]["specd.k"] > 0]
    parents_known = sum(s["parent_id"] is None for s in spans.values()) == 1 and all(
        s["parent_id"] in spans for s in spans.values() if s["parent_id"] is not None
    )
    return bool(rounds) and parents_known and len(named(spans, "draft.propose")) == len(drafting) and len(
        target_work(spans)
    ) == len(rounds)


def named(spans: dict[str, dict], name: str) -> list[dict]:
    return [s for s in spans.values() if s["name"] == name]


def target_work(spans: dict[str, dict]) -> list[dict]:
    """A round that drafted nothing (K shrinks near max_tokens) is a plain Step."""
    return [s for s in spans.values() if s["name"] in TARGET_WORK]


def lineage(spans: dict[str, dict], span: dict) -> list[str]:
    """Names from `span` up to the root."""
    names = [span["name"]]
    while span["parent_id"] is not None:
        span = spans[span["parent_id"]]
        names.append(span["name"])
    return names


def parent(spans: dict[str, dict], span: dict) -> dict:
    return spans[span["parent_id"]]


@pytest.mark.parametrize("edge", ["rest", "grpc", "grpc-stream"])
def test_one_request_is_one_trace_from_the_edge_to_the_model_work(traced, phoenix, edge):
    session_id = f"trace-{edge}-{uuid.uuid4().hex[:8]}"
    if edge == "rest":
        complete_over_rest(traced.http_url, session_id)
        edge_span = "POST /v1/completions"  # the gateway's HTTP server span
    elif edge == "grpc":
        complete_over_grpc(traced.grpc_address, session_id)
        edge_span = f"/{COORDINATOR}/Complete"  # the coordinator's gRPC server span
    else:
        stream_over_grpc(traced.grpc_address, session_id)
        edge_span = f"/{COORDINATOR}/Generate"
    spans = request_trace(phoenix, session_id)

    # coordinator: the edge's server span is the root, the request span its child
    (request_span,) = named(spans, "coordinator.generate")
    assert lineage(spans, request_span) == ["coordinator.generate", edge_span]
    done = request_span["attributes"]
    assert (done["specd.completion_tokens"], done["specd.finish_reason"]) == (N_TOKENS, "length")
    rounds = sorted(named(spans, "speculation.round"), key=lambda s: s["attributes"]["specd.round"])
    assert [r["attributes"]["specd.round"] for r in rounds] == list(range(done["specd.rounds"]))
    assert sum(r["attributes"]["specd.accepted"] for r in rounds) == done["specd.accepted"]
    assert all(r["parent_id"] == request_span["context"]["span_id"] for r in rounds)

    # draft and target processes: their server spans hang under the coordinator's client spans
    # (same trace id, over gRPC metadata), and the model work under those, in the right round
    chain = ["speculation.round", "coordinator.generate", edge_span]
    for work in named(spans, "draft.propose"):
        assert lineage(spans, work) == ["draft.propose", PROPOSE, PROPOSE, *chain]
        round_span = parent(spans, parent(spans, parent(spans, work)))
        assert work["attributes"]["specd.k"] == round_span["attributes"]["specd.k"] > 0
    for work in target_work(spans):
        rpc = TARGET_WORK[work["name"]]
        assert lineage(spans, work) == [work["name"], rpc, rpc, *chain]
        round_span = parent(spans, parent(spans, parent(spans, work)))
        assert work["attributes"]["specd.k"] == round_span["attributes"]["specd.k"]
        assert work["attributes"]["specd.accepted"] == round_span["attributes"]["specd.accepted"]
    assert named(spans, "draft.propose") and len(target_work(spans)) == len(rounds)
