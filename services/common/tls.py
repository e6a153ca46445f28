"""Mutual TLS between the coordinator and the model services.

A deployment's certificates live in one directory (a mounted Secret, or what `specd certs` makes):
`ca.pem` and, per role, `<role>.pem` + `<role>-key.pem`. A model service accepts a connection only
from a certificate its CA signed, and a call only from the coordinator's (anything else:
UNAUTHENTICATED); health checks stay open to any verified peer, and to anyone on the plaintext
`--health-port` (kubelet probes speak no TLS). The coordinator checks that a replica presents the
certificate of its role, whatever address the pool resolved to (a pod IP): the name it verifies is
`specd-<role>`, not the address.

Rotation: a server reads its certificate, key and CA again whenever their files changed, for the
next TLS handshake (gRPC asks before each one): new connections get the rotated set, connections
already made keep theirs. The coordinator's pools make new channels with its rotated certificate
(services/common/replicas.py). A set that does not load (a key that is not its certificate's, a
file half written) is logged and the last good one kept.

Plaintext is for loopback: a service that would serve it on any other address refuses to start
unless told `--insecure` (`refuse_plaintext`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from services.common.settings import env_name
from services.common.watch import Signature, signature

log = logging.getLogger(__name__)
CA_FILE = "ca.pem"
CALLER = "coordinator"  # the one role that may call a model service
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # any verified peer (a healthcheck with the coordinator's files)


def identity(role: str) -> str:
    """The DNS name in a role's certificate, which its peers verify."""
    return f"specd-{role}"


def cert_file(role: str) -> str:
    return f"{role}.pem"


def key_file(role: str) -> str:
    return f"{role}-key.pem"


def loopback_only(host: str) -> bool:
    """`host` (what a server binds) is reachable from this machine alone: 127.0.0.0/8, ::1, localhost.
    0.0.0.0, ::, another address or a name are not."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_plaintext(host: str, what: str, how: str) -> str | None:
    """Why `what` may not serve plaintext on `host` (None: it may, on loopback); `how`: the flag
    that would give it TLS."""
    if loopback_only(host):
        return None
    return (f"refusing to serve {what} in plaintext on {host}, which is not loopback-only: anyone who reaches "
            f"it could call it unencrypted; pass {how}, or --insecure ({env_name('--insecure')}=1) when "
            f"something else secures that network")


def _read(path: Path, hint: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"TLS: cannot read {path} ({error.strerror}); {hint}") from error


def _checked_pair(cert_pem: bytes, key_pem: bytes, cert_path: Path, key_path: Path) -> tuple[bytes, bytes]:
    """The certificate chain and key, when they parse and the key is the (first) certificate's: a
    clear error now rather than failed handshakes later (a set half replaced, swapped files)."""
    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError as error:
        raise ValueError(f"TLS: {cert_path} holds no PEM certificate ({error})") from error
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as error:
        raise ValueError(f"TLS: {key_path} holds no unencrypted PEM private key ({error})") from error
    public = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*public) != key.public_key().public_bytes(*public):
        raise ValueError(f"TLS: {key_path} is not the key of {cert_path}'s certificate")
    return cert_pem, key_pem


def _checked_ca(ca_pem: bytes, path: Path) -> bytes:
    try:
        x509.load_pem_x509_certificates(ca_pem)  # one CA, or several while a new one is rolled out
    except ValueError as error:
        raise ValueError(f"TLS: {path} holds no PEM certificate ({error})") from error
    return ca_pem


def _reloading(load: Callable[[], grpc.ServerCertificateConfiguration], seen: Callable[[], Signature],
               what: str, require_client_auth: bool) -> grpc.ServerCredentials:
    """Server credentials whose certificate (and CA) are read again when their files change: gRPC
    calls the fetcher before each TLS handshake, and a stat of the files is all it costs then."""
    last = [seen()]  # before loading: a change while loading is loaded again at the next handshake
    initial = load()

    def fetch() -> grpc.ServerCertificateConfiguration | None:  # None: keep the current configuration
        try:
            now = seen()
            if now == last[0]:
                return None
            last[0] = now  # a bad set is reported once, and read again when the files change again
            configuration = load()
        except Exception as error:  # whatever it is, a failed fetch would fail the handshake: keep the last good set
            log.error("%s; still serving the previous certificate", error)
            return None
        log.info("TLS: %s reloaded for new connections", what)
        return configuration

    return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=require_client_auth)


@dataclass(frozen=True)
class TlsFiles:
    """`role`'s certificate and key, and the CA that signs its peers', in `directory`."""

    directory: Path
    role: str

    def _read(self, name: str) -> bytes:
        return _read(self.directory / name,
                     f"`specd certs --dir {self.directory}` makes a deployment's certificates")

    def paths(self) -> tuple[Path, Path, Path]:
        return self.directory / CA_FILE, self.directory / cert_file(self.role), self.directory / key_file(self.role)

    def signature(self) -> Signature:
        """Changes when any of the three files does (a rotated set)."""
        return signature(*self.paths())

    def _load(self) -> tuple[bytes, bytes, bytes]:
        """(ca, certificate chain, key), checked."""
        ca_path, cert_path, key_path = self.paths()
        ca = _checked_ca(self._read(CA_FILE), ca_path)
        chain, key = _checked_pair(self._read(cert_file(self.role)), self._read(key_file(self.role)), cert_path,
                                   key_path)
        return ca, chain, key

    def check(self) -> "TlsFiles":
        """Every file is readable and the key is the certificate's (a clear start-up error instead
        of a failed handshake later)."""
        self._load()
        return self

    def _server_configuration(self) -> grpc.ServerCertificateConfiguration:
        ca, chain, key = self._load()
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS, the files read again for new connections when they change."""
        what = f"the {self.role} certificate in {self.directory}"
        return _reloading(self._server_configuration, self.signature, what, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """From the files as they are now: a channel keeps them for its life (reconnects included),
        so a rotated set needs new channels (services/common/replicas.py makes them)."""
        ca, chain, key = self._load()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)


@dataclass(frozen=True)
class EdgeTls:
    """The coordinator's certificate at its client edges, gRPC and REST: a server certificate
    chain and its key, PEM (`tls.crt` / `tls.key` of a kubernetes.io/tls Secret, an ingress's, a
    public CA's). Clients present none: API keys say who they are. Read again when they change."""

    cert: Path
    key: Path

    def paths(self) -> tuple[Path, Path]:
        return self.cert, self.key

    def signature(self) -> Signature:
        return signature(*self.paths())

    def _load(self) -> tuple[bytes, bytes]:
        hint = "--edge-tls-cert and --edge-tls-key name the edge's certificate chain and key (PEM)"
        return _checked_pair(_read(self.cert, hint), _read(self.key, hint), self.cert, self.key)

    def check(self) -> "EdgeTls":
        self._load()
        return self

    @classmethod
    def from_flags(cls, cert: Path | None, key: Path | None) -> "EdgeTls | None":
        """--edge-tls-cert and --edge-tls-key, checked (ValueError: a lone one, a missing file, a key
        that is not the certificate's), or None: neither given, plaintext."""
        if (cert is None) != (key is None):
            raise ValueError("--edge-tls-cert and --edge-tls-key go together: the edge's certificate chain and its key")
        try:
            return cls(cert, key).check() if cert is not None else None
        except ValueError as error:
            raise ValueError(f"--edge-tls-cert / --edge-tls-key: {error}") from error

    def _server_configuration(self) -> grpc.ServerCertificateConfiguration:
        chain, key = self._load()
        return grpc.ssl_server_certificate_configuration([(key, chain)])

    def server_credentials(self) -> grpc.ServerCredentials:
        return _reloading(self._server_configuration, self.signature, f"the edge certificate {self.cert}",
                          require_client_auth=False)

    async def keep_loaded(self, context: ssl.SSLContext, every_s: float = 1.0) -> None:
        """Load the files into `context` (the REST edge's, uvicorn's) again whenever they change,
        until cancelled: new connections get the rotated certificate, open ones keep theirs."""
        last = self.signature()
        while True:
            await asyncio.sleep(every_s)
            now = self.signature()
            if now == last:
                continue
            last = now
            try:
                self.check()
            except ValueError as error:  # reported once, read again when the files change again
                log.error("%s; still serving the previous certificate over REST", error)
                continue
            try:
                context.load_cert_chain(self.cert, self.key)
            except OSError as error:  # ssl.SSLError too: the files changed since check(); look again next tick
                last = None
                log.error("TLS: loading the edge certificate %s failed (%s); trying again", self.cert, error)
                continue
            log.info("TLS: the edge certificate %s reloaded for new REST connections", self.cert)

    def trusted_as_itself(self) -> "EdgeTrust":
        """Trust in this certificate alone, verified under a name it carries: how the process that
        started the coordinator (`specd up`) asks it whether it serves, whatever address it binds and
        whoever signed it (gRPC accepts a trusted certificate that is not self-signed as a chain's end)."""
        chain, _ = self._load()
        cert = x509.load_pem_x509_certificates(chain)[0]
        return EdgeTrust(cert.public_bytes(serialization.Encoding.PEM), _a_name_of(cert))


def _a_name_of(cert: x509.Certificate) -> str | None:
    """A host name `cert` is valid for (a wildcard's with a label in place of `*`); None: it names none."""
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    names = [*alt.get_values_for_type(x509.DNSName), *map(str, alt.get_values_for_type(x509.IPAddress))]
    return names[0].replace("*", "specd", 1) if names else None


@dataclass(frozen=True)
class EdgeTrust:
    """What a client of a coordinator's edge with TLS trusts: `roots` (PEM: the CA that signed the
    edge's certificate, or that certificate itself) and, when set, the name to verify instead of the
    address's host."""

    roots: bytes
    name: str | None = None

    @classmethod
    def from_ca(cls, path: Path) -> "EdgeTrust":
        """The CA in `path` (`specd certs`' ca.pem, an ingress's or a private CA's), checked."""
        return cls(_checked_ca(_read(path, "the CA that signed the edge's certificate (PEM)"), path))

    def channel(self, address: str) -> grpc.Channel:
        options = [("grpc.ssl_target_name_override", self.name)] if self.name else []
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(self.roots), options=options)


def channel_options(peer_role: str) -> list[tuple[str, Any]]:
    """Verify the peer as `specd-<peer_role>` whatever address it was reached at."""
    return [("grpc.ssl_target_name_override", identity(peer_role))]


def peer_names(context: grpc.aio.ServicerContext) -> list[str]:
    """The DNS names in the verified peer certificate (none over plaintext)."""
    return [name.decode() for name in context.auth_context().get("x509_subject_alternative_name", [])]


def is_caller(names: list[str]) -> bool:
    expected = identity(CALLER).encode()
    # Constant time per name: a peer learns nothing from how long a refusal took.
    return any(hmac.compare_digest(name.encode(), expected) for name in names)


class OnlyCoordinator(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless the peer's verified certificate is the
    coordinator's: another service's certificate, signed by the same CA, may not drive a cache."""

    def __init__(self, role: str):
        self.role = role

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        return _guarded(handler, self.role)


def _guarded(handler: grpc.RpcMethodHandler, role: str) -> grpc.RpcMethodHandler:
    async def check(context: grpc.aio.ServicerContext) -> None:
        names = peer_names(context)
        if not is_caller(names):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"the {role} service answers the coordinator ({identity(CALLER)}) only; "
                                f"this peer's certificate names {', '.join(names) or 'nothing'}")

    def unary_reply(behaviour):
        async def guarded(request, context):
            await check(context)
            return await behaviour(request, context)
        return guarded

    def streamed_reply(behaviour):
        async def guarded(request, context):
            await check(context)
            async for reply in behaviour(request, context):
                yield reply
        return guarded

    kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler, unary_reply),
             ("unary_stream", grpc.unary_stream_rpc_method_handler, streamed_reply),
             ("stream_unary", grpc.stream_unary_rpc_method_handler, unary_reply),
             ("stream_stream", grpc.stream_stream_rpc_method_handler, streamed_reply))
    for kind, make, wrap in kinds:
        if behaviour := getattr(handler, kind):
            return make(wrap(behaviour), handler.request_deserializer, handler.response_serializer)
    raise TypeError(f"a method handler without a behaviour: {handler}")
