"""Plain stretches streamed by the target (the Decode RPC, specd.protocols.Decoder): the loop against
scripted fakes that count the steps the target ran, and the real target service on loopback."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from specd.contracts import DecodeRequest, Proposal, SamplingParams, StaleSession, SyncPoint, VerifyRequest
from specd.loop import UNDRAFTED_RUN, GenerationRequest, RoundRecord, Services, generate, one_round
from specd.model_free import SuffixDrafter
from specd.policy import PLAIN, Estimates, PolicyConfig, PolicyState, RoundObservation, hybrid, observe
from specd.policy.cost import plain_time, predicted_speedup
from specd.stopping import StopRules
from services.protogen.specd.v1 import coordinator_pb2, target_pb2, target_pb2_grpc
from services.target import convert
from services.target.client import GrpcVerifier
from tests.cluster import Cluster
from tests.fakes import FakeDecoder, FakeDrafter, FakeStore, FakeVerifier, draft_rule, target_rule
from tests.fakes import target_alone as scripted_alone  # the scripted target; `target_alone` is the tiny model fixture

PROMPT = (3, 1, 4, 1, 5)


def run(request: GenerationRequest, verifier: FakeVerifier, decoder: FakeDecoder | None, drafter=None,
        model_free: SuffixDrafter | None = None, store: FakeStore | None = None, records: list | None = None):
    services = Services(drafter, verifier, store or FakeStore(), model_free=model_free, decoder=decoder)

    async def collect():
        return [e async for e in generate(request, "s", services, lambda ids: "".join(chr(97 + t % 26) for t in ids),
                                          True, records.append if records is not None else None)]

    return asyncio.run(collect())


def plain(max_tokens: int = 20, eos: frozenset[int] = frozenset(), drafter: str = hybrid.AUTO, prompt=PROMPT,
          fixed_k: int | None = 0) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), StopRules(max_tokens, (), eos), SamplingParams(), fixed_k=fixed_k,
                             drafter=drafter)


def test_speculation_off_streams_its_steps_in_one_call():
    """Every token of a plain request comes from one stream, which runs exactly the steps the
    request makes: none run ahead past max_tokens."""
    verifier = FakeVerifier(target_rule)
    decoder = FakeDecoder(verifier)
    done = run(plain(20), verifier, decoder)[-1]
    assert list(done.token_ids) == scripted_alone(PROMPT, 20)
    assert (decoder.opened, decoder.steps, verifier.calls) == (1, 20, 20)
    assert done.stats.rounds == 20


def test_without_a_decoder_each_plain_token_is_a_step_call():
    verifier = FakeVerifier(target_rule)
    done = run(plain(20), verifier, None)[-1]
    assert list(done.token_ids) == scripted_alone(PROMPT, 20) and verifier.calls == 20


def test_a_stop_ends_the_stream_after_at_most_the_step_in_flight():
    """EOS at the 7th token: the target ran at most one step past it, and the turn closed the stream."""
    expected = scripted_alone(PROMPT, 30)
    eos = expected[6]
    verifier = FakeVerifier(target_rule)
    decoder = FakeDecoder(verifier)
    done = run(plain(30, eos=frozenset({eos})), verifier, decoder)[-1]
    assert done.finish_reason == "stop" and list(done.token_ids) == expected[: expected.index(eos) + 1]
    assert len(done.token_ids) <= decoder.steps <= len(done.token_ids) + 1


def repeating(prefix) -> int:
    """A target that repeats its prompt: the model-free drafter predicts it once it has seen it."""
    return prefix[len(prefix) % len(LONG_PROMPT)]


LONG_PROMPT = (7, 3, 9, 12, 4, 18, 2, 30, 21, 5, 16, 8)


def test_a_model_free_draft_stops_the_stream_and_takes_the_step_in_flight():
    """A target alone streams its plain stretches; when a model-free draft pays, the round stops the
    stream and still takes the step in flight as its own: every step the target ran was committed,
    and the output is the target's alone."""
    verifier = FakeVerifier(repeating)
    decoder = FakeDecoder(verifier)
    records: list[RoundRecord] = []
    done = run(plain(60, drafter=hybrid.AUTO, prompt=LONG_PROMPT, fixed_k=None), verifier, decoder,
               model_free=SuffixDrafter(), records=records)[-1]
    assert list(done.token_ids) == scripted_alone(LONG_PROMPT, 60, repeating)
    free = [r for r in records if r.drafter == hybrid.FREE]
    plain_rounds = [r for r in records if r.drafter == hybrid.NONE]
    assert free and decoder.opened >= 1
    assert decoder.steps == len(plain_rounds)  # no step run ahead went to waste
    assert verifier.calls == decoder.steps + len(free)


def test_a_draft_that_would_not_pay_for_leaving_the_stream_leaves_it_running(monkeypatch):
    """The same repeating text with measured timings: its model-free drafts pay and stop the stream;
    priced with leaving the stream at a second per Step call until it reopens, none pays, and the
    turn streams to its end."""
    measured = PolicyState(estimates=Estimates(draft_step_s=0.01, verify_s=tuple((k, 0.03 + 0.002 * k) for k in range(9)),
                                               rtt_s=0.001, observations=20))

    def drafts() -> tuple[list[RoundRecord], FakeDecoder]:
        verifier, records = FakeVerifier(repeating), []
        decoder = FakeDecoder(verifier)
        done = run(plain(60, drafter=hybrid.AUTO, prompt=LONG_PROMPT, fixed_k=None), verifier, decoder,
                   model_free=SuffixDrafter(), store=FakeStore(learned=measured), records=records)[-1]
        assert list(done.token_ids) == scripted_alone(LONG_PROMPT, 60, repeating)
        return [r for r in records if r.drafter == hybrid.FREE], decoder

    assert drafts()[0]
    monkeypatch.setattr(hybrid, "stream_exit_time", lambda est, calls: 1.0 * calls)
    free, decoder = drafts()
    assert not free and decoder.opened == 1


def nothing_to_draft(batch_size: int) -> tuple[FakeVerifier, FakeDecoder]:
    """Speculation on, but nothing to draft (the model-free drafter alone, and the text never repeats;
    under load, a draft model whose catch-up does not pay): 30 tokens, every round choosing none."""
    fresh = lambda prefix: 100 + len(prefix)  # every token new: no copy to draft
    verifier = FakeVerifier(fresh, batch_size=batch_size)
    decoder = FakeDecoder(verifier)
    done = run(plain(30, drafter=hybrid.FREE, fixed_k=None), verifier, decoder, drafter=FakeDrafter(fresh),
               model_free=SuffixDrafter())[-1]
    assert list(done.token_ids) == scripted_alone(PROMPT, 30, fresh)
    return verifier, decoder


def test_under_load_speculating_rounds_that_keep_choosing_no_draft_stream_their_steps():
    """The UNDRAFTED_RUN-th such round in a row opens a stream, as plain mode does, rather than a Step
    call a token, whose round trips would split the target's passes."""
    verifier, decoder = nothing_to_draft(batch_size=8)
    assert decoder.opened == 1 and verifier.calls - decoder.steps == UNDRAFTED_RUN - 1
    assert decoder.steps == 30 - (UNDRAFTED_RUN - 1)


def test_alone_speculating_rounds_without_a_draft_stay_step_calls():
    """A session alone keeps its plain steps between drafts as calls: a stream's step in flight would
    take the place of the next round's draft."""
    verifier, decoder = nothing_to_draft(batch_size=1)
    assert decoder.opened == 0 and verifier.calls == 30


def test_a_speculating_session_whose_draft_model_never_wakes_falls_back_and_streams():
    """The deployment's prior is speculative, but at its timings no K pays at the session's α and the
    draft model's catch-up over the prompt would not pay back: every round chooses none. It judged no
    draft, so the timings alone switch it to plain mode, whose steps stream; it stayed speculative
    before, each plain token a Step call (a prose session on the AVX2 host: 0.90x plain)."""
    slow_draft = PolicyState(estimates=Estimates(draft_step_s=0.012, verify_s=tuple((k, 0.03 + 0.012 * k) for k in range(9)),
                                                 rtt_s=0.001, observations=20))
    verifier = FakeVerifier(target_rule, compute_s=0.03, row_s=0.012)
    drafter, decoder = FakeDrafter(draft_rule(100), compute_s=0.012), FakeDecoder(verifier)
    done = run(plain(30, fixed_k=None), verifier, decoder, drafter=drafter, store=FakeStore(learned=slow_draft))[-1]
    assert list(done.token_ids) == scripted_alone(PROMPT, 30)
    assert drafter.calls == 0 and done.session.policy.mode == PLAIN
    assert decoder.opened == 1 and verifier.calls - decoder.steps == 1  # the prefill's Step call, then one stream


def test_a_stream_that_fails_midway_goes_on_with_step_calls():
    """The stream's replica went away after 5 steps: the turn goes on, one call a round, unchanged."""
    verifier = FakeVerifier(target_rule)
    decoder = FakeDecoder(verifier, fail_after=5)
    done = run(plain(20), verifier, decoder)[-1]
    assert list(done.token_ids) == scripted_alone(PROMPT, 20)
    assert decoder.steps >= 5 and verifier.calls == 20


def test_plain_mode_streams_and_a_probe_stops_the_stream():
    """A session in plain mode between probes streams; the probe's round stops the stream and takes
    the step in flight; the probe then drafts. Output is the target's alone."""
    verifier, drafter = FakeVerifier(target_rule), FakeDrafter(draft_rule(100))
    decoder = FakeDecoder(verifier)
    store = FakeStore(learned=PolicyState(mode=PLAIN, probe_interval=16))
    records: list[RoundRecord] = []
    done = run(plain(40, fixed_k=None), verifier, decoder, drafter=drafter, store=store, records=records)[-1]
    assert list(done.token_ids) == scripted_alone(PROMPT, 40)
    assert decoder.opened >= 1 and drafter.calls >= 1
    plain_rounds = [r for r in records if r.k == 0]
    assert decoder.steps <= len(plain_rounds) + 1  # at most the step in flight at the end of the turn


def test_calibrations_single_round_never_streams():
    """A timed round alone: a stream would run a step ahead in the middle of the timings."""
    verifier = FakeVerifier(target_rule)
    decoder = FakeDecoder(verifier)
    services = Services(None, verifier, FakeStore(), decoder=decoder)
    asyncio.run(one_round(plain(8), "s", services, lambda ids: ""))
    assert decoder.opened == 0 and verifier.calls == 1


def test_streamed_steps_teach_the_pass_and_the_streams_gap_not_the_rtt():
    state = PolicyState(mode=PLAIN, estimates=Estimates(verify_s=((0, 0.03),), rtt_s=0.002, observations=5),
                        plain_rounds_until_probe=8)
    streamed = RoundObservation(k=0, accepted=0, draft_s=0.0, verify_s=0.05, rtt_s=0.0005, streamed=True)
    after = observe(state, streamed, PolicyConfig()).estimates
    assert after.rtt_s == 0.002 and after.stream_s == 0.0005 and dict(after.verify_s)[0] > 0.03
    called = observe(state, replace(streamed, streamed=False), PolicyConfig()).estimates
    assert called.rtt_s < 0.002 and called.stream_s is None


def test_where_plain_steps_stream_a_plain_token_is_priced_at_the_streams_gap():
    """T(0) is a Step call's pass and RTT until a streamed step was timed, then the pass and the
    stream's gap: a speedup over plain is over the plain decoding the deployment does."""
    called = Estimates(alpha=0.6, draft_step_s=0.015, verify_s=tuple((k, 0.03 + 0.004 * k) for k in range(9)),
                       rtt_s=0.003, observations=20)
    streaming = replace(called, stream_s=0.0005)
    assert plain_time(called) == pytest.approx(0.033) and plain_time(streaming) == pytest.approx(0.0305)
    for k in (1, 4, 8):
        ratio = predicted_speedup(streaming, PolicyConfig(), k) / predicted_speedup(called, PolicyConfig(), k)
        assert ratio == pytest.approx(0.0305 / 0.033)


# -- the real target service on loopback -------------------------------------------------------------

IDS = [9, 41, 7, 200, 12, 5]


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_url):
    c = Cluster(*tiny_pair, redis_url)
    yield c
    c.close()


def step(session: str, sync: SyncPoint, params: SamplingParams) -> VerifyRequest:
    return VerifyRequest(session, sync, Proposal((), ()), params)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=7)],
                         ids=["greedy", "sampled"])
def test_a_stream_decides_what_single_steps_decide(cluster, target_alone, params):
    """A stream's steps are Step calls the target makes itself: the same tokens, greedy or sampled
    (its uniforms are keyed by position and seed), and greedy the target alone's."""
    n = 12

    async def streamed() -> list[int]:
        verifier = GrpcVerifier([cluster.address("target")])
        stream = await verifier.decode(DecodeRequest(step(f"stream-{params.seed}", SyncPoint(0, tuple(IDS)), params), n))
        replies = [stream.first]
        while (reply := await stream.next()) is not None:
            replies.append(reply)
        assert [r.position for r in replies] == list(range(len(IDS) + 1, len(IDS) + n + 1))
        return [r.verdict.next_token for r in replies]

    async def stepped() -> list[int]:
        verifier, tokens, sync = GrpcVerifier([cluster.address("target")]), [], SyncPoint(0, tuple(IDS))
        for _ in range(n):
            reply = await verifier.verify(step(f"steps-{params.seed}", sync, params))
            tokens.append(reply.verdict.next_token)
            sync = SyncPoint(reply.position, (), reply.instance_id)
        return tokens

    tokens = cluster._run(streamed())
    assert tokens == cluster._run(stepped())
    if params.greedy:
        assert tokens == target_alone(IDS, n)


def start_message(session: str, max_steps: int, start_pos: int = 0) -> target_pb2.DecodeMessage:
    return convert.decode_to_proto(DecodeRequest(step(session, SyncPoint(start_pos, tuple(IDS)), SamplingParams()),
                                                 max_steps))


def test_a_client_that_stops_taking_replies_holds_the_stream_two_steps_on(cluster):
    """The target runs at most two steps past the replies its client said it took, and after the
    client closes its side, only the step in flight."""
    batcher = cluster.target.batcher
    with grpc.insecure_channel(cluster.address("target")) as channel:
        before = batcher.batches
        call = target_pb2_grpc.TargetServiceStub(channel).Decode(iter_messages := _Messages(), timeout=30)
        iter_messages.put(start_message("held", 50))
        next(call)
        asyncio.run(asyncio.sleep(0.5))
        assert batcher.batches - before == 2  # the first step and the one after it: then it waits
        iter_messages.put(target_pb2.DecodeMessage(taken=1))
        next(call)
        asyncio.run(asyncio.sleep(0.5))
        assert batcher.batches - before == 3
        iter_messages.close()
        rest = list(call)
        assert len(rest) <= 2 and batcher.batches - before <= 4


class _Messages:
    """A request iterator the test feeds as it goes (grpc's sync client reads it on its own thread)."""

    def __init__(self):
        import queue
        self._queue = queue.Queue()

    def put(self, message) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)

    def __iter__(self):
        return self

    def __next__(self):
        message = self._queue.get()
        if message is None:
            raise StopIteration
        return message


@pytest.mark.parametrize("first, code", [
    (target_pb2.DecodeMessage(taken=3), grpc.StatusCode.INVALID_ARGUMENT),
    (start_message("zero", 0), grpc.StatusCode.INVALID_ARGUMENT),
    (start_message("far", 4, start_pos=1000), grpc.StatusCode.FAILED_PRECONDITION),
], ids=["no-start", "zero-steps", "stale"])
def test_a_bad_stream_is_refused_with_a_clear_status(cluster, first, code):
    with grpc.insecure_channel(cluster.address("target")) as channel:
        call = target_pb2_grpc.TargetServiceStub(channel).Decode(iter([first]), timeout=30)
        with pytest.raises(grpc.RpcError) as raised:
            list(call)
    assert raised.value.code() == code


def test_a_stale_stream_start_is_a_stale_session_for_the_loop(cluster):
    async def start():
        verifier = GrpcVerifier([cluster.address("target")])
        await verifier.decode(DecodeRequest(step("stale", SyncPoint(1000, (1,), "elsewhere"), SamplingParams()), 4))

    with pytest.raises(StaleSession):
        cluster._run(start())


def test_plain_requests_through_the_coordinator_stream_their_steps(cluster, target_alone, monkeypatch):
    """speculation off: one Decode stream for the whole completion, and the target alone's tokens."""
    streams = []
    decode = cluster.target.decode
    monkeypatch.setattr(cluster.target, "decode", lambda request, credit: streams.append(request) or decode(request, credit))
    with grpc.insecure_channel(cluster.address("coordinator")) as channel:
        reply = cluster.coordinator(channel).Complete(coordinator_pb2.GenerateRequest(
            token_ids=coordinator_pb2.TokenIds(ids=IDS), max_tokens=16, ignore_eos=True, speculation=False), timeout=60)
    assert list(reply.token_ids) == target_alone(IDS, 16)
    assert len(streams) == 1 and streams[0].max_steps == 16
