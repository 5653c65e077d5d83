"""The environment protocol: what an episode's turns talk to.

An episode alternates the model's actions with an environment's answers. The shape is the
one SkyRL-Gym and OpenRLHF users already write (``reset``, ``step``, ``close``, all async),
with per-turn stop strings as in NeMo-RL, so an existing environment ports by renaming. An
environment is trusted user code run in the service's process; a fresh instance serves
each episode, so an environment may keep per-episode state on ``self`` without locking.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: What an observation may be: text (encoded without special tokens), chat messages
#: (rendered as a chat-template delta) or token ids (used as they are).
Observation = str | list[dict[str, Any]] | list[int]


@dataclass(frozen=True)
class Reset:
    """The start of an episode.

    ``messages`` follow a chat row's messages (a text row refuses them), ``observation``
    is appended to any prompt (text or token ids, as a step's); ``stop`` are the first
    turn's stop strings; ``info`` may list tools' schemas under ``tools`` (the tool
    helper does). A chat row whose environment gives messages or tools starts from the
    template's rendering of the whole conversation, tools included, as the model learned
    to read it (`EpisodeRunner.first_prompt`).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    observation: str | list[int] | None = None
    stop: tuple[str, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)
    #: The whole conversation the first turn continues, in place of the row's prompt
    #: (a session's harness writes its own); rendered by the chat template, or, for a
    #: model without one, as the concatenation of the messages' texts.
    conversation: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Step:
    """The environment's answer to one action.

    ``observation`` is appended (mask 0) before the next turn unless ``done``; ``reward``,
    given on the last step, is the episode's terminal reward (None: the row's verifier
    scores the final text); ``stop`` are the next turn's stop strings.
    """

    observation: Observation | None
    done: bool
    reward: float | None = None
    stop: tuple[str, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)


class EnvironmentFailure(Exception):
    """The environment, not the model, failed (a crash, a timeout, a broken resource).

    An episode that ends this way is neither a success nor a failure of the policy: it is
    re-run instead of counted. A tool that rejects the model's call is not one of these;
    that is an observation the model must learn from.
    """


class Environment(Protocol):
    """One episode's environment (a fresh instance per episode)."""

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        """Start an episode for the dataset row ``row``."""
        ...

    async def step(self, action: str) -> Step:
        """Answer the model's action (the decoded text of its turn)."""
        ...

    async def close(self) -> None:
        """Release what the episode held; called once, whatever the outcome."""
        ...


@dataclass(frozen=True)
class Turn:
    """One model turn as the engine returned it, for an environment that answers with
    more than the text (the session proxy returns the logprobs a harness asks for)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    #: The ids the turn continued (the episode's prompt and every token before the turn).
    context_tokens: int


@runtime_checkable
class TurnEnvironment(Environment, Protocol):
    """An environment that reads whole turns, and learns when its episode was cancelled.

    The runner calls `step_turn` in place of `step`, and `cancelled` (from the episode's
    task, before `close`) when the episode is cancelled as surplus, so that whatever
    drives it from outside (a harness) is told the episode's end from its cause.
    """

    async def step_turn(self, turn: Turn) -> Step:
        """Answer the model's turn."""
        ...

    def cancelled(self) -> None:
        """The episode was cancelled; it must return at once and may be called from any
        thread."""
        ...


#: Called once per episode for a fresh environment.
EnvironmentFactory = Callable[[], Environment]
