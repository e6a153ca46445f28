"""Start-up calibration (specd/calibration.py, `specd.policy.calibrated`): one timed round per row
block on a scratch session gives a fresh deployment a prior that prices every K, so its first
session neither calibrates nor explores. Fakes for the loop, then the real services on loopback."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd import calibration
from specd.kernels import row_blocks
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
from tests.fakes import FakeDrafter, FakeStore, FakeVerifier, draft_rule, target_rule
from tests.test_loop import decode

CPU = PolicyConfig(max_k=16, row_blocks=row_blocks(17))  # blocks 1, 2, 4, 5, 6, 8, 16, 24


def test_one_round_per_row_block_prices_every_k():
    assert calibration_ks(CPU) == (0, 1, 3, 4, 5, 7, 15, 16)  # 16 drafts are 17 rows: the 24-row block
    assert calibration_ks(PolicyConfig(max_k=16)) == tuple(range(17))  # no blocks: every K is priced by its own rounds
    assert calibration_ks(PolicyConfig(max_k=1, row_blocks=(1, 2))) == (0, 1)


def test_the_calibrated_prior_measures_timings_but_not_acceptance():
    rounds = [RoundObservation(k, 0, 0.05 * k, 0.4 + 0.04 * k, 0.002) for k in calibration_ks(CPU)]
    rounds.append(RoundObservation(2, 0, 9.0, 9.0, 0.002, draft_cold=True, target_cold=True))  # a catch-up: left out
    est = calibrated(rounds, CPU).estimates
    expected = {0: 0.4, 1: 0.44, 3: 0.52, 4: 0.56, 5: 0.6, 7: 0.68, 15: 1.0, 23: 1.04}  # K = 16: the 24-row block
    assert dict(est.verify_s) == pytest.approx(expected)
    assert est.draft_step_s == pytest.approx(0.05) and est.rtt_s == pytest.approx(0.002)
    assert est.alpha == 0.7 and est.tested_count == 0 and est.observations == 0  # the prior's


def test_a_session_inheriting_it_neither_calibrates_nor_explores():
    verify_s = {0: 0.45, 1: 0.49, 3: 0.49, 4: 0.6, 5: 0.7, 7: 0.74, 15: 1.0, 16: 1.3}  # the real target's blocks
    rounds = [RoundObservation(k, 0, 0.045 * k, verify_s[k], 0.003) for k in calibration_ks(CPU)]
    state = inherit(calibrated(rounds, CPU))
    assert next_k(state, CPU) == CPU.default_k  # a first drafting round, not a plain calibration round
    code = replace(state.estimates, alpha=0.97)
    k, speedup = best_k(code, CPU)
    assert k == 15 and explore_k(code, CPU, k, speedup) == k  # every block measured: nothing to try


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
    prior = asyncio.run(calibration.seed_prior(services, decode, CPU))
    ks = calibration_ks(CPU)
    assert verifier.calls == 1 + calibration.SWEEPS * len(ks)  # the prefill, then each K SWEEPS times
    assert verifier.synced[0] == len(calibration.SCRATCH_PROMPT) and not any(verifier.synced[1:])  # as a session goes on
    assert dict(prior.estimates.verify_s) == {CPU.cost_k(k): pytest.approx(0.4 + 0.05 * k) for k in ks}  # warm
    assert prior.estimates.draft_step_s == pytest.approx(drafter.compute_s)
    assert store.learned == prior and not store.sessions  # stored; the scratch session deleted
    assert drafter.released == verifier.released and len(verifier.released) == 1 and not verifier.sessions
    assert asyncio.run(calibration.seed_prior(services, decode, CPU)) is None  # it has a prior now
    assert verifier.calls == 1 + calibration.SWEEPS * len(ks) and store.learned == prior


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_url):
    c = Cluster(*tiny_pair, redis_url)
    yield c
    c.close()


def test_calibration_through_the_real_services(cluster, redis_url):
    store = RedisSessionStore(redis_url, prefix=f"calibration-test-{uuid.uuid4().hex}")  # a fresh deployment
    services = Services(cluster.services.drafter, cluster.services.verifier, store)
    config = PolicyConfig(max_k=8, row_blocks=row_blocks(9))  # blocks 1, 2, 4, 5, 6, 8, 16
    try:
        prior = cluster._run(calibration.seed_prior(services, cluster.model.decode, config))
        assert {k for k, _ in prior.estimates.verify_s} == {config.cost_k(k) for k in calibration_ks(config)}
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
