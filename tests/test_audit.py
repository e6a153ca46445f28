"""The online lossless audit (specd/audit.py): a finished greedy request decoded again plainly on
the target must give the tokens it committed. Scripted fakes through the coordinator's Frontend
(where requests finish), then the real services on loopback with /metrics."""

from __future__ import annotations

import asyncio
import logging
import random
import urllib.request
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from specd.audit import Auditor
from specd.contracts import SamplingParams
from specd.loop import Finished, GenerationRequest, Services
from specd.stopping import StopRules
from services.coordinator.root import parse
from services.coordinator.frontend import Frontend
from services.coordinator.requests import Limits
from services.protogen.specd.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.fakes import VOCAB, FakeDrafter, FakeStore, FakeVerifier, draft_rule, target_alone, target_rule
from tests.test_loop import PROMPT, decode

AUDITS, MISMATCHES = "specd:spec_decode_lossless_audits_total", "specd:spec_decode_lossless_audit_mismatches_total"
SKIPPED = "specd:spec_decode_lossless_audits_skipped_total"
DIFFERS_AFTER = len(PROMPT) + 5  # the prefix length after which the non-invariant target's rows disagree


def greedy(max_tokens=20, k: int | None = 4, prompt=PROMPT, stop=(), eos=frozenset()) -> GenerationRequest:
    return GenerationRequest(prompt, StopRules(max_tokens, tuple(stop), eos), SamplingParams(), fixed_k=k)


@dataclass
class RowDependentVerifier(FakeVerifier):
    """Not batch-invariant: a verification with drafts answers differently from a plain step
    after `DIFFERS_AFTER` tokens (its rows there give the next token but one)."""

    def __post_init__(self):
        self.plain_rule = self.rule

    def in_rows(self, prefix) -> int:
        wanted = self.plain_rule(prefix)
        return (wanted + 1) % VOCAB if len(prefix) == DIFFERS_AFTER else wanted

    async def verify(self, request):
        # The rule is read before the fake's first await, so concurrent calls cannot see each other's.
        self.rule = self.in_rows if request.proposal.tokens else self.plain_rule
        return await super().verify(request)


@dataclass
class GatedVerifier(FakeVerifier):
    """Plain steps (no drafts) wait for `gate`; records the most scratch sessions held at once."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    most_audits: int = 0

    async def verify(self, request):
        if not request.proposal.tokens:
            await self.gate.wait()
        reply = await super().verify(request)
        self.most_audits = max(self.most_audits, sum(s.startswith("audit-") for s in self.sessions))
        return reply


def frontend(verifier: FakeVerifier, rate: float = 1.0, store: FakeStore | None = None) -> Frontend:
    services = Services(FakeDrafter(draft_rule(100)), verifier, store or FakeStore())
    return Frontend(services, SimpleNamespace(decode=decode, max_context=4096), Limits(), audit_rate=rate)


async def finish(front: Frontend, request: GenerationRequest, session: str = "") -> Finished:
    events = [e async for e in front.generate(request, session)]
    assert isinstance(events[-1], Finished)
    return events[-1]


async def audited(front: Frontend, *requests: GenerationRequest, session: str = "") -> list[Finished]:
    """Run the requests one after another, each audit ending before the next request."""
    done = []
    for request in requests:
        done.append(await finish(front, request, session))
        await front.auditor.idle()
    return done


def counts(front: Frontend) -> dict[str, float]:
    registry = front.metrics.registry
    skipped = {f"skipped {r}": registry.get_sample_value(SKIPPED, {"reason": r}) or 0 for r in ("sampled", "busy", "failed")}
    return {"audits": registry.get_sample_value(AUDITS), "mismatches": registry.get_sample_value(MISMATCHES), **skipped}


def expected(audits=0, mismatches=0, sampled=0, busy=0, failed=0) -> dict[str, float]:
    return {"audits": audits, "mismatches": mismatches, "skipped sampled": sampled, "skipped busy": busy,
            "skipped failed": failed}


def audit_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "specd.audit" and r.levelno == logging.WARNING]


def test_a_target_whose_rows_differ_from_its_plain_steps_is_caught(caplog):
    front = frontend(RowDependentVerifier(target_rule))
    (done,) = asyncio.run(audited(front, greedy()))
    position = DIFFERS_AFTER - len(PROMPT)
    plain = target_alone(PROMPT, 20)
    assert done.token_ids[:position] == tuple(plain[:position]) and done.token_ids[position] != plain[position]
    assert counts(front) == expected(audits=1, mismatches=1)
    (warning,) = audit_warnings(caplog)
    assert (f"at output position {position} (sequence position {DIFFERS_AFTER}) of 20: "
            f"speculative token {done.token_ids[position]}, plain token {plain[position]}") in warning


@pytest.mark.parametrize("case", ["length", "eos", "stop string", "adaptive K", "second turn"])
def test_an_exact_target_passes_silently_whatever_ended_the_request(case, caplog):
    full = target_alone(PROMPT, 30)
    requests = {
        "length": [greedy(30)],
        "eos": [greedy(30, eos=frozenset({full[13]}))],
        "stop string": [greedy(30, stop=[decode(full)[11:13]])],
        "adaptive K": [greedy(30, k=None)],
        "second turn": [greedy(12), greedy(15, prompt=(7, 7))],  # the audit's prefix holds the first turn
    }[case]
    front = frontend(FakeVerifier(target_rule))
    done = asyncio.run(audited(front, *requests, session="chat" if case == "second turn" else ""))
    if case in ("eos", "stop string"):
        assert done[-1].finish_reason == "stop" and len(done[-1].token_ids) < 30
    assert counts(front) == expected(audits=len(requests))
    assert audit_warnings(caplog) == []


def test_rate_zero_never_audits():
    verifier = FakeVerifier(target_rule)
    front = frontend(verifier, rate=0.0)
    (done,) = asyncio.run(audited(front, *[greedy()] * 5))[-1:]
    assert verifier.calls == 5 * done.stats.rounds  # the requests' rounds, nothing else
    assert counts(front) == expected()


def test_rate_one_audits_every_greedy_request_and_a_fraction_draws_from_its_seeded_source():
    front = frontend(FakeVerifier(target_rule))
    asyncio.run(audited(front, *[greedy()] * 4))
    assert counts(front) == expected(audits=4)

    outcomes: list[str] = []
    front = frontend(FakeVerifier(target_rule))
    front.auditor = Auditor(front.services, 0.3, random.Random(7), outcomes.append)
    asyncio.run(audited(front, *[greedy()] * 20))
    draws = random.Random(7)
    assert len(outcomes) == sum(draws.random() < 0.3 for _ in range(20)) > 0
    assert set(outcomes) == {"match"}


def test_sampled_requests_are_not_audited():
    """Position-keyed uniforms make a sampled request reproducible for one K, not across K: a plain
    run is no token-by-token reference for it (specd/audit.py)."""
    verifier = FakeVerifier(target_rule)
    front = frontend(verifier)
    sampled = replace(greedy(), params=SamplingParams(temperature=0.8, seed=3))
    (done,) = asyncio.run(audited(front, sampled))
    assert verifier.calls == done.stats.rounds
    assert counts(front) == expected(sampled=1)


def test_the_response_does_not_wait_for_its_audit():
    async def scenario():
        verifier = GatedVerifier(target_rule)
        front = frontend(verifier)
        done = await asyncio.wait_for(finish(front, greedy()), timeout=5)  # every round drafted: never gated
        assert front.auditor.running is not None and counts(front) == expected()  # the audit waits at the gate
        verifier.gate.set()
        await front.auditor.idle()
        return front, done

    front, done = asyncio.run(scenario())
    assert done.token_ids == tuple(target_alone(PROMPT, 20))
    assert counts(front) == expected(audits=1)


def test_at_most_one_audit_runs_and_a_request_drawn_meanwhile_is_dropped_and_counted():
    async def scenario():
        verifier = GatedVerifier(target_rule)
        front = frontend(verifier)
        for _ in range(3):
            await finish(front, greedy())
        assert counts(front) == expected(busy=2)
        verifier.gate.set()
        await front.auditor.idle()
        await audited(front, greedy())  # the slot is free again
        return front, verifier

    front, verifier = asyncio.run(scenario())
    assert counts(front) == expected(audits=2, busy=2) and verifier.most_audits == 1


def test_the_audit_forgets_its_scratch_session_and_leaves_the_policy_prior_alone():
    verifier, store = FakeVerifier(target_rule), FakeStore()
    front = frontend(verifier, store=store)
    (done,) = asyncio.run(audited(front, greedy(k=None)))  # an adaptive request remembers its policy
    assert store.learned is done.session.policy
    scratch = [s for s in verifier.released if s.startswith("audit-")]
    assert len(scratch) == 1 and scratch[0] not in verifier.sessions and not store.sessions
    assert counts(front) == expected(audits=1)


def test_a_failed_audit_is_counted_logged_and_forgotten(caplog):
    class PlainStepsFail(FakeVerifier):
        async def verify(self, request):
            if not request.proposal.tokens:
                raise ConnectionError("target away")
            return await super().verify(request)

    verifier, store = PlainStepsFail(target_rule), FakeStore()
    front = frontend(verifier, store=store)
    asyncio.run(audited(front, greedy()))
    assert counts(front) == expected(failed=1)
    assert any("failed: ConnectionError('target away')" in m for m in audit_warnings(caplog))
    assert not store.sessions and any(s.startswith("audit-") for s in verifier.released)


def test_the_coordinator_validates_its_audit_rate_setting(capsys):
    base = ["--model-dir", "m", "--redis-url", "redis://127.0.0.1:1/0"]
    assert parse(base).audit_rate == 0.01
    assert parse(base + ["--audit-rate", "0"]).audit_rate == 0.0
    assert parse(base + ["--audit-rate", "1"]).audit_rate == 1.0
    for bad in ("1.5", "-0.1", "nan", "often"):
        with pytest.raises(SystemExit):
            parse(base + ["--audit-rate", bad])
        assert "audit rate must be a fraction in [0, 1]" in capsys.readouterr().err


def test_the_real_services_pass_their_audits_visibly_in_metrics(tiny_pair, redis_url):
    c = Cluster(*tiny_pair, redis_url, audit_rate=1.0)
    try:
        requests = [
            dict(text="def add(a, b):", max_tokens=24, ignore_eos=True, num_draft_tokens=3),
            dict(text="Once upon a time", max_tokens=16, num_draft_tokens=2, session_id="audited-chat"),
            dict(text=" and then", max_tokens=16, num_draft_tokens=4, session_id="audited-chat"),  # a second turn
            dict(text="x = [1, 2, 3]", max_tokens=12, ignore_eos=True, temperature=0.7, seed=5),  # sampled
        ]
        with grpc.insecure_channel(c.address("coordinator")) as channel:
            for fields in requests:
                replies = list(c.coordinator(channel).Generate(coordinator_pb2.GenerateRequest(**fields), timeout=60))
                assert replies[-1].stats.completion_tokens > 0
                c._run(c.frontend.auditor.idle())
            c.coordinator(channel).ReleaseSession(coordinator_pb2.SessionRequest(session_id="audited-chat"))
        with urllib.request.urlopen(f"{c.base_url}/metrics", timeout=10) as reply:
            families = text_string_to_metric_families(reply.read().decode())
            scraped = {(s.name, tuple(s.labels.items())): s.value for f in families for s in f.samples}
        assert scraped[(AUDITS, ())] == 3 and scraped[(MISMATCHES, ())] == 0
        assert scraped[(SKIPPED, (("reason", "sampled"),))] == 1
        assert c.target_engine.session_count() == 0  # every scratch session released
        assert redis.Redis.from_url(redis_url).keys("specd:{audit-*") == []
    finally:
        c.close()
