"""Entry point shared by the draft and target services: load an engine, serve it."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Callable

from specd.engine import EngineConfig
from services.common import settings
from services.common.metrics import serve_metrics
from services.common.model_service import ModelServicer
from services.common.server import run_until_signalled, start_server
from services.common.telemetry import setup_tracing
from services.common.tls import TlsFiles, refuse_plaintext
from services.common.worker import DEFAULT_MAX_BATCH, Batching, SharedCores

log = logging.getLogger(__name__)
QUANTIZE_HELP = {
    "target": "the weights it runs (specd/numerics.py): none or auto (a GGUF file as stored, batch-invariant: a "
              "verification equals plain steps bit for bit; a Hugging Face checkpoint's dense weights); int8 and "
              "q4_0 are refused (a draft's)",
    "draft": "the weights it runs (specd/numerics.py): none or auto (a GGUF file as stored; a Hugging Face "
             "checkpoint's dense weights), int8 (a Hugging Face checkpoint in dynamic int8; CPU), q4_0 (a GGUF "
             "file's Q5_0 and Q8_0 weights requantized to Q4_0 at load: fewer bytes a step); a draft's "
             "numerics change acceptance only",
}


def parse(role: str, default_port: int, argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser(role, default_port)
    args = parser.parse_args(argv)
    return _checked(parser, role, args)


def build_parser(role: str, default_port: int) -> argparse.ArgumentParser:
    """Every flag, each with its SPECD_* variable (docs/configuration.md is generated from it)."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{role}", description=f"specd {role} model service")
    settings.add(parser, "--model", type=Path, aliases=("--model-dir",),
                 help="the model: a GGUF file, served as stored (`specd models fetch` gives the pair's), or an HF "
                      "model directory")
    settings.add(parser, "--host", default="127.0.0.1", help="address to bind")
    settings.add(parser, "--port", type=int, default=default_port, help="gRPC port")
    settings.add(parser, "--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    settings.add(parser, "--dtype", default="float32", help="float32 | float64 | bfloat16 | float16")
    settings.add(parser, "--threads", type=int, help="torch threads (services on one host share cores)")
    settings.add(parser, "--max-sessions", type=int, default=EngineConfig.max_sessions,
                 help="KV caches kept; idle ones are evicted LRU")
    settings.add(parser, "--quantize", default=settings.SERVICE_QUANTIZE, choices=settings.QUANTIZE_MODES,
                 help=QUANTIZE_HELP[role])
    if role == "draft":
        settings.add(parser, "--head-vocab", type=int, default=settings.DRAFT_HEAD_VOCAB,
                     help="a GGUF draft's output layer scores only the first this many token ids (a BPE or "
                          "SentencePiece vocabulary's most frequent) and the special ones: a shorter draft step; a "
                          "token it cannot propose is a rejection, never a wrong output (0: every id)")
    settings.add(parser, "--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: off)")
    settings.add(parser, "--tls-dir", type=Path,
                 help="mutual TLS: ca.pem, <role>.pem, <role>-key.pem (`specd certs`), read again for new connections "
                      "when they change; only the coordinator's certificate may call (unset: plaintext, anyone who "
                      "reaches the port: on loopback only, unless --insecure)")
    settings.add_switch(parser, "--insecure",
                        help="serve plaintext (no --tls-dir) on an address that is not loopback-only, e.g. 0.0.0.0 "
                             "(refused otherwise): something else must keep everyone but the coordinator from the "
                             "port; the variable takes 1")
    settings.add(parser, "--health-port", type=int, default=0,
                 help="also answer gRPC health checks, and nothing else, in plaintext on this port (probes; 0: off)")
    settings.add(parser, "--cores-lock", type=Path,
                 help="a file every service on this host opens: they take turns at the cores (unset: no turns)")
    settings.add(parser, "--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                 help=f"{'verifications' if role == 'target' else 'proposals'} that queued while the model was busy "
                      "share its passes, up to this many")
    settings.add(parser, "--batch-wait", type=float, default=Batching.wait,
                 help="a pass missing sessions of the last passes waits for them up to this fraction of a pass "
                      "(0: never; like Triton's max queue delay)")
    return parser


def _checked(parser: argparse.ArgumentParser, role: str, args: argparse.Namespace) -> argparse.Namespace:
    if args.model is None:
        parser.error("--model (or SPECD_MODEL) is required")
    try:
        args.tls = TlsFiles(args.tls_dir, role).check() if args.tls_dir else None
        if not args.tls and not args.insecure and (why := refuse_plaintext(args.host, f"the {role} service",
                                                                          "--tls-dir (`specd certs` makes a set)")):
            raise ValueError(why)
        Batching(args.max_batch, args.batch_wait).validate()
        settings.check_head_vocab(getattr(args, "head_vocab", 0))
        settings.check_quantize(role, args.quantize)  # the environment's value too, which argparse does not check
    except ValueError as error:
        parser.error(str(error))
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_dir=args.model,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        max_sessions=args.max_sessions,
        quantize=args.quantize,
        head_vocab=getattr(args, "head_vocab", 0),  # the target scores every id: its p is the output's
    )


def main(
    role: str,
    default_port: int,
    servicer_class: type[ModelServicer],
    register: Callable,
    argv: list[str] | None = None,
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    args = parse(role, default_port, argv)
    setup_tracing(f"specd-{role}")
    cores = SharedCores(args.cores_lock) if args.cores_lock else None
    # Loads the engine on its worker thread.
    batching = Batching(args.max_batch, args.batch_wait)
    servicer = servicer_class.load(engine_config(args), role, cores=cores, batching=batching)

    async def serve() -> None:
        health_address = f"{args.host}:{args.health_port}" if args.health_port else None
        server, port = await start_server(register(servicer), f"{args.host}:{args.port}", tls=args.tls,
                                          health_address=health_address)
        info = servicer.engine_info()
        log.info("%s serving %s on %s:%d (%s), numerics %s (quantize %s, batch-invariant here: %s): %s", role,
                 args.model, args.host, port, "mutual TLS" if args.tls else "plaintext", info.numerics,
                 info.quantize, info.invariant, info.reason)
        if not args.tls:  # on loopback, or told --insecure
            log.warning("no --tls-dir: any process that reaches %s:%d may drive this service's caches%s", args.host,
                        port, " (--insecure)" if args.insecure else "")
        if args.metrics_port:
            serve_metrics(servicer.metrics.registry, args.metrics_port, args.host)
            log.info("%s metrics on http://%s:%d/metrics", role, args.host, args.metrics_port)
        await run_until_signalled(server, servicer.drain)

    try:
        asyncio.run(serve())
    finally:
        servicer.close()
