"""The service layer: everything the HTTP routes call, and nothing about HTTP.

Composes engine, dataset, verifiers, scheduler, durable store and outbox, owns their
life cycle, and turns every client mistake into a `ServiceError` with a status code, so
routes stay thin (parse, call, map errors).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from sampler_service import episodes
from sampler_service.aio import wait_event
from sampler_service.backends.base import Backend, Completion
from sampler_service.config import (
    ConfigError,
    SamplerConfig,
    ServeSettings,
    apply_step,
    check_consistency,
    merge_patch,
    overridden_by_saved,
    validate_config,
)
from sampler_service.dataset import Dataset, DatasetError, PromptRow
from sampler_service.encoding import Encoding
from sampler_service.environments.render import check_prefix_preserving
from sampler_service.errors import ServiceError
from sampler_service.metrics import Metrics
from sampler_service.outbox import Delivered, Outbox, lease_consumer, stream_consumer
from sampler_service.replay import KEY_PREFIX as REPLAY_KEY_PREFIX
from sampler_service.scheduler import STATE_KEY, Scheduler
from sampler_service.state_dir import StateDirError, fingerprint, open_state_dir
from sampler_service.store import ACKED_KEY, AsyncStore, Store, StoredFrame, StoredGroup
from sampler_service.verifiers.base import Verdict
from sampler_service.verifiers.pool import VerifierPool
from sampler_service.weights.manager import WeightPlaces, WeightsManager
from trainer_client.contract import features as wire_features
from trainer_client.contract.protocol import AckResponse, Group, Health, Heartbeat
from trainer_client.contract.wire import pack_group, unpack_group

log = logging.getLogger(__name__)

#: /v1/stats `rates` are averaged over this window.
RATE_WINDOW_S = 60.0
#: /v1/stats `staleness` covers this many of the last delivered groups.
STALENESS_WINDOW = 100


class VerifierSpecError(RuntimeError):
    """A verifier named by --verifier or by a data row cannot be loaded."""


class StartupError(RuntimeError):
    """The sampler cannot start with what it was given; the message says why, for the user."""


class StoreSink:
    """Scheduler sink that persists groups in SQLite and offers frames to the outbox.

    Each group is encoded once for its frame, and those bytes are what the store keeps
    and the stream sends. A group that completes its frame as it finishes (frames of one
    group, the default) goes to SQLite once, framed; only a group that waits for the rest
    of its frame is stored as pending first.
    """

    def __init__(self, store: AsyncStore, outbox: Outbox) -> None:
        self._store = store
        self._outbox = outbox
        self._pending: set[str] = set()  # stored, not yet framed

    @property
    def pending(self) -> int:
        return len(self._pending)

    def remember(self, group_id: str) -> None:
        """A group stored as pending (now or before a restart)."""
        self._pending.add(group_id)

    async def add_pending(self, group: Group, state: dict[str, Any] | None) -> None:
        items = state
        await self._store.call(
            self._store.sync.add_pending, group.group_id, pack_group(group), items
        )
        self.remember(group.group_id)

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        members = [(g.group_id, pack_group(g)) for g in groups]
        batch_id = groups[0].batch_id if groups else uuid.uuid4().hex
        items = state
        seqs = await self._store.call(self._store.sync.frame, batch_id, members, dropped, items)
        self._pending.difference_update(dropped)
        self._pending.difference_update(gid for gid, _ in members)
        stored = [
            _stored(seq, g, payload)
            for seq, g, (_, payload) in zip(seqs, groups, members, strict=True)
        ]
        if stored:
            self._outbox.offer(StoredFrame(batch_id, stored))

    def buffered(self) -> int:
        return self._outbox.ready_groups + self._outbox.leased_groups


def _stored(seq: int, group: Group, payload: bytes) -> StoredGroup:
    return StoredGroup(
        seq, group.group_id, payload, group.policy_version_min, group.prompt_id, group.domain
    )


def _described(stored: StoredGroup) -> StoredGroup:
    """A stored group with its version and prompt read back from its payload (a restart)."""
    return _stored(stored.seq, unpack_group(stored.payload), stored.payload)


def _load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _context_length(model_dir: Path) -> int | None:
    """The model's context length from its config.json, if it states one."""
    try:
        config = orjson.loads((model_dir / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def _instance_id(state_dir: Path) -> str:
    """This sampler's id, kept in its state dir: a restarted sampler finds its replicas."""
    path = state_dir / "instance_id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()


def _engine_factory(settings: ServeSettings) -> Any:
    """A picklable recipe for one engine, built where it runs (a Ray actor)."""
    if settings.backend == "vllm":
        from sampler_service.backends.vllm import VLLMBackend

        return functools.partial(VLLMBackend, settings.model, seed=settings.seed, **settings.vllm)
    from sampler_service.backends.hf import HFBackend

    return functools.partial(
        HFBackend, settings.model, device=settings.device, dtype=settings.dtype
    )


def build_replica_pool(
    settings: ServeSettings,
    metrics: Metrics,
    on_state_change: Callable[[dict[str, Any]], None] | None = None,
) -> Backend:
    """Engine replicas as Ray actors; the only place the service imports Ray."""
    # Ray's C++ core would print a stack dump on every SIGTERM ("*** SIGTERM received ...
    # PC: @ epoll_pwait"), which reads as a crash: the sampler handles SIGTERM itself, as
    # a clean shutdown. Ray reads this when it is imported (and a local Ray's processes
    # inherit it).
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        from sampler_service.backends.ray_pool import RayPoolBackend
    except ImportError as exc:
        raise RuntimeError(
            f"--replicas {settings.replica.count} / --ray-address need Ray: "
            "pip install 'adaptive-rollout[ray]'"
        ) from exc

    return RayPoolBackend(
        _engine_factory(settings),
        settings.replica,
        instance_id=_instance_id(settings.state_dir),
        torch_threads=settings.torch_threads,
        metrics=metrics,
        on_state_change=on_state_change,
    )


def build_http_backend(settings: ServeSettings, tokenizer: Any, metrics: Metrics) -> Backend:
    """`vllm serve` servers the user runs (`--engine-url`), driven over HTTP."""
    from sampler_service.backends.engine_service import ServiceName
    from sampler_service.backends.http_dialects import DIALECTS
    from sampler_service.backends.http_engine import HTTPEngineBackend, HTTPPoolSettings

    assert settings.weights_dir is not None  # required by ServeSettings
    pool = HTTPPoolSettings(
        urls=tuple(settings.engine_url),
        instance_id=_instance_id(settings.state_dir),
        weights_dir=settings.weights_dir,
        replica=settings.replica,
        dialect=DIALECTS[settings.engine_dialect],
        services=tuple(ServiceName.parse(name) for name in settings.engine_service),
        resolve_s=settings.engine_resolve_s,
    )
    return HTTPEngineBackend(settings.model, pool, tokenizer=tokenizer, metrics=metrics)


def build_backend(settings: ServeSettings, tokenizer: Any, metrics: Metrics) -> Backend:
    if settings.backend == "http":
        return build_http_backend(settings, tokenizer, metrics)
    if settings.backend == "vllm":
        from sampler_service.backends.vllm import VLLMBackend

        return VLLMBackend(settings.model, tokenizer=tokenizer, seed=settings.seed, **settings.vllm)
    from sampler_service.backends.hf import HFBackend

    if settings.hf_engine == "process":
        from sampler_service.backends.engine_process import EngineProcess

        # The child loads the tokenizer itself (from the model directory) for response texts.
        factory = functools.partial(
            HFBackend, settings.model, device=settings.device, dtype=settings.dtype
        )
        return EngineProcess(factory, torch_threads=settings.torch_threads)
    return HFBackend(
        settings.model, device=settings.device, dtype=settings.dtype, tokenizer=tokenizer
    )


class SamplerService:
    def __init__(
        self,
        settings: ServeSettings,
        initial_config: SamplerConfig | None = None,
        backend: Backend | None = None,
        given: frozenset[str] = frozenset(),
    ) -> None:
        """`given`: the top-level config keys the command line set (--config, --set),
        named in a warning when the config saved by an earlier run overrides them."""
        self.settings = settings
        self.started_at = time.time()
        self.metrics = Metrics()
        self._initial_config = initial_config or SamplerConfig()
        self._given = given
        self._backend = backend
        self.ready = False
        self._config_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        # Live streams: token -> (consumer, heartbeat_s, when its socket last took a message).
        self._streams: dict[object, tuple[str, float, float]] = {}
        #: The wire features each live stream declared (token -> names).
        self._stream_features: dict[object, frozenset[str]] = {}
        self._closing = asyncio.Event()
        #: Groups acked since the state dir was created (schedules key on it).
        self.trained_groups = 0
        #: Steps of the live schedule already applied (or skipped); they never run again.
        self._schedule_applied = 0
        self._engine_failure_logged = False
        self._prepared = False
        self._env_factories: dict[str, Any] = {}
        #: One line on what this process delivered, set when it stops (the CLI prints it).
        self.shutdown_summary: str | None = None
        self._acked_at_start = 0
        self._event_tasks: set[asyncio.Task[Any]] = set()
        #: Each recently delivered group's lag: served version at delivery minus its oldest
        #: sample's (last, mean, max and histogram in /v1/stats).
        self._lags: deque[int] = deque(maxlen=STALENESS_WINDOW)
        self.groups_delivered = 0
        #: Groups per training step declared by consumers (`groups_per_step`): consumer ->
        #: (groups, until when). A stream's holds while it lives; a lease caller's for a
        #: lease TTL after its last call.
        self._declared_steps: dict[str, tuple[int, float]] = {}
        #: (monotonic time, groups emitted, answers, tokens, groups acked), once a second.
        self._rate_samples: deque[tuple[float, int, int, int, int]] = deque(
            maxlen=int(RATE_WINDOW_S) + 1
        )

    # -- life cycle -------------------------------------------------------------------
    def prepare(self) -> None:
        """Check what the sampler was given and claim its state dir, before any engine or
        tokenizer loads: a bad data file, a config the model cannot serve, a state dir
        held by another sampler or made for another run is a `StartupError` (one message,
        for the command line), and a data or config error leaves nothing created."""
        if self._prepared:
            return
        s = self.settings
        try:
            self.dataset = Dataset(s.data, self._tokenize, seed=s.seed)
        except DatasetError as exc:
            raise StartupError(str(exc)) from exc
        self.context_length = _context_length(s.model)
        specs = self.dataset.env_specs() | ({s.env} if s.env else set())
        try:
            self._env_factories = episodes.load_factories(specs)
            if self._env_factories:  # chat observations need a prefix-preserving template
                check_prefix_preserving(_load_tokenizer(s.model), str(s.model))
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        try:
            if "max_tokens" in self._given:
                self._check_context(self._initial_config)
            check_consistency(self._initial_config, self.dataset.domains)
        except ConfigError as exc:
            hint = (
                f"; start with --set max_tokens=N, N <= {self.context_length}"
                if exc.field == "max_tokens"
                else ""
            )
            raise StartupError(f"--config/--set: {exc}{hint}") from exc
        try:
            self.state_dir = open_state_dir(
                s.state_dir,
                fingerprint(s.model, s.data, s.backend),
                resume=s.resume,
                fresh=s.fresh,
            )
        except StateDirError as exc:
            raise StartupError(str(exc)) from exc
        store = Store(s.state_dir / "sampler.sqlite", s.store_checkpoint_s or None)
        self.store = AsyncStore(store)
        self._config, self._config_version = self._initial_config, 0
        # Unless someone chose max_tokens, answers get what the context leaves (start()).
        self._fit_max_tokens = "max_tokens" not in self._given
        if (saved := store.get("config")) is not None:
            self._fit_max_tokens = False
            try:
                cfg = validate_config(saved["config"])
                check_consistency(cfg, self.dataset.domains)
                self._check_context(cfg)
            except ConfigError as exc:
                raise StartupError(
                    f"the config saved in {s.state_dir} cannot be served: {exc}; start a new "
                    "run with --fresh or another --state-dir"
                ) from exc
            self._config, self._config_version = cfg, int(saved["version"])
            self._schedule_applied = int(saved.get("schedule_applied", 0))
            for knob in overridden_by_saved(self._given, self._initial_config, cfg):
                log.warning(
                    "the config saved in %s (v%d) overrides the command line's %s; "
                    "PATCH /v1/config to change it",
                    s.state_dir,
                    self._config_version,
                    knob,
                )
        self._prepared = True

    async def _fitted(self, cfg: SamplerConfig) -> SamplerConfig:
        """`cfg` with max_tokens cut to what the context leaves after the longest prompt."""
        if not self._fit_max_tokens or self.context_length is None:
            return cfg
        longest, prompt_id = await asyncio.get_running_loop().run_in_executor(
            None, self.dataset.longest_prompt
        )
        room = self.context_length - longest
        if room < 1:
            raise ConfigError(
                f"prompt {prompt_id!r} has {longest} tokens: no room for an answer in the "
                f"model's context ({self.context_length} tokens)",
                "max_tokens",
            )
        if cfg.max_tokens <= room:
            return cfg
        log.info(
            "max_tokens %d: what the model's context (%d tokens) leaves after the longest "
            "prompt (%d tokens); --set max_tokens=N chooses another",
            room,
            self.context_length,
            longest,
        )
        return cfg.model_copy(update={"max_tokens": room})

    async def start(self) -> None:
        self.prepare()
        s = self.settings
        self.outbox = Outbox(self.store)
        self.sink = StoreSink(self.store, self.outbox)
        loop = asyncio.get_running_loop()
        self.tokenizer = await loop.run_in_executor(None, _load_tokenizer, s.model)
        self.metrics.precreate(self.dataset.domains)
        cfg, version = await self._fitted(self._config), self._config_version
        self.verifiers = VerifierPool(
            max_workers=s.verifier_pool_size, timeout_s=s.verifier_timeout_s
        )
        await self._check_verifiers()
        if self._backend is not None:
            self.backend = self._backend
        elif s.uses_ray:
            self.backend = build_replica_pool(s, self.metrics, self._replica_state_changed)
        else:
            self.backend = build_backend(s, self.tokenizer, self.metrics)
        await self.backend.start()
        self.scheduler = Scheduler(
            backend=self.backend,
            dataset=self.dataset,
            verify=self._verify,
            sink=self.sink,
            config=cfg,
            config_version=version,
            metrics=self.metrics,
            seed=s.seed,
            episodes=self._episode_runner(),
        )
        self.weights = WeightsManager(
            self.backend,
            WeightPlaces(s.state_dir, s.weights_dir),
            self.store,
            self.metrics,
            pause=self.scheduler.paused_for_weights,
            engine_error=self.engine_error,
            installed=self._weights_installed,
        )
        await self.weights.restore()
        saved = await self.store.call(self.store.sync.get_many, [STATE_KEY], REPLAY_KEY_PREFIX)
        self.scheduler.restore_state(saved)
        restored = await self.outbox.restore(_described)
        pending = await self.store.call(self.store.sync.pending)
        for stored in pending:
            self.sink.remember(stored.group_id)
        self.scheduler.restore_pending([unpack_group(p.payload) for p in pending])
        await self.scheduler.form_frames()
        self.metrics.config_version.set(version)
        self.metrics.policy_version.set(self.backend.policy_version)
        self.trained_groups = int(await self.store.call(self.store.sync.get, ACKED_KEY, 0))
        self._acked_at_start = self.trained_groups
        # Frames stored under older weights than those restored may be too stale now.
        await self._drop_stale_frames()
        # Steps whose condition was met just before a crash apply now.
        await self._advance_schedule()
        self.scheduler.start()
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="housekeeping"))
        self.ready = True
        log.info(
            "sampler ready: backend=%s model=%s domains=%s restored %d groups (%d unframed)",
            self.backend.name,
            self.backend.model_name,
            self.dataset.domains,
            restored,
            len(pending),
        )

    def begin_shutdown(self) -> None:
        """Stop serving: open streams end (with a `closing` heartbeat), lease waits return."""
        self._closing.set()
        if hasattr(self, "outbox"):
            self.outbox.wake()

    async def _check_verifiers(self) -> None:
        """Resolve the default verifier and every one the data names, or refuse to start.

        A spec that cannot be imported would otherwise score every answer 0 in silence.
        """
        # The default is checked even when every row names its own: it is what a row
        # added later, or a mistyped flag, would silently fall back to.
        users = {self.settings.verifier: "--verifier (the default for rows naming none)"}
        for rows in self.dataset.rows.values():
            for row in rows:
                if row.verifier is not None:
                    users.setdefault(
                        str(row.verifier), f"prompt {row.id!r} (domain {row.domain!r})"
                    )
        for spec, user in users.items():
            if error := await self.verifiers.check(spec):
                raise VerifierSpecError(
                    f"verifier {spec!r}, used by {user}, cannot be loaded: {error}"
                )

    async def stop(self) -> None:
        self.begin_shutdown()
        self.ready = False
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if hasattr(self, "scheduler"):
            await self.scheduler.stop()
            await self.store.call(self.store.sync.put, self.scheduler.saved_state())
        if hasattr(self, "verifiers"):
            self.verifiers.close()
        if hasattr(self, "backend"):
            await self.backend.close()
        if hasattr(self, "store"):
            stored = await self.store.call(self.store.sync.count)
            self.shutdown_summary = (
                f"adaptive-rollout sampler stopped: {self.groups_delivered} groups delivered "
                f"and {self.trained_groups - self._acked_at_start} acked since it started; "
                f"{stored} groups stored in {self.settings.state_dir} for the next start"
            )
            await self.store.close()
        if hasattr(self, "state_dir"):
            self.state_dir.release()

    async def _housekeeping(self) -> None:
        """Expire stale leases, keep the queue gauges and rate window current, log a failed
        engine once."""
        while True:
            if self.outbox.expire():
                self.scheduler.poke()
            self._drop_stalled_streams()
            self._update_step_groups()
            self._update_gauges()
            self._rate_samples.append(self._counters())
            if not self._engine_failure_logged and (error := self.engine_error()):
                self._engine_failure_logged = True
                await self.record_event("engine_failed", "engine", {"error": error})
            await asyncio.sleep(1.0)

    def _counters(self) -> tuple[float, int, int, int, int]:
        st = self.scheduler.stats
        return (time.monotonic(), st.groups_emitted, st.samples, st.tokens, self.trained_groups)

    def _rates(self) -> dict[str, float]:
        """Per-second rates over the last RATE_WINDOW_S seconds (since start when younger)."""
        now = self._counters()
        then = self._rate_samples[0] if self._rate_samples else now
        dt = now[0] - then[0]
        names = ("groups_per_s", "samples_per_s", "tokens_per_s", "acked_per_s")
        rates = {
            n: (a - b) / dt if dt > 0 else 0.0
            for n, a, b in zip(names, now[1:], then[1:], strict=True)
        }
        return {"window_s": dt, **rates}

    # -- event log --------------------------------------------------------------------
    def _replica_state_changed(self, detail: dict[str, Any]) -> None:
        """Log a replica's state change; the pool reports it from the event loop."""

        async def record() -> None:
            try:
                await self.record_event("replica", "engine", detail)
            except Exception as exc:  # noqa: BLE001 - the store may be closing; the log says so
                log.warning("replica event not recorded (%s): %s", exc, detail)

        task = asyncio.get_running_loop().create_task(record())
        self._event_tasks.add(task)
        task.add_done_callback(self._event_tasks.discard)

    async def record_event(
        self, kind: str, source: str, data: dict[str, Any], state: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Append to the persisted event log (with `state` written in the same transaction)."""
        return await self.store.call(self.store.sync.add_event, kind, source, data, state)

    async def events(self, since: int, limit: int, kinds: Sequence[str] = ()) -> dict[str, Any]:
        """Events after `since` (of `kinds`, when given), oldest first; `last_seq` is where
        the next poll starts."""
        return await self.store.call(self.store.sync.event_page, since, limit, kinds)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.labels("ready").set(self.outbox.ready_groups)
        m.queue_depth.labels("leased").set(self.outbox.leased_groups)
        m.queue_depth.labels("pending").set(self.sink.pending)
        m.engine_failed.set(self.engine_error() is not None)
        for domain, shares in self._domain_shares().items():
            for kind in ("target", "admitted", "emitted"):
                m.mixing_share.labels(domain, kind).set(shares[f"{kind}_share"])

    # -- helpers ----------------------------------------------------------------------
    def _tokenize(self, row: PromptRow) -> None:
        if isinstance(row.prompt, str):
            row.text = row.prompt
            row.token_ids = list(self.tokenizer(row.prompt)["input_ids"])
        else:
            row.text = self.tokenizer.apply_chat_template(
                row.prompt, add_generation_prompt=True, tokenize=False
            )
            row.token_ids = list(self.tokenizer(row.text, add_special_tokens=False)["input_ids"])

    def _episode_runner(self) -> episodes.EpisodeRunner | None:
        """The runner of multi-turn episodes, when a row or --env names an environment."""
        if not self._env_factories:
            return None
        return episodes.EpisodeRunner(
            self.tokenizer,
            episodes.observation_renderer(self.tokenizer),
            self._env_factories,
            default_env=self.settings.env,
            max_context=self.context_length,
        )

    def required_features(self) -> dict[str, str]:
        """Wire features a consumer must declare, each with what it must do about them:
        `loss_mask` while episodes are served (their observation tokens must not be
        trained on), `replayed` while replay is on (a replayed answer is off-policy)."""
        required = {}
        if self._env_factories:
            required[wire_features.LOSS_MASK] = "train on Sample.loss_mask == 1 tokens only"
        if self.scheduler.config.replay is not None:
            required[wire_features.REPLAYED] = (
                "treat Sample.replayed answers as off-policy (clip their importance ratio or "
                "drop them)"
            )
        return required

    def check_features(self, declared: frozenset[str]) -> None:
        """409 `feature_required` for a consumer that would mistrain on these groups."""
        required = self.required_features()
        if missing := sorted(set(required) - declared):
            raise ServiceError(
                409,
                "feature_required",
                f"this sampler's groups need the feature{'s' if len(missing) > 1 else ''} "
                f"{', '.join(missing)}: declare {'them' if len(missing) > 1 else 'it'} "
                f"(?{wire_features.QUERY_PARAM}={','.join(missing)}) and "
                + "; ".join(required[name] for name in missing),
                wire_features.QUERY_PARAM,
            )

    def _end_streams_lacking_features(self) -> None:
        """End the live streams that did not declare a feature the groups now need (replay
        switched on): their consumers reconnect and are told (409 `feature_required`),
        and what they held is READY again for the others."""
        required = set(self.required_features())
        for token, declared in list(self._stream_features.items()):
            if required - declared and token in self._streams:
                consumer = self._streams[token][0]
                log.warning("stream %s lacks features %s: ended", consumer, required - declared)
                self.outbox.disconnect(consumer, token)

    async def _verify(self, row: PromptRow, completion: Completion) -> Verdict:
        spec = row.verifier or self.settings.verifier
        text = completion.text if completion.answer_text is None else completion.answer_text
        verdict = await self.verifiers.verify(spec, text, row.answer, row.metadata)
        self.metrics.verifier_latency.observe(verdict.seconds)
        if verdict.kind != "ok":
            self.metrics.verifier_errors.labels(verdict.kind).inc()
        return verdict

    # -- health -----------------------------------------------------------------------
    def engine_error(self) -> str | None:
        """Why the engine cannot generate any more (it died or failed), or None."""
        if not self.ready:
            return None
        health = self.backend.health()
        return (
            str(health.detail.get("error", "the engine reports it is unhealthy"))
            if health.state == "failed"
            else None
        )

    def engine_degraded(self) -> bool:
        """No engine replica can serve now, but one is recovering (admission is paused)."""
        return self.ready and self.backend.health().state == "degraded"

    def replicas(self) -> list[dict[str, Any]] | None:
        """Per-replica state when engines run as replicas, else None."""
        if not self.ready:
            return None
        return self.backend.health().detail.get("replicas")

    def backend_name(self) -> str:
        """The engine as the start-up log names it: `ray` for replicas of an hf or vLLM
        engine (which one is the `--backend` flag)."""
        if (backend := getattr(self, "backend", None)) is not None:
            return str(backend.name)
        return "ray" if self.settings.uses_ray else self.settings.backend

    def health(self) -> Health:
        backend = getattr(self, "backend", None)
        error = self.engine_error()
        status = "ok" if self.ready else "starting"
        if error:
            status = "engine_failed"
        elif self.engine_degraded():
            status = "degraded"
        return Health(
            status=status,
            replicas=self.replicas(),
            backend=self.backend_name(),
            model=str(self.settings.model),
            policy_version=backend.policy_version if backend and self.ready else 0,
            uptime_s=time.time() - self.started_at,
            engine_error=error,
            warnings=self.warnings(),
            auth_required=self.settings.api_key is not None,
        )

    def warnings(self) -> list[str]:
        """Verifier specs failing or cut off, and an engine failing most of its calls."""
        if not self.ready:
            return []
        engine = self.scheduler.engine_warning()
        return [*self.verifiers.warnings(), *([engine] if engine else [])]

    # -- config -----------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {
            "config_version": self.scheduler.config_version,
            **self.scheduler.config.model_dump(),
        }

    async def patch_config(self, patch: Any) -> dict[str, Any]:
        if not isinstance(patch, dict):
            raise ServiceError(
                422, "invalid_config", "the body must be a JSON object of config keys"
            )
        async with self._config_lock:
            patch = dict(patch)
            has_expected = "config_version" in patch
            expected = patch.pop("config_version", None)
            if has_expected and (type(expected) is not int):
                raise ServiceError(
                    422,
                    "invalid_config",
                    "config_version: must be an integer (the version this change expects)",
                    "config_version",
                )
            if has_expected and expected != self.scheduler.config_version:
                raise ServiceError(
                    409,
                    "config_version_conflict",
                    f"config_version is {self.scheduler.config_version}, not {expected}",
                    "config_version",
                )
            old = self.scheduler.config
            merged = merge_patch(old.model_dump(), patch)
            # Judged on what it changes (a knob it does not name is not held against it)
            # and on whether the result is consistent, as the start-up config is.
            try:
                cfg = validate_config(merged)
                check_consistency(cfg, self.dataset.domains)
                if "max_tokens" in patch:
                    self._check_context(cfg)
            except ConfigError as exc:
                raise ServiceError(422, "invalid_config", str(exc), exc.field) from exc
            # A new schedule starts from its first step; steps already due apply below.
            applied = 0 if cfg.schedule != old.schedule else self._schedule_applied
            await self._commit_config(cfg, "api", applied)
        await self._advance_schedule()
        return self.get_config()

    def _check_context(self, cfg: SamplerConfig) -> None:
        """max_tokens beyond the model's context could never be generated."""
        if self.context_length is not None and cfg.max_tokens > self.context_length:
            raise ConfigError(
                f"max_tokens ({cfg.max_tokens}) exceeds the model's context "
                f"({self.context_length} tokens)",
                "max_tokens",
            )

    async def _commit_config(
        self, cfg: SamplerConfig, source: str, applied: int, detail: dict[str, Any] | None = None
    ) -> None:
        """Persist and install `cfg` as the next version, logged with its diff.

        The config, the schedule's progress and the event are one transaction, so a
        crash never leaves a step applied but unrecorded (or recorded twice). Callers hold
        the config lock.
        """
        old = self.scheduler.config.model_dump(mode="json")
        new = cfg.model_dump(mode="json")
        diff = {k: [old.get(k), v] for k, v in new.items() if old.get(k) != v}
        version = self.scheduler.config_version + 1
        record = {"config": new, "version": version, "schedule_applied": applied}
        await self.record_event(
            "config",
            source,
            {"config_version": version, "diff": diff, **(detail or {})},
            {"config": record},
        )
        self._schedule_applied = applied
        await self.scheduler.apply_config(cfg, version)
        self._end_streams_lacking_features()
        await self.scheduler.form_frames()
        log.info("config v%d (%s): %s", version, source, diff)
        await self._drop_stale_frames()  # a lowered max_staleness applies to what is READY

    def _schedule_due(self) -> bool:
        schedule = self.scheduler.config.schedule
        if self._schedule_applied >= len(schedule):
            return False
        kind, threshold = schedule[self._schedule_applied].at.key()
        progress = self.trained_groups if kind == "trained_groups" else self.backend.policy_version
        return progress >= threshold

    async def _advance_schedule(self) -> None:
        """Apply, in order and once each, every schedule step whose condition now holds.

        A step that is no longer valid on top of the live config (a PATCH changed other
        knobs since) is skipped and logged rather than retried forever.
        """
        if not self._schedule_due():
            return
        async with self._config_lock:
            while self._schedule_due():
                cfg, i = self.scheduler.config, self._schedule_applied
                step = cfg.schedule[i]
                kind, threshold = step.at.key()
                detail = {"step": i, "at": {kind: threshold}}
                try:
                    new = apply_step(cfg.model_dump(mode="json"), step.set, self.dataset.domains)
                except ConfigError as exc:
                    record = {
                        "config": cfg.model_dump(mode="json"),
                        "version": self.scheduler.config_version,
                        "schedule_applied": i + 1,
                    }
                    await self.record_event(
                        "schedule_skipped",
                        "schedule",
                        {**detail, "error": str(exc), "field": exc.field},
                        {"config": record},
                    )
                    self._schedule_applied = i + 1
                    log.warning("schedule step %d skipped: %s", i, exc)
                    continue
                await self._commit_config(
                    new.model_copy(update={"schedule": cfg.schedule}), "schedule", i + 1, detail
                )

    # -- delivery ---------------------------------------------------------------------
    def _heartbeat(self, consumer: str, closing: bool = False) -> dict[str, Any]:
        return Heartbeat(
            time=time.time(),
            policy_version=self.backend.policy_version,
            config_version=self.scheduler.config_version,
            ready=self.outbox.ready_groups,
            leased=self.outbox.leased_groups,
            active_prompts=self.scheduler.active_prompts + self.scheduler.finalizing,
            unacked=self.outbox.unacked(consumer),
            engine_error=self.engine_error(),
            closing=closing,
            engine_state=self.backend.health().state,
        ).model_dump()

    def _check_step(self, groups_per_step: int | None) -> None:
        limit = self.scheduler.config.max_buffered_groups
        if groups_per_step is not None and groups_per_step > limit:
            raise ServiceError(
                422,
                "invalid_request",
                f"groups_per_step ({groups_per_step}) exceeds max_buffered_groups ({limit}): "
                "such a step could never fill; raise max_buffered_groups",
                "groups_per_step",
            )

    def _declare_step(self, consumer: str, groups_per_step: int | None, until: float) -> None:
        """Note the step size a consumer trains on (admission under max_staleness counts
        steps); without a declaration a step is one frame (`batch_groups`)."""
        if groups_per_step is not None:
            self._declared_steps[consumer] = (groups_per_step, until)
            self._update_step_groups()

    def _update_step_groups(self) -> None:
        now = time.monotonic()
        self._declared_steps = {c: d for c, d in self._declared_steps.items() if d[1] > now}
        step = max((groups for groups, _ in self._declared_steps.values()), default=0)
        if step != self.scheduler.consumer_step_groups:
            self.scheduler.consumer_step_groups = step
            self.scheduler.poke()

    def _delivered(self, delivered: list[Delivered]) -> list[Delivered]:
        """Record each delivered group's lag behind the served weights."""
        served = self.backend.policy_version
        for item in delivered:
            lag = served - item.group.policy_version_min
            self._lags.append(lag)
            self.metrics.delivered_staleness.observe(lag)
            self.metrics.staleness.set(lag)
        self.groups_delivered += len(delivered)
        return delivered

    async def _drop_stale_frames(self) -> None:
        """Drop READY frames more than max_staleness versions behind the served weights;
        their prompts are served again. Checked at every weight commit and config change."""
        bound = self.scheduler.config.max_staleness
        if bound is None:
            return
        frames = self.outbox.drop_stale(self.backend.policy_version, bound)
        members = [m for f in frames for m in f.members]
        if not members:
            return
        await self.store.call(self.store.sync.discard, [m.group_id for m in members])
        for member in members:
            self.dataset.serve_again(member.domain, member.prompt_id)
        self.scheduler.count_dropped("stale", len(members))
        self.scheduler.poke()
        log.info(
            "dropped %d READY groups (%d frames) more than %d versions behind v%d; their "
            "prompts are served again",
            len(members),
            len(frames),
            bound,
            self.backend.policy_version,
        )

    def open_stream(
        self,
        name: str,
        max_unacked: int,
        heartbeat_s: float,
        encoding: Encoding,
        groups_per_step: int | None = None,
        features: frozenset[str] = frozenset(),
    ) -> AsyncIterator[bytes]:
        """Claim the stream name `name` (409 while another live stream holds it);
        `features` are those the consumer declared (checked by `check_features`)."""
        self._check_step(groups_per_step)
        consumer = stream_consumer(name)
        token = self.outbox.connect(consumer)
        if token is None:
            raise ServiceError(
                409,
                "consumer_busy",
                f"consumer {name!r} already has a live stream; give each trainer its own name",
                "consumer",
            )
        self._streams[token] = (consumer, heartbeat_s, time.monotonic())
        self._stream_features[token] = features
        self._declare_step(consumer, groups_per_step, math.inf)
        return self._stream(consumer, token, max_unacked, heartbeat_s, encoding)

    async def _stream(
        self,
        consumer: str,
        token: object,
        max_unacked: int,
        heartbeat_s: float,
        encoding: Encoding,
    ) -> AsyncIterator[bytes]:
        """Messages for one consumer: whole frames as credit allows, else heartbeats."""

        def sending() -> None:  # a yield returns once the socket has taken the message
            self._streams[token] = (consumer, heartbeat_s, time.monotonic())

        try:
            sending()
            yield encoding.message(self._heartbeat(consumer))
            next_beat = time.monotonic() + heartbeat_s
            while self.outbox.is_current(consumer, token) and not self._closing.is_set():
                self._streams[token] = (consumer, heartbeat_s, math.inf)
                changed = self.outbox.changed()
                size = self.outbox.next_frame_size()
                unacked = self.outbox.unacked(consumer)
                if size is not None and (unacked + size <= max_unacked or unacked == 0):
                    ttl = self.scheduler.config.lease_ttl_s
                    sending()
                    delivered = self._delivered(self.outbox.take(consumer, ttl))
                    yield b"".join(map(encoding.group_message, delivered))
                    continue
                now = time.monotonic()
                if now >= next_beat:
                    sending()
                    yield encoding.message(self._heartbeat(consumer))
                    next_beat = now + heartbeat_s
                await wait_event(changed, next_beat - now)
            if self._closing.is_set():
                yield encoding.message(self._heartbeat(consumer, closing=True))
        finally:
            self._streams.pop(token, None)
            self._stream_features.pop(token, None)
            self.outbox.disconnect(consumer, token)
            if self._declared_steps.pop(consumer, None) is not None:
                self._update_step_groups()
            self.scheduler.poke()

    def _drop_stalled_streams(self) -> None:
        """Free the name of a stream whose socket has not taken a message in 2 heartbeats.

        A consumer that vanished without closing its connection would otherwise hold its
        name (409 to its own reconnect) and its groups until their lease expires.
        """
        now = time.monotonic()
        for token, (consumer, heartbeat_s, since) in list(self._streams.items()):
            if now - since > 2 * heartbeat_s:
                log.warning("stream %s took no message for %.0f s: dropped", consumer, now - since)
                del self._streams[token]
                self._stream_features.pop(token, None)
                self.outbox.disconnect(consumer, token)
                self.scheduler.poke()

    async def ack(self, delivery_ids: list[str]) -> AckResponse:
        acked, unknown = await self.outbox.ack(delivery_ids)
        self.trained_groups += acked
        self.metrics.groups_acked.inc(acked)
        self.scheduler.poke()
        await self._advance_schedule()
        return AckResponse(acked=acked, unknown=unknown)

    async def lease(
        self,
        consumer: str,
        max_groups: int,
        wait_s: float,
        encoding: Encoding,
        groups_per_step: int | None = None,
    ) -> bytes:
        """An encoded LeaseResponse, built from the stored group bytes."""
        self._check_step(groups_per_step)
        ttl = self.scheduler.config.lease_ttl_s
        self._declare_step(lease_consumer(consumer), groups_per_step, time.monotonic() + ttl)
        deadline = time.monotonic() + min(wait_s, self.settings.max_lease_wait_s)
        while (
            self.outbox.next_frame_size() is None
            and time.monotonic() < deadline
            and not self._closing.is_set()
        ):
            await wait_event(self.outbox.changed(), deadline - time.monotonic())
        ttl = self.scheduler.config.lease_ttl_s
        delivered = self._delivered(
            self.outbox.take(lease_consumer(consumer), ttl, max_groups=max_groups)
        )
        return encoding.lease(
            {"lease_id": uuid.uuid4().hex, "expires_at": time.time() + ttl}, delivered
        )

    # -- weights ----------------------------------------------------------------------
    async def _weights_installed(
        self, version: int, transport: str, seconds: float, paused_s: float
    ) -> None:
        """Log a weight update and apply schedule steps keyed on the new policy version."""
        data = {"version": version, "transport": transport, "seconds": seconds}
        await self.record_event("weights", "api", {**data, "paused_s": paused_s})
        await self._drop_stale_frames()
        await self._advance_schedule()

    # -- stats ------------------------------------------------------------------------
    def _domain_shares(self) -> dict[str, dict[str, Any]]:
        st = self.scheduler.stats
        targets = self.scheduler.mixer.proportions()
        out = {}
        for domain, ds in st.domains.items():
            rates = ds.recent_pass_rates
            out[domain] = {
                "pass_rate": sum(rates) / len(rates) if rates else None,
                "target_share": targets[domain],
                "admitted_share": st.recent_admitted.count(domain)
                / max(len(st.recent_admitted), 1),
                "emitted_share": st.recent_emitted.count(domain) / max(len(st.recent_emitted), 1),
                "admitted": ds.admitted,
                "emitted": ds.emitted,
                "samples": ds.samples,
            }
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "policy_version": self.backend.policy_version,
            "config_version": self.scheduler.config_version,
            "queue": {
                "ready": self.outbox.ready_groups,
                "leased": self.outbox.leased_groups,
                "pending": self.sink.pending,
                "active_prompts": self.scheduler.active_prompts,
                "finalizing": self.scheduler.finalizing,
            },
            "paused": self.scheduler.paused,
            "last_error": self.scheduler.last_error,
            "engine_error": self.engine_error(),
            "warnings": self.warnings(),
            "verifiers": dataclasses.asdict(self.verifiers.stats),
            "engine": self.backend.health().detail,
            "replicas": self.replicas(),
            "domains": self._domain_shares(),
            **self.scheduler.stats.to_dict(),
            "rates": self._rates(),
            "staleness": self._staleness(),
            "allocation": self.scheduler.allocation_stats(),
            "trained_groups": self.trained_groups,
            "schedule": {
                "steps": len(self.scheduler.config.schedule),
                "applied": self._schedule_applied,
            },
        }

    def _staleness(self) -> dict[str, Any]:
        """Delivered groups' lag behind the served weights (over the last ones delivered)
        and what bounds it."""
        lags = self._lags
        return {
            "last": lags[-1] if lags else None,
            "mean": sum(lags) / len(lags) if lags else None,
            "max": max(lags) if lags else None,
            "window": len(lags),
            "histogram": {str(lag): n for lag, n in sorted(Counter(lags).items())},
            "max_staleness": self.scheduler.config.max_staleness,
            "step_groups": self.scheduler.step_groups,
            "dropped_stale": self.scheduler.stats.dropped.get("stale", 0),
        }

    def metrics_text(self) -> bytes:
        self._update_gauges()
        return self.metrics.render()
