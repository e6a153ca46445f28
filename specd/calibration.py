"""Start-up calibration: before a fresh deployment's first request, timed rounds for every K on
a scratch session, so its first sessions inherit measured timings instead of exploring
K on a user's request (`specd.policy.calibrated`). Transport-free: it drives the loop over whatever
`Services` it is given (gRPC clients, Ray handles, fakes)."""

from __future__ import annotations

import uuid

from specd.contracts import SamplingParams
from specd.loop import GenerationRequest, Services, forget, one_round, streamed_rounds
from specd.policy import PolicyConfig, PolicyState, RoundObservation, calibrated, calibration_ks
from specd.stopping import Decode, StopRules

SCRATCH_PROMPT = (1,) * 8  # any tokens: only the timings count, and the scratch session is forgotten
SWEEPS = 2  # rounds per K; the fastest counts (a service's first passes and start-up noise only add time)
# Plain steps streamed after the sweeps, as plain decoding runs them: their pass is what every speculative
# round is weighed against, and a session that drafts every round never times it again (docs/policy.md).
PLAIN_STEPS = 8


async def seed_prior(services: Services, decode: Decode, config: PolicyConfig) -> PolicyState | None:
    """Calibrate and store the deployment's prior, unless it has one (learnt from sessions, or
    another coordinator's calibration): then None."""
    if await services.store.prior() is not None:
        return None
    prior = await calibrate(services, decode, config)
    await services.store.remember(prior)
    return prior


async def calibrate(services: Services, decode: Decode, config: PolicyConfig) -> PolicyState:
    """SWEEPS greedy rounds per `calibration_ks` after a prefill round, each a request that goes
    on from the last committed token (K + 1 rows, as in a session); K = 0 last in a sweep, so the
    draft is never more than the round's own tokens behind (a catch-up would time a prefill); then
    PLAIN_STEPS plain steps, streamed where the target streams them."""
    session_id = f"calibration-{uuid.uuid4().hex}"
    ks = sorted(calibration_ks(config) if services.drafter else (0,), key=lambda k: k == 0) * SWEEPS
    try:
        await _one_round(services, decode, session_id, SCRATCH_PROMPT, 1, config)  # both services prefill
        rounds = [await _one_round(services, decode, session_id, (), k, config) for k in ks]
        rounds += await _plain_steps(services, decode, session_id, config)
    finally:
        await forget(session_id, services)
    return calibrated(rounds)


async def _one_round(
    services: Services, decode: Decode, session_id: str, prompt: tuple[int, ...], k: int, config: PolicyConfig
) -> RoundObservation:
    """The first round of a fixed-K request that continues the scratch session."""
    request = GenerationRequest(
        prompt, StopRules(max_tokens=k + 1, ignore_eos=True), SamplingParams(), policy=config, fixed_k=k
    )
    return (await one_round(request, session_id, services, decode)).observation


async def _plain_steps(services: Services, decode: Decode, session_id: str, config: PolicyConfig
                       ) -> list[RoundObservation]:
    request = GenerationRequest((), StopRules(max_tokens=PLAIN_STEPS, ignore_eos=True), SamplingParams(),
                                policy=config, fixed_k=0)
    return [record.observation for record in await streamed_rounds(request, session_id, services, decode)]
