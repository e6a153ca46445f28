"""Coordinator entry point: connects to the draft and target pools and serves clients over gRPC
and REST (built in services/coordinator/root.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from services.common.metrics import serve_metrics
from services.common.server import run_until_signalled, start_server
from services.common.telemetry import setup_tracing
from services.coordinator import root
from services.coordinator.gateway import HttpServer, create_app
from services.coordinator.server import CoordinatorServicer, register
from services.draft.client import GrpcDrafter
from services.target.client import GrpcVerifier

log = logging.getLogger(__name__)


async def serve(args: argparse.Namespace) -> None:
    drafter = None if args.draft_addr == root.NO_DRAFT else GrpcDrafter(args.draft_addr, tls=args.tls)
    verifier = GrpcVerifier(args.target_addr, retry_s=args.target_wait_s, tls=args.tls)
    frontend = root.build(args, drafter, verifier, decoder=verifier)
    services = frontend.services
    try:
        if args.require_durable_store == "on":
            await root.check_store(services.store)
    except root.StoreNotDurable as error:
        await services.store.close()
        raise SystemExit(f"coordinator: {error}") from None
    if args.metrics_port:
        serve_metrics(frontend.metrics.registry, args.metrics_port, args.host)
        log.info("coordinator metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    keys = root.api_keys(args)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keys.reload)  # read the key file again now
    starting = asyncio.create_task(root.start_up(frontend, args.calibrate == "on"))

    stop = asyncio.Event()

    def refuse(task: asyncio.Task) -> None:  # the draft cannot serve this target: stop, and exit non-zero
        if not task.cancelled() and isinstance(task.exception(), root.VocabularyMismatch):
            log.error("%s", task.exception())
            stop.set()

    starting.add_done_callback(refuse)
    edge = args.edge_tls  # None: plaintext (loopback, or --insecure)
    server, port = await start_server(
        register(CoordinatorServicer(frontend, keys)), f"{args.host}:{args.port}", warm_up=starting,
        max_message_bytes=args.max_body_bytes,  # the same bound as a REST body
        tls=edge, health_address=f"{args.host}:{args.health_port}" if args.health_port else None,
    )
    log.info("coordinator on %s:%d (%s; draft %s, target %s)", args.host, port, "TLS" if edge else "plaintext",
             args.draft_addr, args.target_addr)
    http, reloading = None, None
    if args.http_port >= 0:
        name = root.served_model_name(args)
        app = create_app(frontend, keys, name, args.max_body_bytes)
        files = {"ssl_certfile": str(edge.cert), "ssl_keyfile": str(edge.key)} if edge else {}
        http, http_port = await HttpServer.start(app, args.host, args.http_port, **files,
                                                 max_connections=args.max_connections)
        if edge:  # the gRPC edge reads a rotated certificate per handshake; uvicorn's context is loaded here
            reloading = asyncio.create_task(edge.keep_loaded(http.config.ssl))
        log.info("REST gateway on %s://%s:%d/v1 (model %r)", "https" if edge else "http", args.host, http_port, name)
    try:
        await run_until_signalled(server, stop=stop)
    finally:
        starting.cancel()
        if reloading:
            reloading.cancel()
        await frontend.auditor.close()
        if http:
            await http.stop()
        await asyncio.gather(*([drafter.replicas.close()] if drafter else []), verifier.replicas.close(),
                             services.store.close())
    if starting.done() and not starting.cancelled() and isinstance(starting.exception(), root.VocabularyMismatch):
        raise SystemExit(f"coordinator: {starting.exception()}")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    setup_tracing("specd-coordinator")  # before serve() builds the server and channels
    asyncio.run(serve(root.parse(argv, edges=True)))


if __name__ == "__main__":
    main()
