"""A session as an episode's environment: the harness's calls are the episode's turns.

The episode runner drives the model; the harness drives the conversation. So `reset`
waits for the harness's first call and starts the episode from its messages; each model
turn answers the waiting call, and `step_turn` then waits for what the harness does next:
- another call: its messages must be the transcript so far, unchanged, plus new messages
  after the last assistant turn; those new messages are the observation (a chat-template
  delta, or their text for a model without a template), appended with loss mask 0;
- the end of the session, with its reward (or none: the row's verifier scores the last
  turn);
- the harness stopping, raising or staying silent past `env_timeout_s`: an environment
  failure, so the episode is run again and never counted as a negative.

The model's tokens are the runner's, never re-encoded from the text the harness sends back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sampler_service.environments.base import EnvironmentFailure, Observation, Reset, Step, Turn
from sampler_service.environments.render import message_text
from sampler_service.errors import ServiceError
from sampler_service.sessions.chat import (
    ToolParser,
    assistant_turn,
    canonical,
    completion_body,
)
from sampler_service.sessions.harness import Launcher, RunningHarness
from sampler_service.sessions.hub import Call, End, Session, SessionHub


@dataclass(frozen=True)
class SessionSetup:
    """What every session of a sampler shares."""

    hub: SessionHub
    parser: ToolParser
    #: Starts a harness per session; None: harnesses claim sessions over HTTP.
    launcher: Launcher | None
    #: Token id -> its text, for the logprobs a call asks for.
    token_text: Callable[[int], str]
    #: Whether the model has a chat template (else messages are rendered as their text).
    templated: bool


class SessionEnvironment:
    """One episode's session (see the module's docstring)."""

    def __init__(self, setup: SessionSetup) -> None:
        self._setup = setup
        self._session: Session | None = None
        self._harness: RunningHarness | None = None
        self._pending: Call | None = None
        self._transcript: list[tuple[Any, ...]] = []
        self._tools: list[dict[str, Any]] | None = None
        self._turns = 0

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        hub = self._setup.hub
        session = self._session = hub.open(row, asyncio.get_running_loop())
        if self._setup.launcher is None:
            hub.offer(session)
        else:
            if hub.server_url is None:
                raise EnvironmentFailure("the sampler's own URL is not known yet")
            urls = hub.urls(session, hub.server_url)
            self._harness = await self._setup.launcher.start(session, urls, hub.api_key or "unused")
        while True:
            event = await session.next_event()
            if isinstance(event, End):
                raise EnvironmentFailure("the harness ended its session before any call")
            if not isinstance(event, Call):
                raise EnvironmentFailure(f"{event.reason} before any call")
            messages = event.request.plain_messages()
            if messages[-1]["role"] == "assistant":
                event.refuse(
                    ServiceError(
                        422,
                        "invalid_request",
                        "messages: the last message is the assistant's; a call asks for the "
                        "next assistant turn",
                        "messages",
                    )
                )
                continue
            self._accept(event, messages)
            info = {"tools": event.request.tools} if event.request.tools else {}
            return Reset(conversation=messages, stop=self._setup.parser.stop, info=info)

    def _accept(self, call: Call, messages: list[dict[str, Any]]) -> None:
        self._pending = call
        self._transcript = [canonical(m) for m in messages]
        self._tools = call.request.tools

    async def step_turn(self, turn: Turn) -> Step:
        self._answer(turn)
        assert self._session is not None
        while True:
            event = await self._session.next_event()
            if isinstance(event, End):
                return Step(observation=None, done=True, reward=event.reward)
            if not isinstance(event, Call):
                raise EnvironmentFailure(f"{event.reason} without ending its session")
            try:
                new = self._continued(event)
            except ServiceError as exc:
                event.refuse(exc)
                continue
            self._accept(event, event.request.plain_messages())
            return Step(
                observation=self._observation(new), done=False, stop=self._setup.parser.stop
            )

    async def step(self, action: str) -> Step:
        raise EnvironmentFailure("a session reads whole turns (step_turn)")

    def _answer(self, turn: Turn) -> None:
        """Answer the waiting call with the model's turn."""
        assert self._pending is not None and self._session is not None
        call, self._pending = self._pending, None
        self._turns += 1
        reply = assistant_turn(
            self._setup.parser,
            turn.text,
            turn.finish_reason,
            f"call_{self._session.id}_{self._turns}",
        )
        self._transcript.append(canonical(reply.message))
        asked = call.request.logprobs
        call.answer(
            completion_body(
                completion_id=f"chatcmpl-{self._session.id}-{self._turns}",
                model=self._setup.hub.model,
                turn=reply,
                prompt_tokens=turn.context_tokens,
                tokens=[self._setup.token_text(t) for t in turn.token_ids] if asked else None,
                logprobs=turn.logprobs,
            )
        )

    def _continued(self, call: Call) -> list[dict[str, Any]]:
        """The call's new messages; 409 `history_changed` if it does not continue the
        transcript."""
        assert self._session is not None
        messages = call.request.plain_messages()
        sent = [canonical(m) for m in messages[: len(self._transcript)]]
        if sent != self._transcript or call.request.tools != self._tools:
            where = next(
                (i for i, (a, b) in enumerate(zip(sent, self._transcript, strict=False)) if a != b),
                min(len(sent), len(self._transcript)),
            )
            what = "the tools" if sent == self._transcript else f"message {where}"
            raise ServiceError(
                409,
                "history_changed",
                f"session {self._session.id}: {what} differs from the transcript; a call "
                "resends the transcript unchanged (the assistant turns as returned) plus the "
                "messages after the last assistant turn",
                "messages",
            )
        new = messages[len(self._transcript) :]
        if any(m["role"] == "assistant" for m in new):
            raise ServiceError(
                409,
                "history_changed",
                f"session {self._session.id}: a call may add messages after the last "
                "assistant turn, not assistant turns of its own",
                "messages",
            )
        return new

    def _observation(self, messages: list[dict[str, Any]]) -> Observation:
        if self._setup.templated:
            return messages
        return "".join(message_text(m) for m in messages)

    def cancelled(self) -> None:
        if self._session is not None:
            self._session.cancel()

    async def close(self) -> None:
        session = self._session
        if session is None:
            return
        session.close(self._pending)
        self._setup.hub.forget(session)
        if self._harness is not None:
            await self._harness.stop(ended=session.state == "ended")
