"""The toy calculator tool's syntax and answers, defined once for both sides.

The sampler's built-in `calculator` environment answers these calls during episodes; the
toy calculator model was warm-started to write them and its checks run episodes against
the same answers on the trainer side. Pure Python, so a trainer install (which has no
server) reads it from here, as it reads the wire format.

After the prompt ``37*4=`` the model may write ``[37*4]`` (the turn stops at ``]``); the
tool answers ``148;`` and the model then writes its final answer, ``148``. A turn without
``[`` is the final answer. A call that is not an arithmetic expression answers ``;``
alone: the model's mistake, told back to it.
"""

from __future__ import annotations

import re

OPEN, CLOSE, END = "[", "]", ";"
#: Every turn stops where a call closes.
STOP = (CLOSE,)
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


def reply(action: str) -> str | None:
    """The tool's answer to a turn, or None when the turn makes no call (it is final)."""
    expression = call_of(action)
    if expression is None:
        return None
    value = evaluate(expression)
    return END if value is None else f"{value}{END}"
