"""The OpenAI chat-completions wire of a session: requests, the history's canonical
form, tool-call parsers, and the response body.

A harness written against OpenAI's API sends `/v1/chat/completions` calls; the proxy
reads the messages and tools from them and nothing else. Sampling is the sampler's:
every other field a harness sends (temperature, max_tokens, stop, seed...) is counted
and ignored, because a group whose answers were drawn under the harness's settings would
not be the policy's distribution the trainer corrects for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from sampler_service.environments.render import message_text
from sampler_service.environments.tools import STOP as HERMES_STOP
from sampler_service.environments.tools import ToolCall as ParsedCall
from sampler_service.environments.tools import parse_tool_calls, strip_tool_calls
from sampler_service.errors import ServiceError
from trainer_client.contract import calculator


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: ToolFunction


class ChatMessage(BaseModel):
    """One message; fields the OpenAI SDK adds (refusal, audio, annotations) are kept
    and play no part in the history."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(BaseModel):
    """A `/chat/completions` body: what the proxy reads; anything else is ignored
    (and counted, by name, in `/v1/stats` `sessions.ignored`)."""

    model_config = ConfigDict(extra="allow")
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    model: str | None = None
    n: int = Field(1, description="must be 1: a session is one episode")
    stream: bool = Field(False, description="must be false: answers are returned whole")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def check(self) -> None:
        """400 for what a session cannot serve."""
        if self.n != 1:
            raise ServiceError(
                400, "n_unsupported", f"n={self.n}: a session is one episode, ask n=1", "n"
            )
        if self.stream:
            raise ServiceError(
                400,
                "stream_unsupported",
                "stream=true: a session's answers are returned whole (the turn is "
                "decoded before its tool calls are parsed); send stream=false",
                "stream",
            )

    def ignored(self) -> list[str]:
        """The names of the fields sent that the sampler's own settings override."""
        return sorted(self.model_extra or {})

    def plain_messages(self) -> list[dict[str, Any]]:
        """The messages as plain dicts, without the fields left unset."""
        return [m.model_dump(exclude_none=True) for m in self.messages]


def canonical(message: dict[str, Any]) -> tuple[Any, ...]:
    """What two copies of a message must agree on to be the same turn of a transcript.

    The text (a list of parts joined), the tool calls (their arguments compared as JSON
    values) and the call a tool result answers; not the SDK's extra fields, and not
    the optional ``name``.
    """
    calls = tuple(
        (c["id"], c["function"]["name"], _json_value(c["function"]["arguments"]))
        for c in message.get("tool_calls") or ()
    )
    return (message["role"], message_text(message), calls, message.get("tool_call_id"))


def _json_value(arguments: str) -> Any:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except json.JSONDecodeError:
        return arguments


class ToolParser(Protocol):
    """Reads a turn's tool calls in one chat template's syntax."""

    #: The stop strings every turn ends at (where a call closes).
    stop: tuple[str, ...]

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The turn's content without its calls, and the calls as (name, arguments)."""
        ...


class HermesToolParser:
    """Hermes/Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
    A turn with a malformed block is returned as text, without calls (as vLLM's parser
    does): the harness sees what the model wrote."""

    stop: tuple[str, ...] = HERMES_STOP

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        calls = parse_tool_calls(text)
        wellformed = [c for c in calls if isinstance(c, ParsedCall)]
        if not calls or len(wellformed) < len(calls):
            return text, []
        return strip_tool_calls(text).strip(), [
            {"name": c.name, "arguments": c.arguments} for c in wellformed
        ]


class CalculatorToolParser:
    """The toy calculator's ``[expr]``: one call of the tool ``calculator`` with the
    argument ``expression``; its result is the text the tool answers (``148;``)."""

    stop: tuple[str, ...] = calculator.STOP

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        expression = calculator.call_of(text)
        if expression is None:
            return text, []
        head = text[: text.rfind(calculator.OPEN)]
        return head, [{"name": "calculator", "arguments": {"expression": expression}}]


class NoToolParser:
    """A template without tool calls: every turn is text."""

    stop: tuple[str, ...] = ()

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return text, []


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": HermesToolParser(),
    "calculator": CalculatorToolParser(),
    "none": NoToolParser(),
}


def parser_for(name: str, chat_template: str | None) -> ToolParser:
    """The parser `name` names; `auto` reads the template: `<tool_call>` in it is Hermes,
    no template at all is the toy calculator's, any other template has no tool calls."""
    if name != "auto":
        return TOOL_PARSERS[name]
    if chat_template is None:
        return TOOL_PARSERS["calculator"]
    return TOOL_PARSERS["hermes" if "<tool_call>" in chat_template else "none"]


@dataclass(frozen=True)
class AssistantTurn:
    """A model turn as the harness receives it."""

    message: dict[str, Any]
    finish_reason: str


def assistant_turn(
    parser: ToolParser, text: str, finish_reason: str, call_prefix: str
) -> AssistantTurn:
    """The assistant message of a turn (its calls as OpenAI `tool_calls`, numbered from
    `call_prefix`) and OpenAI's finish reason for it."""
    content, calls = parser.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"{call_prefix}_{k}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for k, c in enumerate(calls)
        ]
        reason = "tool_calls"
    else:
        reason = "length" if finish_reason == "length" else "stop"
    return AssistantTurn(message, reason)


def completion_body(
    *,
    completion_id: str,
    model: str,
    turn: AssistantTurn,
    prompt_tokens: int,
    tokens: Sequence[str] | None,
    logprobs: Sequence[float],
) -> dict[str, Any]:
    """An OpenAI `chat.completion` object; `tokens` (the sampled tokens' texts) when the
    call asked for logprobs. Only the sampled token's logprob is known, so
    `top_logprobs` lists are empty."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": turn.message,
        "finish_reason": turn.finish_reason,
        "logprobs": None,
    }
    if tokens is not None:
        choice["logprobs"] = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, logprobs, strict=True)
            ]
        }
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(logprobs),
            "total_tokens": prompt_tokens + len(logprobs),
        },
    }


class EndRequest(BaseModel):
    """`POST /sessions/{id}/end`: the session's reward, or null for the row's verifier."""

    model_config = ConfigDict(extra="forbid")
    reward: float | None = Field(None, allow_inf_nan=False)


class EndResponse(BaseModel):
    session_id: str
    ended: bool


class ClaimRequest(BaseModel):
    """`POST /v1/sessions/claim`: how long to wait for a session no harness holds."""

    model_config = ConfigDict(extra="forbid")
    wait_s: float = Field(0.0, ge=0.0, le=300.0, allow_inf_nan=False)


class ClaimedSession(BaseModel):
    session_id: str
    #: For an OpenAI client.
    base_url: str
    #: `POST {session_url}/end` ends the session.
    session_url: str
    #: The dataset row: id, prompt, answer, domain, metadata.
    row: dict[str, Any]


class ClaimResponse(BaseModel):
    """The claimed session, or null when none came within `wait_s`."""

    session: ClaimedSession | None
