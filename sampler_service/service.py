"""The service layer: everything the HTTP routes call, and nothing about HTTP.

`SamplerService.build` composes the parts (engine, dataset, verifiers, scheduler, store
and outbox) and the components over them (delivery, control, weights, stats, health),
and returns the service ready to serve; `stop` ends them in order. Every client mistake
is a `ServiceError` with a status code, so routes stay thin (parse, call, map errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sampler_service import episodes
from sampler_service.aio import TaskSet
from sampler_service.backends.base import Backend, Completion
from sampler_service.backends.factory import build_backend
from sampler_service.config import JUDGE_PREFIX, SamplerConfig, ServeSettings
from sampler_service.consumers import ConsumerSteps
from sampler_service.control import Control, EventLog
from sampler_service.dataset import PromptRow
from sampler_service.delivery import Delivery
from sampler_service.errors import ServiceError
from sampler_service.health import ServiceHealth
from sampler_service.journal import DATASET_KEY, AnswerJournal
from sampler_service.live_config import LiveConfig
from sampler_service.metrics import Metrics
from sampler_service.outbox import Outbox, StoreSink, described
from sampler_service.replay import KEY_PREFIX as REPLAY_KEY_PREFIX
from sampler_service.resume import resume
from sampler_service.sampling import VerifyFn
from sampler_service.scheduler import STATE_KEY, Scheduler
from sampler_service.sessions import SessionHub, SessionSetup
from sampler_service.sessions.chat import ClaimedSession, ClaimResponse
from sampler_service.startup import Prepared, check_verifiers, prepare
from sampler_service.state_dir import StateDir
from sampler_service.stats import Stats
from sampler_service.store import ACKED_KEY, AsyncStore, JournalRows
from sampler_service.tally import Tally
from sampler_service.verifiers.base import Verdict
from sampler_service.verifiers.judge import Judges
from sampler_service.verifiers.pool import VerifierPool
from sampler_service.verifiers.retry import RetryPolicy, verify_with_retries
from sampler_service.weights.manager import WeightPlaces, WeightsManager
from trainer_client.contract.protocol import AckResponse
from trainer_client.contract.wire import unpack_group

log = logging.getLogger(__name__)

#: The wait before a program verifier's first retry (doubled for each next one): a
#: crashed or hung worker has been replaced by then.
_PROGRAM_BACKOFF_S = 0.2


def _verifier(
    verifiers: VerifierPool, judges: Judges, settings: ServeSettings, tally: Tally
) -> VerifyFn:
    """The scheduler's verify call: the row's verifier (else --verifier) on a wave's
    answers, a program in the pool or a judge over HTTP, its failures asked again
    (`retry`): what it returns still failed after every retry."""
    program = RetryPolicy(settings.verifier_retries, _PROGRAM_BACKOFF_S)

    async def verify(row: PromptRow, completions: Sequence[Completion]) -> list[Verdict]:
        spec = row.verifier or settings.verifier
        texts = [c.verified_text for c in completions]
        judge = spec.removeprefix(JUDGE_PREFIX) if spec.startswith(JUDGE_PREFIX) else None

        async def once(indices: Sequence[int]) -> list[Verdict]:
            chosen = [texts[i] for i in indices]
            if judge is None:
                verdicts = await verifiers.verify_wave(spec, chosen, row.answer, row.metadata)
            else:
                verdicts = await judges.verify_wave(judge, row, chosen)
            for verdict in verdicts:
                tally.verified(verdict.kind, verdict.seconds)
            return verdicts

        if judge is None:
            return await verify_with_retries(
                once, len(texts), lambda: program, tally.verifier_retried
            )
        return await verify_with_retries(
            once,
            len(texts),
            functools.partial(judges.retry_policy, judge),
            functools.partial(tally.judge_retried, judge),
        )

    return verify


def _episode_runner(prepared: Prepared) -> episodes.EpisodeRunner | None:
    """The runner of multi-turn episodes, when a row or --env names an environment."""
    if not prepared.env_factories:
        return None
    tokenizer = prepared.tokenize.tokenizer
    return episodes.EpisodeRunner(
        tokenizer,
        episodes.EpisodeRenderer(tokenizer),
        prepared.env_factories,
        default_env=prepared.settings.env,
        max_context=prepared.context_length,
    )


@dataclass(eq=False)
class SamplerService:
    """A running sampler: its parts and components, and the housekeeping that keeps them
    current. Made by `build`, complete; the routes call its components."""

    settings: ServeSettings
    state_dir: StateDir
    store: AsyncStore
    outbox: Outbox
    sink: StoreSink
    verifiers: VerifierPool
    judges: Judges
    backend: Backend
    scheduler: Scheduler
    health: ServiceHealth
    delivery: Delivery
    control: Control
    weights: WeightsManager
    stats: Stats
    journal: AnswerJournal
    #: Harness sessions, when rows are answered by them.
    sessions: SessionSetup | None = None
    #: One line on what this process delivered, set when it stops (the CLI prints it).
    shutdown_summary: str | None = None
    _tasks: TaskSet = field(default_factory=TaskSet)
    _acked_at_start: int = 0

    @classmethod
    async def build(
        cls,
        settings: ServeSettings,
        initial_config: SamplerConfig | None = None,
        *,
        given: frozenset[str] = frozenset(),
        backend: Backend | None = None,
        prepared: Prepared | None = None,
    ) -> SamplerService:
        """The service, started and ready, or an error with whatever it claimed released.

        `prepared`: what `prepare(settings, initial_config, given)` returned, when the
        caller checked the start before (the command line does, before it binds its port);
        `backend`: an engine to use instead of the one `settings` name.
        """
        p = prepared or prepare(settings, initial_config, given)
        async with contextlib.AsyncExitStack() as undo:
            undo.callback(p.state_dir.release)
            undo.push_async_callback(p.store.close)
            service = await cls._assemble(p, backend, undo)
            undo.pop_all()  # complete: what it claimed is the service's to release
        return service

    @classmethod
    async def _assemble(
        cls, p: Prepared, engine: Backend | None, undo: contextlib.AsyncExitStack
    ) -> SamplerService:
        s, store, dataset, metrics = p.settings, p.store, p.dataset, Metrics()
        outbox = Outbox(store)
        sink = StoreSink(store, outbox)
        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(None, lambda: p.tokenize.tokenizer)
        live = LiveConfig(p.config, p.config_version, dataset.domains, dataset.prompt_ids())
        tally = Tally(dataset.domains, time.monotonic, judges=s.judge_url)
        if p.sessions is not None:
            p.sessions.hub.attach(loop)
        verifiers = VerifierPool(max_workers=s.verifier_pool_size, timeout_s=s.verifier_timeout_s)
        undo.callback(verifiers.close)
        judges = Judges(s.judge_url, s.judge_api_key, lambda: live.config.judges, tally)
        undo.push_async_callback(judges.close)
        await check_verifiers(verifiers, dataset, s.verifier)
        events = EventLog(store)
        backend = engine or build_backend(s, tokenizer, metrics, events.replica_changed)
        await backend.start()
        undo.push_async_callback(backend.close)
        consumers = ConsumerSteps()
        journal = AnswerJournal(store, dataset)
        undo.push_async_callback(journal.close)
        scheduler = Scheduler(
            backend=backend,
            dataset=dataset,
            verify=_verifier(verifiers, judges, s, tally),
            sink=sink,
            live=live,
            consumer_step=lambda: consumers.step,
            tally=tally,
            metrics=metrics,
            seed=s.seed,
            episodes=_episode_runner(p),
            journal=journal,
        )
        consumers.on_change = scheduler.poke
        metrics.follow(
            tally,
            active_prompts=lambda: scheduler.active_prompts,
            policy_version=lambda: backend.policy_version,
            config_version=lambda: live.version,
        )
        health = ServiceHealth(s, p.started_at, backend, scheduler, verifiers, judges)
        delivery = Delivery(
            outbox,
            scheduler,
            live,
            consumers,
            backend,
            store,
            dataset,
            tally,
            health.engine_error,
            s.max_lease_wait_s,
            serves_episodes=bool(p.env_factories),
        )
        control = Control(
            live,
            scheduler,
            events,
            dataset.domains,
            p.context_length,
            lambda: backend.policy_version,
            delivery.config_changed,
            int(await store.call(store.sync.get, ACKED_KEY, 0)),
            p.schedule_applied,
            p.check_judges,
        )
        weights = WeightsManager(
            backend,
            WeightPlaces(s.state_dir, s.weights_dir),
            store,
            metrics,
            pause=scheduler.paused_for_weights,
            engine_error=health.engine_error,
            installed=control.weights_installed,
        )
        await weights.restore()
        stats = Stats(
            scheduler,
            outbox,
            sink,
            backend,
            verifiers,
            metrics,
            health,
            control,
            p.filtered_overlong,
            p.sessions.hub if p.sessions is not None else None,
        )
        scheduler.restore_state(
            await store.call(store.sync.get_many, [STATE_KEY, DATASET_KEY], REPLAY_KEY_PREFIX)
        )
        restored = await outbox.restore(described)
        pending = await store.call(store.sync.pending)
        for stored in pending:
            sink.remember(stored.group_id)
        scheduler.restore_pending([unpack_group(stored.payload) for stored in pending])
        await scheduler.form_frames()
        # Frames stored under older weights than those restored may be too stale now.
        await delivery.drop_stale_frames()
        # Steps whose condition was met just before a crash apply now.
        await control.advance_schedule()
        # Prompts half-sampled when it stopped continue from their stored answers.
        resumption = resume(
            await store.call(store.sync.attempts), dataset, live, backend.policy_version, tally
        )
        if resumption.gone:
            await store.call(store.sync.journal, JournalRows(ended=resumption.gone))
        scheduler.resume(resumption.runs)
        service = cls(
            s,
            p.state_dir,
            store,
            outbox,
            sink,
            verifiers,
            judges,
            backend,
            scheduler,
            health,
            delivery,
            control,
            weights,
            stats,
            journal,
            sessions=p.sessions,
            _acked_at_start=control.trained_groups,
        )
        journal.start()
        scheduler.start()
        service._tasks.spawn(service._housekeeping(), "housekeeping")
        health.ready = True
        log.info(
            "sampler ready: backend=%s model=%s domains=%s restored %d groups (%d unframed); "
            "resumed %d half-sampled prompts (%d stored answers)",
            backend.name,
            backend.model_name,
            dataset.domains,
            restored,
            len(pending),
            len(resumption.runs),
            tally.restart["reused_answers"],
        )
        return service

    @property
    def ready(self) -> bool:
        return self.health.ready

    def begin_shutdown(self) -> None:
        """Stop serving: open streams end (with a `closing` heartbeat), lease waits return."""
        self.delivery.close()

    async def stop(self) -> None:
        self.begin_shutdown()
        self.health.ready = False
        await self._tasks.cancel()
        await self.scheduler.stop()
        await self.journal.close()  # what the prompts still sampling had verified
        await self.store.call(self.store.sync.put, self.scheduler.saved_state())
        self.verifiers.close()
        await self.judges.close()
        await self.backend.close()
        stored = await self.store.call(self.store.sync.count)
        self.shutdown_summary = (
            f"adaptive-rollout sampler stopped: {self.scheduler.tally.groups_delivered} groups "
            f"delivered and {self.control.trained_groups - self._acked_at_start} acked since "
            f"it started; {stored} groups stored in {self.settings.state_dir} for the next start"
        )
        await self.store.close()
        self.state_dir.release()

    async def _housekeeping(self) -> None:
        """Expire stale leases, keep the queue gauges and rate window current, log a failed
        engine once."""
        failure_logged = False
        while True:
            self.delivery.tend()
            self.stats.update_gauges()
            self.stats.sample()
            if not failure_logged and (error := self.health.engine_error()):
                failure_logged = True
                await self.control.events.record("engine_failed", "engine", {"error": error})
            await asyncio.sleep(1.0)

    def session_hub(self) -> SessionHub:
        """The live sessions; 404 when no row is answered by sessions."""
        if self.sessions is None:
            raise ServiceError(
                404,
                "no_sessions",
                "this sampler serves no sessions: rows answered by harnesses name the "
                "environment 'session' (or serve --env session)",
            )
        return self.sessions.hub

    async def claim_session(self, wait_s: float, server_url: str) -> ClaimResponse:
        """A session for a harness that runs elsewhere, its URLs on `server_url` (the
        address the harness reached this server at)."""
        hub = self.session_hub()
        session = await hub.claim(wait_s)
        if session is None:
            return ClaimResponse(session=None)
        urls = hub.urls(session, server_url)
        return ClaimResponse(
            session=ClaimedSession(
                session_id=session.id,
                base_url=urls.base_url,
                session_url=urls.session_url,
                row=session.row,
            )
        )

    async def ack(self, delivery_ids: list[str]) -> AckResponse:
        """Acked groups leave the store; schedule steps keyed on trained groups may apply."""
        response = await self.delivery.ack(delivery_ids)
        await self.control.acked(response.acked)
        return response
