"""Start-up calibration (specd/calibration.py, `specd.policy.calibrated`): timed rounds of every K
on a scratch session give a fresh deployment a prior that prices every K, so its first session
neither calibrates nor explores. Fakes for the loop, then the real services on loopback."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd import calibration
from specd.loop import Services
from specd.policy import (
    PolicyConfig,
    RoundObservation,
    best_k,
    calibrated,
    calibration_ks,
    explore_k,
    inherit,
    next_k,
)
from services.common.server import start_server
from services.coordinator.store import RedisSessionStore
from tests.cluster import Cluster
from tests.fakes import FakeDecoder, FakeDrafter, FakeStore, FakeVerifier, draft_rule, target_rule
from tests.test_loop import decode

CONFIG = PolicyConfig(max_k=16)
# The real float32 target's verify(K): its passes pad rows to blocks, so the K of a block cost alike.
VERIFY_S = {0: 0.45, 1: 0.49, 2: 0.49, 3: 0.49, 4: 0.6, 5: 0.7, 6: 0.74, 7: 0.74, **dict.fromkeys(range(8, 16), 1.0),
            16: 1.3}


def test_every_k_up_to_max_k_is_priced_by_its_own_rounds():
    assert calibration_ks(CONFIG) == tuple(range(17))
    assert calibration_ks(PolicyConfig(max_k=1)) == (0, 1)


def test_the_calibrated_prior_measures_timings_but_not_acceptance():
    rounds = [RoundObservation(k, 0, 0.05 * k, 0.4 + 0.04 * k, 0.002) for k in calibration_ks(CONFIG)]
    # a draft catching up on 100 tokens: left out of the step, and its time beyond two steps a token of a catch-up
    rounds.append(RoundObservation(2, 0, 9.0, 9.0, 0.002, draft_cold=True, target_cold=True, draft_sent=100))
    # streamed plain steps: a faster pass than the lone plain step's, and a gap that is no call's RTT
    rounds += [RoundObservation(0, 0, 0.0, 0.36 + 0.01 * i, 0.0005, streamed=True) for i in range(3)]
    est = calibrated(rounds).estimates
    assert est.catch_up_s == pytest.approx((9.0 - 2 * 0.05) / 100)
    assert dict(est.verify_s) == pytest.approx({0: 0.36} | {k: 0.4 + 0.04 * k for k in range(1, 17)})
    assert est.calibrated_s == est.verify_s  # kept apart: learning moves verify_s only
    assert est.draft_step_s == pytest.approx(0.05) and est.rtt_s == pytest.approx(0.002)
    assert est.stream_s == pytest.approx(0.0005)
    assert est.alpha == 0.7 and est.tested_count == 0 and est.observations == 0  # the prior's


def test_a_pass_is_priced_at_most_as_the_fastest_pass_of_more_positions():
    """Noise only adds time and more positions never cost less: a slow moment during K = 1's rounds
    (68 ms where K = 2 took 61, the AVX2 host's start-up) must not price the first extra row at 24 ms."""
    timed = {0: 0.044, 1: 0.068, 2: 0.061, 3: 0.072, 4: 0.087, 5: 0.123, 6: 0.129, 7: 0.119}
    est = calibrated([RoundObservation(k, 0, 0.014 * k, t, 0.003) for k, t in timed.items()]).estimates
    assert dict(est.verify_s) == pytest.approx(timed | {1: 0.061, 5: 0.119, 6: 0.119})
    assert est.calibrated_s == est.verify_s


def test_a_session_inheriting_it_neither_calibrates_nor_explores():
    rounds = [RoundObservation(k, 0, 0.045 * k, VERIFY_S[k], 0.003) for k in calibration_ks(CONFIG)]
    state = inherit(calibrated(rounds))
    assert next_k(state, CONFIG) == CONFIG.default_k  # a first drafting round, not a plain calibration round
    code = replace(state.estimates, alpha=0.97)
    k, speedup = best_k(code, CONFIG)
    assert k == 15 and explore_k(code, CONFIG, k, speedup) == k  # every K measured: nothing to try


@dataclass
class RowPricedVerifier(FakeVerifier):
    """Reports a verification of K drafts as 0.4 s + 0.05 s a draft, 1 s more while warming up;
    records how many committed tokens each call brought it (a fake holds the round's last token)."""

    warm_up_calls: int = 5
    synced: list[int] = field(default_factory=list)

    async def verify(self, request):
        reply = await super().verify(request)
        self.synced.append(len(request.sync.tokens))
        cold = 1.0 if self.calls <= self.warm_up_calls else 0.0
        return replace(reply, compute_s=cold + 0.4 + 0.05 * len(request.proposal.tokens))


def test_calibration_times_each_k_on_a_scratch_session_and_forgets_it():
    drafter, verifier, store = FakeDrafter(draft_rule(3)), RowPricedVerifier(target_rule), FakeStore()
    services = Services(drafter, verifier, store)
    prior = asyncio.run(calibration.seed_prior(services, decode, CONFIG))
    ks = calibration_ks(CONFIG)
    sweeps = 1 + calibration.SWEEPS * len(ks)  # the prefill, then each K SWEEPS times
    assert verifier.calls == sweeps + calibration.PLAIN_STEPS  # then plain steps (no stream here: Step calls)
    assert verifier.synced[0] == len(calibration.SCRATCH_PROMPT) and not any(verifier.synced[1:])  # as a session goes on
    assert dict(prior.estimates.verify_s) == {k: pytest.approx(0.4 + 0.05 * k) for k in ks}  # warm
    assert prior.estimates.draft_step_s == pytest.approx(drafter.compute_s)
    assert store.learned == prior and not store.sessions  # stored; the scratch session deleted
    assert drafter.released == verifier.released and len(verifier.released) == 1 and not verifier.sessions
    assert asyncio.run(calibration.seed_prior(services, decode, CONFIG)) is None  # it has a prior now
    assert verifier.calls == sweeps + calibration.PLAIN_STEPS and store.learned == prior


def test_with_no_draft_model_calibration_times_plain_steps_only():
    verifier, store = RowPricedVerifier(target_rule, warm_up_calls=0), FakeStore()
    prior = asyncio.run(calibration.seed_prior(Services(None, verifier, store), decode, CONFIG))
    assert dict(prior.estimates.verify_s) == {0: pytest.approx(0.4)} and prior.estimates.draft_step_s is None
    assert verifier.calls == 1 + calibration.SWEEPS + calibration.PLAIN_STEPS and len(verifier.released) == 1


@dataclass
class WarmWhenStreamed:
    """The verifier's passes as a stream of plain steps runs them: `compute_s` each, where a lone call's
    plain step (the sweeps') reports the verifier's own price."""

    verifier: FakeVerifier
    compute_s: float

    async def verify(self, request):
        return replace(await self.verifier.verify(request), compute_s=self.compute_s)


def test_a_plain_step_is_priced_as_the_deployment_decodes_plainly():
    """Every speculative round is weighed against plain decoding, which streams its steps, and a session
    that drafts every round never times it again: the prior's verify(0) is a streamed step's."""
    verifier = RowPricedVerifier(target_rule, warm_up_calls=0)  # a lone call: 0.4 s + 0.05 s a draft
    decoder = FakeDecoder(WarmWhenStreamed(verifier, 0.3))
    services = Services(FakeDrafter(draft_rule(3)), verifier, FakeStore(), decoder=decoder)
    est = asyncio.run(calibration.seed_prior(services, decode, CONFIG)).estimates
    assert dict(est.verify_s) == {0: pytest.approx(0.3)} | {k: pytest.approx(0.4 + 0.05 * k) for k in range(1, 17)}
    assert decoder.opened == 1 and decoder.steps == calibration.PLAIN_STEPS and est.stream_s is not None


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_url):
    c = Cluster(*tiny_pair, redis_url)
    yield c
    c.close()


def test_calibration_through_the_real_services(cluster, redis_url):
    store = RedisSessionStore(redis_url, prefix=f"calibration-test-{uuid.uuid4().hex}")  # a fresh deployment
    services = Services(cluster.services.drafter, cluster.services.verifier, store)
    config = PolicyConfig(max_k=6)
    try:
        prior = cluster._run(calibration.seed_prior(services, cluster.model.decode, config))
        assert {k for k, _ in prior.estimates.verify_s} == set(calibration_ks(config))
        assert all(t > 0 for _, t in prior.estimates.verify_s) and prior.estimates.draft_step_s > 0
        assert cluster._run(store.prior()) == prior
        assert cluster.draft_engine.session_count() == cluster.target_engine.session_count() == 0  # scratch gone
    finally:
        cluster._run(store.close())


def test_health_answers_serving_once_the_warm_up_is_done():
    """The coordinator passes its calibration as `warm_up`: a readiness probe waits for it."""

    async def main():
        done = asyncio.get_running_loop().create_future()
        server, port = await start_server(lambda server: [], "127.0.0.1:0", warm_up=done)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            before = (await health.Check(health_pb2.HealthCheckRequest())).status
            done.set_result(None)
            for _ in range(100):
                after = (await health.Check(health_pb2.HealthCheckRequest())).status
                if after == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.01)
        await server.stop(None)
        return before, after

    before, after = asyncio.run(main())
    assert before == health_pb2.HealthCheckResponse.NOT_SERVING and after == health_pb2.HealthCheckResponse.SERVING
