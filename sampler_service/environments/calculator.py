"""The toy calculator: a tool environment in a syntax a 21-token vocabulary can spell.

The toy model has no chat template and a 64-token context, so its tool call is compact:
after the prompt ``37*4=`` the model may write ``[37*4]`` (the turn stops at ``]``); the
environment answers ``148;`` and the model then writes its final answer, ``148``. A turn
without ``[`` is the final answer and ends the episode (the row's verifier scores it). A
call that is not an arithmetic expression answers ``;`` alone: the model's mistake, told
back to it, never an environment failure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sampler_service.environments.base import Reset, Step

#: Every turn stops where a call closes.
STOP = ("]",)
OPEN, CLOSE, END = "[", "]", ";"
#: Non-negative integers joined by + - *; operands are capped so no call is expensive.
_EXPRESSION = re.compile(r"\d{1,9}(?:[+\-*]\d{1,9}){0,7}")
_TERM = re.compile(r"[+\-]?[^+\-]+")


def evaluate(expression: str) -> int | None:
    """The value of ``expression`` (``*`` before ``+`` and ``-``), None if it is not one."""
    expression = expression.replace(" ", "")
    if not _EXPRESSION.fullmatch(expression):
        return None
    total = 0
    for term in _TERM.findall(expression):
        sign = -1 if term[0] == "-" else 1
        product = 1
        for factor in term.lstrip("+-").split("*"):
            product *= int(factor)
        total += sign * product
    return total


def call_of(action: str) -> str | None:
    """The expression of the action's last call, None where the action makes no call.

    The closing ``]`` may be missing: engines differ on whether the stop string that ended
    the turn is part of the returned text.
    """
    start = action.rfind(OPEN)
    if start < 0:
        return None
    return action[start + 1 :].split(CLOSE, 1)[0]


class CalculatorEnvironment:
    """One episode of the toy calculator (see the module's docstring)."""

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        return Reset(stop=STOP)

    async def step(self, action: str) -> Step:
        expression = call_of(action)
        if expression is None:
            return Step(observation=None, done=True)
        value = evaluate(expression)
        observation = END if value is None else f"{value}{END}"
        return Step(observation=observation, done=False, stop=STOP)

    async def close(self) -> None:
        return None
