"""Cross-session batching: several sessions' verifications in one target pass, and their
drafting steps in one draft pass each.

Role engines: `TargetEngine.verify` on a batch decides exactly what it decides one session at a
time, and `DraftEngine.propose` on a batch drafts what it drafts for each session alone (greedy
and sampled, mixed K and lengths). Service level, real gRPC servers with the tiny float64 pair:
concurrent generations are batched in both services and each stays token-identical to the
target alone; a request that fails in a batch fails alone.

Over 350 lines: batching at each layer (engine, batcher, services), each against one session alone."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specd import sparse
from specd.contracts import Proposal, ProposeRequest, SamplingParams, SyncPoint, VerifyRequest
from specd.draft_engine import DraftEngine
from specd.engine import EngineConfig, ModelEngine
from specd.sampling import warp
from specd.target_engine import TargetEngine
from services.common.worker import Batcher, Batching, EngineWorker, SharedCores
from services.common import model_service
from services.draft import convert as draft_convert
from services.protogen.specd.v1 import coordinator_pb2, draft_pb2_grpc, target_pb2_grpc
from services.target import convert
from tests.cluster import Cluster
from tests.conftest import greedy_reference
from tests.engines import held, propose, verify_proposal

PROMPTS = [[72, 101, 108, 108, 111], [3, 17, 250, 42, 99, 7, 7, 128, 64, 5, 200], [9], [100, 101, 102, 103] * 4]


# -- role engines: a batch = each session alone ----------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_k=6, seed=3)],
                         ids=["greedy", "sampled"])
def test_verify_batch_decides_what_one_session_at_a_time_decides(tiny_pair, params):
    draft_dir, target_dir = tiny_pair
    draft = ModelEngine(EngineConfig(draft_dir, dtype="float64"))
    alone, batched = (ModelEngine(EngineConfig(target_dir, dtype="float64")) for _ in range(2))
    for session, prompt in enumerate(PROMPTS):
        for engine in (draft, alone, batched):
            engine.sync(str(session), 0, prompt)
    for round_ in range(4):
        proposals = {str(s): propose(draft, str(s), (s + round_) % 5, params) for s in range(len(PROMPTS))}
        expected = {s: verify_proposal(alone, s, p, params) for s, p in proposals.items()}
        requests = [VerifyRequest(s, held(batched, s), p, params) for s, p in proposals.items()]
        # What the pass fed: the prompts the first time, then each session's last token and its drafts.
        fed = sum(len(p) for p in PROMPTS) if round_ == 0 else len(PROMPTS)
        for request, reply in zip(requests, TargetEngine(batched).verify(requests)):
            assert reply.verdict == expected[request.session_id]
            assert reply.batch_size == len(requests)
            assert reply.pass_rows == fed + sum(len(p.tokens) for p in proposals.values())
            assert batched.tokens(request.session_id) == alone.tokens(request.session_id)
            draft.sync(request.session_id, request.sync.end + reply.verdict.num_accepted, [reply.verdict.next_token])


@pytest.mark.parametrize("min_confidence", [0.0, 0.5], ids=["to-K", "confidence-stop"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_k=6, seed=3)],
                         ids=["greedy", "sampled"])
def test_draft_batch_drafts_what_each_session_drafts_alone(tiny_pair, params, min_confidence):
    alone, batched = (ModelEngine(EngineConfig(tiny_pair[0], dtype="float64")) for _ in range(2))
    for session, prompt in enumerate(PROMPTS):
        for engine in (alone, batched):
            engine.sync(str(session), 0, prompt)
    for round_ in range(3):
        requests = [ProposeRequest(str(s), held(batched, str(s)), (s + round_) % 5 + 1, params,
                                   min_confidence=min_confidence) for s in range(len(PROMPTS))]
        for request, reply in zip(requests, DraftEngine(batched).propose(requests)):
            proposal = reply.proposal
            expected = propose(alone, request.session_id, request.k, params, min_confidence)
            assert proposal.tokens == expected.tokens and len(proposal.q) == len(expected.q)
            for row, expected_row in zip(proposal.q, expected.q):  # equal up to the rounding of a batched matmul
                assert torch.allclose(sparse.decode(row, alone.vocab_size), sparse.decode(expected_row, alone.vocab_size))
            assert batched.tokens(request.session_id) == alone.tokens(request.session_id)
            for engine in (alone, batched):  # the round's verdict: one draft accepted, then a recovered token
                engine.sync(request.session_id, request.sync.end + 1, [(7 * round_ + 1) % 256])


def test_a_confidence_stop_ends_the_draft_after_its_first_unsure_token(tiny_pair):
    engine, greedy, K = ModelEngine(EngineConfig(tiny_pair[0], dtype="float64")), SamplingParams(), 8
    stops = []
    for session, prompt in enumerate(PROMPTS):
        s, n = str(session), len(prompt)
        engine.sync(s, 0, prompt)
        full = propose(engine, s, K, greedy)
        confidence = []  # the draft's probability of each of its drafts, one plain forward each
        for i, token in enumerate(full.tokens):
            engine.sync(s, n, full.tokens[:i])
            confidence.append(float(torch.softmax(engine.forward(s)[-1], -1)[token]))
        engine.sync(s, n, [])
        unsure = next((i for i, p in enumerate(confidence) if p < 0.5), K - 1)
        assert propose(engine, s, K, greedy, 0.5).tokens == full.tokens[: unsure + 1]
        stops.append(unsure + 1)
    assert min(stops) < K  # the prompts do make it stop


# -- the batcher --------------------------------------------------------------------------------


def test_batcher_takes_what_queued_while_busy_keeps_one_call_per_key_and_fails_calls_alone():
    worker = EngineWorker("test-batcher")
    seen: list[list[tuple[str, int]]] = []

    def run_batch(items: list[tuple[str, int]]) -> list[int | Exception]:
        seen.append(items)
        return [ValueError(f"bad {v}") if v < 0 else v * 10 for _, v in items]

    batcher = Batcher(worker, run_batch, key=lambda item: item[0], batching=Batching(max_batch=3))

    async def main():
        release = threading.Event()
        blocked = asyncio.ensure_future(worker.run(release.wait))
        calls = [asyncio.ensure_future(batcher.submit(item)) for item in
                 [("a", 1), ("b", -2), ("a", 3), ("c", 4), ("d", 5)]]
        while batcher.waiting < 5:
            await asyncio.sleep(0.01)
        release.set()
        await blocked
        return await asyncio.gather(*calls, return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        worker.close()
    assert results[0] == 10 and results[2:] == [30, 40, 50]
    assert isinstance(results[1], ValueError) and str(results[1]) == "bad -2"
    # the second "a" waits for the next turn; that turn also takes what is left, in arrival order
    assert seen == [[("a", 1), ("b", -2), ("c", 4)], [("a", 3), ("d", 5)]]
    assert (batcher.batches, batcher.largest) == (2, 3)


def test_a_lone_call_does_not_wait_for_a_batch():
    worker = EngineWorker("test-lone")
    batcher = Batcher(worker, lambda items: [v for v in items], key=lambda item: item)

    async def main():
        start = time.perf_counter()
        assert await batcher.submit(7) == 7
        return time.perf_counter() - start

    try:
        assert asyncio.run(main()) < 0.5
    finally:
        worker.close()
    assert (batcher.batches, batcher.largest) == (1, 1)


def passes_of(seconds: float, seen: list[list[str]]):
    """A run_batch that records each batch and takes `seconds`, as a model pass would."""

    def run_batch(items: list[str]) -> list[str]:
        seen.append(items)
        time.sleep(seconds)
        return items

    return run_batch


def test_a_pass_reports_the_sessions_it_holds_up_not_only_those_in_it():
    """a, b and c shared a pass; d's call then takes a pass of its own (no wait): that pass holds up
    all four (the policy prices a round by them, specd/policy/learning.py), and once a, b and c are
    two turns gone, d alone."""
    worker = EngineWorker("test-active")
    active: list[int] = []
    batcher = Batcher(worker, lambda items: active.append(batcher.held_up()) or items, key=lambda item: item[0],
                      batching=Batching(wait=0.0))

    async def main():
        release = threading.Event()
        blocked = asyncio.ensure_future(worker.run(release.wait))  # a, b and c queue behind it
        first = [asyncio.ensure_future(batcher.submit(f"{s}1")) for s in "abc"]
        while batcher.waiting < 3:
            await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(blocked, *first)
        for turn in "234":
            await batcher.submit(f"d{turn}")

    try:
        asyncio.run(main())
    finally:
        worker.close()
    assert batcher.batches == 4 and active == [3, 4, 1, 1]


def test_a_pass_counts_the_sessions_that_queued_behind_it_as_held_up():
    """a's call runs alone; b and c arrive while it runs and wait for it: its pass held up all three.
    (On a Xeon, eight sessions at once: the one whose prefill ran alone read the batch as one and
    drafted into the pass the other seven's prefills then shared.)"""
    worker = EngineWorker("test-held")
    held: list[int] = []

    def run_batch(items: list[str]) -> list[str]:
        while items == ["a1"] and batcher.waiting < 2:
            time.sleep(0.005)
        held.append(batcher.held_up())
        return items

    batcher = Batcher(worker, run_batch, key=lambda item: item[0], batching=Batching(wait=0.0))

    async def main():
        first = asyncio.ensure_future(batcher.submit("a1"))
        while batcher.batches < 1:
            await asyncio.sleep(0.005)
        await asyncio.gather(first, *(batcher.submit(f"{s}1") for s in "bc"))

    try:
        asyncio.run(main())
    finally:
        worker.close()
    assert batcher.batches == 2 and held == [3, 3]


@pytest.mark.parametrize("wait", [0.2, 0.0])
def test_a_turn_waits_briefly_for_the_sessions_the_last_turns_took(wait):
    """a and b shared a pass; b now comes 50 ms after a (its reply from the other service was a
    little later): with a wait of 0.2 of a 0.5 s pass (100 ms) they share the next pass again,
    without one each. A session that ended is not waited for, nor one that does not come in time."""
    worker = EngineWorker("test-gather")
    seen: list[list[str]] = []
    batcher = Batcher(worker, passes_of(0.5, seen), key=lambda item: item[0], batching=Batching(wait=wait))

    async def late(item: str, delay: float) -> str:
        await asyncio.sleep(delay)
        return await batcher.submit(item)

    async def timed(*calls) -> float:
        start = time.perf_counter()
        await asyncio.gather(*calls)
        return time.perf_counter() - start

    async def main() -> list[float]:
        release = threading.Event()
        blocked = asyncio.ensure_future(worker.run(release.wait))
        first = [asyncio.ensure_future(batcher.submit(item)) for item in ("a1", "b1")]
        while batcher.waiting < 2:
            await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(blocked, *first)
        await timed(batcher.submit("a2"), late("b2", 0.05))
        alone = await timed(batcher.submit("a3"))  # b is not coming: the turn waits out the 100 ms
        batcher.forget("b")
        forgotten = await timed(batcher.submit("a4"))  # b ended: no wait
        await asyncio.gather(batcher.submit("a5"), batcher.submit("b5"))

        async def end_b() -> None:
            await asyncio.sleep(0.02)
            batcher.forget("b")

        ending = await timed(batcher.submit("a6"), end_b())  # b ends while the turn waits for it
        return [alone, forgotten, ending]

    try:
        alone, forgotten, ending = asyncio.run(main())
    finally:
        worker.close()
    if wait:
        assert seen == [["a1", "b1"], ["a2", "b2"], ["a3"], ["a4"], ["a5", "b5"], ["a6"]]
        assert 0.58 < alone < 0.75 and forgotten < 0.58 and ending < 0.58, (alone, forgotten, ending)
        assert batcher.waits == 3
    else:
        assert seen == [["a1", "b1"], ["a2"], ["b2"], ["a3"], ["a4"], ["a5", "b5"], ["a6"]]
        assert batcher.waits == 0


def test_batching_flags_are_checked_when_a_service_starts(capsys):
    from services.common import model_main

    assert model_main.parse("target", 1, ["--model-dir", "m"]).batch_wait == Batching.wait
    assert model_main.parse("draft", 1, ["--model-dir", "m", "--batch-wait", "0"]).batch_wait == 0.0
    for bad in (["--batch-wait", "-0.1"], ["--batch-wait", "1.5"], ["--batch-wait", "nan"], ["--max-batch", "0"]):
        with pytest.raises(SystemExit):
            model_main.parse("draft", 1, ["--model-dir", "m", *bad])
        assert "must be" in capsys.readouterr().err


@pytest.mark.parametrize("shared", [True, False])
def test_workers_sharing_cores_take_turns(tmp_path, shared):
    """Two services' workers (each its own lock descriptor, as two processes have): with shared
    cores the second one's model work starts only when the first one's turn ends."""
    lock = tmp_path / "cores.lock"
    workers = [EngineWorker(f"test-cores-{i}", SharedCores(lock) if shared else None) for i in range(2)]
    events: list[str] = []
    first_running = threading.Event()

    def work(name: str) -> None:
        events.append(f"{name} starts")
        first_running.set()
        time.sleep(0.3)
        events.append(f"{name} ends")

    async def main():
        first = asyncio.ensure_future(workers[0].run(work, "draft"))
        await asyncio.to_thread(first_running.wait)
        await asyncio.gather(first, workers[1].run(work, "target"))

    try:
        asyncio.run(main())
    finally:
        for worker in workers:
            worker.close()
    in_turns = ["draft starts", "draft ends", "target starts", "target ends"]
    assert (events == in_turns) is shared, events


# -- real gRPC services --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_url):
    c = Cluster(*tiny_pair, redis_url)
    slow_down(c.draft_engine)
    slow_down(c.target_engine)
    yield c
    c.close()


def slow_down(engine: ModelEngine, seconds: float = 0.02) -> None:
    """The tiny models are so fast that requests rarely meet; real ones are busy long enough that
    they do. Each pass takes a little longer here, so concurrent rounds do queue up."""
    forward_many = engine.forward_many

    def slow(requests, **options):
        time.sleep(seconds)
        return forward_many(requests, **options)

    engine.forward_many = slow


def test_concurrent_generations_are_batched_and_each_is_the_target_alone(cluster, tiny_pair):
    reference = greedy_reference(tiny_pair[1])
    texts = ["def add(a, b):", "Once upon a time", "The quick brown fox", "x = [1, 2, 3]", "Hej! Ça va?",
             "import numpy as np", "while True:", "SELECT * FROM"]
    n_tokens = 20
    largest_before = cluster.target.batcher.largest, cluster.draft.batcher.largest

    def complete(i: int) -> list[int]:
        with grpc.insecure_channel(cluster.address("coordinator")) as channel:
            request = coordinator_pb2.GenerateRequest(
                text=texts[i], max_tokens=n_tokens, ignore_eos=True,
                **({"speculation": False} if i == 0 else {"num_draft_tokens": i % 5 + 1}),  # K = 0 (plain steps) .. 5
            )
            return list(cluster.coordinator(channel).Complete(request, timeout=120).token_ids)

    with ThreadPoolExecutor(len(texts)) as pool:
        outputs = list(pool.map(complete, range(len(texts))))
    for text, output in zip(texts, outputs):
        assert output == reference(cluster.model.encode(text), n_tokens), text
    assert cluster.target.batcher.largest >= 3 > largest_before[0]
    assert cluster.draft.batcher.largest >= 3 > largest_before[1]


HELD_S = 0.2


def in_one_turn(cluster, servicer, rpc, sessions: list[str]) -> dict[str, tuple]:
    """rpc(session) for every session while the servicer's worker is held, so that all of them
    queue for its next turn; session -> (status code, reply or None)."""

    def call(session: str):
        try:
            return grpc.StatusCode.OK, rpc(session)
        except grpc.RpcError as error:
            return error.code(), None

    release = threading.Event()
    blocked = asyncio.run_coroutine_threadsafe(servicer.worker.run(release.wait), cluster.loop)
    with ThreadPoolExecutor(len(sessions)) as pool:
        replies = [pool.submit(call, session) for session in sessions]
        while servicer.batcher.waiting < len(sessions):
            time.sleep(0.01)
        time.sleep(HELD_S)  # every call has queued at least this long
        release.set()
        blocked.result(timeout=10)
        return dict(zip(sessions, (r.result() for r in replies)))


def test_a_request_that_fails_in_a_batch_fails_alone(cluster):
    target, servicer = cluster.target_engine, cluster.target
    prompt = (72, 101, 108, 108, 111)
    good = SyncPoint(0, prompt)
    calls = {  # session -> (sync, drafts, expected status)
        "batch-ok-1": (good, (1, 2), grpc.StatusCode.OK),
        "batch-stale": (SyncPoint(3, (108, 111), "another-instance"), (1,), grpc.StatusCode.FAILED_PRECONDITION),
        "batch-bad-token": (good, (target.vocab_size,), grpc.StatusCode.INVALID_ARGUMENT),
        "batch-ok-2": (good, (), grpc.StatusCode.OK),
    }
    expected = {}
    for session, (sync, drafts, _) in calls.items():
        reference = f"{session}-alone"
        target.sync(reference, 0, sync.tokens)
        if calls[session][2] == grpc.StatusCode.OK:
            expected[session] = servicer.worker.call(verify_proposal, target, reference, Proposal(drafts, ()), SamplingParams())
    batches_before = servicer.batcher.batches

    def verify(session: str):
        sync, drafts, _ = calls[session]
        request = VerifyRequest(session, sync, Proposal(drafts, ()), SamplingParams())
        request = convert.verify_to_proto(request) if drafts else convert.step_to_proto(request)
        with grpc.insecure_channel(cluster.address("target")) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            return (stub.Verify if drafts else stub.Step)(request, timeout=60)

    outcomes = in_one_turn(cluster, servicer, verify, list(calls))
    assert servicer.batcher.batches == batches_before + 1  # all four went through one pass
    for session, (code, reply) in outcomes.items():
        assert code == calls[session][2], session
    for session in ("batch-ok-1", "batch-ok-2"):
        reply = convert.reply_from_proto(outcomes[session][1])
        assert reply.verdict == expected[session]
        assert reply.queued_s >= HELD_S > reply.compute_s  # the wait is reported as queueing, not as the pass
        assert reply.batch_size == 4  # its compute_s timed the others' rows too
        assert reply.active_sessions >= 4  # and its pass held up at least those four
        assert reply.pass_rows == 2 * len(prompt) + 2  # over the wire: both prompts and two drafts, not the failed
        assert reply.position == target.position(session) == len(prompt) + reply.verdict.num_accepted + 1
        assert target.tokens(session)[len(prompt):] == (*calls[session][1][: reply.verdict.num_accepted],
                                                        reply.verdict.next_token)


def test_proposals_that_queue_draft_together_and_one_that_fails_fails_alone(cluster):
    draft, servicer = cluster.draft_engine, cluster.draft
    prompt = (72, 101, 108, 108, 111)
    params = SamplingParams(temperature=1.0, top_k=6, seed=5)
    calls = {  # session -> (sync, K, expected status)
        "draft-ok-1": (SyncPoint(0, prompt), 2, grpc.StatusCode.OK),
        "draft-stale": (SyncPoint(3, (108, 111), "another-instance"), 2, grpc.StatusCode.FAILED_PRECONDITION),
        "draft-too-long": (SyncPoint(0, (7,) * (draft.max_context - 2)), 4, grpc.StatusCode.INVALID_ARGUMENT),
        "draft-ok-2": (SyncPoint(0, prompt[:3]), 4, grpc.StatusCode.OK),
    }
    expected = {}
    for session, (sync, k, code) in calls.items():
        if code == grpc.StatusCode.OK:
            reference = f"{session}-alone"
            draft.sync(reference, 0, sync.tokens)
            expected[session] = servicer.worker.call(propose, draft, reference, k, params)
    batches_before = servicer.batcher.batches

    def propose_rpc(session: str):
        sync, k, _ = calls[session]
        request = draft_convert.propose_to_proto(ProposeRequest(session, sync, k, params))
        with grpc.insecure_channel(cluster.address("draft")) as channel:
            return draft_pb2_grpc.DraftServiceStub(channel).Propose(request, timeout=60)

    outcomes = in_one_turn(cluster, servicer, propose_rpc, list(calls))
    assert servicer.batcher.batches == batches_before + 1  # all four went through one turn
    for session, (code, reply) in outcomes.items():
        assert code == calls[session][2], session
    for session, proposal in expected.items():
        reply = draft_convert.reply_from_proto(outcomes[session][1])
        assert reply.proposal.tokens == proposal.tokens and reply.position == len(calls[session][0].tokens)
        assert reply.queued_s >= HELD_S > reply.compute_s
    # one pass: a session is charged the drafting steps it took part in (2 of 4), the rest is waiting
    short, long = (draft_convert.reply_from_proto(outcomes[s][1]) for s in ("draft-ok-1", "draft-ok-2"))
    assert short.compute_s == pytest.approx(long.compute_s / 2)


def test_each_request_of_a_batch_gets_its_own_span_under_its_own_rpc(cluster, monkeypatch):
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")  # the process's global provider stays untouched
    monkeypatch.setattr(model_service, "tracer", tracer)
    servicer = cluster.target
    calls = [VerifyRequest(f"span-{k}", SyncPoint(0, (72, 101, 108)), Proposal(tuple(range(1, k + 1)), ()),
                           SamplingParams()) for k in range(3)]

    async def rpc(call: VerifyRequest):
        with tracer.start_as_current_span(f"rpc {call.session_id}"):  # stands in for the gRPC server span
            return await servicer.verify(call)

    async def batch():
        release = threading.Event()
        blocked = asyncio.ensure_future(servicer.worker.run(release.wait))
        replies = [asyncio.ensure_future(rpc(call)) for call in calls]
        while servicer.batcher.waiting < len(calls):
            await asyncio.sleep(0.01)
        release.set()
        await blocked
        return await asyncio.gather(*replies)

    replies = asyncio.run_coroutine_threadsafe(batch(), cluster.loop).result(timeout=60)
    spans = exporter.get_finished_spans()
    for call, reply in zip(calls, replies):
        k = len(call.proposal.tokens)
        (work,) = [s for s in spans if s.name.startswith("target.")
                   and s.attributes["specd.session_id"] == call.session_id]
        (parent,) = [s for s in spans if s.name == f"rpc {call.session_id}"]
        assert work.name == ("target.verify" if k else "target.step")
        assert work.parent.span_id == parent.context.span_id
        a = work.attributes
        assert (a["specd.k"], a["specd.accepted"], a["specd.position"], a["specd.batch_size"]) == (
            k, reply.verdict.num_accepted, 3, len(calls))
        assert reply.compute_s == pytest.approx(replies[0].compute_s)  # the batch's model time


@pytest.mark.parametrize("batching, passes", [(Batching(), 1), (Batching(wait=0.1), 2)])
def test_eight_sessions_answered_in_turn_by_one_coordinator_share_the_next_pass(batching, passes):
    """After a pass of eight, one coordinator handles the replies in turn and sends each session's next
    call ~1-1.5 ms after the last (2 ms here): the eighth comes 14 ms after the first. The default wait
    (0.3 of a 0.1 s pass) takes all eight into one pass; 0.1 of it (the old default) split them in two,
    each paying a whole pass's weights (`specd bench --load`: 0.92x plain at eight sessions)."""
    worker = EngineWorker("test-turns")
    seen: list[list[str]] = []
    batcher = Batcher(worker, passes_of(0.1, seen), key=lambda item: item[0], batching=batching)
    sessions = "abcdefgh"

    async def main() -> None:
        release = threading.Event()
        blocked = asyncio.ensure_future(worker.run(release.wait))
        first = [asyncio.ensure_future(batcher.submit(f"{s}1")) for s in sessions]
        while batcher.waiting < len(sessions):
            await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(blocked, *first)
        calls = []
        for s in sessions:
            calls.append(asyncio.ensure_future(batcher.submit(f"{s}2")))
            await asyncio.sleep(0.002)
        await asyncio.gather(*calls)

    try:
        asyncio.run(main())
    finally:
        worker.close()
    assert seen[0] == [f"{s}1" for s in sessions]
    assert len(seen) - 1 == passes and sorted(x for batch in seen[1:] for x in batch) == [f"{s}2" for s in sessions]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=6, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_verification_reports_the_targets_confidence_at_each_committed_position(tiny_pair, params):
    """The probability of the target's most likely token (its warped distribution's, when sampled)
    at rows 0 .. num_accepted of the pass: what the policy reads the text's predictability from."""
    draft_dir, target_dir = tiny_pair
    draft, target, reference = (ModelEngine(EngineConfig(d, dtype="float64")) for d in (draft_dir, target_dir, target_dir))
    for engine in (draft, target, reference):
        engine.sync("s", 0, PROMPTS[1])
    for k in (0, 1, 4):
        proposal = propose(draft, "s", k, params)
        reference.sync("s", target.position("s"), ())
        rows = reference.forward("s", proposal.tokens)[-(len(proposal.tokens) + 1):]  # [K+1, vocab]
        reply = TargetEngine(target).verify([VerifyRequest("s", held(target, "s"), proposal, params)])[0]
        committed = reply.verdict.num_accepted + 1
        p = torch.softmax(rows.double(), -1) if params.greedy else warp(rows, params)
        assert reply.confidence == pytest.approx(p[:committed].amax(-1).tolist(), rel=1e-5)
        assert all(0.0 < c <= 1.0 for c in reply.confidence)
        draft.sync("s", reply.position - 1, [reply.verdict.next_token])
        reference.sync("s", reply.position - 1, [reply.verdict.next_token])
