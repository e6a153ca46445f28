"""Short requests first (specd/priority.py): a request past `after_tokens` waits before each round
while shorter requests are in flight, never longer than `max_wait_s`, and never for its output."""

from __future__ import annotations

import asyncio
import time

import pytest

from specd.loop import Finished, Services, generate
from specd.priority import Background, RoundGate
from tests.fakes import FakeDrafter, FakeStore, FakeVerifier, draft_rule, target_alone, target_rule
from tests.test_loop import PROMPT, decode, request


async def waited_s(gate: RoundGate, generated: int) -> float:
    with gate.request() as priority:
        start = time.monotonic()
        await priority.before_round(generated)
        return time.monotonic() - start


def test_a_long_request_waits_while_a_short_one_is_in_flight_at_most_max_wait():
    async def scenario():
        gate = RoundGate(Background(after_tokens=100, max_wait_s=0.2))
        assert await waited_s(gate, 500) < 0.05  # alone: at once
        with gate.request():  # a short request in flight
            assert await waited_s(gate, 99) < 0.05  # short itself: at once
            assert 0.2 <= await waited_s(gate, 100) < 0.4  # long: until max_wait
        assert gate.short == 0 and gate.deferred == 1

    asyncio.run(scenario())


def test_a_long_request_goes_on_as_soon_as_the_short_ones_end():
    async def scenario():
        gate = RoundGate(Background(after_tokens=10, max_wait_s=5))

        async def short_request():
            with gate.request():
                await asyncio.sleep(0.1)

        short = asyncio.ensure_future(short_request())
        await asyncio.sleep(0)
        waited = await waited_s(gate, 10)
        await short
        assert 0.08 <= waited < 1

    asyncio.run(scenario())


def test_off_by_default_and_counts_come_back_after_a_failed_request():
    async def scenario():
        gate = RoundGate()
        with gate.request():
            assert await waited_s(gate, 10**6) < 0.05  # off: nothing waits
        strict = RoundGate(Background(after_tokens=1, max_wait_s=1))
        with pytest.raises(RuntimeError), strict.request():
            raise RuntimeError("the request failed")
        assert strict.short == 0 and await waited_s(strict, 5) < 0.05

    asyncio.run(scenario())


@pytest.mark.parametrize("after_tokens", [0, 1, 8])
def test_a_deferred_request_gets_the_target_alones_tokens(after_tokens):
    gate = RoundGate(Background(after_tokens, max_wait_s=0.01))
    services = Services(FakeDrafter(draft_rule(3)), FakeVerifier(target_rule), FakeStore(), gate=gate)

    async def scenario():
        with gate.request():  # a short request in flight the whole time
            return [e async for e in generate(request(max_tokens=40, k=3), "s1", services, decode)]

    done = asyncio.run(scenario())[-1]
    assert isinstance(done, Finished) and list(done.token_ids) == target_alone(PROMPT, 40)
    assert (gate.deferred > 0) == bool(after_tokens)
