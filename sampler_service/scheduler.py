"""The adaptive scheduler: per-prompt sampling until the stopping rule fires.

Continuous mode (the default) has no global round barrier: every admitted prompt runs
its own loop of waves (generate -> verify -> ask the rule), so the engine's continuous
batching stays full and a new prompt is admitted as soon as one finishes. `mode:
rounds` reproduces Reinforce-Ada's synchronous rounds for comparison.

The scheduler owns no I/O of its own: the engine, the verifier, the clock and the sink
that stores finished groups are injected, so the benchmarks drive this exact code with
a simulated engine in simulated time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

from sampler_service import grouping
from sampler_service.aio import wait_event
from sampler_service.backends.base import Backend, Completion, GenerationAborted, SamplingParams
from sampler_service.config import PolicySet, SamplerConfig
from sampler_service.dataset import Dataset, PromptRow
from sampler_service.episodes import EpisodeRunner, EpisodeWave
from sampler_service.metrics import Metrics
from sampler_service.replay import KEY_PREFIX as REPLAY_KEY_PREFIX
from sampler_service.replay import Replayed, ReplayStore
from sampler_service.verifiers.base import Verdict
from strategies import admission, mixing
from strategies.allocation import AllocationPolicy
from strategies.estimator import Estimator
from strategies.stopping import StoppingRule, StopReason
from trainer_client.contract.protocol import AdmissionWait, Group

log = logging.getLogger(__name__)

#: Scores a wave's answers to one prompt together (one hand-off to a verifier pool per
#: wave, not per answer): a verdict per answer, in order.
VerifyFn = Callable[[PromptRow, Sequence[Completion]], Awaitable[list[Verdict]]]

#: Attempts at a wave whose engine call fails before the prompt is given up.
_ENGINE_RETRIES = 3
#: Prompts admitted per pass of the admission loop before it yields to the event loop.
_ADMIT_CHUNK = 64
#: Seconds between snapshots of the mixer/estimator/dataset state, which travel with the
#: next finished group into the store. By time, not by count: a snapshot of 8,192
#: prompts' estimator state takes ~27 ms of the event loop. A crash loses at most this
#: much state (a few prompts are served again), never a finished group.
_STATE_EVERY_S = 1.0
#: The state store's key of the scheduler's learned state (`Scheduler.state_dict`).
STATE_KEY = "scheduler_state"
#: Most finished prompts a finalizer stores in one write. Those that finished while
#: the last write ran share the next one: a commit per group would cap the front at one
#: store round trip per group, and a backlog would wait in line for its turn. A larger
#: batch makes the first of a burst wait for the last: a 700-token group of 4 answers
#: takes ~0.2 ms to build and ~0.3-0.6 ms to write, so 64 at once held the first ~50 ms.
_STORE_BATCH = 16
#: Finalizer tasks: while one batch is written (the store's thread), the next is built
#: (the event loop), so a burst of finished prompts pays one of the two, not the sum.
#: The store's frame lock keeps writes one at a time, in the order they were built.
_FINALIZERS = 2


class GroupSink(Protocol):
    """Where finished groups go: the durable store in the service, memory in benchmarks."""

    async def add_pending(self, group: Group, state: dict[str, Any] | None) -> None:
        """Store a group that waits for its frame, with `state` (`Scheduler.saved_state`:
        state keys and their values) when given."""
        ...

    async def add_frames(
        self, frames: Sequence[grouping.FrameResult], state: dict[str, Any] | None = None
    ) -> None:
        """Store frames together (`state`, when given, with them) and offer them in order;
        a member may not have been through `add_pending` (it completed its frame as it
        finished), and a dropped member is deleted if it was."""
        ...

    def buffered(self) -> int:
        """Framed groups not yet acked (READY + LEASED)."""
        ...


@dataclass(frozen=True)
class PromptPlan:
    """What a prompt snapshots at admission; later PATCHes do not touch it. Built once
    per config version (and estimator), not per prompt: none of it holds a prompt's
    state, and validating a rule's parameters per prompt cost the loop ~3% at the knee."""

    config_version: int
    cfg: SamplerConfig
    sampling: SamplingParams
    policies: PolicySet
    rule: StoppingRule


@dataclass
class PromptRun:
    row: PromptRow
    plan: PromptPlan
    #: The allocation policy at admission and the history it reads (the estimator).
    allocation: AllocationPolicy | None = None
    history: Estimator | None = None
    completions: list[Completion] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    outcomes: list[bool] = field(default_factory=list)  # positive or not, in order
    n_pos: int = 0
    n_neg: int = 0
    done: bool = False
    #: Set when the allocation budget, not the rule or n_max, ended the prompt.
    cut: bool = False
    #: The allocation budget when last asked (None without a policy).
    budget: int | None = None
    #: Environment failures met by this prompt's episodes (each one re-run).
    env_errors: int = 0

    @property
    def n_generated(self) -> int:
        return self.n_pos + self.n_neg

    def next_wave(self) -> int:
        """The rule's next wave, cut to what is left of the allocation budget."""
        want = self.plan.rule.next_wave(self.n_pos, self.n_neg, prompt_id=self.row.id)
        if want == 0 or self.allocation is None or self.history is None:
            return want
        self.budget = self.allocation.budget(
            self.history, self.row.id, self.outcomes, self.plan.cfg.n_max
        )
        room = max(self.budget - self.n_generated, 0)
        self.cut = room == 0
        return min(want, room)

    def stop_reason(self) -> StopReason:
        """`budget` when the allocation stopped it, else the rule's reason."""
        if self.cut:
            return "budget"
        return self.plan.rule.stop_reason(self.n_pos, self.n_neg, prompt_id=self.row.id)


@dataclass
class DomainStats:
    admitted: int = 0
    emitted: int = 0
    skipped: int = 0  # prompts an admission policy passed over (no answer generated)
    samples: int = 0
    positives: int = 0
    recent_pass_rates: deque[float] = field(default_factory=lambda: deque(maxlen=200))


@dataclass
class AllocationStats:
    """Groups finished under an allocation policy (since start, whichever policy)."""

    groups: int = 0
    cut: int = 0  # stopped by the allocation budget (stop reason `budget`)
    answers: int = 0
    budgets: int = 0  # sum of the budgets the groups ended with

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": self.groups,
            "cut": self.cut,
            "answers": self.answers,
            "mean_answers": self.answers / self.groups if self.groups else None,
            "mean_budget": self.budgets / self.groups if self.groups else None,
        }


@dataclass
class EpisodeStats:
    """Multi-turn episodes finished, and what they spent (since start)."""

    episodes: int = 0
    turns: Counter[int] = field(default_factory=Counter)  # model turns -> episodes
    env_errors: int = 0
    env_seconds: float = 0.0
    model_tokens: int = 0  # sampled tokens (loss mask 1)
    observation_tokens: int = 0  # tokens appended from observations (loss mask 0)
    last_env_error: str | None = None

    def record(self, wave: EpisodeWave) -> None:
        for episode in wave.completions:
            sampled = sum(episode.loss_mask) if episode.loss_mask is not None else 0
            self.episodes += 1
            self.turns[episode.num_turns] += 1
            self.model_tokens += sampled
            self.observation_tokens += len(episode.token_ids) - sampled
        self.env_errors += len(wave.env_errors)
        self.env_seconds += wave.env_seconds
        if wave.env_errors:
            self.last_env_error = wave.env_errors[-1]

    def to_dict(self) -> dict[str, Any]:
        turns = sum(k * v for k, v in self.turns.items())
        return {
            "episodes": self.episodes,
            "turns_per_episode": turns / self.episodes if self.episodes else None,
            "turns": {str(k): v for k, v in sorted(self.turns.items())},
            "env_errors": self.env_errors,
            "last_env_error": self.last_env_error,
            "env_seconds": self.env_seconds,
            "model_tokens": self.model_tokens,
            "observation_tokens": self.observation_tokens,
        }


class SchedulerStats:
    """Counters behind GET /v1/stats (Prometheus gets the same events via Metrics)."""

    def __init__(self, domains: list[str], clock: Callable[[], float], replay: ReplayStore) -> None:
        self._clock = clock
        self.replay = replay
        self.started = clock()
        self.domains = {d: DomainStats() for d in domains}
        self.samples_per_group: Counter[int] = Counter()
        self.stop_reasons: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.allocation = AllocationStats()
        self.episodes = EpisodeStats()
        self.samples = 0
        self.tokens = 0
        self.groups_emitted = 0
        self.recent_emitted: deque[str] = deque(maxlen=200)
        self.recent_admitted: deque[str] = deque(maxlen=200)

    def to_dict(self) -> dict[str, Any]:
        elapsed = max(self._clock() - self.started, 1e-9)
        return {
            "elapsed_s": elapsed,
            "samples": self.samples,
            "tokens": self.tokens,
            "groups_emitted": self.groups_emitted,
            "samples_per_s": self.samples / elapsed,
            "tokens_per_s": self.tokens / elapsed,
            "groups_per_s": self.groups_emitted / elapsed,
            "samples_per_group": {str(k): v for k, v in sorted(self.samples_per_group.items())},
            "stop_reasons": dict(self.stop_reasons),
            "dropped": dict(self.dropped),
            "skipped": {d: ds.skipped for d, ds in self.domains.items()},
            "episodes": self.episodes.to_dict(),
            "replay": self.replay.stats(),
        }


def _unverified(completion: Completion) -> Verdict | None:
    """The verdict of an answer no verifier scores (see `Scheduler._score`), else None."""
    if completion.env_reward is not None:
        return Verdict(completion.env_reward, None)
    if completion.finish_reason in ("length", "turns"):
        return Verdict(0.0, None)
    return None


class Scheduler:
    # The live config and what is built from it (`_install`).
    config: SamplerConfig
    config_version: int
    #: The live version's group and batch policies, built once per version.
    policies: PolicySet
    estimator: Estimator
    mixer: mixing.Mixer
    _admission: list[admission.AdmissionPolicy]
    _allocation: AllocationPolicy | None
    _plan: PromptPlan

    def __init__(
        self,
        *,
        backend: Backend,
        dataset: Dataset,
        verify: VerifyFn,
        sink: GroupSink,
        config: SamplerConfig,
        config_version: int = 0,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.backend = backend
        self.episodes = episodes
        self.dataset = dataset
        self._verify = verify
        self.sink = sink
        self.metrics = metrics or Metrics()
        self.clock = clock
        estimator = config.build_estimator()
        estimator.set_prompts(dataset.prompt_ids())
        self._install(config, config_version, estimator)
        #: Set while a new estimator is built off the loop: (prompt, answers, correct) of
        #: the groups finished meanwhile, folded into whichever estimator is installed.
        self._estimator_updates: list[tuple[str, int, int]] | None = None
        self.admitter = mixing.DeficitAdmitter(dataset.domains, window=200)
        for domain in dataset.domains:
            self.metrics.prompts_skipped.labels(domain)  # every domain's series from the start
        #: Earlier right answers per prompt, for all-wrong groups (config `replay`).
        self.replay = ReplayStore()
        self.stats = SchedulerStats(dataset.domains, clock, self.replay)
        self._rng = np.random.default_rng(seed)
        self._unframed: list[Group] = []
        self._frame_lock = asyncio.Lock()
        self._active: set[asyncio.Task[None]] = set()
        # Prompts whose answers are all in wait here for the finalizer tasks to store
        # their groups. A prompt leaves its engine slot as soon as its answers are
        # verified, so the next prompt is admitted at once and the engine never waits on
        # the store; waiting groups count as buffered for backpressure.
        self._finished: asyncio.Queue[PromptRun] = asyncio.Queue()
        self._finalizing = 0
        self._finalizers: list[asyncio.Task[None]] = []
        self._gate = asyncio.Event()  # cleared while weights are being swapped
        self._gate.set()
        self._weights_lock = asyncio.Lock()
        self._in_flight = 0
        self._drained = asyncio.Event()  # set whenever no engine request is in flight
        self._drained.set()
        self._wakeup = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        #: Groups per training step as the consumers show it (the service keeps it
        #: current): without it a bound of s steps would count in single frames.
        self.consumer_step_groups = 0
        #: What holds admission at 0 and since when (None: nothing; `capacity` keeps it).
        self.admission: AdmissionWait | None = None
        self._state_saved_at = clock()
        self.last_error: str | None = None
        #: Recent engine calls: the time of each failure, None for each success.
        self.engine_errors: deque[float | None] = deque(maxlen=100)

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        self._runner = asyncio.create_task(self._run(), name="scheduler")
        self._finalizers = [
            asyncio.create_task(self._finalize_finished(), name=f"finalizer-{i}")
            for i in range(_FINALIZERS)
        ]

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop generating; groups whose answers are all in are still stored (bounded wait)."""
        tasks = [t for t in (self._runner, *self._active) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._runner = None
        if self._finalizers:
            try:
                async with asyncio.timeout(drain_timeout_s):
                    await self._finished.join()
            except TimeoutError:
                log.error("stopped with %d finished groups not stored", self._finalizing)
            for finalizer in self._finalizers:
                finalizer.cancel()
            await asyncio.gather(*self._finalizers, return_exceptions=True)
            self._finalizers = []

    def poke(self) -> None:
        """Something that limits admission changed (ack, config, weights): re-check."""
        self._wakeup.set()

    @property
    def active_prompts(self) -> int:
        return len(self._active)

    @property
    def finalizing(self) -> int:
        """Prompts whose answers are all in, their groups not yet stored."""
        return self._finalizing

    def engine_warning(self, window_s: float = 60.0) -> str | None:
        """Set while most recent engine calls fail (it clears once calls succeed again)."""
        now = self.clock()
        recent = [t for t in self.engine_errors if t is None or now - t <= window_s]
        failures = sum(t is not None for t in recent)
        if failures >= 3 and failures * 2 >= len(recent):
            return f"engine: {failures} of its last {len(recent)} calls failed ({self.last_error})"
        return None

    @property
    def paused(self) -> bool:
        return not self._gate.is_set()

    # -- configuration ----------------------------------------------------------------
    async def apply_config(self, cfg: SamplerConfig, version: int) -> None:
        """Install a validated config: admission knobs apply now, prompt knobs on admission.

        A new estimator (est, n_max or rule changed) is built off the event loop, since
        its cost grows with the number of prompts; everything is installed at once after.
        """
        old = self.config
        estimator = self.estimator
        if cfg.est != old.est or cfg.n_max != old.n_max or cfg.rule != old.rule:
            estimator = await self._rebuilt_estimator(cfg)
        self._install(cfg, version, estimator, old)
        self.metrics.config_version.set(version)
        self.poke()

    def _install(
        self,
        cfg: SamplerConfig,
        version: int,
        estimator: Estimator,
        old: SamplerConfig | None = None,
    ) -> None:
        """Make `cfg` the live config and `estimator` the live estimator. The mixer and
        the admission and allocation policies are built anew only where their knobs
        differ from `old` (the config before; None: build everything), so the state they
        learned survives unrelated changes; an allocation that calibrates on the history
        (knapsack) starts afresh with a new estimator. Prompts admitted before keep the
        plan they were admitted with."""
        if old is None or cfg.mixing != old.mixing:
            self.mixer = mixing.build(
                cfg.mixing.name, domains=self.dataset.domains, **cfg.mixing.params
            )
        if old is None or cfg.admission_policies != old.admission_policies:
            self._admission = cfg.admission_policy_objects()
        if old is None or cfg.allocation != old.allocation or estimator is not self.estimator:
            self._allocation = cfg.build_allocation()
        self.config, self.config_version = cfg, version
        self.policies = cfg.policy_set()
        self.estimator = estimator
        self._plan = self._new_plan()

    async def _rebuilt_estimator(self, cfg: SamplerConfig) -> Estimator:
        """The learned state of the live estimator under `cfg`'s parameters.

        The worker thread reads the live estimator, so while it runs the groups that
        finish are only logged; they are folded into the new estimator (or, should the
        build fail, back into the live one) before it is installed: none is lost.
        """
        live = self.estimator

        def build() -> Estimator:
            new = cfg.build_estimator()
            new.set_prompts(self.dataset.prompt_ids())
            new.load_state_dict(live.state_dict())
            return new

        self._estimator_updates = []
        target = live
        try:
            target = await asyncio.to_thread(build)
            return target
        finally:
            updates, self._estimator_updates = self._estimator_updates, None
            for update in updates:
                target.update(*update)

    def state_dict(self) -> dict[str, Any]:
        return {
            "mixer": self.mixer.state_dict(),
            "admitter": self.admitter.state_dict(),
            "estimator": self.estimator.state_dict(),
            "dataset": self.dataset.state_dict(),
        }

    def saved_state(self) -> dict[str, Any]:
        """What a save writes, by state key: the learned state (`state_dict`) and the
        replay store's prompts changed since the last save."""
        return {STATE_KEY: self.state_dict(), **self.replay.changes()}

    def restore_state(self, saved: dict[str, Any]) -> None:
        """Load what `saved_state` wrote (every key of it, however many saves ago)."""
        if saved.get(STATE_KEY):
            self.load_state_dict(saved[STATE_KEY])
        self.replay.restore({k: v for k, v in saved.items() if k.startswith(REPLAY_KEY_PREFIX)})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, target in (
            ("mixer", self.mixer),
            ("admitter", self.admitter),
            ("estimator", self.estimator),
            ("dataset", self.dataset),
        ):
            if key in state:
                target.load_state_dict(state[key])

    def restore_pending(self, groups: list[Group]) -> None:
        """Finished groups stored before a restart but not yet framed."""
        self._unframed.extend(groups)

    # -- admission --------------------------------------------------------------------
    def buffered(self) -> int:
        return self.sink.buffered() + len(self._unframed) + self._finalizing

    def capacity(self) -> int:
        """How many prompts may be admitted now (docs/architecture.md, admission); what
        holds admission at 0, when something does, is `admission`."""
        cap, blocked_by, detail = self._room()
        if blocked_by is None:
            self.admission = None
        elif self.admission is None or self.admission.blocked_by != blocked_by:
            self.admission = AdmissionWait(blocked_by=blocked_by, since=time.time(), detail=detail)
        elif self.admission.detail != detail:
            self.admission = self.admission.model_copy(update={"detail": detail})
        return cap

    def _room(self) -> tuple[int, str | None, str]:
        """(prompts that may start now, what holds it at 0 if anything, why in words).
        A full engine (`max_active_prompts`) holds nothing up: it is busy."""
        cfg = self.config
        if self.paused:
            return 0, "weight_update", "new weights are being installed"
        if not self.backend.health().ok:  # a dead engine would only burn prompts
            return 0, "engine", "no engine can serve"
        buffered = self.buffered()
        if buffered >= cfg.max_buffered_groups:
            return (
                0,
                "max_buffered_groups",
                f"{buffered} groups wait for a trainer's ack (READY, LEASED or being stored), "
                f"max_buffered_groups is {cfg.max_buffered_groups}: ack the groups you hold, "
                "or raise max_buffered_groups",
            )
        cap = cfg.max_active_prompts - len(self._active)
        if cfg.max_staleness is not None:
            ahead = buffered + len(self._active)
            allowed = (cfg.max_staleness + 1) * self.step_groups
            if ahead >= allowed:
                return (
                    0,
                    "max_staleness",
                    f"{ahead} groups are generating or not yet acked, and max_staleness "
                    f"{cfg.max_staleness} allows {cfg.max_staleness + 1} steps of "
                    f"{self.step_groups} groups ahead of the trainer: ack the groups you hold, "
                    "or declare the groups you train on per step (groups_per_step)",
                )
            cap = min(cap, allowed - ahead)
        return max(cap, 0), None, ""

    @property
    def step_groups(self) -> int:
        """Groups the trainer takes per step, what `max_staleness` counts in: the most any
        consumer declared or, declaring none, held unacked at once, and at least a frame
        (`batch_groups`)."""
        return max(self.config.batch_groups, self.consumer_step_groups)

    def _new_plan(self) -> PromptPlan:
        """The plan of the prompts admitted under the live config and estimator."""
        cfg = self.config
        sampling = SamplingParams(
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_tokens
        )
        rule = cfg.build_rule(self.estimator)
        return PromptPlan(self.config_version, cfg, sampling, self.policies, rule)

    def _admit(self) -> PromptRun:
        domain = self.admitter.choose(self.mixer.proportions())
        row = self._next_admissible(domain)
        self.stats.domains[domain].admitted += 1
        self.stats.recent_admitted.append(domain)
        return PromptRun(row, self._plan, self._allocation, self.estimator)

    def allocation_stats(self) -> dict[str, Any]:
        """The allocation policy in force, what it learned, and its groups' counters."""
        spec = self.config.allocation
        policy = self._allocation
        return {
            "policy": None if spec is None else spec.model_dump(),
            **({} if policy is None else policy.describe()),
            **self.stats.allocation.to_dict(),
        }

    def _next_admissible(self, domain: str) -> PromptRow:
        """The domain's next prompt that no admission policy skips; skips are counted.

        A skipped prompt is passed over for this epoch of its domain. Every policy keeps
        a floor chance of admitting, so the loop ends.
        """
        while True:
            row = self.dataset.next(domain)
            if not any(
                self._rng.random() < policy.skip_probability(self.estimator, row.id)
                for policy in self._admission
            ):
                return row
            self.stats.domains[domain].skipped += 1
            self.metrics.prompts_skipped.labels(domain).inc()

    def _spawn(self, run: PromptRun) -> None:
        task = asyncio.create_task(self._run_prompt(run), name=f"prompt-{run.row.id}")
        self._active.add(task)
        self.metrics.active_prompts.set(len(self._active))

        def finished(t: asyncio.Task[None]) -> None:
            self._active.discard(t)
            self.metrics.active_prompts.set(len(self._active))
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
                self._spawn(self._admit())
            await asyncio.sleep(0)

    async def _run_cohort(self) -> None:
        """Paper mode: a cohort runs synchronous rounds; the next waits for all of it."""
        while self.capacity() <= 0 or self._active:
            await self._sleep_until_poked(1.0)
        cfg = self.config
        runs = []
        for i in range(cfg.cohort_size):
            runs.append(self._admit())
            if i % _ADMIT_CHUNK == _ADMIT_CHUNK - 1:
                await asyncio.sleep(0)
        self.metrics.active_prompts.set(len(runs))
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
            await self._finalize(finished)
        await self._finalize([run for run in runs if not run.done])
        self.metrics.active_prompts.set(0)

    # -- one prompt -------------------------------------------------------------------
    async def _run_prompt(self, run: PromptRun) -> None:
        while (n := run.next_wave()) > 0:
            if failed := await self._wave(run, n):
                self._drop(run, failed)
                return
        self._finalizing += 1
        self._finished.put_nowait(run)

    async def _finalize_finished(self) -> None:
        """Store finished prompts' groups: whatever finished meanwhile goes in one write."""
        while True:
            runs = [await self._finished.get()]
            while len(runs) < _STORE_BATCH and not self._finished.empty():
                runs.append(self._finished.get_nowait())
            try:
                await self._finalize(runs)
            except Exception as exc:  # a failed write must not stop the finalizer
                self.last_error = f"storing {len(runs)} groups failed: {exc!r}"
                log.exception("storing the groups of %d prompts failed", len(runs))
            finally:
                self._finalizing -= len(runs)
                for _ in runs:
                    self._finished.task_done()
                self.poke()

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

    async def _wave(self, run: PromptRun, n: int) -> str | None:
        """Generate and verify one wave; why the prompt must be dropped, or None.

        "engine_error": the engine kept failing. "verifier_unavailable": the prompt's
        verifier is refusing calls after too many time-outs; its answers are not scored 0
        (that would emit a wrong group), the prompt is dropped instead.
        """
        started = self.clock()
        completions: list[Completion] | None = None
        failures = 0
        while completions is None:
            try:
                completions = await self._answers(run, n)
            except GenerationAborted:
                continue  # a weight update aborted it: re-issue once the gate reopens
            except Exception as exc:  # noqa: BLE001 - any engine failure is retried, then reported
                failures += 1
                self.last_error = f"engine error: {exc!r}"
                log.warning(
                    "wave for prompt %s failed (%d/%d): %r",
                    run.row.id,
                    failures,
                    _ENGINE_RETRIES,
                    exc,
                )
                self.engine_errors.append(self.clock())
                if failures >= _ENGINE_RETRIES:
                    return "engine_error"
                await asyncio.sleep(0.5 * 2**failures)
        self.engine_errors.append(None)
        if run.env_errors >= run.plan.cfg.episode.max_env_errors:
            return "env_error"
        verdicts = await self._score(run.row, completions)
        if any(v.kind == "unavailable" for v in verdicts):
            return "verifier_unavailable"
        self._count_wave(run, completions, verdicts)
        self.metrics.wave_latency.observe(self.clock() - started)
        return None

    def _count_wave(
        self, run: PromptRun, completions: list[Completion], verdicts: list[Verdict]
    ) -> None:
        """Add a verified wave to its prompt and to the counters: a metric update per
        outcome, not per answer (each costs a lock and a label lookup)."""
        threshold = run.plan.cfg.positive_threshold
        outcomes: Counter[str] = Counter()
        n_pos = tokens = 0
        for completion, verdict in zip(completions, verdicts, strict=True):
            positive = verdict.reward > threshold
            run.outcomes.append(positive)
            n_pos += positive
            outcomes["error" if verdict.error else ("positive" if positive else "negative")] += 1
            tokens += len(completion.token_ids)
        run.completions.extend(completions)
        run.verdicts.extend(verdicts)
        run.n_pos += n_pos
        run.n_neg += len(verdicts) - n_pos
        for outcome, count in outcomes.items():
            self.metrics.samples_generated.labels(run.row.domain, outcome).inc(count)
        self.metrics.generated_tokens.inc(tokens)
        domain_stats = self.stats.domains[run.row.domain]
        domain_stats.samples += len(verdicts)
        domain_stats.positives += n_pos
        self.stats.samples += len(verdicts)
        self.stats.tokens += tokens

    async def _answers(self, run: PromptRun, n: int) -> list[Completion]:
        """One wave's answers: n single answers in one engine call, or n episodes."""
        row = run.row
        factory = self.episodes.factory_for(row) if self.episodes is not None else None
        if factory is None:
            async with self._generating():
                return await self.backend.generate(
                    row.token_ids, n, run.plan.sampling, affinity_key=row.id
                )
        assert self.episodes is not None
        knobs = run.plan.cfg.episode

        async def turn(ids: list[int], sampling: SamplingParams) -> Completion:
            while True:  # a weight update's abort re-issues the turn, not the episode
                try:
                    async with self._generating():
                        [answer] = await self.backend.generate(
                            ids, 1, sampling, affinity_key=row.id
                        )
                    return answer
                except GenerationAborted:
                    continue

        wave = await self.episodes.wave(
            row, factory, n, run.plan.sampling, knobs, turn, knobs.max_env_errors - run.env_errors
        )
        run.env_errors += len(wave.env_errors)
        self.stats.episodes.record(wave)
        if wave.env_errors:
            log.warning("environment of prompt %s: %s", row.id, wave.env_errors[-1])
        self.metrics.observe_episodes(wave)
        return wave.completions

    async def _score(self, row: PromptRow, completions: list[Completion]) -> list[Verdict]:
        """A verdict per answer: those a verifier must score in one call. A truncated
        answer scores 0 without being verified: its final answer is missing. So does an
        episode that ran out of turns; one whose environment gave a terminal reward
        scores that."""
        verdicts = [_unverified(c) for c in completions]
        todo = [i for i, verdict in enumerate(verdicts) if verdict is None]
        if todo:
            verified = await self._verify(row, [completions[i] for i in todo])
            for i, verdict in zip(todo, verified, strict=True):
                verdicts[i] = verdict
        return cast(list[Verdict], verdicts)

    # -- finalization -----------------------------------------------------------------
    def _drop(self, run: PromptRun, reason: str) -> None:
        run.done = True
        self.count_dropped(reason)

    def count_dropped(self, reason: str, groups: int = 1) -> None:
        """Count groups not delivered, by reason (here or, once stored, by the service)."""
        self.stats.dropped[reason] += groups
        self.metrics.groups_dropped.labels(reason).inc(groups)

    async def _finalize(self, runs: list[PromptRun]) -> None:
        """Account for finished prompts, build their groups (`grouping`) and store them
        in one write."""
        groups = []
        for run in runs:
            try:
                group = self._built(run)
            except Exception as exc:  # one bad group must not stop the rest
                self.last_error = f"finalizing prompt {run.row.id} failed: {exc!r}"
                log.exception("finalizing prompt %s failed", run.row.id)
                continue
            if group is not None:
                groups.append(group)
        if groups:
            await self._store(groups)

    def _built(self, run: PromptRun) -> Group | None:
        """Account for a finished prompt and build its group; None if it is dropped."""
        run.done = True
        row = run.row
        n_gen = run.n_generated
        stop_reason = run.stop_reason()
        if run.budget is not None:
            allocated = self.stats.allocation
            allocated.groups += 1
            allocated.cut += run.cut
            allocated.answers += n_gen
            allocated.budgets += run.budget
        self.stats.samples_per_group[n_gen] += 1
        self.stats.stop_reasons[stop_reason] += 1
        self.metrics.samples_per_group.observe(n_gen)
        self.metrics.stop_reasons.labels(stop_reason).inc()
        self.metrics.pass_rate.observe(run.n_pos / n_gen)
        self.stats.domains[row.domain].recent_pass_rates.append(run.n_pos / n_gen)
        if self._estimator_updates is None:
            self.estimator.update(row.id, n_gen, run.n_pos)
        else:  # a new estimator is being built from the live one's state
            self._estimator_updates.append((row.id, n_gen, run.n_pos))

        replay = self._replay_for(run)
        result = grouping.build_group(
            row=row,
            cfg=run.plan.cfg,
            config_version=run.plan.config_version,
            group_policies=run.plan.policies.group,
            completions=run.completions,
            verdicts=run.verdicts,
            n_pos=run.n_pos,
            stop_reason=stop_reason,
            n_env_errors=run.env_errors,
            replay=replay,
        )
        reward_mean = sum(v.reward for v in run.verdicts) / len(run.verdicts)
        self.mixer.observe(row.domain, reward_mean, result.mean_abs_advantage)
        group = result.group
        if group is None:
            self._drop(run, str(result.drop_reason))
            return None
        if replay is not None and any(s.replayed for s in group.samples):
            self.replay.replayed += 1
            self.metrics.replayed_answers.inc()
        return group

    async def _store(self, groups: list[Group]) -> None:
        """Store finished groups: those that complete frames framed, in one write (so
        each is written once), and those that wait for the rest of their frame as
        pending, so a restart still finds them."""
        async with self._frame_lock:
            state = None
            if self.clock() - self._state_saved_at >= _STATE_EVERY_S:
                state, self._state_saved_at = self.saved_state(), self.clock()
            size = self.config.batch_groups
            unframed = len(self._unframed)
            framed = (unframed + len(groups)) // size * size - unframed
            for group in groups[max(framed, 0) :]:
                await self.sink.add_pending(group, state)
                state = None
            self._unframed.extend(groups)
            await self._form_frames(state)

    def _replay_for(self, run: PromptRun) -> Replayed | None:
        """An earlier right answer for a prompt whose answers are all wrong (config
        `replay`), or None; a prompt with right answers has them kept for later."""
        knobs = run.plan.cfg.replay
        if knobs is None:
            return None
        if run.n_pos == 0:
            return self.replay.take(run.row.id, self.backend.policy_version, knobs.max_version_lag)
        rewards = [v.reward for v in run.verdicts]
        threshold = run.plan.cfg.positive_threshold
        self.replay.remember(run.row.id, run.completions, rewards, threshold, knobs.per_prompt)
        return None

    async def form_frames(self) -> None:
        """Re-check framing (e.g. after batch_groups was lowered by a PATCH)."""
        async with self._frame_lock:
            await self._form_frames()

    async def _form_frames(self, state: dict[str, Any] | None = None) -> None:
        """Frame what is unframed, every frame in one write; `state` is stored with them."""
        size = self.config.batch_groups
        count = len(self._unframed) // size * size
        if not count:
            return
        frames = []
        policies = self.policies
        for start in range(0, count, size):
            frame = grouping.apply_batch_policies(
                self._unframed[start : start + size],
                policies.selections,
                policies.weightings,
                batch_id=grouping.new_id(),
            )
            for _, reason in frame.dropped:
                self.count_dropped(reason)
            for group in frame.kept:
                self.stats.groups_emitted += 1
                self.stats.domains[group.domain].emitted += 1
                self.stats.recent_emitted.append(group.domain)
                self.metrics.groups_emitted.labels(group.domain).inc()
            frames.append(frame)
        # The members stay in `_unframed` until the sink has offered them: while their
        # frames are written they must still count as buffered, or admission
        # (max_staleness) would see room that the frames are about to take.
        try:
            await self.sink.add_frames(frames, state)
        finally:
            del self._unframed[:count]

    # -- weight updates ---------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def paused_for_weights(self) -> AsyncIterator[None]:
        """Stop new waves, drain (`wait`) or abort (`abort`) in-flight ones, then resume."""
        async with self._weights_lock:
            self._gate.clear()
            try:
                if self.config.weight_update_mode == "abort":
                    await self.backend.abort_all()
                await self._drain(self.config.weight_drain_timeout_s)
                yield
            finally:
                self._gate.set()
                self.metrics.policy_version.set(self.backend.policy_version)
                self.poke()

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


class VolatileSink:
    """Base of the in-memory sinks (benchmarks, tests): nothing is stored, so a group that
    waits for the rest of its frame needs no write, and frames need no shared one: each
    subclass takes them one at a time (`add_frame`)."""

    async def add_pending(self, group: Group, state: dict[str, Any] | None) -> None:
        return None

    async def add_frames(
        self, frames: Sequence[grouping.FrameResult], state: dict[str, Any] | None = None
    ) -> None:
        """Each frame to `add_frame` in turn; `state` with the first."""
        for frame in frames:
            await self.add_frame(frame.kept, [g.group_id for g, _ in frame.dropped], state)
            state = None

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        """One frame's kept groups and the ids of the members dropped from it."""
        raise NotImplementedError


class MemorySink(VolatileSink):
    """In-memory sink for benchmarks and tests: frames are 'acked' by popping them."""

    def __init__(self) -> None:
        self.frames: list[list[Group]] = []
        self.dropped: list[str] = []

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        if groups:
            self.frames.append(groups)
        self.dropped.extend(dropped)

    def buffered(self) -> int:
        return sum(len(f) for f in self.frames)

    def groups(self) -> list[Group]:
        return [g for frame in self.frames for g in frame]
