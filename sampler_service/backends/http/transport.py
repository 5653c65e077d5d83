"""`vllm serve` (or SGLang) servers the user already runs, as one fleet
(`--backend http --engine-url URL`, one URL per server, or `--engine-service NAME:PORT`).

The sampler never starts or restarts a server: the fleet (`sampler_service.fleet`)
routes waves to them, moves weights into them through their own API and takes a dead
one out of routing until it answers again; each server is one member (`member.py`).
What the servers share is here: the HTTP clients, the checkpoint they serve, the label
namespace, and how an update reaches them.

- Weights go through a directory every server can read (`--weights-dir`): an update is
  a per-version directory of links to its files (files under the weights dir linked
  relatively, so the servers may mount it elsewhere), or of the tensors written there.
  Servers reload whole checkpoints, so an update must name every tensor.
- Servers behind headless Services (`discovery.py`) are re-resolved every `resolve_s`:
  an address that joins is synced before it is routed to, one that leaves is `gone`.

vLLM servers need `VLLM_SERVER_DEV_MODE=1` (the RL endpoints) and, for the sampler's
logprob semantics, `--logprobs-mode processed_logprobs` (checked when attached).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sampler_service.backends.checkpoint import eos_token_ids, read_checkpoint
from sampler_service.backends.http.dialects import VLLM, Dialect
from sampler_service.backends.http.discovery import (
    ServiceName,
    membership,
    resolve_service,
    system_resolver,
)
from sampler_service.backends.http.member import HTTPMember, Servers
from sampler_service.config import ReplicaSettings
from sampler_service.fleet.member import Member, Source, Transport
from sampler_service.fleet.pool import Fleet
from sampler_service.metrics import Metrics
from sampler_service.weights.types import WeightsRejected

log = logging.getLogger(__name__)

#: Answers' requests take turns over this many connection pools. A request holds its
#: connection while it generates, so one pool would hold a connection per answer in
#: flight, and httpx's pool scans every connection it holds when a request starts or
#: ends: at 64 waves of 4 answers in flight, 8 pools left that scan most of the sampler's
#: CPU per wave (5.7 CPU ms per wave against a fake server; 3.0 with 64 pools).
_WAVE_POOLS = 64


@dataclass(frozen=True)
class HTTPPoolSettings:
    """What the HTTP engine fleet needs of the serve settings: its servers, and the
    replica settings (routing, probes) as the serve settings hold them."""

    urls: tuple[str, ...]
    instance_id: str
    #: Where per-version weight directories are made; every server must read it.
    weights_dir: Path
    replica: ReplicaSettings = field(default_factory=ReplicaSettings)
    #: How long one wave may take on a server before it counts as hung.
    request_timeout_s: float = 600.0
    #: How long start-up waits for at least one server's /health.
    start_timeout_s: float = 300.0
    #: The servers' API (paths and field names).
    dialect: Dialect = VLLM
    #: Headless Services whose DNS name lists the servers (one per pod IP), re-resolved
    #: every `resolve_s`: new addresses join (synced before they are routed to), vanished
    #: ones leave.
    services: tuple[ServiceName, ...] = ()
    resolve_s: float = 10.0
    #: How a name becomes addresses (injectable so tests need no DNS server).
    resolver: Callable[[str, int], list[str]] | None = None


class HTTPTransport(Transport):
    """The servers' shared wire: see the module docstring."""

    name = "http"
    reads_weight_files = True
    whole_waves_cheaper = True
    noun = "engine server"
    row_key = "server"
    rows_key = "servers"
    nccl_hint = (
        'start vllm serve with --weight-transfer-config \'{"backend":"nccl"}\' (GPU servers)'
    )

    def __init__(
        self,
        model_dir: Path | str,
        settings: HTTPPoolSettings,
        *,
        tokenizer: Any | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._model_dir = Path(model_dir)
        self.settings = settings
        self._tokenizer = tokenizer
        self._client = client
        self._servers: Servers | None = None

    @property
    def servers(self) -> Servers:
        assert self._servers is not None, "the transport is not open"
        return self._servers

    async def open(self) -> list[Member]:
        # httpx logs every request at INFO: a probe per server every probe_s and a line per
        # wave would bury the sampler's own log.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        s = self.settings
        checkpoint = await asyncio.to_thread(read_checkpoint, self._model_dir)
        s.weights_dir.mkdir(parents=True, exist_ok=True)
        clients = (
            [self._client]
            if self._client is not None
            else [
                httpx.AsyncClient(
                    timeout=httpx.Timeout(s.request_timeout_s, connect=5.0),
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                )
                for _ in range(_WAVE_POOLS)
            ]
        )
        self._servers = Servers(
            s.instance_id,
            self._model_dir,
            checkpoint,
            s.replica,
            s.dialect,
            s.request_timeout_s,
            self._tokenizer,
            clients,
            eos_token_ids(self._model_dir),
            checkpoint.vocab_size or (len(self._tokenizer) if self._tokenizer is not None else 0),
        )
        return [HTTPMember(url, self._servers) for url in s.urls]

    async def close(self) -> None:
        if self._servers is not None and self._client is None:
            for client in self._servers.clients:
                await client.aclose()

    def member(self, name: str) -> Member:
        return HTTPMember(name, self.servers)

    def detail(self, committed: int) -> dict[str, Any]:
        return {"weight_label": self.servers.label(committed)}

    async def roster(self, present: list[str]) -> tuple[list[str], list[str]] | None:
        """The servers the Services list now, beside the URLs given. A failed lookup
        changes nothing: a DNS hiccup must not empty the fleet."""
        if not self.settings.services:
            return None
        resolve = self.settings.resolver or system_resolver
        found: list[str] = list(self.settings.urls)
        for service in self.settings.services:
            try:
                found += await asyncio.to_thread(resolve_service, service, resolve)
            except OSError as exc:
                log.warning("engine service %s did not resolve: %r", service, exc)
                return None
        return membership(present, [url.rstrip("/") for url in found])

    # -- weights ----------------------------------------------------------------------
    def _whole(self, names: Sequence[str]) -> frozenset[str]:
        """The canonical tensors of an update, which must be all of them: the servers
        reload whole checkpoints."""
        checkpoint = self.servers.checkpoint
        canonical = checkpoint.canonical(set(names))
        missing = sorted(set(checkpoint.specs) - canonical)
        if missing:
            raise WeightsRejected(
                f"--backend http reloads whole checkpoints: the update lacks {len(missing)} "
                f"tensor(s), e.g. {missing[:3]}"
            )
        return frozenset(canonical)

    async def stage_files(self, files: Sequence[str], version: int, names: Sequence[str]) -> Source:
        canonical = self._whole(names)
        where = await asyncio.to_thread(self._link_dir, files, version)
        return Source(version, canonical, where)

    async def stage_tensors(self, tensors: Mapping[str, Any], version: int) -> Source:
        from safetensors.torch import save_file

        canonical = self._whole(list(tensors))
        where = self._version_dir(version)
        contiguous = {k: v.contiguous() for k, v in tensors.items()}
        await asyncio.to_thread(save_file, contiguous, str(where / "model.safetensors"))
        return Source(version, canonical, where)

    def _version_dir(self, version: int) -> Path:
        where = self.settings.weights_dir / f"v{version}-{uuid.uuid4().hex[:8]}"
        where.mkdir(parents=True)
        return where

    def _link_dir(self, files: Sequence[str], version: int) -> Path:
        """A directory holding (links to) exactly the version's files, for `weights_path`."""
        where = self._version_dir(version)
        for i, file in enumerate(files):
            target = Path(file).resolve()
            link = where / f"{i:05d}-{target.name}"
            try:
                os.symlink(os.path.relpath(target, where), link)
            except ValueError:  # another drive
                os.symlink(target, link)
        return where

    async def release(self, source: Source) -> None:
        await asyncio.to_thread(shutil.rmtree, source.payload, ignore_errors=True)


def build_http_fleet(
    model_dir: Path | str,
    settings: HTTPPoolSettings,
    *,
    tokenizer: Any | None = None,
    client: httpx.AsyncClient | None = None,
    metrics: Metrics | None = None,
    on_state_change: Callable[[dict[str, Any]], None] | None = None,
) -> Fleet:
    """The fleet of the servers `settings` name (see the module docstring)."""
    transport = HTTPTransport(model_dir, settings, tokenizer=tokenizer, client=client)
    return Fleet(
        transport,
        settings.replica,
        metrics=metrics,
        on_state_change=on_state_change,
        start_wait_s=settings.start_timeout_s,
        roster_s=settings.resolve_s if settings.services else None,
    )
