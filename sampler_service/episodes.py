"""The episode runner: a prompt's multi-turn rollouts, each one a `Completion`.

A prompt whose row names an environment is answered by episodes instead of single
answers: per turn the engine generates (ending at the environment's stop strings or EOS),
the environment steps on the text, and its observation is appended as tokens, until the
environment says done, `max_turns` is reached or the token budget is spent. A wave of n
is n episodes run concurrently, each with its index, handed on as each finishes and
cancelled by index as single answers are; the stopping rule counts episodes by their
terminal reward.

Token-in/token-out: the episode's prompt is rendered once (the row's, or, where the
environment adds messages or tools to a chat row, the whole conversation with the tools'
schemas), the sampled tokens are kept as the engine returned them, never re-encoded from
text, and every observation is rendered once into tokens that are appended with loss mask
0 and logprob 0.0. So the ids sent at each turn are exactly the episode's prompt plus
everything before it, which is what the trainer scores (`grouping.on_one_prompt`).

Environments are user code: each episode gets a fresh instance whose calls run on a
thread of its own (its own event loop), under `env_timeout_s` per call, so an environment
that blocks or hangs costs its episode, never the service's event loop. A failure (an
exception or a time-out) is neither a positive nor a negative answer: the episode is run
again, and the scheduler drops the prompt as `env_error` after `max_env_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from sampler_service.backends.base import (
    Completion,
    FinishReason,
    SamplingParams,
    Wave,
    as_list,
)
from sampler_service.config import EpisodeKnobs
from sampler_service.dataset import PromptRow
from sampler_service.environments import load_environment_factory
from sampler_service.environments.base import Environment, Reset, Step, Turn, TurnEnvironment
from sampler_service.environments.render import ObservationRenderer, message_text
from sampler_service.tally import EpisodeCost

log = logging.getLogger(__name__)

T = TypeVar("T")

#: One engine call of one turn: the ids so far and the turn's sampling knobs.
GenerateTurn = Callable[[list[int], SamplingParams], Awaitable[Completion]]


class EpisodeTokenizer(Protocol):
    """What the runner needs of a tokenizer: stop strings to ids, token ids to text."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class EnvironmentFailed(RuntimeError):
    """The environment raised or timed out: the episode is neither right nor wrong."""


class EpisodesExhausted(RuntimeError):
    """The prompt's environment failed as often as its error budget allows: the prompt
    is dropped as `env_error`."""


@dataclass
class Partial:
    """An episode's tokens so far: what it had sampled when it was cancelled."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def aborted(self) -> Completion:
        return Completion(self.ids, self.logprobs, "", "abort", loss_mask=self.mask)


class EpisodeWave(Wave):
    """n episodes of one prompt, issued now: each as it finishes, by index. An episode
    whose environment fails is run again under the same index (a re-draw, counted) while
    the error budget lasts; past it, reading the wave raises `EpisodesExhausted`. A
    cancelled episode stops at its next await (its engine call is aborted) and comes
    back with what it had sampled (finish reason `abort`)."""

    cancels_answers = True

    def __init__(
        self,
        runner: EpisodeRunner,
        row: PromptRow,
        factory: Callable[[], Environment],
        n: int,
        sampling: SamplingParams,
        limits: EpisodeKnobs,
        generate: GenerateTurn,
        error_budget: int,
    ) -> None:
        super().__init__(n)
        self._runner, self._row, self._factory = runner, row, factory
        self._sampling, self._limits, self._generate = sampling, limits, generate
        self._budget = error_budget
        self._tasks: dict[int, asyncio.Task[Completion]] = {}
        self._partials: dict[int, Partial] = {}
        self._finished: asyncio.Queue[tuple[int, Completion] | BaseException] = asyncio.Queue()
        self._attempts = 0
        #: The finished episodes, in the order they finished.
        self.completions: list[Completion] = []
        #: Environment failures met (each one an episode run again while the budget lasts).
        self.env_errors: list[str] = []
        self.env_seconds = 0.0
        for index in range(n):
            self._start(index)

    def _start(self, index: int) -> None:
        partial = self._partials[index] = Partial()
        episode = self._runner.episode(
            self._row,
            self._factory,
            self._sampling,
            self._limits,
            self._generate,
            self._attempts,  # each attempt draws its own seeds
            self,
            partial,
        )
        self._attempts += 1
        task = self._tasks[index] = asyncio.create_task(episode)
        task.add_done_callback(functools.partial(self._ended, index))

    def _ended(self, index: int, task: asyncio.Task[Completion]) -> None:
        if task.cancelled() or self._tasks.get(index) is not task:
            return  # cancelled: `cancel` reports it
        del self._tasks[index]
        exc = task.exception()
        if isinstance(exc, EnvironmentFailed):
            self.env_errors.append(str(exc))
            if len(self.env_errors) < self._budget:
                self._start(index)
            else:
                self._finished.put_nowait(EpisodesExhausted(str(exc)))
        elif exc is not None:
            self._finished.put_nowait(exc)
        else:
            self.completions.append(task.result())
            self._finished.put_nowait((index, task.result()))

    @property
    def reruns(self) -> int:
        """Episodes run again after their environment failed."""
        return min(len(self.env_errors), self._budget - 1)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Completion]]:
        try:
            for _ in range(self.n):
                item = await self._finished.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            await self.cancel(list(self._tasks))

    async def cancel(self, indices: Collection[int]) -> None:
        cancelled = [(i, task) for i in indices if (task := self._tasks.pop(i, None))]
        for _, task in cancelled:
            task.cancel()
        await asyncio.gather(*(task for _, task in cancelled), return_exceptions=True)
        for index, _ in cancelled:
            self._finished.put_nowait((index, self._partials[index].aborted()))

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    def cost(self) -> EpisodeCost:
        """What the finished episodes spent beyond their answers."""
        model = sum(
            int(sum(e.loss_mask)) if e.loss_mask is not None else 0 for e in self.completions
        )
        total = sum(len(e.token_ids) for e in self.completions)
        return EpisodeCost(
            turns=tuple(e.num_turns for e in self.completions),
            model_tokens=model,
            observation_tokens=total - model,
            env_errors=len(self.env_errors),
            env_seconds=self.env_seconds,
            last_env_error=self.env_errors[-1] if self.env_errors else None,
        )

    async def run(self) -> EpisodeWave:
        """Read the whole wave: the episodes that finished before the error budget ran
        out (`completions`), and the failures met (`env_errors`)."""
        with contextlib.suppress(EpisodesExhausted):
            async for _ in self:
                pass
        return self


class EnvThread:
    """A thread with its own event loop for one episode's environment.

    An environment's `async` methods may still block (a subprocess, a socket, a sleep):
    on a loop of their own they stall only this episode. A call that runs past its
    time-out is abandoned (cancelled where it awaits; a blocking one finishes on its
    daemon thread later, unobserved).
    """

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            # Calls handed over just before the stop (a close() while the episode was
            # cancelled) are started, then cancelled, so none is left unawaited.
            self._loop.run_until_complete(asyncio.sleep(0))
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    async def call(self, make: Callable[[], Awaitable[T]], timeout_s: float, what: str) -> T:
        """Run `make()` on the environment's loop; `EnvironmentFailed` if it raises or
        takes longer than `timeout_s`."""

        async def invoke() -> T:
            return await make()

        future = asyncio.run_coroutine_threadsafe(invoke(), self._loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError as exc:
            future.cancel()
            raise EnvironmentFailed(f"{what} took longer than env_timeout_s={timeout_s}") from exc
        except (asyncio.CancelledError, EnvironmentFailed):
            future.cancel()
            raise
        except Exception as exc:  # user code: any failure is the environment's
            raise EnvironmentFailed(f"{what} raised {exc!r}") from exc

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def row_view(row: PromptRow) -> dict[str, Any]:
    """The row as an environment's `reset` sees it."""
    return {
        "id": row.id,
        "prompt": row.prompt,
        "answer": row.answer,
        "domain": row.domain,
        "metadata": row.metadata,
    }


def turn_seed(seed: int | None, episode: int, turn: int) -> int | None:
    """A distinct seed per episode and turn of a seeded wave (one seed for all would
    make the wave's episodes identical)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + episode * 10_007 + turn) % 2**31


class EpisodeRunner:
    """Runs episodes for the scheduler; knows the tokenizer and the context length."""

    def __init__(
        self,
        tokenizer: EpisodeTokenizer,
        render: EpisodeRenderer,
        factories: Mapping[str, Callable[[], Environment]],
        *,
        default_env: str | None = None,
        max_context: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self.render = render
        self.factories = dict(factories)
        self.default_env = default_env
        self.max_context = max_context
        self.clock = clock

    def factory_for(self, row: PromptRow) -> Callable[[], Environment] | None:
        """The environment factory of a row (its own `env`, else the default), or None:
        the row is answered by single answers."""
        spec = row.env or self.default_env
        return self.factories[spec] if spec is not None else None

    def stop_params(self, stop: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Stop strings that are one token become stop ids (every engine matches those
        exactly and cheaply); the rest stay strings."""
        strings, ids = [], []
        for text in stop:
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == 1 and self.tokenizer.decode(encoded) == text:
                ids.append(encoded[0])
            else:
                strings.append(text)
        return tuple(strings), tuple(ids)

    async def episode(
        self,
        row: PromptRow,
        factory: Callable[[], Environment],
        sampling: SamplingParams,
        limits: EpisodeKnobs,
        generate: GenerateTurn,
        index: int,
        totals: EpisodeWave,
        partial: Partial,
    ) -> Completion:
        """One episode, start to end; `EnvironmentFailed` if its environment failed.
        `partial` holds its tokens as they come."""
        thread = EnvThread(f"env-{row.id}-{index}")
        timeout = limits.env_timeout_s
        env: Environment | None = None

        async def timed(make: Callable[[], Awaitable[T]], what: str) -> T:
            began = self.clock()
            try:
                return await thread.call(make, timeout, what)
            finally:
                totals.env_seconds += self.clock() - began

        async def construct() -> Environment:
            return factory()

        try:
            env = await timed(construct, "creating the environment")
            live = env
            reset = await timed(
                lambda: live.reset(row_view(row), seed=turn_seed(sampling.seed, index, 0)),
                "reset",
            )
            if not isinstance(reset, Reset):
                raise EnvironmentFailed(f"reset returned {type(reset).__name__}, not a Reset")
            return await self._turns(
                row, live, reset, sampling, limits, generate, index, timed, partial
            )
        except asyncio.CancelledError:
            if isinstance(env, TurnEnvironment):
                env.cancelled()
            raise
        finally:
            if env is not None:
                closing = env
                try:
                    await thread.call(closing.close, timeout, "close")
                except EnvironmentFailed as exc:  # the episode is over: only worth a log line
                    log.warning("environment of prompt %s: %s", row.id, exc)
            thread.stop()

    async def _turns(
        self,
        row: PromptRow,
        env: Environment,
        reset: Reset,
        sampling: SamplingParams,
        limits: EpisodeKnobs,
        generate: GenerateTurn,
        index: int,
        timed: Callable[[Callable[[], Awaitable[Any]], str], Awaitable[Any]],
        partial: Partial,
    ) -> Completion:
        prompt, prompt_text = self.first_prompt(row, reset)
        ids, mask, logprobs = partial.ids, partial.mask, partial.logprobs
        pieces: list[str] = []
        versions: list[int] = []
        budget = limits.max_total_tokens
        if self.max_context is not None:
            # every turn's request must leave the engine room for at least one token
            budget = min(budget, self.max_context - len(prompt) - 1)

        turn_ids: list[int] = []

        def observe(observation: Any) -> bool:
            """Append an observation (mask 0); False when it used up the budget."""
            tokens = self.render.observation(observation, turn_ids)[: limits.obs_max_tokens]
            room = budget - len(ids)
            cut = tokens[: max(room, 0)]
            ids.extend(cut)
            mask.extend([0] * len(cut))
            logprobs.extend([0.0] * len(cut))
            pieces.append(self.tokenizer.decode(cut, skip_special_tokens=True))
            return len(cut) < room

        stop: Sequence[str] = tuple(reset.stop)
        finish: FinishReason = "turns"
        reward: float | None = None
        last_text = ""
        turns = 0
        if reset.observation and not observe(reset.observation):
            finish = "length"
        while finish == "turns" and turns < limits.max_turns:
            room = budget - len(ids)
            if room <= 0:
                finish = "length"
                break
            strings, stop_ids = self.stop_params(stop)
            turn_sampling = replace(
                sampling,
                max_tokens=min(limits.max_tokens_per_turn, room),
                stop=strings,
                stop_token_ids=stop_ids,
                seed=turn_seed(sampling.seed, index, turns + 1),
            )
            context = len(prompt) + len(ids)
            out = await generate(prompt + ids, turn_sampling)
            turn_ids = as_list(out.token_ids)
            turns += 1
            ids.extend(turn_ids)
            mask.extend([1] * len(turn_ids))
            logprobs.extend(as_list(out.logprobs))
            versions.append(out.policy_version)
            pieces.append(out.text)
            last_text = out.text
            if isinstance(env, TurnEnvironment):
                turn = Turn(out.text, turn_ids, as_list(out.logprobs), out.finish_reason, context)
                step = await timed(functools.partial(env.step_turn, turn), f"step {turns}")
            else:
                step = await timed(functools.partial(env.step, out.text), f"step {turns}")
            if not isinstance(step, Step):
                raise EnvironmentFailed(f"step {turns} returned {type(step).__name__}, not a Step")
            if step.done:
                finish, reward = "stop", step.reward
                break
            stop = tuple(step.stop) or stop
            if turns == limits.max_turns:
                break  # no turn would read an observation: it would only cost tokens
            if step.observation is not None and not observe(step.observation):
                finish = "length"
        return Completion(
            token_ids=ids,
            logprobs=logprobs,
            text="".join(pieces),
            finish_reason=finish,
            policy_version=min(versions) if versions else 0,
            loss_mask=mask,
            num_turns=turns,
            answer_text=last_text,
            env_reward=reward,
            prompt_token_ids=None if prompt_text is None else prompt,
            prompt_text=prompt_text,
        )

    def first_prompt(self, row: PromptRow, reset: Reset) -> tuple[list[int], str | None]:
        """The ids the episode's first turn continues, and their text where they are not
        the row's (None: the row's own prompt).

        A chat row whose environment adds messages or tools is rendered whole, the row's
        messages then `Reset.messages`, with `Reset.info["tools"]`; a row without either
        starts from its own rendering. A text row has no template turns to add messages
        to (`Reset.observation` is what extends it) and its tools go unrendered.
        """
        tools = reset.info.get("tools") or None
        if reset.conversation is not None:
            ids, text = self.render.conversation(reset.conversation, tools)
            return (list(row.token_ids), None) if ids == row.token_ids else (ids, text)
        if isinstance(row.prompt, str):
            if reset.messages:
                raise EnvironmentFailed(
                    f"prompt {row.id!r} is text: Reset.messages need a chat prompt "
                    "(Reset.observation extends a text prompt)"
                )
            return list(row.token_ids), None
        if not reset.messages and tools is None:
            return list(row.token_ids), None
        return self.render.prompt([*row.prompt, *reset.messages], tools)


def load_factories(specs: set[str]) -> dict[str, Callable[[], Environment]]:
    """Every environment spec resolved once, at start-up; ValueError names a bad one."""
    factories = {}
    for spec in sorted(specs):
        try:
            factories[spec] = load_environment_factory(spec)
        except ValueError:
            raise
        except Exception as exc:  # an import of user code can fail in any way
            raise ValueError(f"environment {spec!r} cannot be loaded: {exc!r}") from exc
    return factories


class EpisodeRenderer:
    """An episode's tokens from what its environment gave: the first prompt of a chat
    row and each observation (`sampler_service.environments.render`); what cannot be
    rendered fails the episode as the environment's fault."""

    def __init__(self, tokenizer: Any) -> None:
        self._renderer = ObservationRenderer(tokenizer)

    def prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], str]:
        """The ids and text of a chat conversation ready for the model's first turn: the
        template renders it whole, with the tools' schemas where it renders tools, as the
        model learned to read them (a delta after the row's own rendering would open an
        empty assistant turn before the environment's messages, and lose the tools)."""
        try:
            text = self._renderer.chat_text(messages, generation=True, tools=tools)
            return self._renderer.encode(text), text
        except (TypeError, ValueError, KeyError) as exc:
            raise EnvironmentFailed(
                f"the episode's first prompt cannot be rendered: {exc!r}"
            ) from exc

    def conversation(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], str]:
        """The ids and text of a whole conversation an environment starts from: the chat
        template's rendering, or, for a model without a template, the messages' texts
        joined and encoded as a text prompt is."""
        if self._renderer.templated:
            return self.prompt(messages, tools)
        text = "".join(message_text(m) for m in messages)
        return self._renderer.encode_prompt(text), text

    def observation(self, observation: Any, turn: list[int]) -> list[int]:
        """An observation's tokens (text encoded without special tokens, token ids as they
        are, chat messages as the template's delta after the turn); anything else fails
        the episode."""
        if not isinstance(observation, str | list):
            raise EnvironmentFailed(
                f"an observation must be text, chat messages or token ids, got {observation!r:.200}"
            )
        try:
            return self._renderer.render(observation, turn=turn)
        except (TypeError, ValueError, KeyError) as exc:
            raise EnvironmentFailed(f"the observation cannot be rendered: {exc!r}") from exc
