"""`specd certs`: a deployment's certificates for mutual TLS (services/common/tls.py): a new CA
and, signed by it, one certificate per role naming `specd-<role>` — the model services' for
serving, the coordinator's for calling them, Redis's (also naming its host names) for a
store served over TLS, and the coordinator's client edge's (`edge`, naming the host names its
clients use; they trust ca.pem). The CA's key is never written: to re-issue, make a
new set and replace the old one everywhere (a stolen set cannot mint more; running services take
the new files without a restart, services/common/tls.py). Keys are ECDSA P-256,
0600; certificates 0644; the directory 0700."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.tls import CA_FILE, CALLER, cert_file, identity, key_file

EDGE = "edge"  # the coordinator's client edges (gRPC and REST): --edge-tls-cert edge.pem --edge-tls-key edge-key.pem
SERVERS = ("draft", "target", "redis", EDGE)
ROLES = (*SERVERS, CALLER)
DEFAULT_DAYS = 365
# Redis is reached by its host name (rediss://HOST:6379), which its certificate must name:
# loopback (`specd up`), compose's service and the k8s StatefulSet's pod; `specd certs --redis-host` adds more.
REDIS_HOSTS = ("localhost", "127.0.0.1", "redis", "redis-0.redis", "redis-0.redis.specd.svc.cluster.local")
# The names clients reach the edge by: this host (`specd up`, compose's ports published on 127.0.0.1)
# unless `specd certs --edge-host` names others.
EDGE_HOSTS = ("localhost", "127.0.0.1")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specd"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))


def _write(path: Path, data: bytes, mode: int) -> None:
    """By a rename: a running service that reads its files again when they change (tls.py) sees the
    old file or the new one, never half of one."""
    staged = path.with_name(f".{path.name}.next")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.chmod(staged, mode)  # O_CREAT's mode applies to new files only
    os.replace(staged, path)


def new_ca(days: int = DEFAULT_DAYS) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("specd CA")
    cert = (_builder(name, name, key, days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _alt_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def issue(directory: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, role: str, client: bool,
          days: int = DEFAULT_DAYS, hosts: tuple[str, ...] = ()) -> list[Path]:
    """`role`'s certificate (naming `specd-<role>` and `hosts`, for TLS clients or servers) and key;
    returns both paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    names = [x509.DNSName(identity(role)), *(_alt_name(h) for h in hosts)]
    cert = (_builder(_name(identity(role)), ca.subject, key, days)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            # which key signed it: strict verifiers (Python 3.13's default context, the webpki profile) require it
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    paths = [directory / cert_file(role), directory / key_file(role)]
    _write(paths[0], cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(paths[1], key_pem, 0o600)
    return paths


def make(directory: Path, days: int = DEFAULT_DAYS, owner: int | None = None, more_clients: tuple[str, ...] = (),
         per_role: bool = False, redis_hosts: tuple[str, ...] = (), edge_hosts: tuple[str, ...] = ()) -> list[Path]:
    """Write ca.pem and every role's certificate and key into `directory` (`per_role`: each role's
    with a copy of ca.pem into `directory/<role>`, a directory one container mounts); returns the files.
    `more_clients`: other client identities the same CA signs (tests: a peer that is not the coordinator).
    `redis_hosts`: names Redis's certificate carries besides REDIS_HOSTS; `edge_hosts`: the edge's
    instead of EDGE_HOSTS."""
    places = {role: directory / role if per_role else directory for role in (*ROLES, *more_clients)}
    # A host name that is a service's identity would let that key pass for the service (the coordinator
    # verifies a replica as `specd-<role>`, whatever its address).
    if taken := sorted({identity(role) for role in places} & {h.lower() for h in (*redis_hosts, *edge_hosts)}):
        raise ValueError(f"{', '.join(taken)}: the services' own names, which no other certificate may carry")
    ca, ca_key = new_ca(days)
    written = []
    for where in dict.fromkeys(places.values()):
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write(where / CA_FILE, ca.public_bytes(serialization.Encoding.PEM), 0o644)
        written.append(where / CA_FILE)
    hosts_of = {"redis": (*REDIS_HOSTS, *redis_hosts), EDGE: edge_hosts or EDGE_HOSTS}
    for role, where in places.items():
        hosts = hosts_of.get(role, ())
        written += issue(where, ca, ca_key, role, client=role == CALLER or role in more_clients, days=days, hosts=hosts)
    if owner is not None:
        for path in {directory, *places.values(), *written}:
            os.chown(path, owner, owner)
    return written
