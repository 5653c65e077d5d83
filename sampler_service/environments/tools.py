"""Plain Python functions as a tool environment, with Qwen/Hermes-style tool calls.

The model calls tools the way Qwen and Hermes chat models are trained to: one or more
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in its turn (the turn
stops at ``</tool_call>``). Each call's result comes back as a chat message of role
``tool``, so the model's own chat template renders it as the model learned to read it
(Qwen's wraps each in ``<tool_response>`` inside a user turn and opens the next assistant
turn); a text observation would hard-code one template's markup into the environment. A
turn without a call is the final answer and ends the episode.

What the model gets wrong (malformed JSON, an unknown tool, bad arguments, a tool that
raises) is told back to it as an error result: that is the policy's failure to learn
from, not the environment's. Only :class:`EnvironmentFailure` raised by a tool fails the
episode. Sync functions run in a worker thread, so a slow one never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sampler_service.environments.base import EnvironmentFactory, EnvironmentFailure, Reset, Step

#: Every turn stops where a call closes.
STOP = ("</tool_call>",)
#: A call's body; the closing tag may be missing at the end of the turn (engines differ on
#: whether the stop string that ended it is part of the returned text).
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
_JSON_TYPES.update({list: "array", dict: "object"})


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A ``<tool_call>`` block that is not a call, and why."""

    text: str
    error: str


def parse_tool_calls(action: str) -> list[ToolCall | MalformedCall]:
    """Every ``<tool_call>`` block of ``action``, in order; empty where it makes no call."""
    calls: list[ToolCall | MalformedCall] = []
    for match in _CALL.finditer(action):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(MalformedCall(body, f"invalid JSON: {exc}"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(MalformedCall(body, 'expected {"name": ..., "arguments": {...}}'))
            continue
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            calls.append(MalformedCall(body, "arguments must be a JSON object"))
            continue
        calls.append(ToolCall(payload["name"], arguments))
    return calls


def strip_tool_calls(action: str) -> str:
    """``action`` without its ``<tool_call>`` blocks: the text around the calls."""
    return _CALL.sub("", action)


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI/Qwen function schema of ``fn``: name, docstring, parameters by type hint."""
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for name, param in inspect.signature(fn).parameters.items():
        json_type = _JSON_TYPES.get(hints.get(name))  # type: ignore[arg-type]
        properties[name] = {"type": json_type} if json_type else {}
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": inspect.getdoc(fn) or "",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _content(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class ToolEnvironment:
    """One episode over a fixed set of tools (see the module's docstring)."""

    def __init__(self, functions: Sequence[Callable[..., Any]]) -> None:
        self._tools = {fn.__name__: fn for fn in functions}

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        schemas = [tool_schema(fn) for fn in self._tools.values()]
        return Reset(stop=STOP, info={"tools": schemas})

    async def step(self, action: str) -> Step:
        calls = parse_tool_calls(action)
        if not calls:
            return Step(observation=None, done=True)
        results = [await self._run(call) for call in calls]
        messages = [{"role": "tool", "name": name, "content": content} for name, content in results]
        return Step(observation=messages, done=False, stop=STOP)

    async def _run(self, call: ToolCall | MalformedCall) -> tuple[str, str]:
        """The (tool name, result text) of one call; the model's mistakes as errors."""
        if isinstance(call, MalformedCall):
            return "", _content({"error": f"malformed tool call: {call.error}"})
        fn = self._tools.get(call.name)
        if fn is None:
            known = ", ".join(self._tools)
            return call.name, _content({"error": f"unknown tool {call.name!r}; tools: {known}"})
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as exc:
            return call.name, _content({"error": f"bad arguments: {exc}"})
        try:
            if inspect.iscoroutinefunction(fn):
                value = await fn(**call.arguments)
            else:
                value = await asyncio.to_thread(fn, **call.arguments)
        except Exception as exc:
            if isinstance(exc, EnvironmentFailure):
                raise
            return call.name, _content({"error": f"{type(exc).__name__}: {exc}"})
        return call.name, _content(value)

    async def close(self) -> None:
        return None


def tool_environment(*functions: Callable[..., Any]) -> EnvironmentFactory:
    """A factory (for a ``python:module:factory`` spec) of tool episodes over ``functions``."""
    return lambda: ToolEnvironment(functions)
