"""Mutual TLS between the coordinator and the model services.

A deployment's certificates live in one directory (a mounted Secret, or what `specd certs` makes):
`ca.pem` and, per role, `<role>.pem` + `<role>-key.pem`. A model service accepts a connection only
from a certificate its CA signed, and a call only from the coordinator's (anything else:
UNAUTHENTICATED); health checks stay open to any verified peer, and to anyone on the plaintext
`--health-port` (kubelet probes speak no TLS). The coordinator checks that a replica presents the
certificate of its role, whatever address the pool resolved to (a pod IP): the name it verifies is
`specd-<role>`, not the address.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import grpc

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


@dataclass(frozen=True)
class TlsFiles:
    """`role`'s certificate and key, and the CA that signs its peers', in `directory`."""

    directory: Path
    role: str

    def _read(self, name: str) -> bytes:
        path = self.directory / name
        try:
            return path.read_bytes()
        except OSError as error:
            raise ValueError(f"TLS: cannot read {path} ({error.strerror}); `specd certs --dir {self.directory}` "
                             f"makes a deployment's certificates") from error

    def check(self) -> "TlsFiles":
        """Every file is readable (a clear start-up error instead of a failed handshake later)."""
        for name in (CA_FILE, cert_file(self.role), key_file(self.role)):
            self._read(name)
        return self

    def server_credentials(self) -> grpc.ServerCredentials:
        pair = (self._read(key_file(self.role)), self._read(cert_file(self.role)))
        return grpc.ssl_server_credentials([pair], root_certificates=self._read(CA_FILE), require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(CA_FILE),
            private_key=self._read(key_file(self.role)),
            certificate_chain=self._read(cert_file(self.role)),
        )


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
