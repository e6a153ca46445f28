"""Real gRPC servers on loopback for integration tests.

Draft, target and coordinator servers run in one background thread's event loop (the
same servicers `python -m services.*` runs), each on a free 127.0.0.1 port; tests talk
to them with ordinary gRPC clients, and may inspect the engines directly.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc

from specd.loop import Services
from specd.model_free import SuffixDrafter
from specd.engine import EngineConfig
from services.common.server import start_server
from services.coordinator import server as coordinator_server
from services.coordinator.auth import ApiKeys
from services.coordinator.gateway import MAX_BODY_BYTES, HttpServer, create_app
from services.coordinator.requests import Limits
from services.coordinator.frontend import Frontend
from services.coordinator.model_info import load_model_info
from services.coordinator.quotas import QuotaLimits, Quotas
from services.coordinator.store import RedisSessionStore
from services.draft import server as draft_server
from services.draft.client import GrpcDrafter
from services.protogen.specd.v1 import coordinator_pb2_grpc
from services.target import server as target_server
from services.target.client import GrpcVerifier


MODEL_NAME = "tiny-target"  # the id the REST gateway serves


class Cluster:
    def __init__(
        self,
        draft_dir: Path | None,  # None: no draft model (the coordinator's --draft-addr none)
        target_dir: Path,
        redis_url: str,
        dtype: str = "float64",
        limits: Limits = Limits(),
        keys: ApiKeys = ApiKeys.open(),
        audit_rate: float = 0.0,  # the coordinator's lossless audit (specd/audit.py): off unless a test asks
        draft_quantize: str = "none",
        target_quantize: str = "none",
        quotas: QuotaLimits | None = None,  # per-key quotas (the coordinator's flags), off unless a test asks
        model_free: bool = True,  # the coordinator's --model-free (on by default, as there)
        target_wait_s: float | None = None,  # how long a call waits for a target replica (the client's default)
    ):
        self.redis_url, self.keys, self.audit_rate, self.quota_limits = redis_url, keys, audit_rate, quotas
        self.model_free, self.target_wait_s = model_free, target_wait_s
        self.draft = draft_dir and draft_server.DraftServicer.load(
            EngineConfig(draft_dir, dtype=dtype, quantize=draft_quantize), "draft"
        )
        self.target = target_server.TargetServicer.load(
            EngineConfig(target_dir, dtype=dtype, quantize=target_quantize), "target"
        )
        self.draft_engine, self.target_engine = self.draft and self.draft.engine, self.target.engine
        self.model = load_model_info(target_dir)
        self.limits = limits
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ports: dict[str, int] = self._run(self._start())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    async def _start(self) -> dict[str, int]:
        self.servers = []
        ports = {}
        roles = (("draft", self.draft and draft_server.register(self.draft)),
                 ("target", target_server.register(self.target)))
        for role, register in roles:
            if register:
                server, ports[role] = await start_server(register, "127.0.0.1:0")
                self.servers.append(server)
        verifier = GrpcVerifier([f"127.0.0.1:{ports['target']}"],
                                **({"retry_s": self.target_wait_s} if self.target_wait_s else {}))
        self.services = Services(
            GrpcDrafter([f"127.0.0.1:{ports['draft']}"]) if self.draft else None,
            verifier,
            RedisSessionStore(self.redis_url),
            model_free=SuffixDrafter() if self.model_free else None,
            decoder=verifier,
        )
        quotas = self.quota_limits and Quotas(self.services.store.client, self.quota_limits, session_ttl_s=3600)
        self.frontend = Frontend(self.services, self.model, self.limits, self.audit_rate, quotas)
        self.coordinator_servicer = coordinator_server.CoordinatorServicer(self.frontend, self.keys)
        register = coordinator_server.register(self.coordinator_servicer)
        server, ports["coordinator"] = await start_server(register, "127.0.0.1:0", max_message_bytes=MAX_BODY_BYTES)
        self.servers.append(server)
        app = create_app(self.frontend, self.keys, MODEL_NAME)
        self.http, ports["http"] = await HttpServer.start(app, "127.0.0.1", 0)
        return ports

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.ports[role]}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    def coordinator(self, channel: grpc.Channel) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(channel)

    def close(self) -> None:
        async def stop():
            await self.frontend.auditor.close()
            await self.http.stop()
            for server in self.servers:
                await server.stop(1.0)
            if self.services.drafter:
                await self.services.drafter.replicas.close()
            await self.services.verifier.replicas.close()
            await self.services.store.close()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if self.draft:
            self.draft.close()
        self.target.close()
