"""A model service's pool of replicas as one client. Each session goes to its rendezvous-hashed
replica (services/common/placement.py), so every coordinator picks the same one; a replica that
is down, stopping, or (for a session it does not hold yet) full is passed over for the next in
the session's order. The pool is resolved again while it runs (services/common/discovery.py)
and every replica's load is polled.

Retrying on another replica is safe because every call carries its SyncPoint: a replica that
lacks the prefix says so (StaleSession) and the loop resends it; running a round again gives
the same result.

Certificates: a gRPC channel keeps the credentials it was made with, reconnects included. So when
the coordinator's certificate files change (a rotated set), the next refresh makes every replica a
new channel with them, and the old one closes after its calls in flight. A set that does not load
is logged and the last good credentials kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

import grpc

from specd.contracts import ReplicaLoad, ServiceUnavailable
from services.common import discovery, placement
from services.common.client import timeout
from services.common.convert import LOAD_REQUEST, load_from_proto
from services.common.server import MAX_MESSAGE_BYTES
from services.common.telemetry import client_interceptors
from services.common.tls import TlsFiles, channel_options

S = TypeVar("S")
R = TypeVar("R")
log = logging.getLogger(__name__)

# Reconnect quickly: the default backoff (1 s growing to 120 s) would stall recovery after a restart.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
DOWN_FOR_S = 2.0  # a replica that failed is tried last for this long (or until a poll reaches it)
REFRESH_S = 1.0  # between re-resolving the pool and polling its replicas' load
POLL_TIMEOUT_S = 1.0
# A replica going away: UNAVAILABLE, or CANCELLED for the calls a stopping server had not yet
# handed to a handler (grpc/grpc#41785); a call the client itself cancels raises CancelledError.
GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
CLOSE_GRACE_S = 30.0  # a replica that left the pool keeps its channel this long for calls in flight


@dataclass
class _Replica(Generic[S]):
    address: str
    channel: grpc.aio.Channel
    stub: S
    instance_id: str = ""
    down_until: float = 0.0
    load: ReplicaLoad | None = None  # last polled; None: not yet

    def up(self, now: float) -> bool:
        return self.down_until <= now and not (self.load and self.load.draining)

    def takes(self, instance_id: str) -> bool:
        """Holds the session already, or has room for it."""
        return bool(instance_id) and self.instance_id == instance_id or self.load is None or self.load.has_room


class Replicas(Generic[S]):
    def __init__(
        self,
        name: str,
        source: str | Sequence[str],
        make_stub: Callable[[grpc.aio.Channel], S],
        retry_s: float = 60.0,
        refresh_s: float = REFRESH_S,
        tls: TlsFiles | None = None,
    ):
        """`source`: see discovery.resolver. `retry_s`: how long a call waits for some replica to answer.
        `tls`: the coordinator's certificate; every replica must present its role's (`name`'s)."""
        self.name, self.retry_s, self.refresh_s = name, retry_s, refresh_s
        self._tls = tls
        self._seen = tls.signature() if tls else None  # before reading: a change meanwhile is read again
        self._credentials = tls.channel_credentials() if tls else None
        self.resolver = discovery.resolver(source)
        self._make_stub = make_stub
        self._interceptors = client_interceptors()  # propagate the caller's trace context to the service
        self._replicas: dict[str, _Replica[S]] = {}
        self._tasks: set[asyncio.Task] = set()  # the refresher, channels closing
        self._refresher: asyncio.Task | None = None
        if isinstance(self.resolver, discovery.Static):
            self._update(self.resolver.addresses)

    @property
    def addresses(self) -> list[str]:
        return list(self._replicas)

    async def start(self) -> None:
        """Resolve the pool (when not yet) and keep it fresh in the background; calls do this first."""
        if self._refresher is None:
            self._refresher = self._spawn(self._refresh_forever())
            if not self._replicas:
                try:
                    await self._resolve()
                except Exception as error:  # calls wait (up to retry_s) for the refresher to find some
                    log.warning("%s pool: %s", self.name, error)

    async def call(self, instance_id: str, session_id: str, rpc: Callable[[S], Awaitable[R]]) -> R:
        """Run `rpc` on the session's replica; when it is GONE try the next in its order, then wait
        and retry until `retry_s` (or the client's deadline) has passed."""
        await self.start()
        deadline = time.monotonic() + timeout(self.retry_s)
        delay, last_error = 0.05, None
        while True:
            for replica in self._order(instance_id, session_id):
                try:
                    reply = await rpc(replica.stub)
                except grpc.aio.AioRpcError as error:
                    if error.code() not in GONE:
                        raise
                    replica.down_until, last_error = time.monotonic() + DOWN_FOR_S, error
                    continue
                replica.instance_id, replica.down_until = reply.instance_id, 0.0
                return reply
            if time.monotonic() + delay > deadline:
                why = f"{last_error.details()}" if last_error else "the pool is empty"
                raise ServiceUnavailable(f"no {self.name} replica answered within {self.retry_s:g}s: {why}")
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _order(self, instance_id: str, session_id: str) -> list[_Replica[S]]:
        """The session's rendezvous order, those up and taking it first (a stable sort keeps the order within)."""
        now = time.monotonic()
        ranked = [self._replicas[a] for a in placement.rank(session_id, self._replicas)]
        return sorted(ranked, key=lambda r: (not r.up(now), not r.takes(instance_id)))

    async def broadcast(self, rpc: Callable[[S], Awaitable[R]]) -> list[R | BaseException]:
        """Best effort on every replica (releasing a session: any of them may hold a copy): each
        one's reply or error, in the order of `addresses`."""
        await self.start()
        return await asyncio.gather(*(rpc(r.stub) for r in self._replicas.values()), return_exceptions=True)

    async def probe(self) -> bool:
        """Ask every replica now: does any of them take calls?"""
        await self.start()
        await self.refresh()
        now = time.monotonic()
        return any(r.up(now) for r in self._replicas.values())

    async def refresh(self) -> None:
        self._renew_credentials()
        if self.resolver.dynamic:
            await self._resolve()
        await asyncio.gather(*(self._poll(r) for r in list(self._replicas.values())))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception as error:  # a name that does not resolve now may later: keep the last pool
                log.warning("%s pool: %s", self.name, error)

    async def _resolve(self) -> None:
        addresses = await self.resolver.resolve()
        if not addresses:
            raise ServiceUnavailable(f"the {self.name} pool resolved to no address")
        self._update(addresses)

    async def _poll(self, replica: _Replica[S]) -> None:
        try:
            load = load_from_proto(await replica.stub.GetLoad(LOAD_REQUEST, timeout=POLL_TIMEOUT_S))
        except grpc.aio.AioRpcError as error:
            if error.code() in GONE:
                replica.down_until = max(replica.down_until, time.monotonic() + DOWN_FOR_S)
            return
        replica.load, replica.instance_id, replica.down_until = load, load.instance_id, 0.0

    def _update(self, addresses: Sequence[str]) -> None:
        added = [a for a in addresses if a not in self._replicas]
        gone = [a for a in self._replicas if a not in addresses]
        for address in added:
            channel = self._channel(address)
            self._replicas[address] = _Replica(address, channel, self._make_stub(channel))
        for address in gone:
            self._spawn(self._replicas.pop(address).channel.close(CLOSE_GRACE_S))
        if self._tasks and (added or gone):  # not at construction
            log.info("%s pool: %d replicas (added %s, gone %s)", self.name, len(self._replicas), added, gone)

    def _renew_credentials(self) -> None:
        """The certificate files changed: new credentials, and a new channel for every replica."""
        if self._tls is None or (seen := self._tls.signature()) == self._seen:
            return
        self._seen = seen  # a bad set is reported once, and read again when the files change again
        try:
            self._credentials = self._tls.channel_credentials()
        except ValueError as error:
            log.error("%s pool: %s; keeping the previous certificate", self.name, error)
            return
        for replica in self._replicas.values():
            old = replica.channel
            replica.channel = self._channel(replica.address)
            replica.stub = self._make_stub(replica.channel)
            self._spawn(old.close(CLOSE_GRACE_S))
        log.info("%s pool: certificates in %s changed: new channels to %d replicas", self.name, self._tls.directory,
                 len(self._replicas))

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=self._interceptors)
        return grpc.aio.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS + channel_options(self.name),
                                       interceptors=self._interceptors)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for task in list(self._tasks):
            if task is self._refresher:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.channel.close() for r in self._replicas.values()))
