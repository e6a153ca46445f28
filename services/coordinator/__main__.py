"""Coordinator entry point: connects to the draft and target services and serves clients."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import grpc

from services.common import settings
from services.common.server import run_until_signalled, start_server
from services.coordinator.convert import Limits
from services.coordinator.model_info import load_model_info
from services.coordinator.server import CoordinatorServicer, register
from services.draft.client import GrpcDrafter
from services.target.client import GrpcVerifier

DEFAULT_PORT = 50051
log = logging.getLogger(__name__)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.coordinator", description="specd coordinator")
    settings.add(parser, "--model-dir", type=Path, help="the target's model directory (tokenizer, limits)")
    settings.add(parser, "--host", default="127.0.0.1", help="address to bind")
    settings.add(parser, "--port", type=int, default=DEFAULT_PORT, help="gRPC port")
    settings.add(parser, "--draft-addr", default="127.0.0.1:50052", help="draft service host:port")
    settings.add(parser, "--target-addr", default="127.0.0.1:50053", help="target service host:port")
    settings.add(parser, "--default-k", type=int, default=Limits.default_k, help="draft tokens per round")
    settings.add(parser, "--max-k", type=int, default=Limits.max_k, help="largest K a request may ask for")
    args = parser.parse_args(argv)
    if args.model_dir is None:
        parser.error("--model-dir (or SPECD_MODEL_DIR) is required")
    return args


async def serve(args: argparse.Namespace) -> None:
    model = load_model_info(args.model_dir)
    limits = Limits(default_k=args.default_k, max_k=args.max_k)
    async with grpc.aio.insecure_channel(args.draft_addr) as draft, grpc.aio.insecure_channel(args.target_addr) as target:
        servicer = CoordinatorServicer(GrpcDrafter(draft), GrpcVerifier(target), model, limits)
        server, port = await start_server(register(servicer), f"{args.host}:{args.port}")
        log.info("coordinator on %s:%d (draft %s, target %s)", args.host, port, args.draft_addr, args.target_addr)
        await run_until_signalled(server)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
