"""One admitted prompt's sampling: waves issued, answers verified and counted in index
order, surplus answers cancelled.

Each answer's index in its prompt's sequence is fixed when its wave is issued. Answers
come back as they finish, in any order; each batch that finished together is verified
in one call, and the prompt counts answers in index order only (`PromptRun`). Under
exact stopping the rule is asked after every counted answer, so the group is answers
1..j for the first j where it holds, distributed as under sequential sampling, however
long each answer took; the answers above j are surplus: cancelled in the engine if
still running, discarded if finished. Under wave stopping the rule is asked when a
whole wave is counted.

Exactness needs every index up to j to be drawn once. An answer that is thrown away and
drawn again for a reason tied to it (a weight update's abort or a drain time-out cuts
the long ones; an engine that dies takes its running answers with it; an environment
that fails re-runs its episode; `max_versions_per_answer` cuts an answer that a
`continue` update would carry over too many versions) is counted as `redrawn`, by cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from sampler_service.backends.base import (
    Backend,
    Completion,
    GenerationAborted,
    SamplingParams,
    Wave,
    WholeWave,
)
from sampler_service.dataset import PromptRow
from sampler_service.episodes import EpisodeRunner, EpisodesExhausted, EpisodeWave
from sampler_service.grouping import sampled_tokens
from sampler_service.journal import Journal
from sampler_service.prompt_run import PromptRun
from sampler_service.tally import EpisodeCost, Tally, WaveOutcome
from sampler_service.verifiers.base import Verdict

log = logging.getLogger(__name__)

#: Scores a wave's answers to one prompt together (one hand-off to a verifier pool per
#: batch of answers, not per answer): a verdict per answer, in order. A failed
#: verification is a verdict of a kind other than `ok` (after whatever retries the
#: function makes itself).
VerifyFn = Callable[[PromptRow, Sequence[Completion]], Awaitable[list[Verdict]]]
#: The scheduler's hold on the engine while a wave runs: it waits while weights are
#: installed, and a weight update waits for (or aborts) what runs.
Generating = Callable[[], contextlib.AbstractAsyncContextManager[None]]

#: Attempts at a wave whose engine call fails before the prompt is given up.
ENGINE_RETRIES = 3
#: Seconds a stopped prompt waits for its cancelled answers to come back (to count
#: what they decoded); an engine slower than this to cancel is not waited for.
CANCEL_WAIT_S = 10.0


#: What a wave's reader gets: an answer by index, the engine's failure, or the end.
_Item = tuple[int, Completion] | BaseException | None


def _unverified(completion: Completion) -> Verdict | None:
    """The verdict of an answer no verifier scores, else None: a truncated answer scores 0
    (its final answer is missing), and so does an episode that ran out of turns; one
    whose environment gave a terminal reward scores that."""
    if completion.env_reward is not None:
        return Verdict(completion.env_reward, None)
    if completion.finish_reason in ("length", "turns"):
        return Verdict(0.0, None)
    return None


def _tokens(completion: Completion) -> int:
    return sampled_tokens(completion.token_ids, completion.loss_mask)


class PromptDropped(Exception):
    """The prompt cannot be finished; `reason` is the drop reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Account:
    """What one wave of a prompt cost beyond its counted answers."""

    counted_before: int
    positives_before: int
    surplus_answers: int = 0
    surplus_tokens: int = 0
    aborted_tokens: int = 0
    dropped_tokens: int = 0
    redrawn: Counter[str] = field(default_factory=Counter)
    episodes: list[EpisodeCost] = field(default_factory=list)
    spanning_answers: int = 0
    continued_tokens: int = 0

    def returned(self, completion: Completion) -> None:
        """An answer the engine handed back: what a `continue` update kept of it."""
        spans = completion.version_spans
        if spans is not None and len(spans) > 1:
            self.spanning_answers += 1
            self.continued_tokens += spans[-1][1]


@dataclass(eq=False)
class _InFlight:
    """A wave being drawn: the version it was issued under, its handle once issued, and
    whether `max_versions_per_answer` cancelled it."""

    version: int
    wave: Wave | None = None
    capped: bool = False


class PromptSampler:
    """Samples admitted prompts until they stop (see the module docstring). It knows the
    engine, the verifier and the tally, not the scheduler that admits the prompts."""

    def __init__(
        self,
        *,
        backend: Backend,
        verify: VerifyFn,
        tally: Tally,
        generating: Generating,
        clock: Callable[[], float],
        engine_result: Callable[[str | None], None],
        episodes: EpisodeRunner | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.backend = backend
        self._verify = verify
        self.tally = tally
        self._generating = generating
        self._clock = clock
        #: Told of every engine call: None for a success, the error for a failure.
        self._engine_result = engine_result
        self.episodes = episodes
        #: Told of every answer issued and verified, so a restart can resume the prompt.
        self.journal = journal or Journal()
        self._in_flight: set[_InFlight] = set()

    async def sample(self, run: PromptRun) -> str | None:
        """Waves until the prompt stops (a resumed prompt first draws again the answers
        it was missing); why it must be dropped, or None."""
        try:
            if run.redo:
                redo, run.redo = run.redo, []
                await self.wave(run, len(redo), redo)
            while (n := run.wave_size()) > 0:
                await self.wave(run, n)
        except PromptDropped as exc:
            return exc.reason
        return None

    async def wave(self, run: PromptRun, n: int, indices: list[int] | None = None) -> None:
        """Issue the prompt's next n answers (or the answers `indices`, issued before)
        and count them (PromptDropped if it cannot be finished)."""
        started = self._clock()
        account = _Account(run.n_generated, run.n_pos)
        if indices is None:
            indices = list(range(run.issued, run.issued + n))
            run.issued += n
            self.journal.issued(run)
        failures = 0
        try:
            while indices and not run.stopped:
                indices, error = await self._draw(run, indices, account)
                if error is None:
                    continue
                failures += 1
                self._engine_result(f"engine error: {error!r}")
                log.warning(
                    "wave for prompt %s failed (%d/%d): %r",
                    run.row.id,
                    failures,
                    ENGINE_RETRIES,
                    error,
                )
                if failures >= ENGINE_RETRIES:
                    raise PromptDropped("engine_error") from error
                account.redrawn["engine_error"] += len(indices)
                await asyncio.sleep(0.5 * 2**failures)
        except PromptDropped:
            account.dropped_tokens += sum(_tokens(c) for c, _ in run.waiting.values())
            run.waiting.clear()
            self.tally.wave(self._outcome(run, account, None))
            raise
        self.tally.wave(self._outcome(run, account, self._clock() - started))

    async def cap_versions(self, version: int, cap: int) -> None:
        """Before a `continue` update to `version`: cancel the waves still running that
        would then span more than `cap` versions; their answers are drawn again, counted
        as `redrawn` version_cap (a re-draw that favours short answers)."""
        over = [w for w in self._in_flight if w.wave is not None and version - w.version >= cap]
        for flight in over:
            flight.capped = True
        await asyncio.gather(
            *(f.wave.cancel(range(f.wave.n)) for f in over if f.wave is not None),
            return_exceptions=True,
        )

    def _outcome(self, run: PromptRun, account: _Account, seconds: float | None) -> WaveOutcome:
        counted = run.completions[account.counted_before :]
        tokens = sum(map(_tokens, counted))
        run.recorded_tokens += tokens
        return WaveOutcome(
            run.row.domain,
            quartile=run.quartile(),
            answers=len(counted),
            positives=run.n_pos - account.positives_before,
            tokens=tokens,
            seconds=seconds,
            episodes=_merged(account.episodes),
            surplus_answers=account.surplus_answers,
            surplus_tokens=account.surplus_tokens,
            aborted_tokens=account.aborted_tokens,
            dropped_tokens=account.dropped_tokens,
            redrawn=tuple(sorted(account.redrawn.items())),
            spanning_answers=account.spanning_answers,
            continued_tokens=account.continued_tokens,
        )

    async def _draw(
        self, run: PromptRun, indices: list[int], account: _Account
    ) -> tuple[list[int], Exception | None]:
        """One engine call for the answers `indices`, each counted as it is verified.
        Returns the indices still to draw (answers a weight update aborted, or the engine
        lost) and the engine's failure, if it failed."""
        results: asyncio.Queue[_Item] = asyncio.Queue()
        issued: asyncio.Future[Wave] = asyncio.get_running_loop().create_future()
        pump = asyncio.create_task(self._pump(run, indices, issued, results, account))
        missing = set(range(len(indices)))
        again: list[int] = []
        error: Exception | None = None
        flight = _InFlight(self.backend.policy_version)
        self._in_flight.add(flight)
        try:
            wave = flight.wave = await issued
            while missing and (batch := await _next_batch(results)) is not None:
                answers = []
                for local, completion in batch:
                    missing.discard(local)
                    account.returned(completion)
                    if completion.finish_reason == "abort":  # a weight update cut it short
                        account.aborted_tokens += _tokens(completion)
                        again.append(indices[local])
                    else:
                        answers.append((indices[local], completion))
                if answers:
                    await self._count(run, answers, account)
                if run.stopped and missing:
                    await self._cancel(wave, sorted(missing), results, account)
                    missing.clear()
        except GenerationAborted:  # the engine dropped what was left of the wave
            pass
        except EpisodesExhausted as exc:
            raise PromptDropped("env_error") from exc
        except PromptDropped:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure: the caller retries
            error = exc
        finally:
            self._in_flight.discard(flight)
            if not pump.done():
                pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        if run.stopped:  # what was left to draw again is surplus now
            account.surplus_answers += len(again) + len(missing)
            return [], None
        if error is None and (redrawn := len(again) + len(missing)):
            account.redrawn["version_cap" if flight.capped else "aborted"] += redrawn
        return sorted(again + [indices[i] for i in missing]), error

    async def _pump(
        self,
        run: PromptRun,
        indices: list[int],
        issued: asyncio.Future[Wave],
        results: asyncio.Queue[_Item],
        account: _Account,
    ) -> None:
        """Issue the wave of answers `indices` and pass on each answer as it comes; an
        engine failure ends the stream as the exception. A wave of single answers holds
        the engine's gate while it runs; episodes hold it per turn, not across their
        environments' steps."""
        n = len(indices)
        try:
            factory = self.episodes.factory_for(run.row) if self.episodes is not None else None
            if factory is None:
                async with self._generating():
                    row, sampling = run.row, run.plan.sampling
                    key, priorities = row.id, run.priorities(indices)
                    if run.exact or not self.backend.whole_waves_cheaper:
                        wave = self.backend.wave(
                            row.token_ids, n, sampling, affinity_key=key, priorities=priorities
                        )
                    else:  # read whole, nothing cancelled alone: one request of n
                        answers = self.backend.generate(
                            row.token_ids, n, sampling, affinity_key=key, priorities=priorities
                        )
                        wave = WholeWave(answers, n)
                    await _relay(wave, issued, results)
            else:
                assert self.episodes is not None
                knobs = run.plan.cfg.episode
                episode_wave = EpisodeWave(
                    self.episodes,
                    run.row,
                    factory,
                    n,
                    run.plan.sampling,
                    knobs,
                    functools.partial(self._turn, run),
                    knobs.max_env_errors - run.env_errors,
                )
                try:
                    await _relay(episode_wave, issued, results)
                finally:
                    run.env_errors += len(episode_wave.env_errors)
                    if episode_wave.reruns:
                        account.redrawn["env_error"] += episode_wave.reruns
                    account.episodes.append(episode_wave.cost())
                    if episode_wave.env_errors:
                        log.warning(
                            "environment of prompt %s: %s", run.row.id, episode_wave.env_errors[-1]
                        )
            self._engine_result(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which decides
            if not issued.done():
                issued.set_exception(exc)
            results.put_nowait(exc)
        finally:
            results.put_nowait(None)

    async def _turn(self, run: PromptRun, ids: list[int], sampling: SamplingParams) -> Completion:
        """One model turn of an episode, held in the engine's gate; a weight update's
        abort issues the turn again, not the episode."""
        while True:
            try:
                async with self._generating():
                    [answer] = await self.backend.generate(
                        ids, 1, sampling, affinity_key=run.row.id, priorities=run.priorities([0])
                    )
                return answer
            except GenerationAborted:
                continue

    async def _count(
        self, run: PromptRun, answers: list[tuple[int, Completion]], account: _Account
    ) -> None:
        """Verify a batch of answers and count the prompt's answers in index order; once
        the rule holds, the answers above it are surplus."""
        verdicts = await self._score(run.row, [c for _, c in answers])
        # A failed verification says nothing about its answer: scoring it 0 would count a
        # negative that never was, so the prompt is dropped instead.
        failed = next((v.kind for v in verdicts if v.kind != "ok"), None)
        if failed is not None:
            account.dropped_tokens += sum(_tokens(c) for _, c in answers)
            unavailable = any(v.kind == "unavailable" for v in verdicts)
            raise PromptDropped("verifier_unavailable" if unavailable else "verifier_error")
        if run.stopped:  # stopped while this batch was verified: all of it is surplus
            self._surplus(account, [c for _, c in answers])
            return
        verified = [(i, c, v) for (i, c), v in zip(answers, verdicts, strict=True)]
        for index, completion, verdict in verified:
            run.arrived(index, completion, verdict)
        self.journal.answered(run, verified)
        if run.count_arrived():
            self._surplus(account, [c for c, _ in run.waiting.values()])
            run.waiting.clear()

    def _surplus(self, account: _Account, completions: Sequence[Completion]) -> None:
        account.surplus_answers += len(completions)
        account.surplus_tokens += sum(map(_tokens, completions))

    async def _cancel(
        self,
        wave: Wave,
        locals_: list[int],
        results: asyncio.Queue[_Item],
        account: _Account,
    ) -> None:
        """Cancel a stopped prompt's answers still running, and count what they decoded
        as they come back (an engine that answers whole waves is let finish)."""
        if wave.cancels_answers:
            await wave.cancel(locals_)
        left = set(locals_)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT_S):
                while left and (batch := await _next_batch(results)) is not None:
                    for local, completion in batch:
                        left.discard(local)
                        account.returned(completion)
                        self._surplus(account, [completion])
        account.surplus_answers += len(left)  # not back in time: their tokens are unknown

    async def _score(self, row: PromptRow, completions: list[Completion]) -> list[Verdict]:
        """A verdict per answer: those a verifier must score in one call."""
        verdicts = [_unverified(c) for c in completions]
        todo = [i for i, verdict in enumerate(verdicts) if verdict is None]
        if todo:
            verified = await self._verify(row, [completions[i] for i in todo])
            for i, verdict in zip(todo, verified, strict=True):
                verdicts[i] = verdict
        return cast(list[Verdict], verdicts)


async def _relay(wave: Wave, issued: asyncio.Future[Wave], results: asyncio.Queue[_Item]) -> None:
    issued.set_result(wave)
    async for item in wave:
        results.put_nowait(item)


async def _next_batch(results: asyncio.Queue[_Item]) -> list[tuple[int, Completion]] | None:
    """Every answer that has come in (waiting for the first); None once the wave ended.
    An engine failure is raised here."""
    first = await results.get()
    items = [first]
    while not results.empty():
        items.append(results.get_nowait())
    batch: list[tuple[int, Completion]] = []
    for item in items:
        if isinstance(item, BaseException):
            raise item
        if item is None:
            results.put_nowait(None)  # the end stays visible to the next read
            return batch or None
        batch.append(item)
    return batch


def _merged(costs: list[EpisodeCost]) -> EpisodeCost | None:
    """What a wave's episodes cost, over every engine call it took."""
    if not costs:
        return None
    return EpisodeCost(
        turns=tuple(t for c in costs for t in c.turns),
        model_tokens=sum(c.model_tokens for c in costs),
        observation_tokens=sum(c.observation_tokens for c in costs),
        env_errors=sum(c.env_errors for c in costs),
        env_seconds=sum(c.env_seconds for c in costs),
        last_env_error=next((c.last_env_error for c in reversed(costs) if c.last_env_error), None),
    )
