"""Pools of real processes on loopback: sessions placed by rendezvous hashing over replicas that
come and go, a draft pool that vanishes mid-stream, a target pool that does.

Replicas listen on distinct loopback addresses at one port, as pods of a headless Service do,
so every run places the sessions the same way. Output must equal the target alone every time.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.common import placement
from services.common.redis_server import LocalRedis
from services.common.replicas import REFRESH_S
from services.protogen.specd.v1 import common_pb2, coordinator_pb2, target_pb2, target_pb2_grpc
from tests.procs import ServiceProcess, coordinator, model_service, stub

pytestmark = pytest.mark.slow  # replica processes stopped and killed

PORT = 51753
TARGET_HOSTS = ["127.0.0.11", "127.0.0.12", "127.0.0.13"]
NEW_TARGET_HOST = "127.0.0.14"
DRAFT_HOSTS = ["127.0.0.21", "127.0.0.22"]
SESSIONS = [f"pool-{i}" for i in range(16)]
N = 16  # tokens per turn
MAX_GAP_S = 1.0  # between two chunks of a stream whose drafts all died (a draft timeout is 2 s, a target wait 60 s)


def turn(proc: ServiceProcess, session: str, text: str, n: int = N) -> coordinator_pb2.CompleteResponse:
    request = coordinator_pb2.GenerateRequest(text=text, max_tokens=n, session_id=session, ignore_eos=True,
                                              num_draft_tokens=3)
    return stub(proc).Complete(request, timeout=120)


def holders(targets: list[ServiceProcess], lengths: dict[str, int]) -> dict[str, str]:
    """Each session's target replica: the one that holds all its committed tokens."""
    found = {}
    for target in targets:
        with grpc.insecure_channel(target.address) as channel:
            service = target_pb2_grpc.TargetServiceStub(channel)
            for session, length in lengths.items():
                if service.GetSession(common_pb2.SessionRef(session_id=session), timeout=10).position == length:
                    found[session] = target.address
    return found


def test_sessions_spread_by_rendezvous_and_move_only_when_their_replica_changes(
    procs, tiny_pair, tmp_path, model, target_alone
):
    draft_dir, target_dir = tiny_pair
    targets = [model_service("target", target_dir, tmp_path, PORT, host, "--max-batch", "16") for host in TARGET_HOSTS]
    drafts = [model_service("draft", draft_dir, tmp_path, PORT, host) for host in DRAFT_HOSTS]
    pool_file = tmp_path / "targets"
    pool_file.write_text("".join(f"{t.address}\n" for t in targets))
    histories: dict[str, list[int]] = {s: [] for s in SESSIONS}
    with LocalRedis() as redis:
        procs(*targets, *drafts)
        coordinators = procs(*(
            coordinator(target_dir, [d.address for d in drafts], f"file://{pool_file}", redis.url, tmp_path)
            for _ in range(2)
        ))

        def play(turn_no: int, text: str) -> set[str]:
            """Every session takes a turn at once, through the coordinator it did not use last time;
            each output is the target's alone. Returns the sessions that were resent anywhere."""

            def one(index: int) -> coordinator_pb2.CompleteResponse:
                return turn(coordinators[(index + turn_no) % 2], SESSIONS[index], text)

            with ThreadPoolExecutor(len(SESSIONS)) as pool:
                replies = list(pool.map(one, range(len(SESSIONS))))
            for session, reply in zip(SESSIONS, replies):
                histories[session] += model.encode(text)
                assert list(reply.token_ids) == target_alone(histories[session], N), session
                histories[session] += list(reply.token_ids)
            return {session for session, reply in zip(SESSIONS, replies) if reply.stats.resyncs}

        def placed(addresses: list[str]) -> dict[str, str]:
            return {s: placement.rank(s, addresses)[0] for s in SESSIONS}

        three = [t.address for t in targets]
        assert play(0, "A first turn.") == set()
        assert play(1, " A second turn.") == set()  # the other coordinator sends each session to the same replica
        assert holders(targets, {s: len(h) for s, h in histories.items()}) == placed(three)
        assert len(set(placed(three).values())) == 3  # spread over all three

        # scale out: a 4th replica joins the pool file; only the sessions it now ranks first for move
        (new,) = procs(model_service("target", target_dir, tmp_path, PORT, NEW_TARGET_HOST, "--max-batch", "16"))
        pool_file.write_text(pool_file.read_text() + f"{new.address}\n")
        time.sleep(3 * REFRESH_S)  # both coordinators re-read it
        four = [*three, new.address]
        moved = {s for s in SESSIONS if placed(four)[s] == new.address}
        assert play(2, " Scaled out.") == moved
        assert 0 < len(moved) <= len(SESSIONS) / 3
        assert holders([*targets, new], {s: len(h) for s, h in histories.items()}) == placed(four)

        # a replica dies (still listed): only its own sessions move
        before = placed(four)
        victim = max(targets, key=lambda t: list(before.values()).count(t.address))
        victim.kill9()
        assert play(3, " After a crash.") == {s for s in SESSIONS if before[s] == victim.address}
        live = [t for t in [*targets, new] if t is not victim]
        assert holders(live, {s: len(h) for s, h in histories.items()}) == placed([t.address for t in live])


def test_streams_go_on_plainly_while_no_draft_answers_then_speculate_again(
    procs, tiny_pair, tmp_path, model, target_alone
):
    draft_dir, target_dir = tiny_pair
    drafts = [model_service("draft", draft_dir, tmp_path) for _ in range(2)]
    with LocalRedis() as redis:
        (target, *_) = procs(model_service("target", target_dir, tmp_path), *drafts)
        (coord,) = procs(coordinator(target_dir, [d.address for d in drafts], [target.address], redis.url, tmp_path))
        prompts = [f"Stream {i} begins here:" for i in range(4)]
        arrivals: list[list[float]] = [[] for _ in prompts]
        three_each = threading.Barrier(len(prompts) + 1)

        def stream(i: int) -> list[coordinator_pb2.GenerateResponse]:
            request = coordinator_pb2.GenerateRequest(text=prompts[i], max_tokens=240, ignore_eos=True,
                                                      num_draft_tokens=3)
            chunks = []
            for chunk in stub(coord).Generate(request, timeout=180):
                chunks.append(chunk)
                arrivals[i].append(time.monotonic())
                if len(chunks) == 3:
                    three_each.wait(timeout=60)  # every stream is under way: then the drafts die
            return chunks

        with ThreadPoolExecutor(len(prompts)) as pool:
            running = [pool.submit(stream, i) for i in range(len(prompts))]
            three_each.wait(timeout=60)
            for draft in drafts:
                draft.kill9()
            results = [r.result() for r in running]
        for prompt, chunks, times in zip(prompts, results, arrivals):
            tokens = [t for c in chunks for t in c.token_ids]
            assert tokens == target_alone(model.encode(prompt), 240)
            assert chunks[-1].stats.outage_rounds >= 1  # the kill hit this stream, which went on plainly
            assert max(b - a for a, b in zip(times, times[1:])) < MAX_GAP_S

        for draft in drafts:
            draft.start().wait_ready()
        time.sleep(3 * REFRESH_S)  # the coordinator's probe finds them
        again = turn(coord, "after-the-outage", "Speculate again.", 32)
        assert list(again.token_ids) == target_alone(model.encode("Speculate again."), 32)
        assert again.stats.outage_rounds == 0 and again.stats.drafted_tokens > 0


def test_no_target_fails_unavailable_after_a_bounded_wait_and_the_session_resumes(
    procs, tiny_pair, tmp_path, model, target_alone
):
    draft_dir, target_dir = tiny_pair
    with LocalRedis() as redis:
        draft, target = procs(model_service("draft", draft_dir, tmp_path), model_service("target", target_dir, tmp_path))
        (coord,) = procs(coordinator(target_dir, [draft.address], [target.address], redis.url, tmp_path,
                                     "--target-wait-s", "2"))
        prompt = "Resumable after the target returns."
        request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=400, session_id="no-target",
                                                  ignore_eos=True, num_draft_tokens=3)
        streamed: list[int] = []
        with pytest.raises(grpc.RpcError) as failed:
            for chunk in stub(coord).Generate(request, timeout=180):
                streamed += chunk.token_ids
                if len(streamed) >= 8 and target.proc.poll() is None:
                    target.kill9()
                    killed = time.monotonic()
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        details = failed.value.details()  # stable words and an error id; the addresses only in the log
        assert "no model replica answered" in details and "retry" in details and "error id" in details
        assert time.monotonic() - killed < 10  # 2 s of waiting, not the 60 s default

        target.start().wait_ready()
        history = model.encode(prompt) + streamed
        summary = stub(coord).GetSession(coordinator_pb2.SessionRequest(session_id="no-target", include_tokens=True))
        assert list(summary.token_ids) == history  # everything streamed was kept, nothing more
        reply = turn(coord, "no-target", " Go on.")
        assert list(reply.token_ids) == target_alone(history + model.encode(" Go on."), N)


def test_a_stopping_target_replica_hands_its_sessions_on_without_an_error(procs, tiny_pair, tmp_path, model,
                                                                          target_alone):
    """SIGTERM (a rollout, a node drain) of the replica serving a stream: it finishes the round it
    has, refuses the next, and the stream goes on on the other replica, unchanged."""
    draft_dir, target_dir = tiny_pair
    targets = [model_service("target", target_dir, tmp_path) for _ in range(2)]
    with LocalRedis() as redis:
        (draft, *_) = procs(model_service("draft", draft_dir, tmp_path), *targets)
        (coord,) = procs(coordinator(target_dir, [draft.address], [t.address for t in targets], redis.url, tmp_path))
        prompt = "Drained, not dropped:"
        request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=240, session_id="drained", ignore_eos=True,
                                                  num_draft_tokens=3)
        chunks, stopping = [], None
        for chunk in stub(coord).Generate(request, timeout=180):
            chunks.append(chunk)
            if len(chunks) == 3:
                placed = placement.rank("drained", [t.address for t in targets])[0]
                stopping = next(t for t in targets if t.address == placed)
                stopping.proc.terminate()
        assert stopping.proc.wait(timeout=30) == 0  # a clean exit after draining
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == target_alone(model.encode(prompt), 240)
        assert chunks[-1].stats.resyncs >= 1  # the session moved to the other replica


def test_one_draft_batches_sessions_of_every_target_replica(tiny_pair, redis_url, model, target_alone):
    """Any draft replica serves any session: the draft is addressed by session, not by target,
    so sessions placed on different target replicas share its passes."""
    from specd.engine import EngineConfig
    from services.common.server import start_server
    from services.coordinator.frontend import Frontend
    from services.coordinator.requests import Limits
    from services.coordinator.store import RedisSessionStore
    from services.draft import server as draft_server
    from services.draft.client import GrpcDrafter
    from services.target import server as target_server
    from services.target.client import GrpcVerifier
    from specd.loop import Finished, GenerationRequest, Services
    from specd.sampling import SamplingParams
    from specd.stopping import StopRules

    draft_dir, target_dir = tiny_pair
    draft = draft_server.DraftServicer.load(EngineConfig(draft_dir, dtype="float64"), "draft")
    targets = [target_server.TargetServicer.load(EngineConfig(target_dir, dtype="float64"), "target") for _ in range(2)]
    batches: list[list[str]] = []
    engine_batch = draft._engine_batch
    draft._engine_batch = lambda requests: (batches.append([r.session_id for r in requests]), engine_batch(requests))[1]
    prompts: dict[str, list[int]] = {}

    async def run() -> dict[str, list[int]]:
        servers = []
        for register in (draft_server.register(draft), *(target_server.register(t) for t in targets)):
            servers.append(await start_server(register, "127.0.0.1:0"))
        draft_addr, *target_addrs = (f"127.0.0.1:{port}" for _, port in servers)
        # four sessions that each replica ranks first (placement.rank): eight names at random land
        # all on one replica once in 128 runs, whatever the code does
        for replica in target_addrs:
            names = (f"shared-draft-{i}" for i in itertools.count())
            for name in itertools.islice((n for n in names if placement.rank(n, target_addrs)[0] == replica), 4):
                prompts[name] = model.encode(f"Session {name} says:")
        services = Services(GrpcDrafter([draft_addr]), GrpcVerifier(target_addrs), RedisSessionStore(redis_url))
        frontend = Frontend(services, model, Limits())

        async def one(session: str) -> list[int]:
            request = GenerationRequest(tuple(prompts[session]), StopRules(24, ignore_eos=True), SamplingParams(),
                                        fixed_k=3)
            events = [e async for e in frontend.generate(request, session)]
            assert isinstance(events[-1], Finished)
            return list(events[-1].token_ids)

        try:
            outputs = await asyncio.gather(*(one(s) for s in prompts))
            return dict(zip(prompts, outputs))
        finally:
            await services.drafter.replicas.close()
            await services.verifier.replicas.close()
            await services.store.close()
            for server, _ in servers:
                await server.stop(0)

    try:
        outputs = asyncio.run(run())
        holder = {s: i for i, t in enumerate(targets) for s in prompts if t.engine.position(s) > 0}
    finally:
        for servicer in (draft, *targets):
            servicer.close()
    for session, ids in prompts.items():
        assert outputs[session] == target_alone(ids, 24)
    assert set(holder.values()) == {0, 1}  # the sessions spread over both target replicas
    mixed = [b for b in batches if len({holder[s] for s in b}) == 2]
    assert mixed, f"no draft pass served sessions of both targets: {batches}"


def test_replicas_report_their_load_and_a_draining_one_refuses_new_calls(tiny_pair, redis_url):
    from services.common.convert import LOAD_REQUEST
    from services.protogen.specd.v1 import draft_pb2_grpc
    from tests.cluster import Cluster

    cluster = Cluster(*tiny_pair, redis_url)
    try:
        with grpc.insecure_channel(cluster.address("coordinator")) as channel:
            # a fixed K on the draft model: both services hold the session, whatever the deployment's learnt policy
            request = coordinator_pb2.GenerateRequest(text="Load me.", max_tokens=8, session_id="loaded",
                                                      drafter="model", num_draft_tokens=2)
            cluster.coordinator(channel).Complete(request, timeout=60)
        with grpc.insecure_channel(cluster.address("target")) as channel:
            target = target_pb2_grpc.TargetServiceStub(channel)
            load = target.GetLoad(LOAD_REQUEST, timeout=10)
            assert (load.sessions, load.max_sessions, load.max_batch, load.draining) == (1, 64, 8, False)
            assert load.cached_tokens > 0 and load.instance_id == cluster.target_engine.instance_id
            cluster._run(cluster.target.drain(1.0))
            assert target.GetLoad(LOAD_REQUEST, timeout=10).draining
            step = target_pb2.StepRequest(session_id="other", sync=common_pb2.SyncPoint(tokens=[1, 2]))
            with pytest.raises(grpc.RpcError) as refused:
                target.Step(step, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in refused.value.details()
        with grpc.insecure_channel(cluster.address("draft")) as channel:
            assert draft_pb2_grpc.DraftServiceStub(channel).GetLoad(LOAD_REQUEST, timeout=10).sessions == 1
    finally:
        cluster.close()
