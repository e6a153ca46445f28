"""Where a pool's replicas are: a fixed list (`host:port,host:port`), a DNS name that resolves
to many (`dns:///target-headless.specd.svc:50053`: a headless Service, `docker compose
--scale`), or a file of addresses, one a line (`file:///run/specd/targets`). Names and files are
resolved again while sessions run, so replicas may come and go."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Protocol, Sequence

DNS_SCHEME, FILE_SCHEME = "dns:///", "file://"


class Resolver(Protocol):
    dynamic: bool  # worth resolving again

    async def resolve(self) -> list[str]: ...


def check_address(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a replica address is host:port, got {address!r}")
    return address


class Static:
    dynamic = False

    def __init__(self, addresses: Sequence[str]):
        if not addresses:
            raise ValueError("at least one replica address is required")
        self.addresses = [check_address(a) for a in addresses]

    async def resolve(self) -> list[str]:
        return list(self.addresses)


class Dns:
    """Every address the name resolves to (A and AAAA records), at one port."""

    dynamic = True

    def __init__(self, name: str):
        self.host, _, port = check_address(name).rpartition(":")
        self.port = int(port)

    async def resolve(self) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        ips = {info[4][0] for info in infos}
        return sorted(f"[{ip}]:{self.port}" if ":" in ip else f"{ip}:{self.port}" for ip in ips)


class AddressFile:
    """One host:port a line (blank lines and # comments skipped), read again on every resolve."""

    dynamic = True

    def __init__(self, path: str):
        self.path = Path(path)

    async def resolve(self) -> list[str]:
        lines = (line.split("#")[0].strip() for line in self.path.read_text().splitlines())
        return [check_address(line) for line in lines if line]


def resolver(spec: str | Sequence[str]) -> Resolver:
    """`dns:///name:port`, `file:///path`, or host:port[,host:port...] (or a list of them)."""
    if not isinstance(spec, str):
        return Static(spec)
    if spec.startswith(DNS_SCHEME):
        return Dns(spec.removeprefix(DNS_SCHEME))
    if spec.startswith(FILE_SCHEME):
        return AddressFile(spec.removeprefix(FILE_SCHEME))
    return Static([a.strip() for a in spec.split(",") if a.strip()])
