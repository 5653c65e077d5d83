"""One inference server the user runs, driven over its own HTTP API: the fleet's member
for `--backend http` (what every server shares, and the fleet around them: `transport.py`).

- Waves are token-in/token-out requests (`POST /v1/completions` for vLLM) under ids of
  ours: the prompt as token ids, every sampling parameter spelled out (a server's
  generation_config changes nothing), token ids and logprobs back, never re-tokenized.
  A streamed wave is one request per answer, each with its seed (`base.answer_seed`), as
  servers abort the n answers of one request together; a wave read whole is one request.
- A cancel aborts requests through the dialect's abort endpoint (vLLM's `/abort_requests`,
  under the ids the server runs them as); each answer comes back as its request returns,
  aborted, with what it had decoded. If that call fails, the requests' connections are
  closed (aborting them in vLLM's server) and they come back aborted with nothing counted.
- Versions are labels. A server's `/weight_info` is a free label (`"default"` on a fresh
  server): the sampler writes its own, `adaptive-rollout/<instance>/v<version>`, after
  every load, and reads it back; a label of another instance is no version of ours.
- Weights reload from a directory every server can read (`reload_weights` with
  `weights_path`, or the base model's own directory), then the prefix cache is dropped.
- NCCL (vLLM servers started with `--weight-transfer-config '{"backend":"nccl"}'`): the
  server's ranks, its join, and one round (start, receive, finish under the new label).
  A failed receive leaves part of the round (`PartialWeights`): reloaded before routing.
- A server that refuses connections, times out or answers a wave with 5xx is down
  (`MemberDown`); one whose `weight_versions` spans (`vllm-generate`) differ from the
  wave's label had its weights changed by someone else (`ForeignWeights`), unless the
  later labels are those this member set at `continue` updates it was frozen for: the
  answer's `version_spans`.

Paths and field names are the server's dialect (`dialects.py`: vLLM's or SGLang's).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from sampler_service.backends.base import (
    Completion,
    ContinueKV,
    FinishReason,
    GenerationAborted,
    PauseMode,
    RequestWave,
    SamplingParams,
    Wave,
    WaveRequest,
    WholeWave,
    aborted,
    answer_seed,
    check_request,
    versions_of,
)
from sampler_service.backends.checkpoint import Checkpoint
from sampler_service.backends.http.dialects import VLLM, Answer, Dialect, NCCLPaths
from sampler_service.config import ReplicaSettings
from sampler_service.errors import NotSupported
from sampler_service.fleet.member import (
    Attached,
    ForeignWeights,
    MemberDown,
    Misconfigured,
    PartialWeights,
    Probe,
    Source,
)
from sampler_service.weights.types import NCCLDescription, NCCLUnavailable

log = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"
#: The finish reasons of an answer the sampler keeps (a request it aborted included).
_FINISHED: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def weight_label(instance_id: str, version: int) -> str:
    """The `/weight_info` label of `version` in a sampler instance's namespace."""
    return f"adaptive-rollout/{instance_id}/v{version}"


class ServerError(RuntimeError):
    """A server refused an RL call or answered it with an error."""


@dataclass
class Servers:
    """What every server's member shares: the settings, the clients, the checkpoint the
    servers serve, and the label namespace."""

    instance_id: str
    model_dir: Path
    checkpoint: Checkpoint
    replica: ReplicaSettings
    dialect: Dialect = VLLM
    request_timeout_s: float = 600.0
    tokenizer: Any | None = None
    #: The first serves the RL calls; waves take turns over all of them.
    clients: list[httpx.AsyncClient] = field(default_factory=list)
    eos: list[int] = field(default_factory=list)
    #: Checked before a wave is sent: the checkpoint's embedding rows, else the tokenizer's.
    vocab_size: int = 0
    _turn: int = field(default=0, init=False)

    def label(self, version: int) -> str:
        return weight_label(self.instance_id, version)

    def version(self, label: str | None) -> int | None:
        """The version a label of ours names; None for any other label."""
        prefix = self.label(0)[:-1]
        if label is None or not label.startswith(prefix):
            return None
        try:
            return int(label[len(prefix) :])
        except ValueError:
            return None

    def wave_client(self) -> httpx.AsyncClient:
        self._turn = (self._turn + 1) % len(self.clients)
        return self.clients[self._turn]


class HTTPMember:
    """One server: see the module docstring."""

    restartable = False
    cancels_answers = True

    def __init__(self, url: str, servers: Servers) -> None:
        self.name = self.address = url.rstrip("/")
        self._servers = servers
        self._dialect = servers.dialect
        self.model = ""  # the served model's name (the `model` field of requests)
        self.max_model_len = 0
        #: Its weight-transfer backend (vLLM's `weight_transfer_config`; None: not set),
        #: as /server_info told it at attach.
        self.transfer: str | None = None
        #: Its scheduling policy, as /server_info told it at attach (None: a server kind
        #: that reports none). Answers carry their priority only to a `priority` server:
        #: vLLM documents a priority other than 0 as an error under `fcfs` (0.32 ignores it).
        self.scheduling_policy: str | None = None
        self.label_text: str | None = None  # its label, as last seen or set
        self.checksum_digest: str | None = None  # of its /weight_checker checksums
        self._paused = False  # by our own calls: a server without a pause query
        self.requests: set[str] = set()
        #: Requests of ours asked to abort (a cancel, or a weight update's `abort`): an
        #: error they answer with is an answer aborted with nothing counted, never a
        #: failed member.
        self.aborted: set[str] = set()
        #: How the server's running requests were frozen for the update under way
        #: (`keep` or `recompute`; None: not frozen).
        self._frozen: PauseMode | None = None
        #: Labels set at `continue` updates: an answer running across one has it in its
        #: spans, never a foreign reload's.
        self._continued: set[str] = set()

    @property
    def continues(self) -> frozenset[ContinueKV]:
        return self._dialect.continues

    @property
    def orders_by_priority(self) -> bool:
        """The server was started with `--scheduling-policy priority`."""
        return self.scheduling_policy == "priority"

    def describe(self) -> dict[str, Any]:
        digest = self.checksum_digest
        return {
            "url": self.address,
            "weight_label": self.label_text,
            "weights_checksum": digest[:16] if digest else None,
            "scheduling_policy": self.scheduling_policy,
        }

    # -- HTTP -------------------------------------------------------------------------
    async def _get(self, path: str, timeout: float) -> Any:
        try:
            response = await self._servers.clients[0].get(self.address + path, timeout=timeout)
        except httpx.TransportError as exc:
            raise MemberDown(f"{self.address}{path}: {exc!r}") from exc
        return self._answer(path, response)

    async def _post(
        self, path: str, body: dict[str, Any] | None = None, timeout: float = 600.0
    ) -> Any:
        client = self._servers.clients[0]
        try:
            response = await client.post(self.address + path, json=body, timeout=timeout)
        except httpx.TransportError as exc:
            raise MemberDown(f"{self.address}{path}: {exc!r}") from exc
        return self._answer(path, response)

    def _answer(self, path: str, response: httpx.Response) -> Any:
        if response.status_code in (403, 404, 405) and path != "/health":
            raise ServerError(
                f"{self.address}{path} answered {response.status_code}: {self._dialect.hint}"
            )
        if response.status_code != 200:
            raise ServerError(f"{self.address}{path}: {response.status_code} {response.text[:500]}")
        return orjson.loads(response.content) if response.content else None

    # -- attach and probes ------------------------------------------------------------
    async def attach(self) -> Attached:
        """Health, the served model, its logprob semantics and transfer, its label."""
        timeout = self._servers.replica.probe_timeout_s
        try:
            await self._get("/health", timeout)
            models = await self._get("/v1/models", timeout)
        except ServerError as exc:
            raise MemberDown(repr(exc)) from exc
        card = models["data"][0]
        self.model, self.max_model_len = str(card["id"]), int(card.get("max_model_len") or 0)
        try:
            mode = await self._read_server_info()
        except ServerError as exc:
            raise Misconfigured(str(exc)) from exc
        if mode != LOGPROBS_MODE:
            raise Misconfigured(
                f"{self.address} computes logprobs as {mode!r}; start it with --logprobs-mode "
                f"{LOGPROBS_MODE} (the sampler's per-token logprobs are after temperature, "
                "top-k and top-p)"
            )
        label, paused = await self._label_and_pause()
        return Attached(
            version=self._servers.version(label),
            fresh=label == "default",
            paused=paused,
            model_name=str(self._servers.model_dir),
            specs=self._servers.checkpoint.weight_specs(),
        )

    async def _read_server_info(self) -> str | None:
        """The server's weight transfer and scheduling policy, and its logprobs mode."""
        if self._dialect.server_info is None:
            return LOGPROBS_MODE
        config = (await self._get(self._dialect.server_info, 60.0)).get("vllm_config", {})
        self.transfer = (config.get("weight_transfer_config") or {}).get("backend")
        policy = (config.get("scheduler_config") or {}).get("policy")
        self.scheduling_policy = str(policy) if policy is not None else None
        mode = config.get("model_config", {}).get("logprobs_mode")
        return str(mode) if mode is not None else None

    async def _label_and_pause(self) -> tuple[str, bool]:
        timeout = self._servers.replica.probe_timeout_s
        try:
            if self._dialect.is_paused is not None:
                self._paused = (await self._get(self._dialect.is_paused, timeout))["is_paused"]
            info = await self._get(self._dialect.weight_label, timeout)
        except ServerError as exc:
            raise MemberDown(repr(exc)) from exc
        self.label_text = str(info.get("weight_version"))
        return self.label_text, self._paused

    async def recover(self, kill: bool) -> Attached:
        return await self.attach()  # the sampler never restarts a server: its owner does

    async def probe(self) -> Probe:
        try:
            await self._get("/health", self._servers.replica.probe_timeout_s)
        except ServerError as exc:
            raise MemberDown(repr(exc)) from exc
        label, paused = await self._label_and_pause()
        return Probe(True, self._servers.version(label), paused=paused)

    # -- waves ------------------------------------------------------------------------
    def request_body(
        self, prompt: list[int], n: int, sampling: SamplingParams, request_id: str
    ) -> dict[str, Any]:
        """A request of `n` answers in the dialect's words, stopping at the model's EOS too."""
        stops = (*self._servers.eos, *sampling.stop_token_ids)
        return self._dialect.request(
            self.model, prompt, n, replace(sampling, stop_token_ids=stops), request_id
        )

    def generate(self, request: WaveRequest, version: int) -> Wave:
        prompt_token_ids, n, sampling = request.prompt_token_ids, request.n, request.sampling
        check_request(
            prompt_token_ids,
            n,
            sampling,
            vocab_size=self._servers.vocab_size,
            max_model_len=self.max_model_len or None,
        )
        base = f"ar-{uuid.uuid4().hex}"
        ordered = self.orders_by_priority and bool(request.priorities)
        if request.whole:  # nothing to cancel alone: one request, parsed once by the server
            priority = request.priority() if ordered else None
            return WholeWave(
                self._request(prompt_token_ids, sampling, base, version, n, priority), n
            )
        ids = [f"{base}-{i}" for i in range(n)]

        async def one(index: int) -> Completion:
            own = replace(sampling, seed=answer_seed(sampling.seed, index))
            priority = request.priority(index) if ordered else None
            [answer] = await self._request(prompt_token_ids, own, ids[index], version, 1, priority)
            return answer

        async def cancel(indices: list[int]) -> None:
            asked = [ids[i] for i in indices]
            try:
                await self._abort(asked, self._servers.replica.probe_timeout_s)
            except (MemberDown, ServerError) as exc:
                log.warning("%s: closing requests the abort did not reach: %r", self.address, exc)
                wave.close_requests(indices, version)

        wave = RequestWave(n, one, cancel)
        return wave

    async def _request(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        request_id: str,
        version: int,
        n: int,
        priority: int | None = None,
    ) -> list[Completion]:
        """One request of n answers (with its engine priority where one is given), to its
        answers (aborted, with what they had decoded, where it was asked to abort)."""
        body = self.request_body(prompt, n, sampling, request_id)
        if priority is not None:  # both vLLM endpoints read it at the body's top level
            body["priority"] = priority
        expected = self._servers.label(version)
        if self._dialect.cache_salt is not None:  # no cached block of other weights is read
            body[self._dialect.cache_salt] = expected.replace("/", "-")  # '/' is refused
        self.requests.add(request_id)
        try:
            response = await self._servers.wave_client().post(
                self.address + self._dialect.generate, json=body
            )
        except httpx.TransportError as exc:
            if request_id in self.aborted:
                return [aborted(version) for _ in range(n)]
            raise MemberDown(f"{self.address} lost the wave: {exc!r}") from exc
        finally:
            self.requests.discard(request_id)
            stopped = request_id in self.aborted
            self.aborted.discard(request_id)
        if response.status_code != 200 and stopped:
            return [aborted(version) for _ in range(n)]
        if response.status_code >= 500:
            raise MemberDown(f"{self.address}: {response.status_code} {response.text[:300]}")
        if response.status_code != 200:
            raise ValueError(
                f"{self.address} refused the wave: {response.status_code} {response.text[:300]}"
            )
        answers = self._dialect.answers(orjson.loads(response.content))
        if len(answers) != n:
            raise GenerationAborted(f"{self.address} returned {len(answers)} of {n} answers")
        # Each run of tokens is under the wave's label, or one set at a `continue` update
        # the answer ran across (or waited through).
        ours = {expected} | {
            label
            for label in self._continued
            if (v := self._servers.version(label)) is not None and v > version
        }
        if foreign := {label for a in answers for label, _ in a[3] or () if label not in ours}:
            raise ForeignWeights(
                f"{self.address} sampled tokens under {sorted(foreign)}, not {expected!r}"
            )
        return [self._completion(answer, version) for answer in answers]

    def _completion(self, answer: Answer, version: int) -> Completion:
        ids, values, reason, labelled = answer
        spans = [(self._servers.version(label), start) for label, start in labelled or ()]
        oldest, version_spans = versions_of([(v, a) for v, a in spans if v is not None], version)
        finish = _FINISHED.get(reason or "")
        if finish is None:
            raise RuntimeError(f"the server finished an answer with {reason!r}")
        if len(values) != len(ids):
            raise RuntimeError("the server's token ids and logprobs do not line up")
        tokenizer = self._servers.tokenizer
        text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else ""
        return Completion(ids, values, text, finish, oldest, version_spans=version_spans)

    async def _abort(self, ids: list[str], timeout: float) -> None:
        """Ask the server to abort these requests of ours, under the ids it runs them as."""
        self.aborted.update(ids)
        bodies = self._dialect.abort_bodies(ids)
        calls = (self._post(self._dialect.abort, body, timeout) for body in bodies)
        results = await asyncio.gather(*calls, return_exceptions=True)
        if failed := [r for r in results if isinstance(r, BaseException)]:
            raise failed[0]

    async def abort(self) -> int:
        """Abort this sampler's requests on the server: each answer comes back aborted,
        with what it had decoded. Returns how many requests it asked to abort."""
        ids = sorted(self.requests)
        if ids:
            with contextlib.suppress(MemberDown, ServerError):
                await self._abort(ids, self._servers.replica.probe_timeout_s)
        return len(ids)

    # -- the weight barrier -----------------------------------------------------------
    async def pause(self, mode: PauseMode) -> None:
        """`keep` and `recompute` both freeze the running requests (`/pause?mode=keep`);
        the load then keeps their cache or drops it (`load`)."""
        frozen = mode in ("keep", "recompute")
        if frozen and mode not in self._dialect.continues:
            raise NotSupported(f"{self._dialect.name} servers do not continue answers ({mode})")
        if not frozen and mode not in self._dialect.pause_modes:
            raise NotSupported(f"{self._dialect.name} servers do not pause with mode {mode}")
        await self._post(self._dialect.pause.format(mode="keep" if frozen else mode))
        self._paused, self._frozen = True, mode if frozen else None

    async def resume(self) -> None:
        await self._post(self._dialect.resume)
        self._paused, self._frozen = False, None

    async def load(self, source: Source | None, version: int) -> None:
        """Reload from the source's directory (None: the base model's), then drop the
        prefix cache (blocks computed with the old weights; running requests frozen by
        `recompute` are prefilled again), unless `keep` froze them: their cache stays, and
        new requests read none of it (their cache salt is their label)."""
        path = str(source.payload if source is not None else self._servers.model_dir)
        timeout = self._servers.request_timeout_s
        await self._post(self._dialect.reload, self._dialect.reload_body(path), timeout=timeout)
        if self._dialect.reset_cache is not None and self._frozen != "keep":
            await self._post(self._dialect.reset_cache)

    async def label(self) -> int | None:
        label, _ = await self._label_and_pause()
        return self._servers.version(label)

    async def set_label(self, version: int) -> None:
        label = self._servers.label(version)
        await self._post(self._dialect.set_label, {"new_version": label})
        self._labelled(label)

    def _labelled(self, label: str) -> None:
        """The server carries `label` now; one set at a `continue` update may label the
        later spans of the answers it froze."""
        self.label_text = label
        if self._frozen is not None:
            self._continued.add(label)

    async def checksum(self) -> str:
        """One digest of the server's /weight_checker checksums (one per tensor, under
        vLLM's fused run-time names and its parallel ranks)."""
        if self._dialect.weight_checker is None:
            raise NotSupported(f"{self._dialect.name} servers compute no weight checksums")
        timeout = self._servers.request_timeout_s
        body = await self._post(self._dialect.weight_checker, {"action": "checksum"}, timeout)
        canonical = json.dumps(body["checksums"], sort_keys=True).encode()
        self.checksum_digest = hashlib.sha256(canonical).hexdigest()
        return self.checksum_digest

    # -- NCCL -------------------------------------------------------------------------
    def _nccl_paths(self) -> NCCLPaths:
        if self._dialect.nccl is None:
            raise NCCLUnavailable(
                f"--backend http moves weights over NCCL only into vLLM servers, not "
                f"{self._dialect.name}: SGLang's distributed update is not supported by this "
                "backend; push weights as files (PUT /v1/weights or POST /v1/weights/load)"
            )
        return self._dialect.nccl

    async def nccl_ranks(self) -> NCCLDescription:
        paths = self._nccl_paths()
        size = await self._get(paths.world_size, self._servers.replica.probe_timeout_s)
        specs, required = self._servers.checkpoint.nccl_specs()
        return NCCLDescription(
            enabled=self.transfer == "nccl",
            inference_ranks=int(size["world_size"]),
            specs=specs,
            required=frozenset(required),
        )

    async def nccl_join(self, init_info: dict[str, Any]) -> None:
        timeout = self._servers.request_timeout_s
        await self._post(self._nccl_paths().init, {"init_info": init_info}, timeout=timeout)

    async def nccl_receive(self, update_info: dict[str, Any], version: int) -> None:
        """Start, receive (returns once the broadcast arrived), finish under the new
        label, drop the prefix cache. A failed receive still finishes the session, under
        the label the server had, so the next round can start."""
        paths, before = self._nccl_paths(), self.label_text
        timeout = self._servers.request_timeout_s
        try:
            await self._post(paths.start, timeout=timeout)
            try:
                await self._post(paths.update, {"update_info": update_info}, timeout=timeout)
            except (MemberDown, ServerError):
                try:
                    await self._post(paths.finish, {"weight_version": before})
                except (MemberDown, ServerError) as exc:
                    log.warning("%s: closing the failed NCCL round: %r", self.address, exc)
                raise
            label = self._servers.label(version)
            await self._post(paths.finish, {"weight_version": label})
            self._labelled(label)
            if self._dialect.reset_cache is not None and self._frozen != "keep":
                await self._post(self._dialect.reset_cache)
        except ServerError as exc:
            raise PartialWeights(str(exc)) from exc

    async def nccl_leave(self) -> None:
        await self._post(self._nccl_paths().shutdown)

    async def close(self) -> None:
        """The clients are the transport's."""
