"""Prometheus metrics move by exactly what the requests did: real gRPC servers, tiny models,
a real Redis; the numbers are read from each servicer's registry and from a real /metrics
endpoint."""

from __future__ import annotations

import dataclasses
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from specd.loop import Chunk, GenerationRequest
from specd.sampling import SamplingParams
from specd.stopping import StopRules
from services.common import model_main
from services.common.metrics import serve_metrics
from services.protogen.specd.v1 import coordinator_pb2
from tests.cluster import Cluster

# What Prometheus sends: it prefers OpenMetrics, which would mangle `specd:` names (see exposition()).
PROMETHEUS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_url):
    c = Cluster(*tiny_pair, redis_url)
    yield c
    c.close()


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value for family in registry.collect() for s in family.samples
    }


def deltas(before: dict, after: dict) -> dict[tuple[str, frozenset], float]:
    """Every sample that changed, keyed by (name, labels); a new sample counts from zero."""
    changed = {key: value - before.get(key, 0.0) for key, value in after.items()}
    return {key: d for key, d in changed.items() if d != 0}


def delta(changes: dict, name: str, **labels: str) -> float:
    return changes.get((name, frozenset(labels.items())), 0.0)


Replies = list[coordinator_pb2.GenerateResponse]


def stream(cluster: Cluster, prompt: str, **fields) -> tuple[Replies, coordinator_pb2.GenerationStats]:
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        request = coordinator_pb2.GenerateRequest(text=prompt, **fields)
        replies = list(cluster.coordinator(channel).Generate(request, timeout=60))
    return replies, replies[-1].stats


def test_model_free_drafts_are_counted_apart_and_within_the_totals(cluster):
    registry = cluster.frontend.metrics.registry
    before = samples(registry)
    _, stats = stream(cluster, "abcabcabcabcabc", max_tokens=20, ignore_eos=True, drafter="ngram")
    changes = deltas(before, samples(registry))
    assert stats.model_free_drafted_tokens == stats.drafted_tokens > 0
    expected = {
        "specd:spec_decode_num_draft_tokens_total": stats.drafted_tokens,
        "specd:spec_decode_num_accepted_tokens_total": stats.accepted_tokens,
        "specd:spec_decode_num_model_free_draft_tokens_total": stats.model_free_drafted_tokens,
        "specd:spec_decode_num_model_free_accepted_tokens_total": stats.model_free_accepted_tokens,
    }
    assert {name: delta(changes, name) for name in expected} == expected


def test_coordinator_counters_move_by_the_request_stats(cluster):
    registry = cluster.frontend.metrics.registry
    before = samples(registry)
    replies, stats = stream(cluster, "def add(a, b):", max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    changes = deltas(before, samples(registry))

    generated = sum(len(r.token_ids) for r in replies)
    assert generated == stats.completion_tokens == 20 and stats.drafted_tokens > 0  # a real speculative run
    expected = {
        "specd:spec_decode_num_drafts_total": stats.drafted_per_position[0],
        "specd:spec_decode_num_draft_tokens_total": stats.drafted_tokens,
        "specd:spec_decode_num_accepted_tokens_total": stats.accepted_tokens,
        "specd:spec_decode_fallbacks_total": stats.fallbacks,
        "specd:prompt_tokens_total": stats.prompt_tokens,
        "specd:generation_tokens_total": stats.completion_tokens,
        "specd:time_to_first_token_seconds_count": 1,
        "specd:time_per_output_token_seconds_count": 1,  # one per-request mean per request
        "specd:e2e_request_latency_seconds_count": 1,
    }
    assert {name: delta(changes, name) for name in expected} == expected
    assert delta(changes, "specd:request_success_total", finished_reason="length") == 1
    accepted = [*stats.accepted_per_position, 0, 0, 0][:3]
    per_pos = "specd:spec_decode_num_accepted_tokens_per_pos_total"
    assert [delta(changes, per_pos, position=str(i)) for i in range(3)] == accepted
    assert registry.get_sample_value("specd:num_requests_running") == 0
    ttft, tpot, e2e = (
        delta(changes, f"specd:{name}_seconds_sum")
        for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency")
    )
    assert 0 < ttft < e2e and 0 < tpot * (generated - 1) < e2e  # first token, then the other 19, within the request


def test_plain_decoding_counts_tokens_and_no_drafts(cluster):
    """Drafting rounds, not target calls: a plain request has rounds but drafts nothing."""
    registry = cluster.frontend.metrics.registry
    before = samples(registry)
    _, stats = stream(cluster, "Once upon a time", max_tokens=6, ignore_eos=True, speculation=False)
    changes = deltas(before, samples(registry))
    assert stats.rounds == 6 and stats.drafted_tokens == 0
    assert delta(changes, "specd:spec_decode_num_drafts_total") == 0
    assert delta(changes, "specd:spec_decode_num_draft_tokens_total") == 0
    assert delta(changes, "specd:generation_tokens_total") == 6
    assert delta(changes, "specd:request_success_total", finished_reason="length") == 1


def test_requests_running_counts_a_request_until_its_consumer_stops(cluster):
    """A client that goes away mid-stream must not leave the gauge up."""
    registry = cluster.frontend.metrics.registry
    request = GenerationRequest(cluster.model.encode("Once upon a time"), StopRules(max_tokens=20), SamplingParams())

    async def first_chunk_then_leave() -> float:
        events = cluster.frontend.generate(request)
        assert isinstance(await anext(events), Chunk)
        during = registry.get_sample_value("specd:num_requests_running")
        await events.aclose()
        return during

    assert cluster._run(first_chunk_then_leave()) == 1
    assert registry.get_sample_value("specd:num_requests_running") == 0


def test_model_services_report_caches_evictions_and_step_times(tiny_pair, redis_url):
    """Engines holding one session each: a second session evicts the first in both."""
    c = Cluster(*tiny_pair, redis_url)
    try:
        for engine in (c.draft_engine, c.target_engine):
            engine.config = dataclasses.replace(engine.config, max_sessions=1, idle_evict_s=0.0)
        registries = {"draft": c.draft.metrics.registry, "target": c.target.metrics.registry}
        engines = {"draft": c.draft_engine, "target": c.target_engine}
        before = {role: samples(r) for role, r in registries.items()}

        request = dict(max_tokens=8, ignore_eos=True, num_draft_tokens=2)
        _, first = stream(c, "x = [1, 2, 3]", session_id="metrics-a", **request)
        for role, registry in registries.items():
            now = samples(registry)
            assert now[("specd:cache_sessions", frozenset())] == 1
            assert now[("specd:cache_tokens", frozenset())] == engines[role].kv_length("metrics-a") > 0
            assert delta(deltas(before[role], now), "specd:cache_evictions_total") == 0
        # One observation per successful RPC: a Propose per drafting round, a Verify or Step per round.
        changes = {role: deltas(before[role], samples(r)) for role, r in registries.items()}
        assert delta(changes["draft"], "specd:model_step_seconds_count", rpc="propose") == first.drafted_per_position[0]
        verifies = delta(changes["target"], "specd:model_step_seconds_count", rpc="verify")
        assert verifies + delta(changes["target"], "specd:model_step_seconds_count", rpc="step") == first.rounds

        stream(c, "Hej! Ça va?", session_id="metrics-b", **request)
        for role, registry in registries.items():
            now = samples(registry)
            assert engines[role].position("metrics-a") == 0  # evicted
            assert now[("specd:cache_sessions", frozenset())] == 1
            assert now[("specd:cache_tokens", frozenset())] == engines[role].kv_length("metrics-b")
            assert delta(deltas(before[role], now), "specd:cache_evictions_total") == 1

        scraped, target = scrape(registries["target"]), registries["target"]
        assert scraped["specd:cache_evictions_total"] == target.get_sample_value("specd:cache_evictions_total")
        assert scraped["specd:cache_sessions"] == 1

        with grpc.insecure_channel(c.address("coordinator")) as channel:
            c.coordinator(channel).ReleaseSession(coordinator_pb2.SessionRequest(session_id="metrics-b"))
        for registry in registries.values():
            now = samples(registry)
            assert now[("specd:cache_sessions", frozenset())] == now[("specd:cache_tokens", frozenset())] == 0
    finally:
        c.close()


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    """GET /metrics from a real metrics server as Prometheus would; unlabelled samples by name."""
    server = serve_metrics(registry, 0, "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        request = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    families = list(text_string_to_metric_families(text))
    assert {"specd:cache_sessions", "specd:cache_tokens", "specd:cache_evictions", "specd:model_step_seconds"} <= {
        f.name for f in families
    }
    return {s.name: s.value for f in families for s in f.samples if not s.labels}


def test_metrics_port_is_a_flag_and_an_environment_variable(monkeypatch):
    assert model_main.parse("draft", 1, ["--model-dir", "m"]).metrics_port == 0  # off by default
    assert model_main.parse("draft", 1, ["--model-dir", "m", "--metrics-port", "9101"]).metrics_port == 9101
    monkeypatch.setenv("SPECD_METRICS_PORT", "9102")
    assert model_main.parse("target", 1, ["--model-dir", "m"]).metrics_port == 9102
