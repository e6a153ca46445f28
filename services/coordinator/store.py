"""`SessionStore` on Redis: the coordinator keeps no session in memory, so any replica can serve any turn.

Two keys per session, hash-tagged on the session id so a Redis Cluster keeps them on one slot
(the Lua scripts touch both):
  {prefix}:{<id>}:meta    hash: epoch (the lease's fencing token), owner (the key that created it),
                          state (JSON of SessionState minus tokens)
  {prefix}:{<id>}:tokens  string: committed token ids as little-endian uint32, append-only
Each `begin` and `save` is one Lua script, so a save is all-or-nothing and checked against the epoch.
{prefix}:policy-prior holds the deployment's policy (start-up calibration, or the keyless owner's
latest finished session) and {prefix}:policy-prior:<key's tag> each key's own latest: a key's new
sessions start from its own, else the deployment's (`specd.policy.inherit`).
Redis errors other than fencing and a length mismatch propagate; the coordinator maps them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
import types
import typing

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from specd.policy import PolicyState
from specd.session import Fenced, Lease, SessionNotFound, SessionState
from services.coordinator.quotas import owner_tag

# KEYS: meta, tokens. ARGV: create ("1"/"0"), ttl_ms, owner. Returns nil (unknown id, or another
# owner's: the same answer, so an id is no oracle) or {epoch, state, tokens}. The owner is checked and
# the lease taken in one step: two keys racing for one id cannot both get it. (A session stored
# before the owner field existed has its owner in the state JSON.)
BEGIN_LUA = """
local created = redis.call('EXISTS', KEYS[1]) == 0
if created and ARGV[1] == '0' then return false end
if created then
  redis.call('DEL', KEYS[2])  -- tokens outliving their meta are no session's
  redis.call('HSET', KEYS[1], 'owner', ARGV[3])
else
  local owner = redis.call('HGET', KEYS[1], 'owner')
  if not owner then
    local state = redis.call('HGET', KEYS[1], 'state')
    owner = (state and state ~= '') and cjson.decode(state)['owner'] or ARGV[3]
  end
  if owner ~= ARGV[3] then return false end
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {epoch, redis.call('HGET', KEYS[1], 'state') or '', redis.call('GET', KEYS[2]) or ''}
"""

# KEYS: meta, tokens. ARGV: epoch, bytes already held, new token bytes, state JSON, ttl_ms.
# Both checks come before any write, so a refused save changes nothing. A session that expired or was
# deleted under the lease has no epoch, so its writer is fenced too (a save never resurrects it).
# A save retried after a lost reply finds its tokens already appended: under one lease nobody else
# writes, so it only rewrites the state (the client retries on connection errors).
SAVE_LUA = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return redis.error_reply('FENCED') end
local held = redis.call('STRLEN', KEYS[2])
local replayed = held == tonumber(ARGV[2]) + string.len(ARGV[3])
if held ~= tonumber(ARGV[2]) and not replayed then return redis.error_reply('LENGTH ' .. held) end
if not replayed then redis.call('APPEND', KEYS[2], ARGV[3]) end
redis.call('HSET', KEYS[1], 'state', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 1
"""

TOKEN_BYTES = 4
# Ride out a Redis restart (an AOF reload takes about a second) instead of failing the request.
RETRY = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=25)


class RedisSessionStore:
    def __init__(self, url: str, ttl_s: float = 3600, prefix: str = "specd", password: str | None = None):
        """`password`: Redis AUTH, when it is not in the URL (`redis://:password@host:port/db`)."""
        auth = {"password": password} if password else {}
        self._redis = aioredis.from_url(url, retry=RETRY, retry_on_error=[ConnectionError, TimeoutError], **auth)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._prefix = prefix
        self._begin = self._redis.register_script(BEGIN_LUA)
        self._save = self._redis.register_script(SAVE_LUA)

    @property
    def client(self) -> aioredis.Redis:
        """Its connection pool, which the key quotas share (services/coordinator/quotas.py)."""
        return self._redis

    def _keys(self, session_id: str) -> list[str]:
        base = f"{self._prefix}:{{{session_id}}}"
        return [f"{base}:meta", f"{base}:tokens"]

    async def begin(self, session_id: str, create: bool, owner: str = "") -> tuple[Lease, SessionState]:
        args = ["1" if create else "0", self._ttl_ms, owner]
        reply = await self._begin(keys=self._keys(session_id), args=args)
        if reply is None:
            raise SessionNotFound(session_id)
        epoch, state_json, token_bytes = reply
        state = decode_state(session_id, state_json, token_bytes)
        return Lease(session_id, int(epoch)), dataclasses.replace(state, owner=owner)  # checked by the script

    async def save(self, lease: Lease, state: SessionState, appended_from: int) -> None:
        args = [lease.epoch, TOKEN_BYTES * appended_from, pack_tokens(state.tokens[appended_from:]),
                encode_state(state), self._ttl_ms]
        try:
            await self._save(keys=self._keys(lease.session_id), args=args)
        except ResponseError as e:
            if str(e).startswith("FENCED"):
                raise Fenced(f"session {lease.session_id!r}: epoch {lease.epoch} is no longer current") from e
            if str(e).startswith("LENGTH"):
                held = int(str(e).split()[1]) // TOKEN_BYTES
                raise RuntimeError(f"session {lease.session_id!r}: store holds {held} committed tokens, "
                                   f"caller says {appended_from}; nothing written") from e
            raise

    async def not_durable(self) -> str | None:
        """Why a Redis crash could lose a save this store acknowledged (and so tokens a client
        received), or None: it must append every write to its AOF and fsync it before replying."""
        try:
            config = {**await self._redis.config_get("appendonly"), **await self._redis.config_get("appendfsync")}
        except ResponseError as error:  # CONFIG renamed or not allowed (managed Redis)
            return f"cannot read its persistence settings ({error})"
        except (ConnectionError, TimeoutError) as error:
            return f"unreachable ({error})"
        config = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                  for k, v in config.items()}
        if config.get("appendonly") != "yes" or config.get("appendfsync") != "always":
            return (f"appendonly {config.get('appendonly')!r}, appendfsync {config.get('appendfsync')!r}: a crash "
                    "loses the writes not yet fsynced (appendonly yes and appendfsync always lose none)")
        return None

    async def delete(self, session_id: str) -> bool:
        return await self._redis.delete(*self._keys(session_id)) > 0

    async def get(self, session_id: str) -> SessionState | None:
        """Read without taking a lease (no epoch bump): for inspection and tests."""
        meta, tokens = self._keys(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            exists, state_json, owner, token_bytes = await (
                pipe.exists(meta).hget(meta, "state").hget(meta, "owner").get(tokens).execute())
        if not exists:
            return None
        state = decode_state(session_id, state_json or b"", token_bytes or b"")
        # `begin` writes the owner before any save: a session whose first turn failed is still its owner's
        return dataclasses.replace(state, owner=owner.decode()) if owner is not None else state

    def _prior_key(self, owner: str) -> str:
        return f"{self._prefix}:policy-prior" + (f":{owner_tag(owner)}" if owner else "")

    async def prior(self, owner: str = "") -> PolicyState | None:
        raws = await self._redis.mget([self._prior_key(owner), self._prior_key("")])
        raw = next((r for r in raws if r), None)
        return from_jsonable(PolicyState, json.loads(raw)) if raw else None

    async def remember(self, policy: PolicyState, owner: str = "") -> None:
        # a key's prior lives as long as its sessions would; the deployment's stays
        expiry = {"px": self._ttl_ms} if owner else {}
        await self._redis.set(self._prior_key(owner), json.dumps(to_jsonable(policy)), **expiry)

    async def close(self) -> None:
        await self._redis.aclose()


def pack_tokens(tokens: typing.Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // TOKEN_BYTES}I", data)


def encode_state(state: SessionState) -> str:
    # Tokens live in their own key; blank them rather than copy them into the JSON.
    fields = to_jsonable(dataclasses.replace(state, tokens=()))
    del fields["tokens"]
    return json.dumps(fields)


def to_jsonable(value: typing.Any) -> typing.Any:
    """What dataclasses.asdict makes of a value, for JSON and `from_jsonable`, without asdict's deep
    copies: every round's save encodes the session's state (0.19 → 0.11 ms for a policy learnt under load)."""
    if hasattr(type(value), "__dataclass_fields__"):
        return {name: to_jsonable(getattr(value, name)) for name in _field_names(type(value))}
    if isinstance(value, (tuple, list)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    return value


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def decode_state(session_id: str, state_json: bytes, token_bytes: bytes) -> SessionState:
    """A session created by `begin` but never saved has no state yet: it is a fresh one."""
    fields = json.loads(state_json) if state_json else {}
    state = from_jsonable(SessionState, fields | {"session_id": session_id})
    return dataclasses.replace(state, tokens=unpack_tokens(token_bytes))


@functools.cache
def _hints(cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def from_jsonable(tp: typing.Any, value: typing.Any) -> typing.Any:
    """Rebuild `tp` from what `to_jsonable` + JSON made of it: nested dataclasses and tuples come back
    from dicts and lists. Unknown keys are dropped and missing ones take their defaults, so a state written
    by another version of specd still loads."""
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        return tp(**{k: from_jsonable(hints[k], v) for k, v in value.items() if k in names})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
            return tuple(from_jsonable(args[0], v) for v in value)
        return tuple(from_jsonable(a, v) for a, v in zip(args, value))
    if origin in (typing.Union, types.UnionType) and value is not None:  # X | None: decode as X
        return from_jsonable(next(a for a in args if a is not type(None)), value)
    return value  # str, int, float, bool, None
