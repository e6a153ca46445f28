"""The coordinator's composition root: its settings (the flags of `python -m services.coordinator`,
each with its SPECD_* variable), the frontend every edge serves built from them and a
drafter/verifier pair (gRPC pools, or Ray Serve handles), and its start-up (the vocabulary check,
then calibration). `python -m services.coordinator` and the Ray Serve ingress
(services/ray_app.py) both build the coordinator here, so they run the same policy."""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import replace
from pathlib import Path

from specd import audit
from specd.contracts import MAX_K, EngineInfo
from specd.loop import Services
from specd.protocols import Decoder, Drafter, Verifier
from specd.model_free import SuffixDrafter
from specd.outage import DRAFT_TIMEOUT_S, DraftOutage
from specd.policy import PolicyConfig
from specd.priority import Background, RoundGate
from services.common import compute, discovery, settings
from services.common.client import NetworkDelay
from services.common.tls import CALLER, EdgeTls, TlsFiles, refuse_plaintext
from services.coordinator.auth import ApiKeys
from services.coordinator.frontend import Frontend
from services.coordinator.gateway import DEFAULT_HTTP_PORT, MAX_BODY_BYTES, MAX_CONNECTIONS
from services.coordinator.model_info import load_model_info
from services.coordinator.quotas import RATE_BURST_S, QuotaLimits, Quotas
from services.coordinator.requests import Limits
from services.coordinator.store import RedisSessionStore
from services.target import client as target_client

DEFAULT_PORT = 50051
POOL_HELP = "host:port[,host:port...], dns:///name:port (every address it resolves to, re-resolved) or file:///path"
NO_DRAFT = settings.NO_DRAFT
CALIBRATION_ATTEMPTS, CALIBRATION_RETRY_S = 24, 5.0  # two minutes for the model services to come up
log = logging.getLogger(__name__)



def confidence(value: str) -> float:
    try:
        threshold = float(value)
        PolicyConfig(min_confidence=threshold).validate()  # in [0, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"draft confidence must be a probability in [0, 1), got {value!r}")
    return threshold


def audit_rate(value: str) -> float:
    try:
        return audit.validate_rate(float(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"audit rate must be a fraction in [0, 1] (0: off), got {value!r}")


def parse(argv: list[str] | None, edges: bool = False) -> argparse.Namespace:
    """`edges`: this process serves the gRPC and REST edges on --host itself (`python -m
    services.coordinator`): plaintext there is refused off loopback unless --insecure. The Ray
    ingress parses the same flags, but Ray's proxy serves its HTTP."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return _checked(parser, args, edges)


def build_parser() -> argparse.ArgumentParser:
    """Every flag, each with its SPECD_* variable (docs/configuration.md is generated from it)."""
    parser = argparse.ArgumentParser(prog="python -m services.coordinator", description="specd coordinator")
    settings.add(parser, "--model", type=Path, aliases=("--model-dir",),
                 help="the target's GGUF file or HF model directory: its tokenizer, chat template, end tokens and "
                      "limits (a GGUF file's tokenizer from FILE.tokenizer.json beside it, when there)")
    settings.add(parser, "--host", default="127.0.0.1", help="address to bind")
    settings.add(parser, "--port", type=int, default=DEFAULT_PORT, help="gRPC port")
    settings.add(parser, "--draft-addr", default="127.0.0.1:50052",
                 help=f"the draft pool: {POOL_HELP}; {NO_DRAFT}: no draft model (only --model-free drafts)")
    settings.add(parser, "--target-addr", default="127.0.0.1:50053", help=f"the target pool: {POOL_HELP}")
    settings.add(parser, "--draft-timeout-s", type=float, default=DRAFT_TIMEOUT_S,
                 help="a proposal no draft replica answered within this decodes the round plainly, and the "
                      "coordinator decodes plainly until a draft replica answers again")
    settings.add(parser, "--model-free", default="on", choices=("on", "off"),
                 help="draft from the session's own tokens and its API key's recent outputs too, in this process "
                      "(specd/model_free.py), where that is predicted to commit more tokens a second than the draft "
                      "model or a plain step; a request may ask for one drafter (`drafter`)")
    settings.add(parser, "--target-wait-s", type=float, default=target_client.WAIT_S,
                 help="a round waits this long for some target replica, then the request fails UNAVAILABLE (503); "
                      "the session stays resumable")
    settings.add(parser, "--tls-dir", type=Path,
                 help="mutual TLS to the model services: ca.pem, coordinator.pem, coordinator-key.pem (`specd certs`); "
                      "each replica must present its role's certificate; when the files change, the pools make new "
                      "channels with them (unset: plaintext)")
    settings.add(parser, "--edge-tls-cert", type=Path,
                 help="TLS at the client edges (gRPC and REST): this server certificate chain (PEM, e.g. a "
                      "kubernetes.io/tls Secret's tls.crt), with --edge-tls-key; clients need no certificate (API "
                      "keys); read again for new connections when it changes (unset: plaintext, on loopback only "
                      "unless --insecure)")
    settings.add(parser, "--edge-tls-key", type=Path, help="the private key of --edge-tls-cert (PEM)")
    settings.add_switch(parser, "--insecure",
                        help="serve the client edges in plaintext (no --edge-tls-cert) on an address that is not "
                             "loopback-only, e.g. 0.0.0.0 (refused otherwise): TLS ends before them (an ingress, a "
                             "mesh); the variable takes 1")
    settings.add(parser, "--redis-url", help="session store, e.g. redis://127.0.0.1:6379/0")
    settings.add(parser, "--redis-password-file", type=Path,
                 help="the session store's password (a mounted Secret), when it is not in the URL")
    settings.add(parser, "--require-durable-store", default="on", choices=("on", "off"),
                 help="refuse to start unless the session store fsyncs every write before it answers (Redis "
                      "appendonly yes, appendfsync always): tokens a client received then survive a crash of the "
                      "store's host (off: a managed store that hides its settings, or a throwaway one)")
    settings.add(parser, "--session-ttl-s", type=float, default=3600.0, help="idle sessions expire after this")
    settings.add(parser, "--default-k", type=int, default=Limits.default_k, help="draft tokens per round")
    settings.add(parser, "--max-k", type=int, default=Limits.max_k,
                 help=f"largest K a request may ask for (at most {MAX_K}, the model services' limit)")
    settings.add(parser, "--draft-confidence", type=confidence, default=Limits.min_confidence,
                 help="adaptive K: the draft stops after a token it gave a probability below this (0: off)")
    settings.add(parser, "--calibrate", default="on", choices=("on", "off"),
                 help="a deployment with no learnt policy yet times rounds of every K up to --max-k at start, so its "
                      "first sessions need not explore K; health answers SERVING after it (off: they explore)")
    settings.add(parser, "--audit-rate", type=audit_rate, default=audit.DEFAULT_RATE,
                 help="this fraction of finished greedy requests is decoded again plainly on the target in the "
                      "background, one at a time, and any difference from the committed tokens is counted and "
                      "logged (0: off)")
    settings.add(parser, "--inject-rtt-ms", type=float, default=0.0,
                 help="benchmarks: add this round-trip delay to every model-service call")
    settings.add(parser, "--http-port", type=int, default=DEFAULT_HTTP_PORT, help="REST (OpenAI) port; -1: no REST")
    settings.add(parser, "--api-keys-file", type=Path, help="API keys, one `name:key` a line (unset: no auth)")
    settings.add(parser, "--key-max-in-flight", type=int, default=QuotaLimits.in_flight,
                 help="requests one API key may have running at once, over every coordinator (0: no limit); "
                      "more get 429 / RESOURCE_EXHAUSTED with Retry-After")
    settings.add(parser, "--key-max-sessions", type=int, default=QuotaLimits.sessions,
                 help="named sessions one API key may hold (0: no limit)")
    settings.add(parser, "--key-tokens-per-minute", type=int, default=QuotaLimits.tokens_per_minute,
                 help="prompt + generated tokens one API key may use per minute (0: no limit)")
    settings.add(parser, "--key-requests-per-minute", type=int, default=QuotaLimits.requests_per_minute,
                 help=f"requests one API key may start per minute, in bursts of up to {RATE_BURST_S} s worth (0: no limit); "
                      "checked before a request's body is read")
    settings.add(parser, "--background-after-tokens", type=int, default=Background.after_tokens,
                 help="a request that has generated this many tokens yields to shorter ones: each of its rounds "
                      "first waits, up to --background-wait-s, while short requests' rounds run (0: off)")
    settings.add(parser, "--background-wait-s", type=float, default=Background.max_wait_s,
                 help="the longest a background round waits for short requests' rounds")
    settings.add(parser, "--served-model-name",
                 help="the model id REST clients name (default: the model's file name less .gguf, or its directory's)")
    settings.add(parser, "--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                 help="largest REST request body, and gRPC request message")
    settings.add(parser, "--max-connections", type=int, default=MAX_CONNECTIONS,
                 help="open REST connections at once; past it a request gets 503 at once")
    settings.add(parser, "--request-timeout-s", type=float, default=Limits.request_timeout_s,
                 help="a REST request's whole life, its streamed reply included; past it: 504 or a timeout event")
    settings.add(parser, "--stream-stall-s", type=float, default=Limits.stream_stall_s,
                 help="a streamed reply ends when one write waits this long on a client that does not read")
    settings.add(parser, "--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: off)")
    settings.add(parser, "--health-port", type=int, default=0,
                 help="also answer gRPC health checks, and nothing else, in plaintext on this port (probes of an edge "
                      "with TLS: kubelet's gRPC probe speaks none; 0: off)")
    return parser


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace, edges: bool) -> argparse.Namespace:
    for flag in ("draft_addr", "target_addr"):
        if flag == "draft_addr" and args.draft_addr == NO_DRAFT:
            continue
        try:
            discovery.resolver(getattr(args, flag))
        except ValueError as error:
            parser.error(f"--{flag.replace('_', '-')}: {error}")
    try:
        args.tls = TlsFiles(args.tls_dir, CALLER).check() if args.tls_dir else None
    except ValueError as error:
        parser.error(f"--tls-dir: {error}")
    try:
        args.edge_tls = EdgeTls.from_flags(args.edge_tls_cert, args.edge_tls_key)
    except ValueError as error:
        parser.error(str(error))
    if edges and not args.edge_tls and not args.insecure and (why := refuse_plaintext(
            args.host, "the coordinator's gRPC and REST edges", "--edge-tls-cert and --edge-tls-key")):
        parser.error(why)
    if not (1 <= args.max_k <= MAX_K and args.default_k >= 1):  # a default above max-k is capped by it
        parser.error(f"--default-k and --max-k: need default-k >= 1 and 1 <= max-k <= {MAX_K} (the model services' "
                     f"limit), got {args.default_k} and {args.max_k}")
    for positive in ("max_connections", "request_timeout_s", "stream_stall_s"):
        if getattr(args, positive) <= 0:
            parser.error(f"--{positive.replace('_', '-')} must be > 0")
    for required in ("model", "redis_url"):
        if getattr(args, required) is None:
            flag = required.replace("_", "-")
            parser.error(f"--{flag} (or {settings.env_name(flag)}) is required")
    return args


def build(args: argparse.Namespace, drafter: Drafter | None, verifier: Verifier,
          decoder: Decoder | None = None) -> Frontend:
    """The frontend over these model-service clients, as the settings say (`decoder`: the target
    pool's streamed plain steps; without one a plain token is a Step call)."""
    limits = Limits(
        default_k=args.default_k, max_k=args.max_k, min_confidence=args.draft_confidence,
        request_timeout_s=args.request_timeout_s, stream_stall_s=args.stream_stall_s,
    )
    if args.inject_rtt_ms:
        rtt_s = args.inject_rtt_ms / 1e3
        drafter, verifier = drafter and NetworkDelay(drafter, rtt_s), NetworkDelay(verifier, rtt_s)
        decoder = decoder and NetworkDelay(decoder, rtt_s)
    password = args.redis_password_file.read_text().strip() if args.redis_password_file else None
    store = RedisSessionStore(args.redis_url, ttl_s=args.session_ttl_s, password=password)
    model_free = SuffixDrafter() if args.model_free == "on" else None
    gate = RoundGate(Background(args.background_after_tokens, args.background_wait_s))
    services = Services(drafter, verifier, store, DraftOutage(args.draft_timeout_s), model_free, gate, decoder)
    quota_limits = QuotaLimits(args.key_max_in_flight, args.key_max_sessions, args.key_tokens_per_minute,
                               args.key_requests_per_minute)
    quotas = Quotas(store.client, quota_limits, args.session_ttl_s)
    return Frontend(services, load_model_info(args.model), limits, args.audit_rate, quotas)


class StoreNotDurable(RuntimeError):
    """The session store could lose what it acknowledged: the coordinator does not start."""


async def check_store(store: RedisSessionStore) -> None:
    """StoreNotDurable unless the store fsyncs every write before it answers (--require-durable-store)."""
    if why := await store.not_durable():
        raise StoreNotDurable(f"the session store is not durable: {why}; configure it so, or pass "
                              "--require-durable-store off (SPECD_REQUIRE_DURABLE_STORE=off) to accept the loss")


def api_keys(args: argparse.Namespace) -> ApiKeys:
    keys = ApiKeys.from_file(args.api_keys_file) if args.api_keys_file else ApiKeys.open()
    if not keys.required:
        log.warning("no --api-keys-file: the coordinator's APIs are open to anyone who can reach them")
    return keys


def served_model_name(args: argparse.Namespace) -> str:
    path = args.model.resolve()
    return args.served_model_name or (path.stem if path.suffix == ".gguf" else path.name)


class VocabularyMismatch(RuntimeError):
    """The draft and the target (or two replicas) tokenise differently: token ids passed between
    them would mean different text. The coordinator does not start."""


async def check_vocabularies(drafter: Drafter | None, verifier: Verifier, attempts: int = CALIBRATION_ATTEMPTS,
                             retry_s: float = CALIBRATION_RETRY_S) -> dict[str, list[EngineInfo]]:
    """Ask every replica of both pools what it runs (retrying while the pools come up) and raise
    VocabularyMismatch, naming the models, when their vocabulary digests differ. A replica with no
    digest (an HF directory's engine) is not compared; giving up waiting costs only the check.
    Returns the answers by role ("draft", "target")."""
    pools = {role: pool for role, pool in (("draft", drafter), ("target", verifier)) if pool is not None}
    answers: dict[str, list[EngineInfo]] = {}
    for attempt in range(attempts):
        for role, pool in pools.items():
            ask = getattr(pool, "engines", None)  # a pool that cannot say (a test's fake): not compared
            if ask is not None and not answers.get(role):
                try:
                    answers[role] = [a for a in await ask() if isinstance(a, EngineInfo)]
                except Exception as error:  # a pool not up yet
                    log.debug("vocabulary check: %s pool: %s", role, error)
        waiting = [role for role, pool in pools.items() if hasattr(pool, "engines") and not answers.get(role)]
        if not waiting:
            break
        log.info("vocabulary check: waiting for the %s pool (attempt %d of %d)", " and ".join(waiting), attempt + 1,
                 attempts)
        await asyncio.sleep(retry_s)
    else:
        log.warning("vocabulary check: no answer from the %s pool; not compared", " and ".join(waiting))
    known = [(role, info) for role, infos in answers.items() for info in infos if info.vocab_digest]
    if len({info.vocab_digest for _, info in known}) > 1:
        seen = "; ".join(f"{role} {info.model or info.instance_id}: {info.vocab_digest[:16]}" for role, info in known)
        raise VocabularyMismatch(
            f"the draft and target vocabularies differ ({seen}): the draft must share the target's tokenizer "
            "(same tokens, same ids); start a draft made for this target")
    if known:
        log.info("vocabulary check: %d replicas share vocabulary %s", len(known), known[0][1].vocab_digest[:16])
    return answers


async def start_up(frontend: Frontend, calibrate: bool) -> None:
    """The vocabulary check (VocabularyMismatch: the caller stops), then start-up calibration,
    each retried while the model services come up (compose and k8s start them in any order);
    giving up costs only the check, or the exploration calibration would have saved."""
    engines = await check_vocabularies(frontend.services.drafter, frontend.services.verifier)
    contends = compute.contends(engines.get("draft", ()), engines.get("target", ()))
    frontend.limits = replace(frontend.limits, draft_contends=contends)
    log.info("the draft %s the target's compute: the policy prices its steps %s", "shares" if contends else
             "does not share", "by every session they hold up" if contends else "as its session's")
    if not calibrate:
        return
    for attempt in range(CALIBRATION_ATTEMPTS):
        try:
            prior = await frontend.seed_prior()
        except Exception as error:  # any failure: a service not up yet, Redis away
            log.info("start-up calibration: %s (attempt %d of %d)", error, attempt + 1, CALIBRATION_ATTEMPTS)
            await asyncio.sleep(CALIBRATION_RETRY_S)
            continue
        if prior is None:
            log.info("start-up calibration: the deployment has a learnt policy already")
        else:
            est = prior.estimates
            log.info("start-up calibration: draft step %.3f s, verify(K) %s", est.draft_step_s,
                     ", ".join(f"{k}: {t:.3f} s" for k, t in est.verify_s))
        return
    log.warning("start-up calibration gave up: the first sessions will explore K")
