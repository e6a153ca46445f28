"""The coordinator loop against scripted fakes: identity with the target alone, rollback
bookkeeping, stop conditions, recovery from a lost session, sessions across turns,
fencing, fallback, and call counts."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from specd.contracts import SamplingParams, VerifyReply
from specd.loop import Chunk, Finished, GenerationRequest, RoundRecord, Services, generate
from specd.model_free import SuffixDrafter
from specd.outage import DraftOutage
from specd.policy import Estimates, PolicyConfig, PolicyState
from specd.session import Fenced
from specd.stopping import StopRules
from specd.validation import InvalidParams
from tests.fakes import (FakeDecoder, FakeDrafter, FakeStore, FakeVerifier, VirtualClock, draft_rule, target_alone,
                         target_rule)

PROMPT = (3, 1, 4, 1, 5)


def decode(ids) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def run(
    request: GenerationRequest, drafter, verifier, on_round=None, store=None, session="s1", ephemeral=True,
    outage: DraftOutage | None = None,
) -> list:
    services = Services(drafter, verifier, store or FakeStore(), outage or DraftOutage())

    async def collect():
        return [e async for e in generate(request, session, services, decode, ephemeral, on_round)]

    return asyncio.run(collect())


def request(max_tokens=20, k=4, stop=(), eos=frozenset(), prompt=PROMPT) -> GenerationRequest:
    return GenerationRequest(prompt, StopRules(max_tokens, tuple(stop), eos), SamplingParams(), fixed_k=k)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("agreement_every", [2, 3, 100])
def test_output_is_the_target_alone(k, agreement_every):
    drafter, verifier = FakeDrafter(draft_rule(agreement_every)), FakeVerifier(target_rule)
    events = run(request(max_tokens=37, k=k), drafter, verifier)
    done = events[-1]
    assert isinstance(done, Finished) and done.finish_reason == "length"
    assert list(done.token_ids) == target_alone(PROMPT, 37)
    streamed = [t for e in events if isinstance(e, Chunk) for t in e.token_ids]
    assert streamed == list(done.token_ids)
    assert "".join(e.text for e in events if isinstance(e, Chunk)) == decode(done.token_ids) == done.text


def test_a_draft_outage_decodes_plainly_at_once_then_speculates_again():
    drafter, verifier = FakeDrafter(draft_rule(100)), FakeVerifier(target_rule)
    records: list[RoundRecord] = []
    outage = DraftOutage(probe_s=0.0)

    def on_round(record: RoundRecord) -> None:
        records.append(record)
        drafter.down = 2 <= len(records) < 6  # the pool is gone after round 2, back after round 6

    done = run(request(max_tokens=60, k=3), drafter, verifier, on_round, outage=outage)[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 60)
    ks = [r.k for r in records]
    assert ks[:2] == [3, 3]
    assert ks[2] == 0  # the round that found no draft went on plainly: no wait, no error
    last_plain = max(i for i, k in enumerate(ks[:-1]) if k == 0)  # (the last round may have room for one token only)
    assert last_plain >= 5 and 3 in ks[last_plain:]  # plain while down, speculating once a probe got an answer
    proposals_while_down = drafter.calls - sum(k > 0 for k in ks)
    assert proposals_while_down == 1 and drafter.probes >= 1  # then only the background probe asked
    assert outage.outages == 1 and not outage.down


def test_a_draft_slower_than_its_timeout_counts_as_an_outage():
    drafter, verifier = FakeDrafter(draft_rule(100), wait_s=0.5), FakeVerifier(target_rule)
    outage = DraftOutage(timeout_s=0.05, probe_s=10.0)
    records: list[RoundRecord] = []
    done = run(request(max_tokens=10, k=3), drafter, verifier, records.append, outage=outage)[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 10)
    assert [r.k for r in records] == [0] * 10 and outage.outages >= 1  # (its probe answers: it tries again)


def test_rollback_bookkeeping_every_round():
    records: list[RoundRecord] = []
    drafter, verifier = FakeDrafter(draft_rule(3)), FakeVerifier(target_rule)
    done = run(request(max_tokens=30, k=4), drafter, verifier, records.append)[-1]
    committed = len(PROMPT)
    for r in records:
        # the draft synced to exactly the committed length before drafting; the target ends on the new one
        assert r.draft_position in (committed, None)
        committed += r.num_accepted + 1
        assert r.target_position == r.committed_length == committed
    assert any(r.num_accepted < r.k for r in records) and any(r.num_accepted == r.k for r in records)
    assert done.stats.rounds == len(records) == verifier.calls
    assert drafter.calls == sum(r.k > 0 for r in records)
    assert done.stats.accepted == sum(r.num_accepted for r in records)
    assert done.stats.mean_acceptance_length == pytest.approx(30 / len(records))
    assert verifier.released == drafter.released == ["s1"]


def test_last_token_needs_no_draft_and_max_tokens_is_exact():
    drafter, verifier = FakeDrafter(draft_rule(100)), FakeVerifier(target_rule)
    done = run(request(max_tokens=1, k=4), drafter, verifier)[-1]
    assert drafter.calls == 0 and verifier.calls == 1
    assert list(done.token_ids) == target_alone(PROMPT, 1)


def test_eos_ends_generation_where_the_target_alone_would():
    full = target_alone(PROMPT, 40)
    eos = full[17]
    expected = full[: full.index(eos) + 1]
    done = run(request(max_tokens=40, k=8, eos=frozenset({eos})), FakeDrafter(draft_rule(100)), FakeVerifier(target_rule))[-1]
    assert done.finish_reason == "stop" and list(done.token_ids) == expected


def test_stop_string_cuts_text_and_tokens_where_the_target_alone_would():
    full = target_alone(PROMPT, 40)
    text = decode(full)
    stop = text[12:15]
    cut = text.index(stop)
    events = run(request(max_tokens=40, k=8, stop=[stop]), FakeDrafter(draft_rule(100)), FakeVerifier(target_rule))
    done = events[-1]
    assert done.finish_reason == "stop"
    assert done.text == text[:cut]
    assert list(done.token_ids) == full[: cut + len(stop)]  # one character per token in this decode
    assert "".join(e.text for e in events if isinstance(e, Chunk)) == text[:cut]


@pytest.mark.parametrize("who", ["draft", "target"])
def test_a_service_that_lost_the_session_is_resynced(who):
    drafter, verifier = FakeDrafter(draft_rule(3)), FakeVerifier(target_rule)
    victim = drafter if who == "draft" else verifier

    def forget_sometimes(record: RoundRecord) -> None:
        if record.committed_length % 3 == 0:
            victim.forget()

    done = run(request(max_tokens=40, k=3), drafter, verifier, forget_sometimes)[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 40)


def test_adaptive_k_keeps_the_output_identical():
    drafter, verifier = FakeDrafter(draft_rule(5)), FakeVerifier(target_rule)
    adaptive = GenerationRequest(PROMPT, StopRules(60), SamplingParams())
    done = run(adaptive, drafter, verifier)[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 60)
    assert done.stats.drafted > 0


def unsure_where_wrong(agreement_every: int):
    """The draft's confidence: low exactly where draft_rule(agreement_every) disagrees with the target."""
    return lambda prefix: 0.1 if len(prefix) % agreement_every == 0 else 0.9


@pytest.mark.parametrize("min_confidence, pinned", [(0.5, False), (0.0, False), (0.5, True)])
def test_a_confidence_stop_drafts_up_to_the_first_unsure_token(min_confidence, pinned):
    records: list[RoundRecord] = []
    drafter = FakeDrafter(draft_rule(7), compute_s=1e-4, confidence=unsure_where_wrong(7))  # speculation pays
    policy = PolicyConfig(max_k=8, default_k=8, adaptive=False, min_confidence=min_confidence)
    req = GenerationRequest(PROMPT, StopRules(60), SamplingParams(), policy, fixed_k=8 if pinned else None)
    done = run(req, drafter, FakeVerifier(target_rule), records.append)[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 60)
    stopped = min_confidence > 0 and not pinned  # a pinned K drafts exactly K
    drafting = [r for r in records if r.k > 0 and r.mode == "speculative"][:-1]  # the last is cut by max_tokens
    assert len(drafting) >= 5
    # every round stopped at the unsure token, which was the wrong one: none passed in full
    assert all(r.k < 8 and r.num_accepted == r.k - 1 for r in drafting) == stopped
    assert done.stats.drafted == sum(r.k for r in records)  # observations count what was drafted


def _virtual_run(confidence, max_tokens=120):
    """A session at the AVX2 host's costs (20 ms draft step, 55 ms pass, 12 ms a further row) with a draft
    that is wrong at every 7th position: α reads 6/7, where the best K is 2. Its rounds and its clock."""
    clock, records = VirtualClock(), []
    drafter = FakeDrafter(draft_rule(7), compute_s=0.02, confidence=confidence, clock=clock, rpc_s=0.002)
    verifier = FakeVerifier(target_rule, compute_s=0.055, row_s=0.012, clock=clock, rpc_s=0.002)
    services = Services(drafter, verifier, FakeStore(), clock=clock)
    request = GenerationRequest(PROMPT, StopRules(max_tokens), SamplingParams(), PolicyConfig(max_k=8))

    async def collect():
        return [e async for e in generate(request, "s", services, decode, True, records.append)]

    done = asyncio.run(collect())[-1]
    assert list(done.token_ids) == target_alone(PROMPT, max_tokens)
    return [r for r in records if r.k > 0 and r.mode == "speculative"][:-1], done, clock.now


def test_the_draft_model_drafts_past_the_policys_k_while_it_is_sure():
    # sure exactly where it is right: its sure drafts always pass, so it is asked for up to max_k and
    # stops at the unsure (wrong) one; the policy's K, priced at α = 6/7, stays small
    drafting, done, took = _virtual_run(unsure_where_wrong(7))
    est = done.session.policy.estimates
    assert est.alpha < 0.9 < est.sure_alpha
    assert done.session.policy.k <= 3
    later = drafting[len(drafting) // 2:]
    assert all(r.k > done.session.policy.k for r in later)
    assert sum(r.num_accepted for r in later) / sum(r.k for r in later) > 0.8
    # a draft as sure where it is wrong: its sure drafts pass at α, and it is asked for the policy's K alone
    drafting_blind, done_blind, took_blind = _virtual_run(lambda prefix: 0.9)
    assert done_blind.session.policy.estimates.sure_alpha < 0.9
    assert max(r.k for r in drafting_blind[len(drafting_blind) // 2:]) <= 3
    assert took < 0.9 * took_blind


@pytest.mark.parametrize("slower", [1.0, 2.2])
def test_a_host_that_slows_down_evenly_changes_no_decision(slower):
    # both services 2.2x slower from the 8th pass on, as a busy shared host: a session that only times
    # the passes it drafts for must not price plain decoding at the quiet host's pass
    clock, records = VirtualClock(), []
    drafter = FakeDrafter(draft_rule(50), compute_s=0.02, clock=clock, rpc_s=0.002)
    verifier = FakeVerifier(target_rule, compute_s=0.055, row_s=0.012, clock=clock, rpc_s=0.002)
    table = tuple((k, 0.055 + 0.012 * k) for k in range(17))
    prior = PolicyState(estimates=Estimates(draft_step_s=0.02, rtt_s=0.002, verify_s=table, calibrated_s=table))
    services = Services(drafter, verifier, FakeStore(learned=prior), clock=clock)
    verify = verifier.verify

    async def slowing(request):
        if verifier.calls >= 8:
            verifier.compute_s, verifier.row_s, drafter.compute_s = 0.055 * slower, 0.012 * slower, 0.02 * slower
        return await verify(request)

    verifier.verify = slowing

    async def collect():
        return [e async for e in generate(GenerationRequest(PROMPT, StopRules(150), SamplingParams()), "s", services,
                                          decode, True, records.append)]

    done = asyncio.run(collect())[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 150)
    assert done.session.policy.fallbacks == 0
    ks = [r.k for r in records]
    assert min(ks[8:-3]) >= 4  # the K a quiet host runs (6-10 here), not one shrinking toward plain
    assert done.session.policy.estimates.pace == pytest.approx(slower, rel=0.05)


@pytest.mark.parametrize("wait_is_queue", [True, False], ids=["queued", "network"])
def test_time_queued_behind_other_sessions_is_not_counted_as_network_overhead(wait_is_queue):
    # at α = 1/3 speculation pays with a free network; at a 30 ms round trip per call it does not
    third = lambda prefix: target_rule(prefix) if len(prefix) % 3 == 0 else (target_rule(prefix) + 1) % 50  # noqa: E731
    drafter = FakeDrafter(third, compute_s=1e-4, wait_s=0.03, wait_is_queue=wait_is_queue)
    verifier = FakeVerifier(target_rule, compute_s=0.01, wait_s=0.03, wait_is_queue=wait_is_queue)
    adaptive = GenerationRequest(PROMPT, StopRules(30), SamplingParams())
    done = run(adaptive, drafter, verifier)[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 30)
    policy = done.session.policy
    assert (policy.estimates.rtt_s < 0.01) == wait_is_queue
    assert (policy.fallbacks == 0) == wait_is_queue


def test_the_services_clock_times_the_calls_so_the_policy_learns_a_virtual_round_trip():
    clock = VirtualClock()
    drafter = FakeDrafter(draft_rule(100), compute_s=0.015, clock=clock, rpc_s=0.002)
    verifier = FakeVerifier(target_rule, compute_s=0.03, clock=clock, rpc_s=0.002)
    services = Services(drafter, verifier, FakeStore(), clock=clock)

    async def collect():
        return [e async for e in generate(GenerationRequest(PROMPT, StopRules(20), SamplingParams()), "s", services,
                                          decode)]

    done = asyncio.run(collect())[-1]
    assert done.session.policy.estimates.rtt_s == pytest.approx(0.002)
    assert clock.now == pytest.approx(0.002 * (drafter.calls + verifier.calls) + done.stats.draft_compute_s
                                      + done.stats.verify_compute_s)


class LoadedVerifier(FakeVerifier):
    """Alone (a 10 ms pass) for its first calls; then every pass also verifies other sessions'
    rows and takes 200 ms, reported as shared by `batch_size` sessions."""

    def __init__(self, batch_size: int):
        super().__init__(target_rule, compute_s=0.01)
        self.batch_size = batch_size

    async def verify(self, *args) -> VerifyReply:
        reply = await super().verify(*args)
        return reply if self.calls <= 4 else replace(reply, compute_s=0.2, batch_size=self.batch_size)


@pytest.mark.parametrize("batch_size", [8, 1])
def test_a_verification_sharing_its_pass_is_not_priced_at_the_whole_pass(batch_size):
    """α = 1/3 pays with the 10 ms pass alone. A 200 ms pass shared by 8 sessions is load: the
    session keeps speculating; the same 200 ms for this session alone makes it fall back."""
    third = lambda prefix: target_rule(prefix) if len(prefix) % 3 == 0 else (target_rule(prefix) + 1) % 50  # noqa: E731
    drafter = FakeDrafter(third, compute_s=1e-4)
    done = run(GenerationRequest(PROMPT, StopRules(60), SamplingParams()), drafter, LoadedVerifier(batch_size))[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 60)
    assert (done.session.policy.fallbacks == 0) == (batch_size > 1)


class BatchVerifier(FakeVerifier):
    """Every pass also holds the other sessions of a batch, each drafting as this one does:
    sessions·(K + 1) positions at the issue's AVX2 timings (43 ms, 13 ms each further position),
    reported as such (batch_size, pass_rows)."""

    def __init__(self, batch: int):
        super().__init__(target_rule)
        self.batch = batch

    async def verify(self, request) -> VerifyReply:
        reply = await super().verify(request)
        rows = self.batch * (len(request.proposal.tokens) + 1)
        return replace(reply, compute_s=0.043 + 0.013 * (rows - 1), batch_size=self.batch, pass_rows=rows)


@pytest.mark.parametrize("sessions", [8, 1])
def test_a_round_is_priced_by_the_batch_it_joins(sessions):
    """A draft accepted 4 times in 5 pays alone; in passes of eight sessions its rows cost every
    session's step, plain steps are faster, and the session hardly drafts. Output is the target's."""
    four_in_five = lambda prefix: target_rule(prefix) if len(prefix) % 5 else (target_rule(prefix) + 1) % 50  # noqa: E731
    drafter = FakeDrafter(four_in_five, compute_s=0.014 * (1 + 0.1 * (sessions - 1)))
    start = PolicyState(estimates=Estimates(draft_step_s=0.014, rtt_s=0.001,
                                            verify_s=tuple((k, 0.043 + 0.013 * k) for k in range(17))))
    store = FakeStore(learned=start)
    done = run(GenerationRequest(PROMPT, StopRules(80), SamplingParams()), drafter, BatchVerifier(sessions),
               store=store)[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 80)
    assert (drafter.calls < 5) == (sessions > 1), drafter.calls
    assert round(done.session.policy.estimates.batch) == sessions


@pytest.mark.parametrize("idle_s", [0.0, 10.0])
def test_a_turn_that_starts_under_load_streams_plain_steps_from_its_prompt(idle_s):
    """A new session that starts a moment after a pass of sixteen sessions, where not even a draft
    that is always right could pay, decodes plainly from its first round: one stream, the draft never
    called. One that starts after the passes went quiet speculates from the prior as a session alone.
    Each is a key of its own: the busy session's verdict is not the new one's prior."""
    clock = VirtualClock()
    verifier = BatchVerifier(16)
    verifier.clock = clock
    drafter, decoder = FakeDrafter(target_rule, clock=clock), FakeDecoder(verifier)
    start = PolicyState(estimates=Estimates(draft_step_s=0.014, rtt_s=0.001,
                                            verify_s=tuple((k, 0.043 + 0.013 * k) for k in range(17))))
    services = Services(drafter, verifier, FakeStore(learned=start), decoder=decoder, clock=clock)
    records: list[RoundRecord] = []

    async def turn(session: str, on_round=None) -> Finished:
        req = GenerationRequest(PROMPT, StopRules(30), SamplingParams())
        return [e async for e in generate(req, session, services, decode, on_round=on_round, owner=session)][-1]

    asyncio.run(turn("busy"))
    clock.now += idle_s
    drafts_before, streams_before = drafter.calls, decoder.opened
    done = asyncio.run(turn("new", records.append))
    assert list(done.token_ids) == target_alone(PROMPT, 30)
    under_load = idle_s == 0.0
    assert (records[0].mode == "plain") == under_load
    if under_load:
        assert drafter.calls == drafts_before and decoder.opened == streams_before + 1
        assert all(r.drafter == "none" and r.observation.streamed for r in records[1:])
    else:
        assert records[0].mode == "speculative" and not records[0].observation.streamed


def test_a_burst_of_turns_prices_its_first_rounds_by_the_turns_in_flight():
    """Sixteen new sessions at once, before any pass: each turn counts those already in flight here.
    The first, alone, speculates from the prior; once sixteen are in flight, where not even a draft
    always right could pay, a turn starts plain. Every output is the target's."""
    verifier = BatchVerifier(16)
    start = PolicyState(estimates=Estimates(draft_step_s=0.014, rtt_s=0.001,
                                            verify_s=tuple((k, 0.043 + 0.013 * k) for k in range(17))))
    services = Services(FakeDrafter(target_rule), verifier, FakeStore(learned=start), decoder=FakeDecoder(verifier))
    firsts: dict[str, RoundRecord] = {}

    async def turn(session: str) -> Finished:
        req = GenerationRequest(PROMPT, StopRules(20), SamplingParams())
        return [e async for e in generate(req, session, services, decode, owner=session,
                                          on_round=lambda r: firsts.setdefault(session, r))][-1]

    async def burst() -> list[Finished]:
        return await asyncio.gather(*(turn(f"s{i}") for i in range(16)))

    done = asyncio.run(burst())
    assert all(list(d.token_ids) == target_alone(PROMPT, 20) for d in done)
    assert firsts["s0"].mode == "speculative" and firsts["s15"].mode == "plain"
    assert services.load.turns == 0


def test_an_adaptive_turns_first_round_is_the_targets_prefill_alone():
    """The draft model waits a round (its prefill would stand before the first token); a pinned K and
    `drafter: model` draft from the first round."""
    for req, drafts_first in ((GenerationRequest(PROMPT, StopRules(20), SamplingParams()), False),
                              (request(max_tokens=20, k=3), True),
                              (GenerationRequest(PROMPT, StopRules(20), SamplingParams(), drafter="model"), True)):
        records: list[RoundRecord] = []
        drafter = FakeDrafter(draft_rule(100))
        prior = PolicyState(estimates=Estimates(draft_step_s=0.01, rtt_s=0.001,  # measured: no calibration rounds
                                                verify_s=tuple((k, 0.04 + 0.002 * k) for k in range(17))))
        done = run(req, drafter, FakeVerifier(target_rule), on_round=records.append, store=FakeStore(learned=prior))[-1]
        assert list(done.token_ids) == target_alone(PROMPT, 20)
        assert (records[0].drafter == "model") == drafts_first and any(r.drafter == "model" for r in records[1:])


def test_speculation_off_never_calls_the_draft():
    drafter, verifier = FakeDrafter(draft_rule(5)), FakeVerifier(target_rule)
    done = run(request(max_tokens=12, k=0), drafter, verifier)[-1]
    assert drafter.calls == 0 and verifier.calls == 12
    assert list(done.token_ids) == target_alone(PROMPT, 12)


def test_speculation_off_never_asks_the_model_free_drafter():
    """A request that decodes plainly has no use for a model-free draft: no lookup a round. The
    session's next adaptive turn drafts from every token it committed, its index caught up."""
    class Counted(SuffixDrafter):
        proposals = 0

        def propose(self, *args):
            Counted.proposals += 1
            return super().propose(*args)

    repeating = lambda prefix: (3, 1, 4, 1, 5, 9)[len(prefix) % 6]  # noqa: E731
    model_free = Counted()
    services = Services(None, FakeVerifier(repeating), FakeStore(), model_free=model_free)

    async def turn(req: GenerationRequest) -> Finished:
        return [e async for e in generate(req, "s", services, decode, ephemeral=False)][-1]

    plain = asyncio.run(turn(request(max_tokens=24, k=0)))
    assert Counted.proposals == 0 and plain.stats.rounds == 24
    adaptive = asyncio.run(turn(GenerationRequest((3,), StopRules(24), SamplingParams(), drafter="ngram")))
    assert Counted.proposals > 0 and adaptive.stats.model_free_accepted > 0


def test_a_useless_draft_is_dropped_and_only_probed_afterwards():
    useless = FakeDrafter(lambda prefix: (target_rule(prefix) + 1) % 50)
    records: list[RoundRecord] = []
    verifier = FakeVerifier(target_rule)
    done = run(GenerationRequest(PROMPT, StopRules(300), SamplingParams()), useless, verifier, records.append)[-1]
    assert list(done.token_ids) == target_alone(PROMPT, 300)
    first_plain = next(i for i, r in enumerate(records) if r.mode == "plain")
    assert first_plain <= 5  # the prompt's round, then four rounds of one judged draft each
    assert done.stats.fallbacks >= 1 and done.session.policy.mode == "plain"
    probes = sum(r.k > 0 for r in records[first_plain:])
    assert probes <= 6, f"{probes} draft calls after falling back"


def test_a_named_session_continues_without_re_prefill():
    drafter, verifier, store = FakeDrafter(draft_rule(3)), FakeVerifier(target_rule), FakeStore()
    syncs = []
    original = verifier.verify

    async def recording_verify(request):
        syncs.append(request.sync)
        return await original(request)

    verifier.verify = recording_verify
    first = run(request(max_tokens=10, k=3), drafter, verifier, store=store, session="chat", ephemeral=False)[-1]
    turn_one = list(PROMPT) + list(first.token_ids)
    syncs.clear()
    second_prompt = (7, 7)
    second = run(request(max_tokens=10, k=3, prompt=second_prompt), drafter, verifier, store=store, session="chat", ephemeral=False)[-1]
    history = turn_one + list(second_prompt)
    assert list(second.token_ids) == target_alone(history, 10)
    assert syncs[0].start_pos == len(turn_one) and syncs[0].tokens == second_prompt  # only the new tokens travel
    assert store.sessions["chat"][1].tokens == tuple(history + list(second.token_ids))
    assert store.sessions["chat"][1].requests == 2


def test_a_newer_request_on_the_session_fences_the_older_one():
    drafter, verifier, store = FakeDrafter(draft_rule(3)), FakeVerifier(target_rule), FakeStore()
    services = Services(drafter, verifier, store)

    async def interleave():
        old = generate(request(max_tokens=20, k=2), "shared", services, decode, ephemeral=False)
        await old.__anext__()  # the old request has committed one round
        new = [e async for e in generate(request(max_tokens=5, k=2), "shared", services, decode, ephemeral=False)]
        with pytest.raises(Fenced):
            await old.__anext__()
        return new

    new = asyncio.run(interleave())
    assert isinstance(new[-1], Finished)


# --- the save runs beside the next round ----------------------------------------------------


class SlowStore(FakeStore):
    """Each save takes `save_s` (a store across a network); the `fail_at`-th save is fenced."""

    def __init__(self, save_s: float = 0.02, fail_at: int | None = None):
        super().__init__()
        self.save_s, self.fail_at, self.in_flight = save_s, fail_at, False

    async def save(self, lease, state, appended_from: int) -> None:
        self.in_flight = True
        try:
            await asyncio.sleep(self.save_s)
            if self.saves + 1 == self.fail_at:
                raise Fenced(lease.session_id)
            await super().save(lease, state, appended_from)
        finally:
            self.in_flight = False


class WatchingVerifier(FakeVerifier):
    """Counts the calls made while a save of the store was in flight."""

    def __init__(self, store: SlowStore):
        super().__init__(target_rule)
        self.store, self.during_save = store, 0

    async def verify(self, request) -> VerifyReply:
        self.during_save += self.store.in_flight
        return await super().verify(request)


def test_the_next_round_runs_while_the_last_is_saved_and_only_saved_tokens_are_sent():
    store = SlowStore()
    verifier = WatchingVerifier(store)
    services = Services(FakeDrafter(draft_rule(3)), verifier, store)

    async def collect():
        sent = []
        async for event in generate(request(max_tokens=30, k=2), "s", services, decode, ephemeral=False):
            if isinstance(event, Chunk):
                sent += event.token_ids
                assert store.sessions["s"][1].tokens[len(PROMPT):][: len(sent)] == tuple(sent)  # held before sent
        return sent

    sent = asyncio.run(collect())
    assert sent == target_alone(PROMPT, 30)
    rounds = store.sessions["s"][1].stats.rounds
    assert verifier.during_save >= rounds - 2  # every round after the first began beside the last one's save


def test_a_failed_save_drops_the_round_run_ahead_and_sends_nothing_more():
    store = SlowStore(fail_at=3)
    verifier = WatchingVerifier(store)
    services = Services(FakeDrafter(draft_rule(3)), verifier, store)

    async def collect():
        sent = []
        with pytest.raises(Fenced):
            async for event in generate(request(max_tokens=30, k=2), "s", services, decode, ephemeral=False):
                sent += event.token_ids if isinstance(event, Chunk) else ()
        await asyncio.sleep(0.05)
        return sent, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    sent, left = asyncio.run(collect())
    held = store.sessions["s"][1].tokens[len(PROMPT):]
    assert store.saves == 2 and tuple(sent) == held  # the two saved rounds, nothing of the third or a fourth
    assert verifier.calls >= 4 and not left  # the round run ahead did run, and was dropped


# --- idempotent turns: a retry with the turn's request id ----------------------------------


def turn(services: Services, req: GenerationRequest, request_id: str, stop_after_chunks: int | None = None) -> list:
    """One turn of session "idem"; `stop_after_chunks`: the coordinator dies after that many chunks."""

    async def collect():
        events = []
        stream = generate(req, "idem", services, decode, ephemeral=False, request_id=request_id)
        async for event in stream:
            events.append(event)
            if stop_after_chunks is not None and len(events) == stop_after_chunks:
                await stream.aclose()  # its rounds so far are saved; it never finishes
                break
        return events

    return asyncio.run(collect())


def test_a_retried_turn_goes_on_from_what_the_first_attempt_committed_and_holds_its_prompt_once():
    store, drafter, verifier = FakeStore(), FakeDrafter(draft_rule(3)), FakeVerifier(target_rule)
    services = Services(drafter, verifier, store, DraftOutage())
    first = turn(services, request(max_tokens=24, k=3), "t-1")[-1]
    second_req = request(max_tokens=30, k=3, prompt=(9, 9))
    partial = turn(services, second_req, "t-2", stop_after_chunks=2)
    assert not isinstance(partial[-1], Finished) and len(store.sessions["idem"][1].tokens) > 24 + 5 + 2
    retried = turn(services, second_req, "t-2")
    done = retried[-1]
    history = [*PROMPT, *first.token_ids, 9, 9]
    assert list(done.token_ids) == target_alone(history, 30)  # the whole turn, as uninterrupted
    assert [t for e in retried if isinstance(e, Chunk) for t in e.token_ids] == list(done.token_ids)
    assert list(store.sessions["idem"][1].tokens) == history + list(done.token_ids)  # the prompt once
    assert store.sessions["idem"][1].requests == 2


def test_a_retry_of_a_finished_turn_replies_with_it_and_calls_no_model():
    store, drafter, verifier = FakeStore(), FakeDrafter(draft_rule(3)), FakeVerifier(target_rule)
    services = Services(drafter, verifier, store, DraftOutage())
    req = request(max_tokens=20, k=3, stop=("q",))
    first = turn(services, req, "only-once")[-1]
    held, calls = store.sessions["idem"][1].tokens, (drafter.calls, verifier.calls)
    again = turn(services, req, "only-once")[-1]
    assert (again.token_ids, again.text, again.finish_reason) == (first.token_ids, first.text, first.finish_reason)
    assert store.sessions["idem"][1].tokens == held and (drafter.calls, verifier.calls) == calls
    assert again.stats.rounds == 0
    other = turn(services, req, "a-new-turn")[-1]  # a new id is a new turn: the prompt goes in again
    assert len(store.sessions["idem"][1].tokens) == len(held) + len(PROMPT) + len(other.token_ids)


def test_a_request_id_reused_for_a_different_request_is_refused():
    store = FakeStore()
    services = Services(FakeDrafter(draft_rule(3)), FakeVerifier(target_rule), store, DraftOutage())
    turn(services, request(max_tokens=8), "same-id")
    held = store.sessions["idem"][1].tokens
    with pytest.raises(InvalidParams, match="different request"):
        turn(services, request(max_tokens=8, prompt=(2, 7)), "same-id")
    assert store.sessions["idem"][1].tokens == held


# --- the model's start token (Gemma, Llama: tokenizer.ggml.add_bos_token) ------------------------

BOS = 2


def test_a_new_session_starts_with_the_models_start_token_once():
    drafter, verifier, store = FakeDrafter(draft_rule(3)), FakeVerifier(target_rule), FakeStore()
    first = run(replace(request(max_tokens=6, k=3), bos=BOS), drafter, verifier, store=store, session="b",
                ephemeral=False)[-1]
    assert list(first.token_ids) == target_alone([BOS, *PROMPT], 6)  # the target saw the start token first
    second = run(replace(request(max_tokens=6, k=3, prompt=(7, 7)), bos=BOS), drafter, verifier, store=store,
                 session="b", ephemeral=False)[-1]
    history = [BOS, *PROMPT, *first.token_ids, 7, 7]  # a later turn: no second start token
    assert list(second.token_ids) == target_alone(history, 6)
    assert store.sessions["b"][1].tokens == (*history, *second.token_ids)
    given = run(replace(request(max_tokens=6, k=3, prompt=(BOS, *PROMPT)), bos=BOS), drafter, verifier,
                store=store, session="c", ephemeral=False)[-1]
    assert store.sessions["c"][1].tokens[:2] == (BOS, PROMPT[0])  # a prompt that starts with it: not doubled
    assert list(given.token_ids) == list(first.token_ids)


def test_a_retried_first_turn_keeps_its_start_token_once():
    store, drafter, verifier = FakeStore(), FakeDrafter(draft_rule(3)), FakeVerifier(target_rule)
    services = Services(drafter, verifier, store, DraftOutage())
    req = replace(request(max_tokens=24, k=3), bos=BOS)
    partial = turn(services, req, "first", stop_after_chunks=2)
    assert not isinstance(partial[-1], Finished)
    done = turn(services, req, "first")[-1]
    assert list(done.token_ids) == target_alone([BOS, *PROMPT], 24)
    assert list(store.sessions["idem"][1].tokens) == [BOS, *PROMPT, *done.token_ids]


def test_one_keys_plain_sessions_never_set_another_keys_start():
    """Mallory's sessions, with a draft that is never right, end in plain mode and start her next ones
    there; Alice's new session starts from the deployment's prior and speculates."""
    prior = PolicyState(estimates=Estimates(draft_step_s=0.01, rtt_s=0.001,
                                            verify_s=tuple((k, 0.04 + 0.002 * k) for k in range(17))))
    store = FakeStore(learned=prior)
    services = Services(FakeDrafter(lambda prefix: (target_rule(prefix) + 1) % 50, compute_s=0.01),
                        FakeVerifier(target_rule, compute_s=0.04), store)
    adaptive = GenerationRequest(PROMPT, StopRules(60), SamplingParams())

    async def turn(owner: str) -> Finished:
        return [e async for e in generate(adaptive, f"{owner}-s", services, decode, True, owner=owner)][-1]

    assert asyncio.run(turn("mallory")).session.policy.mode == "plain"
    assert store.learned_by["mallory"].mode == "plain" and store.learned is prior
    alice = asyncio.run(turn("alice"))
    assert list(alice.token_ids) == target_alone(PROMPT, 60)
    assert alice.stats.drafted > 0 and store.learned is prior


def test_a_session_that_drafts_nothing_by_request_never_sets_the_deployments_start():
    """A `drafter: none` request (a readiness probe, a client that wants plain decoding) measures no
    draft: the deployment's prior stays as it was (none here: start-up calibration still runs), and
    the next session speculates."""
    store = FakeStore()
    services = Services(FakeDrafter(draft_rule(100), compute_s=0.01), FakeVerifier(target_rule, compute_s=0.04),
                        store)

    async def turn(drafter: str) -> Finished:
        request = GenerationRequest(PROMPT, StopRules(40), SamplingParams(), drafter=drafter)
        return [e async for e in generate(request, f"{drafter}-s", services, decode, True)][-1]

    assert asyncio.run(turn("none")).stats.drafted == 0
    assert store.learned is None
    after = asyncio.run(turn("auto"))
    assert list(after.token_ids) == target_alone(PROMPT, 40) and after.stats.drafted > 0
