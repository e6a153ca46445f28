"""Per-key quotas at the edge: requests in flight, named sessions held, tokens per minute, requests
per minute.

Counted in Redis, so every coordinator replica draws on one budget per key. A request reserves
its prompt and `max_tokens` against the key's minute when it is admitted and gets back what it did
not generate when it ends. A request in flight holds a lease that its coordinator renews; one
whose coordinator died stops counting when the lease runs out. A refused request gets
QuotaExceeded with the seconds after which a retry may pass (429 + Retry-After at the REST edge,
RESOURCE_EXHAUSTED + retry-after at the gRPC edge). The anonymous owner of an edge without API
keys is not limited: these are per-key quotas.

`knock` is the part that needs nothing but the key: the request rate, and a key whose requests in
flight are at its limit already. The REST edge asks it before it reads a body, so a key over its
limits costs a header and one Redis call, not a mebibyte parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import redis.asyncio as aioredis

from specd.validation import validate_that

LEASE_S = 30.0  # an in-flight request's lease, renewed every third of it
WINDOW_S = 60  # tokens are counted per key per minute

# KEYS: in-flight zset, this minute's token counter, sessions zset. ARGV: now_ms, request id,
# lease_until_ms, max in flight, tokens reserved, tokens per minute, ms left in the minute,
# session id ('' none), session_until_ms, max sessions. Returns {0} (admitted) or {why, retry_after_ms}.
ADMIT_LUA = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local max_in_flight = tonumber(ARGV[4])
if max_in_flight > 0 and redis.call('ZCARD', KEYS[1]) >= max_in_flight then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {1, math.min(1000, tonumber(first[2]) - now)}
end
local cost, per_minute = tonumber(ARGV[5]), tonumber(ARGV[6])
if per_minute > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') + cost > per_minute then
  return {2, tonumber(ARGV[7])}
end
if ARGV[8] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  local max_sessions = tonumber(ARGV[10])
  if max_sessions > 0 and not redis.call('ZSCORE', KEYS[3], ARGV[8]) and redis.call('ZCARD', KEYS[3]) >= max_sessions then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    return {3, tonumber(first[2]) - now}
  end
  redis.call('ZADD', KEYS[3], ARGV[9], ARGV[8])
  redis.call('PEXPIREAT', KEYS[3], ARGV[9])
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
if per_minute > 0 then
  redis.call('INCRBY', KEYS[2], cost)
  redis.call('PEXPIRE', KEYS[2], 2 * 60000)
end
return {0, 0}
"""


# KEYS: in-flight zset, the key's request-rate cell. ARGV: now_ms, max in flight, ms between requests
# (0: no rate), burst tolerance in ms. The rate is GCRA: the cell holds when the key's next request is
# due; a request may come up to the tolerance early. Returns {0} (pass) or {why, retry_after_ms}.
KNOCK_LUA = """
local now = tonumber(ARGV[1])
local max_in_flight = tonumber(ARGV[2])
if max_in_flight > 0 and redis.call('ZCOUNT', KEYS[1], now + 1, '+inf') >= max_in_flight then
  local first = redis.call('ZRANGEBYSCORE', KEYS[1], now + 1, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return {1, math.min(1000, tonumber(first[2]) - now)}
end
local interval, tolerance = tonumber(ARGV[3]), tonumber(ARGV[4])
if interval > 0 then
  local due = math.max(tonumber(redis.call('GET', KEYS[2]) or '0'), now)
  if due - now > tolerance then
    return {4, due - now - tolerance}
  end
  redis.call('SET', KEYS[2], due + interval, 'PX', math.ceil(due + interval - now))
end
return {0, 0}
"""
RATE_BURST_S = 10  # a key may send this many seconds' worth of its request rate at once


@dataclass(frozen=True)
class QuotaLimits:
    """Per API key; 0: unbounded."""

    in_flight: int = 16  # requests at once
    sessions: int = 32  # named sessions held (a model service keeps 64 caches by default)
    tokens_per_minute: int = 0  # prompt + generated tokens
    requests_per_minute: int = 1200  # requests started, in bursts of up to RATE_BURST_S seconds' worth


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))  # whole seconds, as Retry-After carries


class Ticket:
    """An admitted request: it reports the tokens it generated, the rest of its reservation goes back."""

    def __init__(self, reserved: int):
        self.reserved, self.generated = reserved, 0


def owner_tag(owner: str) -> str:
    """A key's short stable name in Redis keys and session scopes (the owner name itself may hold anything)."""
    return hashlib.blake2b(owner.encode(), digest_size=8).hexdigest()


class Quotas:
    def __init__(self, client: aioredis.Redis, limits: QuotaLimits, session_ttl_s: float, prefix: str = "specd"):
        self.limits, self.session_ttl_s, self._prefix = limits, session_ttl_s, prefix
        self._redis = client
        self._admit = client.register_script(ADMIT_LUA)
        self._knock = client.register_script(KNOCK_LUA)

    def _keys(self, owner: str, window: int) -> list[str]:
        return [self._key(owner, "in-flight"), self._key(owner, f"tokens:{window}"), self._key(owner, "sessions")]

    def _key(self, owner: str, name: str) -> str:
        return f"{self._prefix}:quota:{{{owner_tag(owner)}}}:{name}"  # one hash slot per key (Redis Cluster)

    async def knock(self, owner: str) -> None:
        """QuotaExceeded if `owner` is over its request rate, or at its limit of requests in flight."""
        if not owner:
            return
        limits = self.limits
        interval_ms = 60_000 / limits.requests_per_minute if limits.requests_per_minute else 0
        burst = max(1, limits.requests_per_minute * RATE_BURST_S // 60)
        why, retry_ms = await self._knock(keys=[self._key(owner, "in-flight"), self._key(owner, "requests")], args=[
            int(time.time() * 1000), limits.in_flight, interval_ms, interval_ms * (burst - 1)])
        if why:
            raise QuotaExceeded(_refusal(int(why), limits), float(retry_ms) / 1000)

    @contextlib.asynccontextmanager
    async def admit(self, owner: str, prompt_tokens: int, max_tokens: int, session_id: str = "") -> AsyncIterator[Ticket]:
        """Hold a place for one request of `owner` (a named session's id: it counts as held)."""
        if not owner:
            yield Ticket(0)
            return
        limits, reserved = self.limits, prompt_tokens + max_tokens
        validate_that(not limits.tokens_per_minute or reserved <= limits.tokens_per_minute,
                      f"this request may use {reserved} tokens (prompt + max_tokens), more than this key's "
                      f"{limits.tokens_per_minute} per minute: lower max_tokens")
        now = time.time()
        window = int(now // WINDOW_S)
        keys, request_id = self._keys(owner, window), uuid.uuid4().hex
        now_ms = int(now * 1000)
        why, retry_ms = await self._admit(keys=keys, args=[
            now_ms, request_id, now_ms + int(LEASE_S * 1000), limits.in_flight, reserved, limits.tokens_per_minute,
            (window + 1) * WINDOW_S * 1000 - now_ms, session_id, now_ms + int(self.session_ttl_s * 1000),
            limits.sessions])
        if why:
            raise QuotaExceeded(_refusal(int(why), limits), int(retry_ms) / 1000)
        ticket = Ticket(reserved if limits.tokens_per_minute else 0)
        renewing = asyncio.create_task(self._renew(keys[0], request_id))
        try:
            yield ticket
        finally:
            renewing.cancel()
            await self._done(keys, request_id, ticket, same_minute=int(time.time() // WINDOW_S) == window)

    async def _renew(self, in_flight: str, request_id: str) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 3)
            until = int((time.time() + LEASE_S) * 1000)
            await self._redis.zadd(in_flight, {request_id: until}, xx=True)
            await self._redis.pexpireat(in_flight, until)

    async def _done(self, keys: list[str], request_id: str, ticket: Ticket, same_minute: bool) -> None:
        unused = ticket.reserved - ticket.generated
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zrem(keys[0], request_id)
            if ticket.reserved and unused > 0 and same_minute:  # a past minute's count no longer matters
                pipe.decrby(keys[1], unused)
            await pipe.execute()

    async def forget_session(self, owner: str, session_id: str) -> None:
        if owner:
            await self._redis.zrem(self._key(owner, "sessions"), session_id)


def _refusal(why: int, limits: QuotaLimits) -> str:
    return {
        1: f"this API key has {limits.in_flight} requests in flight, its limit: retry when one ends",
        2: f"this API key used its {limits.tokens_per_minute} tokens for this minute (prompt + max_tokens "
           "reserved per request, unused tokens returned)",
        3: f"this API key holds {limits.sessions} sessions, its limit: release one "
           "(DELETE /v1/sessions/{id}) or let one expire",
        4: f"this API key sent more than its {limits.requests_per_minute} requests a minute: slow down",
    }[why]
