"""Placement and discovery of model-service replicas, without servers: rendezvous hashing's
properties, the resolvers, and the order a pool tries its replicas in."""

from __future__ import annotations

import asyncio
import time

import pytest

from specd.contracts import ReplicaLoad
from services.common import discovery, placement
from services.common.replicas import Replicas

SESSIONS = [f"session-{i}" for i in range(10_000)]


def owners(addresses: list[str]) -> dict[str, str]:
    return {s: placement.rank(s, addresses)[0] for s in SESSIONS}


def test_adding_a_replica_moves_about_one_in_n_plus_one_sessions_and_only_to_it():
    three = [f"10.0.0.{i}:50053" for i in (1, 2, 3)]
    before, after = owners(three), owners([*three, "10.0.0.4:50053"])
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert all(after[s] == "10.0.0.4:50053" for s in moved)
    assert 0.22 < len(moved) / len(SESSIONS) < 0.28  # 1/4 expected
    counts = {a: list(after.values()).count(a) for a in set(after.values())}
    assert max(counts.values()) / min(counts.values()) < 1.15  # spread evenly


def test_losing_a_replica_moves_only_its_own_sessions():
    four = [f"10.0.0.{i}:50053" for i in (1, 2, 3, 4)]
    before, after = owners(four), owners(four[:2] + four[3:])
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == four[2]}


def test_the_order_is_the_same_whatever_order_the_addresses_come_in():
    addresses = [f"10.0.0.{i}:1" for i in range(6)]
    assert placement.rank("abc", addresses) == placement.rank("abc", list(reversed(addresses)))


@pytest.mark.parametrize("spec, kind", [("a:1,b:2", discovery.Static), ("dns:///target.svc:50053", discovery.Dns),
                                        ("file:///tmp/x", discovery.AddressFile)])
def test_a_pool_is_a_list_a_dns_name_or_a_file(spec, kind):
    assert isinstance(discovery.resolver(spec), kind)


@pytest.mark.parametrize("spec", ["", "host", "host:", "host:99999", ":50", "dns:///nohost", "a:1,b"])
def test_bad_pools_are_refused_with_a_message(spec):
    with pytest.raises(ValueError, match="host:port|at least one"):
        discovery.resolver(spec)


def test_dns_resolves_every_address_of_a_name():
    addresses = asyncio.run(discovery.Dns("localhost:50053").resolve())
    assert "127.0.0.1:50053" in addresses and all(a.endswith(":50053") for a in addresses)


def test_an_address_file_is_read_again_on_every_resolve(tmp_path):
    path = tmp_path / "targets"
    path.write_text("127.0.0.1:1\n# a comment\n\n127.0.0.1:2  # inline\n")
    pool = discovery.resolver(f"file://{path}")
    assert asyncio.run(pool.resolve()) == ["127.0.0.1:1", "127.0.0.1:2"]
    path.write_text("127.0.0.1:3\n")
    assert asyncio.run(pool.resolve()) == ["127.0.0.1:3"]


def test_a_pool_passes_over_replicas_that_are_down_stopping_or_full_for_new_sessions():
    async def orders():
        pool = Replicas("target", [f"127.0.0.1:{p}" for p in (1, 2, 3)], stub_of)
        ranked = placement.rank("s", pool.addresses)
        first, second, third = (pool._replicas[a] for a in ranked)
        plain = [r.address for r in pool._order("", "s")]
        first.load = ReplicaLoad("i1", sessions=64, max_sessions=64, queued=0, max_batch=8)  # full
        first.instance_id = "i1"
        full_new = [r.address for r in pool._order("", "s")]
        full_held = [r.address for r in pool._order("i1", "s")]  # it holds the session: stays
        second.down_until = time.monotonic() + 5
        down = [r.address for r in pool._order("", "s")]
        third.load = ReplicaLoad("i3", 0, 64, 0, 8, draining=True)
        draining = [r.address for r in pool._order("", "s")]
        await pool.close()
        return ranked, plain, full_new, full_held, down, draining

    ranked, plain, full_new, full_held, down, draining = asyncio.run(orders())
    a, b, c = ranked
    assert plain == [a, b, c]
    assert full_new == [b, c, a] and full_held == [a, b, c]
    assert down == [c, a, b]  # the full one before the one that failed
    assert draining == [a, b, c]  # none suits: the full one is at least up, the stopping one last


def stub_of(channel):
    return channel


def test_a_call_the_replica_cancelled_while_stopping_goes_on_to_the_next():
    """grpc-core cancels the calls it had not yet handed to a handler when a server stops
    (grpc/grpc#41785): the client reads CANCELLED, not UNAVAILABLE, from a replica going away."""
    import grpc

    async def run():
        pool = Replicas("target", [f"127.0.0.1:{p}" for p in (1, 2)], stub_of, retry_s=1.0)
        first, second = placement.rank("s", pool.addresses)
        tried = []

        async def rpc(channel):
            address = next(a for a, r in pool._replicas.items() if r.stub is channel)
            tried.append(address)
            if address == first:
                raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="Server Shutdown")
            return ReplicaLoad("i2", 0, 64, 0, 8)

        try:
            return await pool.call("", "s", rpc), tried, first, second
        finally:
            await pool.close()

    reply, tried, first, second = asyncio.run(run())
    assert reply.instance_id == "i2" and tried == [first, second]
