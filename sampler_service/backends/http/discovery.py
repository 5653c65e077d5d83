"""The servers behind a Kubernetes headless Service, from its DNS name.

A headless Service (`clusterIP: None`) answers its name with one A record per ready pod,
which is what the HTTP engine backend needs: each server's own address (a load-balanced
Service address would pause and reload one random pod). Resolution is pure apart from
the resolver, which callers may inject, so membership changes are unit-testable without
a DNS server.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceName:
    """`NAME:PORT` of a headless Service (NAME as the sampler's pod resolves it)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> ServiceName:
        host, sep, port = text.rpartition(":")
        if not sep or not host or "/" in text or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"engine_service {text!r} must be NAME:PORT (a headless Service)")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def system_resolver(host: str, port: int) -> list[str]:
    """Every IPv4 and IPv6 address `host` resolves to (blocking: call it off the loop)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def resolve_service(
    service: ServiceName, resolve: Callable[[str, int], list[str]] = system_resolver
) -> list[str]:
    """The base URL of each server behind `service`, sorted, one per address."""
    urls = set()
    for address in resolve(service.host, service.port):
        host = f"[{address}]" if ":" in address else address
        urls.add(f"http://{host}:{service.port}")
    return sorted(urls)


def membership(known: Iterable[str], found: Sequence[str]) -> tuple[list[str], list[str]]:
    """(URLs to add, URLs to retire) to go from the `known` servers to the `found` ones."""
    known_set, found_set = set(known), set(found)
    return sorted(found_set - known_set), sorted(known_set - found_set)
