"""RedisSessionStore against a real redis-server: leases and fencing, append-only tokens, TTL, and
durability across a SIGKILL. There is no pytest-asyncio: each test drives the store with asyncio.run.

Over 350 lines: every property the store promises, each a short test against one real Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.redis_server import LocalRedis
from services.coordinator.store import RedisSessionStore, decode_state, encode_state, to_jsonable
from specd.policy import PLAIN, Estimates, PolicyState
from specd.session import Fenced, ServiceCursor, SessionNotFound, SessionState, SessionStats


@pytest.fixture(scope="module")
def server():
    with LocalRedis() as r:
        yield r


def run(url: str, body, **store_kwargs):
    """Run `body(store)` on a fresh store and event loop (a redis.asyncio pool is tied to its loop)."""

    async def main():
        store = RedisSessionStore(url, **store_kwargs)
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def new_id() -> str:
    return f"sess-{uuid.uuid4().hex}"


def rich_state(session_id: str, tokens: tuple[int, ...]) -> SessionState:
    estimates = Estimates(alpha=0.55, draft_step_s=0.0031, verify_s=((0, 0.012), (4, 0.0205), (6, 0.031)),
                          rtt_s=0.0007, observations=9)
    return SessionState(
        session_id=session_id,
        tokens=tokens,
        draft=ServiceCursor(len(tokens) - 1, "draft-a1"),
        target=ServiceCursor(len(tokens), "target-b2"),
        policy=PolicyState(mode=PLAIN, k=6, estimates=estimates),
        stats=SessionStats().record(k=4, accepted=3).record(k=6, accepted=1, fallbacks=1),
        owner="key-7",
    )


def test_unknown_id_without_create_is_not_found(server):
    async def body(store):
        with pytest.raises(SessionNotFound):
            await store.begin(new_id(), create=False)

    run(server.url, body)


def test_create_gives_fresh_state_at_epoch_1(server):
    sid = new_id()

    async def body(store):
        lease, state = await store.begin(sid, create=True)
        assert lease.epoch == 1 and lease.session_id == sid
        assert state == SessionState(session_id=sid)
        assert await store.get(sid) == SessionState(session_id=sid)  # created, though never saved

    run(server.url, body)


def test_save_then_begin_round_trips_state_and_bumps_epoch(server):
    sid = new_id()
    saved = rich_state(sid, (7, 0, 2**32 - 1, 151643))

    async def body(store):
        lease, _ = await store.begin(sid, create=True, owner=saved.owner)
        await store.save(lease, saved, appended_from=0)
        lease2, loaded = await store.begin(sid, create=False, owner=saved.owner)
        assert loaded == saved
        assert lease2.epoch == lease.epoch + 1
        assert isinstance(loaded.policy.estimates.verify_s[0], tuple)  # nested tuples, not JSON lists

    run(server.url, body)


def test_tokens_append_across_saves(server):
    sid = new_id()

    async def body(store):
        lease, state = await store.begin(sid, create=True)
        for chunk in [(1, 2, 3), (), (4,), (5, 6)]:
            committed = len(state.tokens)
            state = dataclasses.replace(state, tokens=state.tokens + chunk)
            await store.save(lease, state, appended_from=committed)
        assert (await store.get(sid)).tokens == (1, 2, 3, 4, 5, 6)

    run(server.url, body)
    with redis.Redis.from_url(server.url) as raw:
        token_bytes = raw.get(f"specd:{{{sid}}}:tokens")
    assert token_bytes[:8] == b"\x01\x00\x00\x00\x02\x00\x00\x00"  # little-endian uint32, in order


def test_later_begin_fences_earlier_lease(server):
    sid = new_id()

    async def body(store):
        lease_a, state = await store.begin(sid, create=True, owner="b")
        lease_b, _ = await store.begin(sid, create=False, owner="b")
        with pytest.raises(Fenced):
            await store.save(lease_a, dataclasses.replace(state, tokens=(9,)), appended_from=0)
        await store.save(lease_b, dataclasses.replace(state, tokens=(1,)), appended_from=0)
        assert await store.get(sid) == SessionState(session_id=sid, tokens=(1,), owner="b")

    run(server.url, body)


def test_appended_from_mismatch_writes_nothing(server):
    sid = new_id()
    first = rich_state(sid, (1, 2))

    async def body(store):
        lease, _ = await store.begin(sid, create=True, owner="key-7")
        await store.save(lease, first, appended_from=0)
        for wrong in (0, 1, 3):  # the store holds 2
            with pytest.raises(RuntimeError, match="holds 2 committed tokens"):
                await store.save(lease, dataclasses.replace(first, tokens=(1, 2, 3), owner="x"), wrong)
        assert await store.get(sid) == first

    run(server.url, body)


def test_sessions_expire_after_ttl(server):
    sid = new_id()

    async def body(store):
        lease, state = await store.begin(sid, create=True)
        await store.save(lease, dataclasses.replace(state, tokens=(1, 2)), appended_from=0)
        await asyncio.sleep(1.5)
        assert await store.get(sid) is None
        with pytest.raises(Fenced):  # a save under a lease that outlived its session does not resurrect it
            await store.save(lease, dataclasses.replace(state, tokens=(1, 2, 3)), appended_from=2)
        with pytest.raises(SessionNotFound):
            await store.begin(sid, create=False)

    run(server.url, body, ttl_s=1)
    with redis.Redis.from_url(server.url) as raw:  # both keys expired, not just the one get() reads
        assert raw.exists(f"specd:{{{sid}}}:meta", f"specd:{{{sid}}}:tokens") == 0


def test_delete(server):
    sid = new_id()

    async def body(store):
        lease, state = await store.begin(sid, create=True)
        await store.save(lease, dataclasses.replace(state, tokens=(1,)), appended_from=0)
        assert await store.delete(sid) is True
        assert await store.get(sid) is None
        assert await store.delete(sid) is False

    run(server.url, body)


def test_state_survives_kill9_with_appendonly(tmp_path):
    sid = new_id()
    saved = rich_state(sid, tuple(range(100, 140)))

    async def write(store):
        lease, _ = await store.begin(sid, create=True, owner="key-7")
        await store.save(lease, saved, appended_from=0)

    async def read(store):
        return await store.get(sid)

    with LocalRedis(dir=tmp_path, appendonly=True) as durable:
        run(durable.url, write)
        durable.kill9()  # no shutdown flush: only what appendfsync=always already wrote survives
        durable.start()
        assert run(durable.url, read) == saved


def test_a_replayed_save_is_applied_once(server):
    """A save retried after its reply was lost must not append the tokens twice."""
    sid = new_id()

    async def body(store):
        lease, _ = await store.begin(sid, create=True)
        state = rich_state(sid, (1, 2, 3))
        await store.save(lease, state, appended_from=0)
        await store.save(lease, state, appended_from=0)  # the replay
        return await store.get(sid)

    assert run(server.url, body).tokens == (1, 2, 3)


def test_a_store_rides_out_a_redis_restart_under_one_lease(tmp_path):
    """Redis killed and restarted (AOF) between two saves of one request: the second save waits it out."""
    sid = new_id()
    with LocalRedis(dir=tmp_path, appendonly=True) as durable:

        async def body(store):
            lease, _ = await store.begin(sid, create=True)
            await store.save(lease, rich_state(sid, (1, 2)), appended_from=0)
            durable.kill9()
            restart = asyncio.get_running_loop().run_in_executor(None, durable.start)
            await store.save(lease, rich_state(sid, (1, 2, 3, 4)), appended_from=2)
            await restart
            return await store.get(sid)

        assert run(durable.url, body).tokens == (1, 2, 3, 4)


# Codec alone (no Redis): any field values, including ones hypothesis invents, survive JSON.
@settings(max_examples=200, deadline=None)
@given(st.from_type(SessionState))
def test_codec_round_trips_any_state(state):
    decoded = decode_state(state.session_id, encode_state(state).encode(), b"")
    # repr, not ==: it tells 1 from 1.0 and a tuple from a list, and NaN equals itself in it.
    assert repr(decoded) == repr(dataclasses.replace(state, tokens=()))
    # the encoder writes what dataclasses.asdict would, which states saved by earlier versions hold
    assert repr(to_jsonable(state)) == repr(json.loads(json.dumps(dataclasses.asdict(state))))


def test_codec_ignores_unknown_keys_and_defaults_missing_ones():
    written_by_other_version = {
        "retired": 1, "owner": "k", "policy": {"k": 3, "estimates": {"alpha": 0.5, "gone": 2}},
    }
    state = decode_state("s", json.dumps(written_by_other_version).encode(), b"")
    assert state.owner == "k" and state.policy.k == 3 and state.policy.estimates.alpha == 0.5
    assert state.policy.estimates == dataclasses.replace(Estimates(), alpha=0.5)
    assert state.stats == SessionStats() and state.draft == ServiceCursor()


def test_only_the_key_that_created_a_session_can_take_it_over(server):
    async def body(store):
        sid = new_id()
        lease, state = await store.begin(sid, create=True, owner="alice")
        assert state.owner == "alice"
        for create in (True, False):  # bob neither continues nor re-creates it, even before alice's first save
            with pytest.raises(SessionNotFound):
                await store.begin(sid, create=create, owner="bob")
        await store.save(lease, dataclasses.replace(state, tokens=(1, 2)), appended_from=0)  # alice's lease is intact
        _, again = await store.begin(sid, create=False, owner="alice")
        return again

    assert run(server.url, body).tokens == (1, 2)


def test_a_session_never_saved_is_still_its_owners(server):
    """A first turn that fails before its first save (a model service down, a client gone) leaves
    the session begun: it reads as its owner's, so the owner can retry it or release it."""
    async def body(store):
        sid = new_id()
        await store.begin(sid, create=True, owner="alice")
        return await store.get(sid)

    held = run(server.url, body)
    assert held is not None and held.owner == "alice" and held.tokens == ()

def test_a_session_stored_before_the_owner_field_keeps_its_owner_from_the_state(server):
    async def body(store):
        sid = new_id()
        lease, state = await store.begin(sid, create=True, owner="alice")
        await store.save(lease, dataclasses.replace(state, tokens=(5,)), appended_from=0)
        meta = store._keys(sid)[0]
        await store._redis.hdel(meta, "owner")  # as written by a coordinator without it
        with pytest.raises(SessionNotFound):
            await store.begin(sid, create=True, owner="bob")
        _, kept = await store.begin(sid, create=False, owner="alice")
        return kept

    assert run(server.url, body).tokens == (5,)


def test_racing_owners_cannot_share_a_session(server):
    """Alice and Bob race for one id: each key's ids are its own, so both turns stand, each in its own
    session. Below the frontend, the store's begin checks the owner and takes the lease in one step:
    Bob's begin on Alice's stored session is refused even after his own check saw it free."""
    from types import SimpleNamespace

    from services.coordinator.frontend import Frontend, scoped
    from services.coordinator.requests import Limits
    from specd.loop import Finished, GenerationRequest, Services
    from specd.sampling import SamplingParams
    from specd.stopping import StopRules
    from tests.fakes import FakeDrafter, FakeVerifier, draft_rule, target_rule

    class SlowBegin(RedisSessionStore):
        async def begin(self, session_id, create, owner=""):
            if owner == "bob":
                await alice_done.wait()
            return await super().begin(session_id, create, owner)

    async def turn(frontend, owner, prompt):
        request = GenerationRequest(prompt, StopRules(6, ignore_eos=True), SamplingParams(), fixed_k=2)
        events = [e async for e in frontend.generate(request, sid, owner)]
        if owner == "alice":
            alice_done.set()
        return events[-1]

    async def main():
        store = SlowBegin(server.url)
        services = Services(FakeDrafter(draft_rule(3)), FakeVerifier(target_rule), store)
        frontend = Frontend(services, SimpleNamespace(decode=lambda ids: "", max_context=4096), Limits())
        try:
            bob = asyncio.create_task(turn(frontend, "bob", (9, 9)))
            await asyncio.sleep(0.05)  # bob is past the owner check, waiting to begin
            alice = await turn(frontend, "alice", (1, 2, 3))
            with pytest.raises(SessionNotFound):
                await RedisSessionStore.begin(store, scoped(sid, "alice"), create=True, owner="bob")
            return alice, await bob, await store.get(scoped(sid, "alice")), await store.get(scoped(sid, "bob"))
        finally:
            await store.close()

    sid, alice_done = new_id(), asyncio.Event()
    alice, bob, alices, bobs = asyncio.run(main())  # one id, two keys: two sessions, neither sees the other's
    assert isinstance(alice, Finished) and alices.owner == "alice" and alices.requests == 1
    assert alices.tokens == (1, 2, 3, *alice.token_ids)
    assert isinstance(bob, Finished) and bobs.owner == "bob" and bobs.tokens == (9, 9, *bob.token_ids)


@pytest.mark.slow  # a TLS-built Redis (redis-tools)
def test_a_redis_over_tls_serves_sessions_and_refuses_plaintext_and_strangers(tmp_path, tls_redis_binary):
    from services.common import certs

    certs.make(tmp_path / "tls")
    certs.make(tmp_path / "other")
    with LocalRedis(dir=tmp_path, password="tls-test-pass", tls_dir=tmp_path / "tls", binary=tls_redis_binary) as server:
        assert server.url.startswith("rediss://")

        async def body(store):
            lease, state = await store.begin(new_id(), create=True)
            await store.save(lease, dataclasses.replace(state, tokens=(4, 2)), appended_from=0)
            return await store.get(lease.session_id)

        assert run(server.url, body).tokens == (4, 2)
        with pytest.raises(redis.exceptions.ConnectionError):  # plaintext to the TLS port
            redis.Redis(port=server.port, password="tls-test-pass", socket_timeout=2).ping()
        stranger = server.url.replace(str(tmp_path / "tls"), str(tmp_path / "other"))
        with pytest.raises(redis.exceptions.ConnectionError):  # a server certificate of another CA
            redis.Redis.from_url(stranger, socket_timeout=2).ping()


def test_a_redis_with_a_password_refuses_clients_without_it(tmp_path):
    with LocalRedis(dir=tmp_path, password="s3cret-pass") as protected:
        assert protected.url.startswith("redis://:s3cret-pass@127.0.0.1:")
        assert "s3cret-pass" not in " ".join(protected._proc.args)  # in its 0600 config file, not its argv
        assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=protected.port).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=protected.port, password="wrong").ping()

        async def body(store):
            lease, state = await store.begin(new_id(), create=True)
            await store.save(lease, dataclasses.replace(state, tokens=(1,)), appended_from=0)
            return await store.get(lease.session_id)

        assert run(protected.url, body).tokens == (1,)
        # the coordinator's --redis-password-file: the URL without it, the password beside
        assert run(f"redis://127.0.0.1:{protected.port}/0", body, password="s3cret-pass").tokens == (1,)


def test_specd_up_gives_its_redis_a_password_and_the_coordinator_gets_it_outside_argv(monkeypatch):
    from services import up
    from tests.procs import up_commands

    local = up.local_redis()
    assert local.password and len(local.password) >= 32 and up.local_redis().password != local.password
    commands = up_commands(monkeypatch)
    assert not any("redis://" in arg for command in commands.values() for arg in command)
    assert up.without_password("redis://:pw@127.0.0.1:1/0") == "redis://127.0.0.1:1/0"


def test_each_key_starts_from_its_own_prior_never_anothers(server):
    """One tenant's low-acceptance traffic (its sessions end in plain mode) sets its own new sessions'
    start, not everyone's: another key starts from the deployment's prior (start-up calibration)."""
    deployment = PolicyState(k=5)
    plain = PolicyState(mode=PLAIN, k=1)

    async def body(store):
        await store.remember(deployment)
        await store.remember(plain, owner="mallory")
        return await store.prior("alice"), await store.prior("mallory"), await store.prior()

    alice, mallory, keyless = run(server.url, body, prefix=f"prior-{uuid.uuid4().hex}")
    assert alice == deployment and keyless == deployment and mallory == plain


def test_a_store_that_may_lose_acknowledged_writes_says_why(server, tmp_path):
    """Only appendonly with appendfsync always keeps every write a client was answered for across a
    crash of the store's host: anything else is named, so the coordinator can refuse it."""
    why = run(server.url, lambda store: store.not_durable())
    assert why is not None and "appendonly 'no'" in why
    with LocalRedis(dir=tmp_path, appendonly=True) as durable:
        assert run(durable.url, lambda store: store.not_durable()) is None
        run(durable.url, lambda store: store._redis.config_set("appendfsync", "everysec"))
        assert "appendfsync 'everysec'" in run(durable.url, lambda store: store.not_durable())
