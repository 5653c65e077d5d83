"""The adaptive scheduler: per-prompt sampling until the stopping rule fires.

Continuous mode (the default) has no global round barrier: every admitted prompt runs
its own loop of waves (generate -> verify -> ask the rule), so the engine's continuous
batching stays full and a new prompt is admitted as soon as one finishes. `mode:
rounds` reproduces Reinforce-Ada's synchronous rounds for comparison.

The scheduler owns no I/O of its own: the engine, the verifier, the clock and the sink
that stores finished groups are injected, so the benchmarks drive this exact code with
a simulated engine in simulated time. What it composes never references it: the live
config (`live_config`), admission (`admission`), the finalizer (`finalize`) and the
tally every figure is counted in (`tally`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from sampler_service.admission import Admission
from sampler_service.aio import wait_event
from sampler_service.backends.base import Backend, PauseMode
from sampler_service.config import SamplerConfig
from sampler_service.dataset import Dataset, PromptRow
from sampler_service.episodes import EpisodeRunner
from sampler_service.finalize import Finalizer, GroupSink
from sampler_service.journal import DATASET_KEY, Journal
from sampler_service.live_config import LiveConfig
from sampler_service.metrics import Metrics
from sampler_service.pacing import Pacer
from sampler_service.prompt_run import PromptRun
from sampler_service.replay import KEY_PREFIX as REPLAY_KEY_PREFIX
from sampler_service.replay import ReplayStore
from sampler_service.sampling import PromptDropped, PromptSampler, VerifyFn
from sampler_service.tally import Tally
from strategies import mixing
from trainer_client.contract.protocol import Group

log = logging.getLogger(__name__)

#: Prompts admitted per pass of the admission loop before it yields to the event loop.
_ADMIT_CHUNK = 64
#: Candidates paced admission looks at for each free slot before it waits for a poke.
_PACED_TRIES = 4
#: The state store's key of the scheduler's learned state (`Scheduler.state_dict`).
STATE_KEY = "scheduler_state"


class Scheduler:
    def __init__(
        self,
        *,
        backend: Backend,
        dataset: Dataset,
        verify: VerifyFn,
        sink: GroupSink,
        config: SamplerConfig | None = None,
        config_version: int = 0,
        live: LiveConfig | None = None,
        consumer_step: Callable[[], int] = lambda: 0,
        tally: Tally | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        episodes: EpisodeRunner | None = None,
        journal: Journal | None = None,
    ) -> None:
        """`live` (or `config` and `config_version` to build one from), the consumers'
        step (`consumer_step`) and the `tally` are shared with the service's other
        components; a benchmark gives a config and gets its own. The `journal` stores
        the answers of prompts being sampled (a sampler without one resumes nothing)."""
        self.journal = journal or Journal()
        self.backend = backend
        self.dataset = dataset
        self._verify = verify
        self.metrics = metrics or Metrics()
        self.clock = clock
        if live is None:
            assert config is not None, "a config or a live config"
            live = LiveConfig(config, config_version, dataset.domains, dataset.prompt_ids())
        self.live = live
        self.admission = Admission(live, consumer_step)
        self.pacer = Pacer(
            live, clock, lambda: self.tally.decoded, lambda: self.admission.step_groups
        )
        self.journal.held = self.pacer.delayed_rows
        self.admitter = mixing.DeficitAdmitter(dataset.domains, window=200)
        self.tally = tally or Tally(dataset.domains, clock)
        #: Earlier right answers per prompt, for all-wrong groups (config `replay`).
        self.replay = ReplayStore()
        self.finalizer = Finalizer(
            live=live,
            sink=sink,
            tally=self.tally,
            replay=self.replay,
            served_version=lambda: backend.policy_version,
            saved_state=self.saved_state,
            clock=clock,
            on_error=self._error,
            journal=self.journal,
        )
        self.finalizer.on_stored = self.poke
        self.sampler = PromptSampler(
            backend=backend,
            verify=verify,
            tally=self.tally,
            generating=self._generating,
            clock=clock,
            engine_result=self._engine_result,
            episodes=episodes,
            journal=self.journal,
        )
        self._rng = np.random.default_rng(seed)
        #: Prompts being sampled, by their task; in rounds, the cohort of the round.
        self._active: dict[asyncio.Task[None], PromptRun] = {}
        self._cohort: list[PromptRun] = []
        #: Prompts admitted so far (1 on): each one's place in line (`PromptRun.admitted`).
        self._admissions = itertools.count(1)
        self._gate = asyncio.Event()  # cleared while weights are being swapped
        self._gate.set()
        self._weights_lock = asyncio.Lock()
        #: Why the last weight update drained instead of continuing, as logged.
        self._drains_logged: str | None = None
        self._in_flight = 0
        self._drained = asyncio.Event()  # set whenever no engine request is in flight
        self._drained.set()
        self._wakeup = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        #: Prompts a restart continues (`resume`), sampled before any new admission.
        self._resumed: list[PromptRun] = []
        self.last_error: str | None = None
        #: Recent engine calls: the time of each failure, None for each success.
        self.engine_errors: deque[float | None] = deque(maxlen=100)

    def _error(self, message: str) -> None:
        self.last_error = message

    def _engine_result(self, error: str | None) -> None:
        """An engine call's outcome, for `engine_warning`: None for a success."""
        if error is not None:
            self.last_error = error
        self.engine_errors.append(None if error is None else self.clock())

    # -- life cycle -------------------------------------------------------------------
    def resume(self, runs: list[PromptRun]) -> None:
        """Prompts stored half-sampled before a restart: `start` spawns them first."""
        self._resumed.extend(runs)

    def start(self) -> None:
        for run in self._resumed:
            self._spawn(run)
        self._resumed = []
        self._runner = asyncio.create_task(self._run(), name="scheduler")
        self._runner.add_done_callback(self._runner_ended)
        self.finalizer.start()

    def _runner_ended(self, task: asyncio.Task[None]) -> None:
        """The admission loop ends only when stopped: a failure is said, never silent."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.last_error = f"the admission loop failed, nothing more is admitted: {exc!r}"
            log.error("the admission loop failed; nothing more is admitted", exc_info=exc)

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop generating; groups whose answers are all in are still stored (bounded wait)."""
        # Without a journal, what the prompts still sampling had decoded is lost with
        # them: a restart starts them again. With one, they resume from their answers.
        if not self.journal.keeps_answers:
            for run in [*self._active.values(), *(r for r in self._cohort if not r.done)]:
                self.tally.lost(run.recorded_tokens, run.row.domain, run.quartile())
        tasks = [t for t in (self._runner, *self._active) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._runner = None
        await self.finalizer.stop(drain_timeout_s)

    def poke(self) -> None:
        """Something that limits admission changed (ack, config, weights): re-check."""
        self._wakeup.set()

    @property
    def episodes(self) -> EpisodeRunner | None:
        """The runner of the prompts whose rows name an environment."""
        return self.sampler.episodes

    @episodes.setter
    def episodes(self, runner: EpisodeRunner | None) -> None:
        self.sampler.episodes = runner

    @property
    def config(self) -> SamplerConfig:
        """The live config (its owner is `live`)."""
        return self.live.config

    @property
    def active_prompts(self) -> int:
        return len(self._active)

    def late_prompts(self) -> int:
        """Prompts still sampling (or their groups not yet stored) whose groups the next
        weight push makes too stale to hand out: the answers they keep so far are from
        weights `max_staleness` or more versions old (a hand-out waits for them:
        `handout_hold_s`). A prompt admitted that long ago whose kept answers are all
        newer (down-sampling keeps a class's newest) is not waited for: it would go out
        fresh. Without a bound, none."""
        bound = self.config.max_staleness
        if bound is None:
            return 0
        last = self.backend.policy_version - bound
        running = sum(
            run.admitted_version <= last  # (its answers are no older than its admission)
            and (version := run.group_version_min()) is not None
            and version <= last
            for run in self._active.values()
        )
        return running + self.finalizer.queued_since(last)

    def holds_handout(self, newest_member: int | None, held_s: float) -> bool:
        """Whether a frame about to be handed out (`newest_member`: its newest member's
        policy version) waits on, `held_s` into its hold: while late prompts (above) run
        and it has a member newer than theirs for their groups to replace
        (`Finalizer.frame_late_groups`), up to `handout_hold_s` (resolved: `handout_hold`);
        never while the engine is unhealthy (its prompts may not end)."""
        cfg = self.config
        if (
            cfg.max_staleness is None
            or newest_member is None
            or held_s >= cfg.handout_hold
            or self.live.policies.selections
            or not self.backend.health().ok
        ):
            return False
        return (
            newest_member > self.backend.policy_version - cfg.max_staleness
            and self.late_prompts() > 0
        )

    @property
    def finalizing(self) -> int:
        """Prompts whose answers are all in, their groups not yet stored."""
        return self.finalizer.finalizing

    def engine_warning(self, window_s: float = 60.0) -> str | None:
        """Set while most recent engine calls fail (it clears once calls succeed again)."""
        now = self.clock()
        recent = [t for t in self.engine_errors if t is None or now - t <= window_s]
        failures = sum(t is not None for t in recent)
        if failures >= 3 and failures * 2 >= len(recent):
            return f"engine: {failures} of its last {len(recent)} calls failed ({self.last_error})"
        return None

    def store_warning(self) -> str | None:
        """Set once a write of finished groups failed: those groups are not offered, and
        nothing else says so but the log (it stays: the groups stay lost)."""
        lost = self.finalizer.unstored
        if not lost:
            return None
        return (
            f"store: the groups of {lost} finished prompts could not be stored and are not "
            f"offered ({self.finalizer.unstored_error})"
        )

    @property
    def paused(self) -> bool:
        return not self._gate.is_set()

    def held_tokens(self) -> int:
        """Decoded tokens this scheduler holds: in the counted answers of prompts still
        sampling, of prompts waiting to be finalized, and of groups waiting for their
        frame (the other side of `Tally.tokens_by_fate`'s pending, with the sink's)."""
        runs = [*self._active.values(), *(run for run in self._cohort if not run.done)]
        return sum(run.recorded_tokens for run in runs) + self.finalizer.held_tokens()

    def allocation_stats(self) -> dict[str, Any]:
        """The allocation policy in force, what it learned, and its prompts' counters."""
        return {**self.live.allocation_stats(), **self.tally.allocation.to_dict()}

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "mixer": self.live.mixer.state_dict(),
            "admitter": self.admitter.state_dict(),
            "estimator": self.live.estimator.state_dict(),
        }

    def saved_state(self) -> dict[str, Any]:
        """What a save writes, by state key: the learned state (`state_dict`) and the
        replay store's prompts changed since the last save. The dataset's cursor is the
        journal's to write: it must move with the attempts it admitted."""
        return {STATE_KEY: self.state_dict(), **self.replay.changes()}

    def restore_state(self, saved: dict[str, Any]) -> None:
        """Load what `saved_state` wrote (every key of it, however many saves ago); a
        state dir from before the cursor had a key of its own holds it in the learned
        state."""
        if saved.get(STATE_KEY):
            self.load_state_dict(saved[STATE_KEY])
        if saved.get(DATASET_KEY):
            self.dataset.load_state_dict(saved[DATASET_KEY])
        self.replay.restore({k: v for k, v in saved.items() if k.startswith(REPLAY_KEY_PREFIX)})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, target in (
            ("mixer", self.live.mixer),
            ("admitter", self.admitter),
            ("estimator", self.live.estimator),
            ("dataset", self.dataset),
        ):
            if key in state:
                target.load_state_dict(state[key])

    def restore_pending(self, groups: list[Group]) -> None:
        """Finished groups stored before a restart but not yet framed."""
        self.finalizer.restore_pending(groups)

    async def form_frames(self) -> None:
        """Re-check framing (e.g. after batch_groups was lowered by a PATCH)."""
        await self.finalizer.form_frames()

    # -- admission --------------------------------------------------------------------
    def buffered(self) -> int:
        finalizer = self.finalizer
        return (
            finalizer.sink.buffered()
            + len(finalizer.unframed)
            + finalizer.returning
            + finalizer.finalizing
        )

    def capacity(self) -> int:
        """How many prompts may be admitted now (`admission`)."""
        return self.admission.room(
            paused=self.paused,
            healthy=self.backend.health().ok,
            active=len(self._active),
            buffered=self.buffered(),
        )

    def _admit(self, paced: bool = True) -> PromptRun | None:
        """The next prompt to sample: a delayed one first (`pacing`), then the next the
        mixer and admission policies choose; None while every candidate is delayed."""
        live, pacer = self.live, self.pacer
        pacer.observe(self.backend.policy_version)
        backlog = pacer.backlog(self._active.values) if paced and pacer.active else 0.0
        row = pacer.take_delayed(backlog) if paced else None
        for _ in range(_PACED_TRIES):
            if row is not None or pacer.full():
                break
            candidate = self._next_admissible(self.admitter.choose(live.mixer.proportions()))
            if not paced or pacer.fits(candidate, backlog):
                row = candidate
            else:
                pacer.delay(candidate)
        if row is None:
            return None
        self.tally.admitted(row.domain)
        run = PromptRun(row, live.plan, live.allocation, live.estimator)
        run.admitted, run.admitted_version = next(self._admissions), self.backend.policy_version
        self.journal.issued(run)  # with the cursor that admitted it
        if paced:
            run.expected_tokens = pacer.cost(row)
            pacer.admitted(run.expected_tokens)
        return run

    def _next_admissible(self, domain: str) -> PromptRow:
        """The domain's next prompt that no admission policy skips; skips are counted.

        A skipped prompt is passed over for this epoch of its domain. Every policy keeps
        a floor chance of admitting, so the loop ends.
        """
        live = self.live
        while True:
            row = self.dataset.next(domain)
            if not any(
                self._rng.random() < policy.skip_probability(live.estimator, row.id)
                for policy in live.admission
            ):
                return row
            self.tally.skipped(domain)

    def _spawn(self, run: PromptRun) -> None:
        task = asyncio.create_task(self._run_prompt(run), name=f"prompt-{run.row.id}")
        self._active[task] = run

        def finished(t: asyncio.Task[None]) -> None:
            self._active.pop(t, None)
            if not t.cancelled() and t.exception() is not None:
                self.last_error = f"prompt task failed: {t.exception()!r}"
                log.error("prompt %s failed", run.row.id, exc_info=t.exception())
            self.poke()

        task.add_done_callback(finished)

    async def _sleep_until_poked(self, timeout: float) -> None:
        self._wakeup.clear()
        await wait_event(self._wakeup, timeout)

    async def _run(self) -> None:
        while True:
            if self.config.mode == "rounds":
                await self._run_cohort()
                continue
            n = self.capacity()
            if n <= 0:
                await self._sleep_until_poked(1.0)
                continue
            # A few at a time, yielding in between: heartbeats, PATCHes and /health keep
            # being answered while a large max_active_prompts fills up.
            for _ in range(min(n, _ADMIT_CHUNK)):
                if (run := self._admit()) is None:  # paced: wait for a finish or a version
                    await self._sleep_until_poked(1.0)
                    break
                self._spawn(run)
            await asyncio.sleep(0)

    async def _run_cohort(self) -> None:
        """Paper mode: a cohort runs synchronous rounds; the next waits for all of it."""
        while self.capacity() <= 0 or self._active:
            await self._sleep_until_poked(1.0)
        cfg = self.config
        runs = self._cohort = []
        for i in range(cfg.cohort_size):
            run = self._admit(paced=False)
            assert run is not None
            runs.append(run)
            if i % _ADMIT_CHUNK == _ADMIT_CHUNK - 1:
                await asyncio.sleep(0)
        # Every round adds at least one answer to each live prompt, so n_max rounds end
        # them all, however an allocation budget cuts their waves.
        for _ in range(cfg.n_max):
            live = [(run, n) for run in runs if not run.done and (n := run.next_wave()) > 0]
            if not live:
                break
            results = await asyncio.gather(*(self._wave(run, n) for run, n in live))
            finished = []
            for (run, _), failed in zip(live, results, strict=True):
                if failed:
                    self._drop(run, failed)
                elif run.next_wave() == 0:
                    finished.append(run)
            await self.finalizer.finalize(finished)
        await self.finalizer.finalize([run for run in runs if not run.done])

    # -- one prompt -------------------------------------------------------------------
    async def _run_prompt(self, run: PromptRun) -> None:
        if failed := await self.sampler.sample(run):
            self._drop(run, failed)
            return
        self.pacer.finished(run.recorded_tokens, run.n_generated)
        self.finalizer.put(run)

    async def _wave(self, run: PromptRun, n: int) -> str | None:
        """One wave of a prompt in a round; why the prompt must be dropped, or None."""
        try:
            await self.sampler.wave(run, n)
        except PromptDropped as exc:
            return exc.reason
        return None

    @contextlib.asynccontextmanager
    async def _generating(self) -> AsyncIterator[None]:
        await self._gate.wait()
        self._in_flight += 1
        self._drained.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()
                self.poke()

    def _drop(self, run: PromptRun, reason: str) -> None:
        run.done = True
        self.journal.ended(run)
        self.tally.dropped_group(reason, run.sampled_tokens(), run.row.domain, run.quartile())

    # -- weight updates ---------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def paused_for_weights(self) -> AsyncIterator[None]:
        """Stop new waves; running answers finish first (`wait`), are aborted (`abort`),
        or go on decoding under the new weights (`continue`); then resume."""
        async with self._weights_lock:
            self._gate.clear()
            pause = self._update_pause()
            try:
                if pause == "wait":
                    if self.config.weight_update_mode == "abort":
                        await self.backend.abort_all()
                    await self._drain(self.config.weight_drain_timeout_s)
                else:
                    cap = self.config.max_versions_per_answer
                    if cap is not None:
                        await self.sampler.cap_versions(self.backend.policy_version + 1, cap)
                self.backend.update_pause = pause
                yield
            finally:
                self.backend.update_pause = "wait"
                self._gate.set()
                self.pacer.observe(self.backend.policy_version)
                self.poke()

    def _update_pause(self) -> PauseMode:
        """How this update's barrier pauses running answers: frozen and continued
        (`keep`, `recompute`) where the mode is `continue` and the engine can, else
        `wait` (what `abort` cut has stopped by then)."""
        if self.config.weight_update_mode != "continue":
            return "wait"
        why = self.continue_unsupported()
        if why is not None and why != self._drains_logged:  # once, not at every update
            log.warning("weight_update_mode continue: %s", why)
        self._drains_logged = why
        return "wait" if why is not None else self.config.weight_update_kv

    def continue_unsupported(self) -> str | None:
        """Why `weight_update_mode: continue` drains instead, on this engine and with
        this `weight_update_kv` (None: it continues, or is not asked to)."""
        kv = self.config.weight_update_kv
        if self.config.weight_update_mode != "continue" or kv in self.backend.continues:
            return None
        can = ", ".join(sorted(self.backend.continues)) or "neither"
        return (
            f"the {self.backend.name} engine cannot continue answers across a weight "
            f"update with weight_update_kv {kv} (it can: {can}): running answers finish first"
        )

    async def _drain(self, timeout_s: float) -> None:
        """Wait for in-flight waves; abort the ones still running after `timeout_s`.

        Aborted waves raise GenerationAborted in their prompt's loop and are issued again
        once the gate reopens, so nothing is lost; with several engines, one long answer
        cannot hold every engine idle.
        """
        try:
            async with asyncio.timeout(timeout_s):
                await self._drained.wait()
            return
        except TimeoutError:
            log.warning(
                "weight update: %d waves still running after %.0fs; aborting them",
                self._in_flight,
                timeout_s,
            )
        await self.backend.abort_all()
        await self._drained.wait()
