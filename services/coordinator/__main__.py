"""Coordinator entry point: connects to the draft and target services and serves clients."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from specd.loop import Services
from services.common import settings
from services.common.server import run_until_signalled, start_server
from services.coordinator.convert import Limits
from services.coordinator.frontend import Frontend
from services.coordinator.model_info import load_model_info
from services.coordinator.server import CoordinatorServicer, register
from services.coordinator.store import RedisSessionStore
from services.draft.client import GrpcDrafter
from services.target.client import GrpcVerifier

DEFAULT_PORT = 50051
log = logging.getLogger(__name__)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.coordinator", description="specd coordinator")
    settings.add(parser, "--model-dir", type=Path, help="the target's model directory (tokenizer, limits)")
    settings.add(parser, "--host", default="127.0.0.1", help="address to bind")
    settings.add(parser, "--port", type=int, default=DEFAULT_PORT, help="gRPC port")
    settings.add(parser, "--draft-addr", default="127.0.0.1:50052", help="draft replicas, host:port[,host:port...]")
    settings.add(parser, "--target-addr", default="127.0.0.1:50053", help="target replicas, host:port[,host:port...]")
    settings.add(parser, "--redis-url", help="session store, e.g. redis://127.0.0.1:6379/0")
    settings.add(parser, "--session-ttl-s", type=float, default=3600.0, help="idle sessions expire after this")
    settings.add(parser, "--default-k", type=int, default=Limits.default_k, help="draft tokens per round")
    settings.add(parser, "--max-k", type=int, default=Limits.max_k, help="largest K a request may ask for")
    args = parser.parse_args(argv)
    for required in ("model_dir", "redis_url"):
        if getattr(args, required) is None:
            flag = required.replace("_", "-")
            parser.error(f"--{flag} (or {settings.env_name(flag)}) is required")
    return args


async def serve(args: argparse.Namespace) -> None:
    model = load_model_info(args.model_dir)
    limits = Limits(default_k=args.default_k, max_k=args.max_k)
    services = Services(
        GrpcDrafter(args.draft_addr.split(",")),
        GrpcVerifier(args.target_addr.split(",")),
        RedisSessionStore(args.redis_url, ttl_s=args.session_ttl_s),
    )
    frontend = Frontend(services, model, limits)
    server, port = await start_server(register(CoordinatorServicer(frontend)), f"{args.host}:{args.port}")
    log.info("coordinator on %s:%d (draft %s, target %s)", args.host, port, args.draft_addr, args.target_addr)
    try:
        await run_until_signalled(server)
    finally:
        await asyncio.gather(
            services.drafter.replicas.close(), services.verifier.replicas.close(), services.store.close()
        )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
