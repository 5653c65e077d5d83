"""Agent harnesses for the session tests, written as users write them: an OpenAI client
loop that runs the model's tool calls itself, knowing nothing of the sampler but the
session's URL.

`calculator` is the toy calculator task's harness (a `python:` spec). Run as a script it
is a command harness (its session from the environment the sampler sets) that drives
the same task, or fails as the row's `metadata.harness` asks.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import httpx
import openai

from trainer_client.contract.calculator import evaluate

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of + - * over non-negative integers.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def tool_result(arguments: str) -> str:
    """The calculator's answer in the toy's syntax (``148;``; ``;`` for a non-expression)."""
    value = evaluate(json.loads(arguments).get("expression", ""))
    return ";" if value is None else f"{value};"


def drive(client: openai.OpenAI, prompt: str, session_url: str, api_key: str) -> None:
    """One episode: ask, run the tool calls, ask again, until a turn makes none; then end
    the session without a reward (the row's verifier scores the last turn)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    while True:
        try:
            response = client.chat.completions.create(
                model="toy",
                messages=messages,  # type: ignore[arg-type]
                tools=[CALCULATOR_TOOL],  # type: ignore[list-item]
                temperature=0.3,  # the sampler's settings win: counted and ignored
            )
        except openai.ConflictError:
            return  # cancelled (a surplus session) or over: nothing left to do
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": tool_result(call.function.arguments),  # type: ignore[union-attr]
                }
            )
    httpx.post(
        f"{session_url}/end",
        json={"reward": None},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    )


def calculator(session: Any) -> None:
    """The `python:` harness."""
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    drive(client, session.row["prompt"], session.session_url, session.api_key)


def misbehave(client: openai.OpenAI, row: dict[str, Any], session_url: str, key: str) -> None:
    """What the row's `metadata.harness` asks: `crash` (raise before any call), `silent`
    (one call, then nothing), `quit` (one call, then stop without ending), else the
    calculator harness."""
    mode = (row.get("metadata") or {}).get("harness")
    if mode == "crash":
        raise RuntimeError("the harness crashed")
    if mode in ("silent", "quit"):
        client.chat.completions.create(
            model="toy", messages=[{"role": "user", "content": row["prompt"]}]
        )
        if mode == "silent":
            time.sleep(3600)
        return
    drive(client, row["prompt"], session_url, key)


if __name__ == "__main__":  # the command harness: the session comes in the environment
    misbehave(
        openai.OpenAI(max_retries=0),  # OPENAI_BASE_URL and OPENAI_API_KEY
        json.loads(os.environ["ADAPTIVE_ROLLOUT_ROW"]),
        os.environ["ADAPTIVE_ROLLOUT_SESSION_URL"],
        os.environ["OPENAI_API_KEY"],
    )
