"""`vllm serve` servers the user already runs, behind the one `Backend` interface
(`--backend http --engine-url URL`, one URL per server).

The sampler never starts or restarts a server; it routes waves to them, moves weights
into them through their own API, and takes a dead one out of routing.

- Waves are token-in/token-out `POST /v1/completions` requests: the prompt as token ids,
  `n` answers per request, the sampler's sampling parameters spelled out (so a server's
  generation_config defaults change nothing), the wave's seed, `logprobs: 0` (the sampled
  token's logprob) and `return_token_ids`, so answers come back as ids and are never
  re-tokenized; the text is decoded here with the sampler's tokenizer.
- Routing is the Ray pool's (`routing.py`): sticky by prompt with a per-server in-flight
  cap and least-outstanding fallback, re-issued waves first.
- Exact policy versions. A server's `/weight_info` is a free label (`"default"` on a fresh
  server), so the sampler writes its own, `adaptive-rollout/<instance>/v<version>`, with
  `/update_weight_version` after every load, and routes only to servers whose label is the
  committed one: each sample carries the version of the weights that produced it. At
  start-up a fresh server is labelled version 0 (the weights it was started with); one
  that later shows up with another label (a restart, a new server) is loaded with the
  committed weights and labelled before it is routed to.
- Weights under one barrier: every server up is paused (`/pause?mode=wait`), reloads from
  a directory every server can read (`/collective_rpc` `reload_weights` with
  `weights_path`: a directory of links under `--weights-dir` to the version's files),
  is labelled, and resumed. If any server that answers fails to load, every server goes
  back to the committed weights and nothing is committed; a server that does not answer
  is taken out of routing and synced when it is back. Updates name every tensor (the
  server reloads whole checkpoints). Each server's label is read back after the load
  and, with `--engine-compare-checksums`, the servers' `/weight_checker` checksums are
  compared with each other (vLLM names them after its fused run-time tensors, so they
  cannot be compared with the trainer's); a server that disagrees is out of routing until
  a reload makes it agree.
- NCCL (vLLM servers started with `--weight-transfer-config '{"backend":"nccl"}'`), as
  the Ray pool does it: the group spans the servers up when it is formed, each at its
  own rank offset (their `/get_world_size` summed after the trainer's rank 0); an update
  pauses every member, which start, receive (`/update_weights`, all at once: each
  returns once the broadcast arrived) and finish under the new label, then resume. A
  server that goes down, restarts or joins later makes the group stale (the update is
  refused before any transfer); one whose receive fails may hold partial weights and is
  out of routing until reloaded. Weights that came over NCCL exist only in the servers,
  so the last file weights keep their own version (`_source_version`): a server resynced
  meanwhile is given those under that version and is not routed to until the next NCCL
  round or file push brings the committed one.
- Health: probes (`/health`, `/is_paused`, `/weight_info`) every `probe_s`. A server that
  refuses connections, times out or answers 5xx is taken out of routing; its in-flight
  waves are re-issued whole on another server (their partial answers are dropped, so no
  answer is counted twice).

Paths and field names are the servers' dialect (`http_dialects.py`: vLLM's or SGLang's);
servers are listed by URL or found behind headless Services (`engine_service.py`),
re-resolved every `resolve_s` (joining servers are synced before they are routed to,
leaving ones are `gone`).

vLLM servers need `VLLM_SERVER_DEV_MODE=1` (the RL endpoints) and, for the sampler's
logprob semantics, `--logprobs-mode processed_logprobs` (checked at start-up).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson

from sampler_service.aio import TaskSet
from sampler_service.backends.base import (
    BackendHealth,
    CheckpointBackend,
    Completion,
    GenerationAborted,
    HealthState,
    NCCLDescription,
    NCCLUnavailable,
    SamplingParams,
    TensorSpec,
    WeightsNotServed,
    WeightsRejected,
    check_request,
)
from sampler_service.backends.engine_service import (
    ServiceName,
    membership,
    resolve_service,
    system_resolver,
)
from sampler_service.backends.http_dialects import VLLM, Answer, Dialect, NCCLPaths
from sampler_service.backends.routing import DEFAULT_MAX_INFLIGHT, WaveRouter, affinity
from sampler_service.backends.vllm import eos_token_ids, read_checkpoint
from sampler_service.config import ReplicaSettings
from sampler_service.metrics import Metrics
from sampler_service.weights import nccl

log = logging.getLogger(__name__)

ServerState = Literal["starting", "ok", "syncing", "paused", "down", "gone"]
_STATES: tuple[ServerState, ...] = ("starting", "ok", "syncing", "paused", "down", "gone")
_LOGPROBS_MODE = "processed_logprobs"
#: Waves take turns over this many connection pools. A wave holds its connection while it
#: generates, so one pool would hold a connection per wave in flight, and httpx's pool
#: scans every connection it holds when a request starts or ends: at 64 waves in flight
#: that scan was most of the sampler's CPU per wave.
_WAVE_POOLS = 8


@dataclass(frozen=True)
class HTTPPoolSettings:
    """What the HTTP engine pool needs of the serve settings: its servers, and the
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


class ServerError(RuntimeError):
    """A server refused an RL call or answered it with an error."""


class _ServerFailed(RuntimeError):
    """The wave's server was found down while the wave ran (the pool re-issues it)."""


class _ForeignWeights(RuntimeError):
    """The server reported tokens sampled under a label other than the wave's: someone
    else changed its weights. The wave is re-issued and the server resynced."""


@dataclass(eq=False)
class _Server:
    index: int
    url: str
    state: ServerState = "starting"
    label: str | None = None  # its /weight_info answer, as last seen
    model: str = ""  # the served model's name (the `model` field of requests)
    max_model_len: int = 0
    inflight: int = 0
    epoch: int = 0
    #: Moves when the server may have lost its NCCL group: found down, or its label moved
    #: under us (a restart between two probes). A group member whose count moved has left.
    incarnation: int = 0
    #: Its weight-transfer backend (vLLM's `weight_transfer_config`; None: not set), as
    #: /server_info told it when the server was attached.
    transfer: str | None = None
    error: str | None = None
    waves: int = 0
    #: Seconds its finished waves took, in all (the mean is what /v1/stats shows).
    wave_seconds: float = 0.0
    reissued: int = 0
    #: Digest of its /weight_checker checksums, as last computed (--engine-compare-checksums).
    checksum: str | None = None
    #: It read back another label after a load, or its checksums differ from the other
    #: servers': not routed to until it is reloaded (and, comparing, agrees).
    mismatch: bool = False
    probing: bool = False
    recovering: bool = False
    #: Set when the server is found down: its in-flight waves stop waiting and re-issue.
    down: asyncio.Future[None] | None = None
    requests: set[str] = field(default_factory=set)
    #: Requests of ours asked to abort (weight update `abort`): whatever they answer, the
    #: wave is re-issued after the update, never failed.
    aborted: set[str] = field(default_factory=set)

    def detail(self, prefix: str) -> dict[str, Any]:
        return {
            "server": self.index,
            "url": self.url,
            "state": self.state,
            "inflight_samples": self.inflight,
            "policy_version": _parse_label(self.label, prefix),
            "weight_label": self.label,
            "waves": self.waves,
            "mean_wave_s": round(self.wave_seconds / self.waves, 3) if self.waves else None,
            "reissued_waves": self.reissued,
            "weights_checksum": self.checksum[:16] if self.checksum else None,
            "weights_mismatch": self.mismatch,
            "error": self.error,
        }


def _parse_label(label: str | None, prefix: str) -> int | None:
    if label is None or not label.startswith(prefix):
        return None
    try:
        return int(label[len(prefix) :])
    except ValueError:
        return None


class HTTPEngineBackend(CheckpointBackend):
    """See the module docstring."""

    name = "http"
    reads_weight_files = True

    def __init__(
        self,
        model_dir: Path | str,
        settings: HTTPPoolSettings,
        *,
        tokenizer: Any | None = None,
        client: httpx.AsyncClient | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__(model_dir)
        #: Per-server series share the replica metrics (label `replica` = server index).
        self.metrics = metrics or Metrics()
        self.settings = settings
        self._tokenizer = tokenizer
        self._client = client
        #: The clients waves go through (see _WAVE_POOLS); an injected client serves all.
        self._wave_clients: list[httpx.AsyncClient] = [client] if client is not None else []
        self._next_pool = 0
        self._dialect = settings.dialect
        #: Append-only (a server's index is its position, which the router keys on); a
        #: server that left a Service stays as `gone` and comes back if its address does.
        self._servers = [_Server(i, url.rstrip("/")) for i, url in enumerate(settings.urls)]
        self._router: WaveRouter[_Server] = WaveRouter(
            lambda: self._servers,
            self._routable,
            self._charge,
            max_inflight=settings.replica.max_inflight or DEFAULT_MAX_INFLIGHT,
            route=settings.replica.route,
            poll_s=settings.replica.probe_s,
            wait_s=settings.replica.wait_s,
            on_decision=lambda kind: self.metrics.route_decisions.labels(kind).inc(),
        )
        self._prefix = f"adaptive-rollout/{settings.instance_id}/v"
        #: The committed weights' checksum digest, as the servers agreed on it at the load
        #: (None: not compared); a resynced server must match it.
        self._checksum: str | None = None
        #: The directory the last file weights are reloaded from (None: the base model), and
        #: their version: below the committed one when newer weights came over NCCL, which
        #: exist only in the servers (a server that missed them waits for the next round).
        self._source: Path | None = None
        self._source_version = 0
        self._nccl: nccl.NCCLGroup | None = None
        self._nccl_specs: dict[str, TensorSpec] = {}
        self._specs: dict[str, TensorSpec] = {}
        self._required: set[str] = set()
        self._aliases: dict[str, str | None] = {}
        self._eos: list[int] = []
        self._vocab_size = 0
        self._loading = False
        self._started = False
        self._weights_lock = asyncio.Lock()
        self._tasks = TaskSet()

    # -- life cycle -------------------------------------------------------------------
    def label(self, version: int) -> str:
        """The `/weight_info` label of `version` (this sampler's namespace)."""
        return f"{self._prefix}{version}"

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    async def start(self) -> None:
        # httpx logs every request at INFO: a probe per server every probe_s and a line per
        # wave would bury the sampler's own log.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        checkpoint = read_checkpoint(self._model_dir)
        self._specs = dict(checkpoint.specs)
        for alias, canonical in checkpoint.aliases.items():
            self._specs.setdefault(
                alias, checkpoint.specs[canonical or "model.embed_tokens.weight"]
            )
        self._required, self._aliases = set(checkpoint.specs), dict(checkpoint.aliases)
        self._nccl_specs = checkpoint.nccl_specs()[0]
        self._eos = eos_token_ids(self._model_dir)
        if self._tokenizer is not None:
            self._vocab_size = len(self._tokenizer)
        vocab = checkpoint.specs.get("model.embed_tokens.weight")
        if vocab is not None:
            self._vocab_size = int(vocab.shape[0])
        self.settings.weights_dir.mkdir(parents=True, exist_ok=True)
        if self._client is None:
            self._wave_clients = [
                httpx.AsyncClient(
                    timeout=httpx.Timeout(self.settings.request_timeout_s, connect=5.0),
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                )
                for _ in range(_WAVE_POOLS)
            ]
            self._client = self._wave_clients[0]
        deadline = time.monotonic() + self.settings.start_timeout_s
        while True:
            await self._discover()
            results = await asyncio.gather(
                *(self._attach(s) for s in self._servers), return_exceptions=True
            )
            up = [s for s in self._servers if s.state == "ok"]
            refused = [r for r in results if isinstance(r, ServerError)]
            if refused:  # misconfigured, not merely late: say so at once
                raise refused[0]
            if up or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        if not up:
            raise RuntimeError(
                "no engine server answered /health within "
                f"{self.settings.start_timeout_s:.0f}s: "
                + "; ".join(f"{s.url}: {s.error}" for s in self._servers)
            )
        self._started = True
        self._tasks.spawn(self._probe_loop(), "http-engine-probes")
        if self.settings.services:
            self._tasks.spawn(self._discover_loop(), "http-engine-discovery")
        log.info(
            "%d of %d engine servers up: %s",
            len(up),
            len(self._servers),
            ", ".join(f"{s.url} ({s.state})" for s in self._servers),
        )

    async def _attach(self, srv: _Server) -> None:
        """First contact: health, the served model, its logprob semantics, its label."""
        try:
            await self._get(srv, "/health", self.settings.replica.probe_timeout_s)
            models = await self._get(srv, "/v1/models", self.settings.replica.probe_timeout_s)
        except (httpx.HTTPError, ServerError) as exc:
            srv.state, srv.error = "down", repr(exc)
            return
        card = models["data"][0]
        srv.model, srv.max_model_len = str(card["id"]), int(card.get("max_model_len") or 0)
        if self._dialect.server_info is None:
            mode = _LOGPROBS_MODE
        else:
            info = await self._get(srv, self._dialect.server_info, 60.0)
            config = info.get("vllm_config", {})
            mode = config.get("model_config", {}).get("logprobs_mode")
            srv.transfer = (config.get("weight_transfer_config") or {}).get("backend")
        if mode != _LOGPROBS_MODE:
            raise ServerError(
                f"{srv.url} computes logprobs as {mode!r}; start it with --logprobs-mode "
                f"{_LOGPROBS_MODE} (the sampler's per-token logprobs are after temperature, "
                "top-k and top-p)"
            )
        srv.label = await self._weight_label(srv)
        if srv.label == self.label(self._version) and not srv.mismatch:
            await self._route_again(srv)
        elif not self._started and _parse_label(srv.label, self._prefix) is not None:
            # Labelled by an earlier run of this sampler: the weights it restores next
            # (load_weight_files) are not loaded again where they are served already.
            await self._route_again(srv)
        elif srv.label == "default" and not self._started:
            # At start-up a fresh server serves the weights it was started with: version 0.
            await self._set_label(srv, 0)
            await self._route_again(srv)
        else:
            await self._sync(srv)

    async def _route_again(self, srv: _Server) -> None:
        """Route to a server (at start-up, or in a recovery under the weights lock). The
        sampler pauses its servers only inside a load, and no load runs now: a server
        still paused dropped out of a load before its resume (a failed reload, a
        connection lost), so it is resumed first, or its waves would wait forever."""
        if self._dialect.is_paused is not None:
            timeout = self.settings.replica.probe_timeout_s
            if (await self._get(srv, self._dialect.is_paused, timeout))["is_paused"]:
                log.warning("engine server %s is still paused from a load: resuming it", srv.url)
                await self._post(srv, self._dialect.resume)
        self._set_state(srv, "ok")

    async def close(self) -> None:
        await self._tasks.cancel()
        self._router.cancel_all()
        for client in self._wave_clients:
            await client.aclose()

    # -- state ------------------------------------------------------------------------
    def _set_state(self, srv: _Server, state: ServerState) -> None:
        previous, srv.state = srv.state, state
        if state == "ok":
            srv.error = None
            if srv.down is None or srv.down.done():
                srv.down = asyncio.get_running_loop().create_future()
        if previous != state:
            log.info("engine server %s: %s -> %s", srv.url, previous, state)
        label = str(srv.index)
        for name in _STATES:
            self.metrics.replica_state.labels(label, name).set(1.0 if name == state else 0.0)
        version = _parse_label(srv.label, self._prefix)
        self.metrics.replica_policy_version.labels(label).set(-1 if version is None else version)
        self._router.dispatch()

    def _routable(self, srv: _Server) -> bool:
        return (
            srv.state == "ok"
            and srv.label == self.label(self._version)
            and not srv.mismatch
            and not self._loading
        )

    def _charge(self, srv: _Server, n: int) -> None:
        srv.inflight += n
        self.metrics.replica_inflight_samples.labels(str(srv.index)).set(srv.inflight)

    def servers(self) -> list[dict[str, Any]]:
        """Every server as /v1/stats lists it."""
        return [s.detail(self._prefix) for s in self._servers]

    def health(self) -> BackendHealth:
        usable = any(self._routable(s) for s in self._servers) or (
            self._loading and any(s.state == "ok" for s in self._servers)
        )
        detail: dict[str, Any] = {
            "policy_version": self._version,
            "weight_label": self.label(self._version),
            "servers": self.servers(),
        }
        if not usable:
            detail["error"] = "no engine server is up: " + "; ".join(
                f"{s.url}: {s.error}" for s in self._servers
            )
        # The sampler never restarts a server, but its owner may: none up is `degraded`.
        state: HealthState = "ok" if usable else "degraded"
        return BackendHealth(ok=usable, detail=detail, state=state)

    def _fail(self, srv: _Server, epoch: int, error: str) -> None:
        """Take a server out of routing once per failure; its waves re-issue elsewhere."""
        if epoch != srv.epoch or srv.state in ("down", "gone"):
            return
        srv.epoch += 1
        srv.incarnation += 1
        srv.error = error
        if srv.down is not None and not srv.down.done():
            srv.down.set_result(None)
        log.warning("engine server %s is down: %s", srv.url, error)
        self._set_state(srv, "down")

    # -- generation -------------------------------------------------------------------
    def request_body(
        self, srv: _Server, prompt: list[int], n: int, sampling: SamplingParams, request_id: str
    ) -> dict[str, Any]:
        """One wave as the dialect's generate request, stopping at the model's EOS too."""
        stops = (*self._eos, *sampling.stop_token_ids)
        return self._dialect.request(
            srv.model, prompt, n, replace(sampling, stop_token_ids=stops), request_id
        )

    async def generate(
        self,
        prompt_token_ids: list[int],
        n: int,
        sampling: SamplingParams,
        *,
        affinity_key: str | None = None,
    ) -> list[Completion]:
        prompt = list(prompt_token_ids)
        lens = [s.max_model_len for s in self._servers if s.max_model_len]
        check_request(
            prompt,
            n,
            sampling,
            vocab_size=self._vocab_size,
            max_model_len=min(lens) if lens else None,
        )
        key = affinity(prompt, affinity_key)
        reissue = False
        while True:
            srv = await self._router.acquire(key, n, reissue)
            epoch, version, started = srv.epoch, self._version, time.monotonic()
            label = str(srv.index)
            try:
                out = await self._wave(srv, prompt, n, sampling, version)
            except GenerationAborted:
                raise  # a weight update's abort: the scheduler re-issues it after the update
            except _ForeignWeights as exc:
                self._distrust(srv, str(exc))
                srv.reissued += 1
                self.metrics.replica_reissued_waves.labels(label, "foreign_weights").inc()
                self.metrics.replica_wasted_samples.labels(label).inc(n)
                reissue = True
                continue
            except (httpx.TransportError, _ServerFailed, ServerError) as exc:
                self._fail(srv, epoch, repr(exc))
                srv.reissued += 1
                self.metrics.replica_reissued_waves.labels(label, "down").inc()
                self.metrics.replica_wasted_samples.labels(label).inc(n)
                reissue = True
                continue
            finally:
                self._router.release(srv, n)
            elapsed = time.monotonic() - started
            srv.wave_seconds += elapsed
            self.metrics.replica_wave_seconds.labels(label).observe(elapsed)
            self.metrics.replica_generated_tokens.labels(label).inc(
                sum(len(c.token_ids) for c in out)
            )
            return out

    async def _wave(
        self, srv: _Server, prompt: list[int], n: int, sampling: SamplingParams, version: int
    ) -> list[Completion]:
        assert self._wave_clients and srv.down is not None
        self._next_pool = (self._next_pool + 1) % len(self._wave_clients)
        client = self._wave_clients[self._next_pool]
        request_id = f"ar-{uuid.uuid4().hex}"
        body = self.request_body(srv, prompt, n, sampling, request_id)
        call = asyncio.ensure_future(client.post(srv.url + self._dialect.generate, json=body))
        srv.requests.add(request_id)
        try:
            waiters: set[asyncio.Future[Any]] = {call, srv.down}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            srv.requests.discard(request_id)
            if not call.done():
                call.cancel()
        if request_id in srv.aborted:
            srv.aborted.discard(request_id)
            raise GenerationAborted(f"request {request_id} was aborted for a weight update")
        if not call.done() or call.cancelled():
            raise _ServerFailed(f"{srv.url} went down during the wave")
        response = call.result()
        if response.status_code >= 500:
            raise ServerError(f"{srv.url}: {response.status_code} {response.text[:300]}")
        if response.status_code != 200:
            raise ValueError(
                f"{srv.url} refused the wave: {response.status_code} {response.text[:300]}"
            )
        answers = self._dialect.answers(orjson.loads(response.content))
        if len(answers) != n:
            raise GenerationAborted(f"{srv.url} returned {len(answers)} of {n} answers")
        expected = self.label(version)
        if foreign := {x for a in answers for x in a[3] or () if x != expected}:
            raise _ForeignWeights(
                f"{srv.url} sampled tokens under {sorted(foreign)}, not {expected!r}"
            )
        srv.waves += 1
        return [self._completion(a, version) for a in answers]

    def _completion(self, answer: Answer, version: int) -> Completion:
        ids, values, reason, _ = answer
        if reason == "abort":
            raise GenerationAborted("the server aborted the request")
        if reason != "stop" and reason != "length":
            raise RuntimeError(f"the server finished an answer with {reason!r}")
        if len(values) != len(ids):
            raise RuntimeError("the server's token ids and logprobs do not line up")
        text = self._tokenizer.decode(ids, skip_special_tokens=True) if self._tokenizer else ""
        return Completion(ids, values, text, "stop" if reason == "stop" else "length", version)

    async def abort_all(self) -> int:
        """Abort this sampler's in-flight requests on every server (weight update `abort`)."""
        calls, aborted = [], 0
        for srv in self._servers:
            if srv.requests and srv.state == "ok":
                srv.aborted |= srv.requests
                aborted += len(srv.requests)
                calls += [
                    self._post(srv, self._dialect.abort, body)
                    for body in self._dialect.abort_bodies(sorted(srv.requests))
                ]
        await asyncio.gather(*calls, return_exceptions=True)
        return aborted

    # -- HTTP helpers -----------------------------------------------------------------
    async def _get(self, srv: _Server, path: str, timeout: float) -> Any:
        assert self._client is not None
        response = await self._client.get(srv.url + path, timeout=timeout)
        return self._answer(srv, path, response)

    async def _post(
        self, srv: _Server, path: str, body: dict[str, Any] | None = None, timeout: float = 600.0
    ) -> Any:
        assert self._client is not None
        response = await self._client.post(srv.url + path, json=body, timeout=timeout)
        return self._answer(srv, path, response)

    def _answer(self, srv: _Server, path: str, response: httpx.Response) -> Any:
        if response.status_code in (403, 404, 405) and path != "/health":
            raise ServerError(
                f"{srv.url}{path} answered {response.status_code}: {self._dialect.hint}"
            )
        if response.status_code != 200:
            raise ServerError(f"{srv.url}{path}: {response.status_code} {response.text[:500]}")
        return orjson.loads(response.content) if response.content else None

    async def _weight_label(self, srv: _Server) -> str:
        info = await self._get(
            srv, self._dialect.weight_label, self.settings.replica.probe_timeout_s
        )
        return str(info.get("weight_version"))

    async def _set_label(self, srv: _Server, version: int) -> None:
        await self._post(srv, self._dialect.set_label, {"new_version": self.label(version)})
        srv.label = self.label(version)

    async def _reload(self, srv: _Server, source: Path | None) -> None:
        """Reload a server's weights from `source` (None: the base model) and drop its
        prefix cache (blocks computed with the old weights)."""
        path = str(source if source is not None else self._model_dir)
        started = time.monotonic()
        await self._post(
            srv,
            self._dialect.reload,
            self._dialect.reload_body(path),
            timeout=self.settings.request_timeout_s,
        )
        if self._dialect.reset_cache is not None:
            await self._post(srv, self._dialect.reset_cache)
        self.metrics.replica_weight_load_seconds.labels(str(srv.index)).observe(
            time.monotonic() - started
        )

    # -- probes and syncing -----------------------------------------------------------
    async def _discover(self) -> None:
        """Resolve the Services: new addresses join (attached and synced by the probes'
        recovery, so routed to only once they serve the committed label), vanished ones
        are retired (their in-flight waves re-issue elsewhere). A failed lookup changes
        nothing: a DNS hiccup must not empty the pool."""
        if not self.settings.services:
            return
        resolve = self.settings.resolver or system_resolver
        found: list[str] = list(self.settings.urls)
        for service in self.settings.services:
            try:
                found += await asyncio.to_thread(resolve_service, service, resolve)
            except OSError as exc:
                log.warning("engine service %s did not resolve: %r", service, exc)
                return
        present = [s.url for s in self._servers if s.state != "gone"]
        added, retired = membership(present, [u.rstrip("/") for u in found])
        by_url = {s.url: s for s in self._servers}
        for url in retired:
            srv = by_url[url]
            self._fail(srv, srv.epoch, "left the engine service")
            self._set_state(srv, "gone")
            log.info("engine server %s left the service", url)
        for url in added:
            srv = by_url.get(url) or _Server(len(self._servers), url)
            if srv.index == len(self._servers):
                self._servers.append(srv)
            srv.state, srv.label = "down", None
            log.info("engine server %s joined the service", url)
            if self._started:
                self._spawn_recovery(srv)

    async def _discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resolve_s)
            await self._discover()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.replica.probe_s)
            for srv in self._servers:
                if not (srv.probing or srv.recovering or srv.state == "gone"):
                    srv.probing = True
                    self._tasks.spawn(self._probe(srv), f"probe-{srv.index}")

    async def _probe(self, srv: _Server) -> None:
        epoch, seen = srv.epoch, srv.label
        timeout = self.settings.replica.probe_timeout_s
        try:
            await self._get(srv, "/health", timeout)
            if srv.state == "down":  # back (restarted by its owner): attach and sync it
                self._spawn_recovery(srv)
                return
            paused = (
                (await self._get(srv, self._dialect.is_paused, timeout))["is_paused"]
                if self._dialect.is_paused is not None
                else srv.state == "paused"
            )
            label = await self._weight_label(srv)
        except (httpx.HTTPError, ServerError) as exc:
            if srv.state == "down":
                srv.error = repr(exc)
            else:
                self._fail(srv, epoch, repr(exc))
            return
        finally:
            srv.probing = False
        if (
            self._weights_lock.locked()
            or srv.epoch != epoch
            or srv.state == "syncing"
            or srv.label != seen
        ):
            return  # a weight update or a sync owns (or just set) the server's label and pause
        if srv.label is not None and label != srv.label:
            srv.incarnation += 1  # restarted, or relabelled by someone else
        srv.label = label
        if (label != self.label(self._version) or srv.mismatch) and not self._awaits_nccl(srv):
            log.warning("engine server %s carries %r: syncing it", srv.url, label)
            self._set_state(srv, "syncing")
            self._spawn_recovery(srv)
        elif paused != (srv.state == "paused"):
            self._set_state(srv, "paused" if paused else "ok")

    def _spawn_recovery(self, srv: _Server) -> None:
        srv.recovering = True
        self._tasks.spawn(self._recover(srv), f"recover-{srv.index}")

    async def _recover(self, srv: _Server) -> None:
        """Attach a server that came back, or resync one whose label moved, under the
        weights lock (no commit lands meanwhile)."""
        epoch = srv.epoch
        try:
            async with self._weights_lock:
                if srv.state == "gone":
                    return
                if srv.state == "down":
                    await self._attach(srv)
                else:
                    srv.label = await self._weight_label(srv)
                    await self._sync(srv)
        except (httpx.HTTPError, ServerError) as exc:
            if srv.state == "down":
                srv.error = repr(exc)
            else:
                self._fail(srv, epoch, repr(exc))
        finally:
            srv.recovering = False

    async def _sync(self, srv: _Server) -> None:
        """Bring a server to the committed weights and label, then route to it (when
        comparing checksums, only once they are the committed weights' checksums).

        Weights committed over NCCL exist only in the servers that received them: a server
        that missed them gets the last file weights under their own version (never the
        committed one), and is not routed to until the next NCCL round or file push
        brings the committed version.
        """
        if (srv.label != self.label(self._version) or srv.mismatch) and not self._awaits_nccl(srv):
            version = self._source_version
            self._set_state(srv, "syncing")
            await self._reload(srv, self._source)
            await self._set_label(srv, version)
            if version != self._version:
                srv.mismatch = False  # checked against the others at the next NCCL round
                log.warning(
                    "engine server %s loaded the file weights of v%d; v%d came over NCCL: "
                    "it waits for the trainer's next NCCL round",
                    srv.url,
                    version,
                    self._version,
                )
            elif self._checksum is not None:
                srv.mismatch = await self._weights_checksum(srv) != self._checksum
            else:
                srv.mismatch = False
            if srv.mismatch:
                srv.error = f"its checksums of v{version} differ from the other servers'"
                log.warning("engine server %s: %s", srv.url, srv.error)
            elif version == self._version:
                log.info("engine server %s loaded v%d", srv.url, version)
        await self._route_again(srv)

    def _awaits_nccl(self, srv: _Server) -> bool:
        """A server at the last file weights while newer ones came over NCCL: it waits
        for the trainer's next NCCL round (or a file push), not routed to meanwhile."""
        return (
            self._source_version != self._version
            and srv.label == self.label(self._source_version)
            and not srv.mismatch
        )

    # -- weights ----------------------------------------------------------------------
    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        """Write the tensors under the weights dir, then take the path route."""
        from safetensors.torch import save_file

        path = self.settings.weights_dir / f"tensors-v{version}-{uuid.uuid4().hex[:8]}.safetensors"
        await asyncio.to_thread(
            save_file, {k: v.contiguous() for k, v in tensors.items()}, str(path)
        )
        try:
            await self.load_weight_files([str(path)], version, list(tensors))
        finally:
            path.unlink(missing_ok=True)  # the servers have read it (or refused it)

    async def load_weight_files(
        self, files: Sequence[str], version: int, names: Sequence[str]
    ) -> None:
        """Every server up reloads `files` (paths they can read) and serves them as `version`."""
        canonical = {self._aliases.get(n, n) for n in names} - {None}
        missing = sorted(self._required - canonical)
        if missing:
            raise WeightsRejected(
                f"--backend http reloads whole checkpoints: the update lacks {len(missing)} "
                f"tensor(s), e.g. {missing[:3]}"
            )
        async with self._weights_lock:
            source = await asyncio.to_thread(self._link_dir, files, version)
            try:
                checksum = await self._load_all(source, version)
            except BaseException:
                shutil.rmtree(source, ignore_errors=True)
                raise
            old, self._source, self._source_version = self._source, source, version
            self._version, self._checksum = version, checksum
            if old is not None:
                await asyncio.to_thread(shutil.rmtree, old, ignore_errors=True)
        self._router.dispatch()
        log.info("engine servers serving v%d (%s)", version, source)

    def _link_dir(self, files: Sequence[str], version: int) -> Path:
        """A directory holding (links to) exactly the version's files, for `weights_path`.

        Files under the weights dir are linked relatively, so the servers may mount that
        directory at another path.
        """
        root = self.settings.weights_dir
        where = root / f"v{version}-{uuid.uuid4().hex[:8]}"
        where.mkdir(parents=True)
        for i, file in enumerate(files):
            target = Path(file).resolve()
            link = where / f"{i:05d}-{target.name}"
            try:
                os.symlink(os.path.relpath(target, where), link)
            except ValueError:  # another drive
                os.symlink(target, link)
        return where

    async def _load_all(self, source: Path, version: int) -> str | None:
        """Load `version` into every server up under one pause; the servers' agreed
        checksum digest when they are compared."""
        targets = [s for s in self._servers if s.state in ("ok", "paused")]
        if not targets:
            raise WeightsNotServed("no engine server is up to load the weights")
        epochs = {s.index: s.epoch for s in targets}
        self._loading = True
        try:
            await self._each(targets, epochs, lambda s: self._post(s, self._dialect.pause))
            # a server labelled with `version` by an earlier run serves it already
            loaded = [s for s in targets if s.state != "down" and s.label != self.label(version)]
            results = await asyncio.gather(
                *(self._reload(s, source) for s in loaded), return_exceptions=True
            )
            refused = []
            for srv, result in zip(loaded, results, strict=True):
                if isinstance(result, httpx.TransportError):
                    self._fail(srv, epochs[srv.index], repr(result))
                elif isinstance(result, BaseException):
                    refused.append(f"{srv.url}: {result}")
            if refused:
                await self._roll_back([s for s in loaded if s.state != "down"], epochs)
                back = f"every server is back at v{self._version}"
                if self._source_version != self._version:
                    back = (
                        f"v{self._version} came over NCCL: the servers it reached are back at "
                        f"the file weights of v{self._source_version}, not routed to until the "
                        "next NCCL round"
                    )
                raise WeightsNotServed(f"v{version} not committed ({back}): " + "; ".join(refused))
            if all(s.state == "down" for s in targets):
                raise WeightsNotServed(f"no engine server installed v{version}")
            installed = [s for s in loaded if s.state != "down"]
            await self._each(installed, epochs, lambda s: self._set_label(s, version))
            return await self._confirm([s for s in targets if s.state != "down"], epochs, version)
        finally:
            await self._resume(targets, epochs)

    async def _resume(self, servers: list[_Server], epochs: dict[int, int]) -> None:
        """End a load or NCCL round: routing goes on, the servers still up are resumed."""
        self._loading = False
        await self._each(
            [s for s in servers if s.state != "down"],
            epochs,
            lambda s: self._post(s, self._dialect.resume),
        )

    async def _confirm(
        self, servers: list[_Server], epochs: dict[int, int], version: int
    ) -> str | None:
        """After a load: each server's label read back and, with --engine-compare-checksums,
        the servers' checksums compared with each other. A server that reads back another
        label or is outside the largest group of equal checksums is taken out of routing
        (the probes reload it). Returns the agreed digest (None: not compared).

        Raises WeightsNotServed when no server confirms `version`, or when the largest
        groups tie (with two servers that disagree, neither can be trusted); the servers
        are then reloaded with the committed weights by the probes.
        """
        labels = await asyncio.gather(
            *(self._weight_label(s) for s in servers), return_exceptions=True
        )
        confirmed = []
        for srv, label in zip(servers, labels, strict=True):
            if isinstance(label, httpx.TransportError):
                self._fail(srv, epochs[srv.index], repr(label))
            elif label == self.label(version):
                srv.mismatch = False
                confirmed.append(srv)
            else:
                self._distrust(srv, f"read back {label!r} after loading v{version}")
        if not confirmed:
            raise WeightsNotServed(f"no engine server confirmed v{version} (its label)")
        if not self.settings.replica.compare_checksums:
            return None
        digests = await asyncio.gather(
            *(self._weights_checksum(s) for s in confirmed), return_exceptions=True
        )
        groups: dict[str, list[_Server]] = {}
        for srv, digest in zip(confirmed, digests, strict=True):
            if isinstance(digest, BaseException):
                self._distrust(srv, f"no checksums of v{version}: {digest!r}")
            else:
                groups.setdefault(digest, []).append(srv)
        ranked = sorted(groups.items(), key=lambda kv: len(kv[1]), reverse=True)
        tie = len(ranked) > 1 and len(ranked[0][1]) == len(ranked[1][1])
        for _, members in ranked if tie else ranked[1:]:
            for srv in members:
                self._distrust(srv, f"its checksums of v{version} differ from the other servers'")
        if not ranked:
            raise WeightsNotServed(f"no engine server gave checksums of v{version}")
        if tie:
            raise WeightsNotServed(
                f"v{version} not committed: the engine servers' weight checksums disagree "
                + ", ".join(f"{s.url}: {d[:16]}" for d, m in ranked for s in m)
            )
        return ranked[0][0]

    def _distrust(self, srv: _Server, why: str) -> None:
        """Out of routing until the probes reload it with the committed weights."""
        log.warning("engine server %s is out of routing until reloaded: %s", srv.url, why)
        srv.mismatch, srv.error = True, why

    async def _weights_checksum(self, srv: _Server) -> str:
        """One digest of the server's /weight_checker checksums (one per tensor, under
        vLLM's fused run-time names and its parallel ranks)."""
        assert self._dialect.weight_checker is not None  # refused by the settings otherwise
        body = await self._post(
            srv,
            self._dialect.weight_checker,
            {"action": "checksum"},
            timeout=self.settings.request_timeout_s,
        )
        canonical = json.dumps(body["checksums"], sort_keys=True).encode()
        srv.checksum = hashlib.sha256(canonical).hexdigest()
        return srv.checksum

    async def _roll_back(self, servers: list[_Server], epochs: dict[int, int]) -> None:
        """Reload the last file weights, under their own version, into servers that may
        hold refused ones (the committed weights, unless those came over NCCL)."""

        async def one(srv: _Server) -> None:
            await self._reload(srv, self._source)
            await self._set_label(srv, self._source_version)

        await self._each(servers, epochs, one)

    async def _each(self, servers: list[_Server], epochs: dict[int, int], call: Any) -> None:
        """`call(server)` on each at once; one that does not answer is taken out of routing,
        one that answers with an error is resynced by the probes."""
        results = await asyncio.gather(*(call(s) for s in servers), return_exceptions=True)
        for srv, result in zip(servers, results, strict=True):
            if isinstance(result, httpx.TransportError):
                self._fail(srv, epochs[srv.index], repr(result))
            elif isinstance(result, BaseException):
                log.warning("engine server %s: %r", srv.url, result)
                srv.error = repr(result)
                srv.label = None  # unknown: the next probe resyncs it

    # -- NCCL (vLLM servers started with --weight-transfer-config) ----------------------
    def _nccl_paths(self) -> NCCLPaths:
        if self._dialect.nccl is None:
            raise NCCLUnavailable(
                f"--backend http moves weights over NCCL only into vLLM servers (dialect vllm "
                f"or vllm-generate), not {self._dialect.name}: SGLang's distributed update "
                "(/init_weights_update_group, /update_weights_from_distributed) is not "
                "supported by this backend; push weights as files (PUT /v1/weights or "
                "POST /v1/weights/load)"
            )
        return self._dialect.nccl

    async def _nccl_servers(self) -> list[tuple[_Server, int]]:
        """(server, its ranks: /get_world_size) for every server up now. One that does not
        answer is taken out of routing and left out; NCCLUnavailable when none is up or
        one refuses the question."""
        paths = self._nccl_paths()
        up = [s for s in self._servers if s.state in ("ok", "paused")]
        timeout = self.settings.replica.probe_timeout_s
        sizes = await asyncio.gather(
            *(self._get(s, paths.world_size, timeout) for s in up), return_exceptions=True
        )
        out = []
        for srv, size in zip(up, sizes, strict=True):
            if isinstance(size, httpx.TransportError):
                self._fail(srv, srv.epoch, repr(size))
            elif isinstance(size, BaseException):
                raise NCCLUnavailable(f"{srv.url} did not give its world size: {size}")
            else:
                out.append((srv, int(size["world_size"])))
        if not out:
            raise NCCLUnavailable("no engine server is up")
        return out

    async def nccl_describe(self) -> NCCLDescription:
        """The group over the servers up now: their ranks summed, each one's offset."""
        pairs = await self._nccl_servers()
        workers = [n for _, n in pairs]
        return NCCLDescription(
            enabled=all(s.transfer == "nccl" for s, _ in pairs),
            inference_ranks=sum(workers),
            specs=self._nccl_specs,
            required=frozenset(self._required),
            group=self.nccl_group_state(),
            replicas=nccl.nccl_replicas(
                [{"replica": srv.index, "url": srv.url} for srv, _ in pairs], workers
            ),
            stale=self._nccl_stale_reason(),
        )

    def nccl_group_state(self) -> str:
        return nccl.nccl_group_state(self._nccl, self._nccl_stale_reason())

    def _nccl_stale_reason(self) -> str | None:
        """A server's incarnation when it joined: it moves when the server is found down
        or its label moved under us (a restart)."""
        if self._nccl is None:
            return nccl.NO_NCCL_GROUP
        return self._nccl.stale_reason(
            (
                s.index,
                f"engine server {s.url} ({s.state})",
                s.state in ("ok", "paused"),
                s.incarnation,
            )
            for s in self._servers
        )

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        """Form the group: every server up joins at its own rank offset (trainer = 0);
        each call returns once the trainer's rank joined too."""
        paths = self._nccl_paths()
        self._nccl = None
        pairs = await self._nccl_servers()
        off = [
            f"{s.url} (weight_transfer_config: {s.transfer or 'not set'})"
            for s, _ in pairs
            if s.transfer != "nccl"
        ]
        if off:
            raise NCCLUnavailable(
                "NCCL weight transfer is off on " + ", ".join(off) + ": start vllm serve with "
                '--weight-transfer-config \'{"backend":"nccl"}\' (GPU servers)'
            )
        workers = [n for _, n in pairs]
        members: dict[int, Hashable] = {s.index: s.incarnation for s, _ in pairs}
        timeout = self.settings.request_timeout_s
        joins = [
            self._post(srv, paths.init, {"init_info": info}, timeout=timeout)
            for (srv, _), info in zip(
                pairs, nccl.nccl_replica_init_infos(init_info, workers), strict=True
            )
        ]
        results = await asyncio.gather(*joins, return_exceptions=True)
        failed = []
        for (srv, _), result in zip(pairs, results, strict=True):
            if isinstance(result, httpx.TransportError):
                self._fail(srv, srv.epoch, repr(result))
            if isinstance(result, BaseException):
                failed.append(f"{srv.url}: {result!r}")
        if failed:
            raise ServerError("NCCL group not formed: " + "; ".join(failed))
        self._nccl = nccl.NCCLGroup(members, workers)
        log.info("NCCL group formed over the engine servers: %s", self._nccl)

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None:
        """Every member receives the trainer's broadcast under one pause and serves it as
        `version`.

        Refused with NCCLGroupStale before any transfer when the group no longer spans the
        servers up. A member whose receive fails may hold partial weights: it is taken out
        of routing until the probes reload it, and the group is dropped (the trainer forms
        it again). `version` is committed if any member installed it (its label read back
        and, with --engine-compare-checksums, its checksums agreeing with the others').
        """
        paths = self._nccl_paths()
        async with self._weights_lock:
            group = nccl.nccl_group_for_update(self._nccl, self._nccl_stale_reason())
            members = [self._servers[i] for i in group.members]
            epochs = {s.index: s.epoch for s in members}
            failures: list[str] = []
            self._loading = True
            try:
                await self._each(members, epochs, lambda s: self._post(s, self._dialect.pause))
                results = await asyncio.gather(
                    *(self._receive(s, paths, update_info, version) for s in members),
                    return_exceptions=True,
                )
                for srv, result in zip(members, results, strict=True):
                    if isinstance(result, BaseException):
                        failures.append(f"{srv.url}: {result!r}")
                        if isinstance(result, httpx.TransportError):
                            self._fail(srv, epochs[srv.index], repr(result))
                        srv.label = None
                        self._distrust(
                            srv, f"its NCCL receive of v{version} failed (weights may be partial)"
                        )
                installed = [
                    s
                    for s, r in zip(members, results, strict=True)
                    if r is None and s.state != "down"
                ]
                if failures:
                    self._nccl = None
                if installed:
                    try:
                        checksum = await self._confirm(installed, epochs, version)
                    except WeightsNotServed as exc:
                        failures.append(str(exc))
                    else:
                        self._version, self._checksum = version, checksum
            finally:
                await self._resume(members, epochs)
        self._router.dispatch()
        if failures:
            raise RuntimeError(
                f"NCCL weight update to version {version} failed on "
                + "; ".join(failures)
                + f"; serving v{self._version}"
                + ("; form the NCCL group again" if self._nccl is None else "")
            )
        log.info("engine servers serving v%d (NCCL)", version)

    async def _receive(
        self, srv: _Server, paths: NCCLPaths, update_info: dict[str, Any], version: int
    ) -> None:
        """One member's round: start, receive (returns once the broadcast arrived), finish
        under the new label, drop the prefix cache. A failed receive still finishes the
        session, under the label the server had, so the next round can start."""
        started, before = time.monotonic(), srv.label
        timeout = self.settings.request_timeout_s
        await self._post(srv, paths.start, timeout=timeout)
        try:
            await self._post(srv, paths.update, {"update_info": update_info}, timeout=timeout)
        except (httpx.HTTPError, ServerError):
            try:
                await self._post(srv, paths.finish, {"weight_version": before})
            except (httpx.HTTPError, ServerError) as exc:
                log.warning("engine server %s: closing the failed NCCL round: %r", srv.url, exc)
            raise
        await self._post(srv, paths.finish, {"weight_version": self.label(version)})
        srv.label = self.label(version)
        if self._dialect.reset_cache is not None:
            await self._post(srv, self._dialect.reset_cache)
        self.metrics.replica_weight_load_seconds.labels(str(srv.index)).observe(
            time.monotonic() - started
        )

    async def nccl_shutdown(self) -> None:
        """Every member leaves the group (sampling goes on)."""
        paths = self._nccl_paths()
        group, self._nccl = self._nccl, None
        if group is None:
            return
        members = [self._servers[i] for i in group.members]
        results = await asyncio.gather(
            *(self._post(s, paths.shutdown) for s in members if s.state in ("ok", "paused")),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                log.warning("leaving the NCCL group: %r", result)
