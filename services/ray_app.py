"""specd as a Ray Serve application: draft and target model deployments and an ingress that is
the coordinator with its OpenAI-compatible REST gateway, for when one host or one set of
Deployments is not enough. The loop, the sessions in Redis, the gateway and the model work
are the ones the gRPC services run; only the transport between coordinator and models is
Ray's (deployment handles) instead of gRPC.

    serve run services.ray_app:build_app target_model=... draft_model=... redis_url=...
    specd serve-ray            # the same on a local Ray with the fetched pair and a local Redis

Arguments (all strings, as `serve run` passes them): target_model, draft_model (a GGUF file or an
HF model directory; the old names target_model_dir, draft_model_dir still work), redis_url (required); device (cpu), {draft,target,gateway}_cpus (1, 1, 0),
draft_gpus / target_gpus (0), draft_replicas /
target_replicas / gateway_replicas (1, or "auto" for autoscaling 1..max_replicas),
max_replicas (4), draft_quantize / target_quantize (none; see services/common/settings.py), dtype (float32),
draft_head_vocab (a GGUF draft's output layer: the ids it scores, as the draft service's --head-vocab),
api_keys_file, coordinator_flags (any flags of `python -m services.coordinator`, e.g.
"--default-k 4 --max-k 8": the ingress is built by the same code, services/coordinator/root.py).

Sessions: each call of a session goes to the model replica its id ranks first by rendezvous
hashing (`SessionRouter`, as the gRPC pools place sessions), so a session stays with the
replica that holds its cache; a replica that is gone or full moves only its own sessions (the
loop resends them the committed tokens from Redis).
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from fastapi import FastAPI
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specd.contracts import DraftReply, EngineInfo, ProposeRequest, StaleSession, VerifyReply, VerifyRequest
from specd.engine import EngineConfig, PositionMismatch
from services.common import placement, settings
from services.common.model_service import ModelServicer
from services.draft.server import DraftServicer
from services.target.server import TargetServicer
from services.coordinator import root
from services.coordinator.gateway import create_app

log = logging.getLogger(__name__)


T = TypeVar("T")


@dataclass(frozen=True)
class _Stale:
    """A replica that does not hold the claimed prefix (the loop's StaleSession, as a value)."""

    position: int


class _ModelDeployment:
    """A model engine behind one worker thread: the gRPC model services' servicer, minus gRPC."""

    def __init__(self, servicer: ModelServicer):
        self.servicer = servicer
        self.engine = servicer.engine

    async def release(self, session_id: str) -> None:
        await self.servicer.worker.run(self.servicer.release_session, session_id)

    def engine_info(self) -> EngineInfo:
        return self.servicer.engine_info()


async def _or_stale(reply: Awaitable[T]) -> T | _Stale:
    """The reply, or _Stale: the loop then resends the session (a value rather than an exception
    across Ray, as FAILED_PRECONDITION is across gRPC)."""
    try:
        return await reply
    except PositionMismatch as mismatch:
        return _Stale(mismatch.position)


class SessionRouter(RequestRouter):
    """Each call goes to the replica its session id ranks first by rendezvous hashing (the next
    ones if that is full); calls without a session go to any replica."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        session_id = _session_of(pending_request)
        if session_id is None:
            return [candidate_replicas]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        return [[by_id[unique_id]] for unique_id in placement.rank(session_id, by_id)]


def _session_of(pending: PendingRequest | None) -> str | None:
    """A model call's session: its request's id (propose, verify) or the id itself (release)."""
    first = pending.args[0] if pending is not None and pending.args else None
    return first if isinstance(first, str) else getattr(first, "session_id", None)


SESSION_ROUTED = {"request_router_config": RequestRouterConfig(request_router_class=SessionRouter)}


@serve.deployment(name="draft", **SESSION_ROUTED)
class DraftDeployment(_ModelDeployment):
    def __init__(self, config: EngineConfig):
        super().__init__(DraftServicer.load(config, "draft"))

    async def propose(self, request: ProposeRequest) -> DraftReply | _Stale:
        return await _or_stale(self.servicer.propose(request))


@serve.deployment(name="target", **SESSION_ROUTED)
class TargetDeployment(_ModelDeployment):
    def __init__(self, config: EngineConfig):
        super().__init__(TargetServicer.load(config, "target"))

    async def verify(self, request: VerifyRequest) -> VerifyReply | _Stale:
        return await _or_stale(self.servicer.verify(request))


class _Handle:
    """The loop's Drafter / Verifier over a deployment handle."""

    def __init__(self, handle: DeploymentHandle, method: str):
        self._handle, self._method = handle, method

    async def _call(self, request):
        reply = await getattr(self._handle, self._method).remote(request)
        if isinstance(reply, _Stale):
            raise StaleSession(reply.position)
        return reply

    async def release(self, session_id: str) -> None:
        await self._handle.release.remote(session_id)

    async def engines(self) -> list[EngineInfo | BaseException]:
        """What the replica Ray routes this call to runs (the gRPC clients ask each replica)."""
        try:
            return [await self._handle.engine_info.remote()]
        except Exception as error:
            return [error]


class RayDrafter(_Handle):
    def __init__(self, handle: DeploymentHandle):
        super().__init__(handle, "propose")

    async def propose(self, request: ProposeRequest) -> DraftReply:
        return await self._call(request)

    async def probe(self) -> bool:
        await self._handle.engine_info.remote()
        return True


class RayVerifier(_Handle):
    def __init__(self, handle: DeploymentHandle):
        super().__init__(handle, "verify")

    async def verify(self, request: VerifyRequest) -> VerifyReply:
        return await self._call(request)


@serve.deployment(name="gateway")
@serve.ingress()
class GatewayDeployment:
    """The coordinator: the transport-free loop over the two deployments, sessions in Redis,
    served through the same FastAPI gateway as `python -m services.coordinator`."""

    def __init__(self, draft: DeploymentHandle, target: DeploymentHandle, argv: list[str]):
        self.draft, self.target, self.argv = draft, target, argv

    def __serve_build_asgi_app__(self) -> FastAPI:
        args = root.parse(self.argv)
        frontend = root.build(args, RayDrafter(self.draft), RayVerifier(self.target))
        app = create_app(frontend, root.api_keys(args), root.served_model_name(args), args.max_body_bytes)
        starting: set[asyncio.Task] = set()

        async def start_up() -> None:  # in the background: requests are served meanwhile
            task = asyncio.create_task(root.start_up(frontend, args.calibrate == "on"))
            task.add_done_callback(_report_start_up)
            starting.add(task)

        app.router.on_startup.append(start_up)
        return app


def _report_start_up(task: asyncio.Task) -> None:
    """A failed start-up (a draft whose vocabulary is not the target's) is logged as an error."""
    if not task.cancelled() and task.exception() is not None:
        log.error("start-up: %s", task.exception())


REQUIRED_ARGS = ("target_model", "draft_model", "redis_url")
OLD_NAMES = {"target_model_dir": "target_model", "draft_model_dir": "draft_model"}
ARGS = frozenset({
    *REQUIRED_ARGS, "device", "dtype", "draft_quantize", "target_quantize", "draft_head_vocab", "api_keys_file",
    "coordinator_flags",
    "max_replicas",
    *(f"{role}_{what}" for role in ("draft", "target", "gateway") for what in ("cpus", "gpus", "replicas")),
})


def build_app(args: dict[str, str]):
    """The application builder `serve run services.ray_app:build_app key=value ...` calls."""
    args = {OLD_NAMES.get(key, key): value for key, value in args.items()}
    if unknown := set(args) - ARGS:
        raise ValueError(f"unknown arguments {sorted(unknown)}; known: {sorted(ARGS)}")
    for required in REQUIRED_ARGS:
        if not args.get(required):
            raise ValueError(f"{required}=... is required")
    device, dtype = args.get("device", "cpu"), args.get("dtype", "float32")
    draft_config, target_config = (
        EngineConfig(Path(args[f"{role}_model"]), device=device, dtype=dtype,
                     quantize=settings.check_quantize(role, args.get(f"{role}_quantize", settings.SERVICE_QUANTIZE)),
                     head_vocab=settings.check_head_vocab(int(args.get("draft_head_vocab", settings.DRAFT_HEAD_VOCAB)))
                     if role == "draft" else 0)
        for role in ("draft", "target")
    )
    draft = DraftDeployment.options(**_scaling(args, "draft")).bind(draft_config)
    target = TargetDeployment.options(**_scaling(args, "target")).bind(target_config)
    return GatewayDeployment.options(**_scaling(args, "gateway")).bind(draft, target, coordinator_argv(args))


def coordinator_argv(args: dict[str, str]) -> list[str]:
    """The ingress's coordinator flags, checked here (a bad one fails `serve run`, not a replica)."""
    argv = ["--model", args["target_model"], "--redis-url", args["redis_url"]]
    if args.get("api_keys_file"):
        argv += ["--api-keys-file", args["api_keys_file"]]
    argv += shlex.split(args.get("coordinator_flags", ""))
    try:
        root.parse(argv)
    except SystemExit:
        raise ValueError(f"coordinator_flags: not flags `python -m services.coordinator` takes: {argv}") from None
    return argv


DEFAULT_CPUS = {"draft": 1.0, "target": 1.0, "gateway": 0.0}  # the gateway waits on I/O: it reserves no core


def _scaling(args: dict[str, str], role: str) -> dict:
    """Replicas (a number, or "auto" for Ray's autoscaler), CPUs and GPUs per replica."""
    resources = {"num_cpus": float(args.get(f"{role}_cpus", DEFAULT_CPUS[role])),
                 "num_gpus": float(args.get(f"{role}_gpus", 0))}
    options: dict = {"ray_actor_options": resources}
    replicas = args.get(f"{role}_replicas", "1")
    if replicas == "auto":
        options["autoscaling_config"] = {"min_replicas": 1, "max_replicas": int(args.get("max_replicas", 4))}
    else:
        options["num_replicas"] = int(replicas)
    return options
