"""An agent harness for the toy calculator task, written as any OpenAI-client harness is.

It knows nothing of the sampler: it asks the model, runs the tool calls it makes, asks
again with the results, and ends the session when a turn makes no call. Run by the
sampler per session, either way:

    adaptive-rollout serve ... --env session --harness python:examples.calculator_harness:harness
    adaptive-rollout serve ... --env session --harness "python -m examples.calculator_harness"

The first is called with the session (`HarnessSession`); the second, a command, finds it
in its environment (``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, which the openai package
reads by itself, ``ADAPTIVE_ROLLOUT_SESSION_URL`` and ``ADAPTIVE_ROLLOUT_ROW``).
"""

from __future__ import annotations

import json
import os
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
    value = evaluate(str(json.loads(arguments).get("expression", "")))
    return ";" if value is None else f"{value};"


def drive(
    client: openai.OpenAI, http: httpx.Client, prompt: str, session_url: str, api_key: str
) -> None:
    """One episode: ask, run the tool calls, ask again until a turn makes none, then end
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
            return  # the session was cancelled (surplus) or is over: nothing left to do
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
    http.post(
        f"{session_url}/end",
        json={"reward": None},
        headers={"Authorization": f"Bearer {api_key}"},
    )


#: One connection pool for every session of this process: building an HTTP client (its TLS
#: context) costs ~30 ms of CPU, more than a session's calls on the toy.
_HTTP = httpx.Client(timeout=httpx.Timeout(120.0))


def harness(session: Any) -> None:
    """The `python:` harness: called with the sampler's `HarnessSession`."""
    client = openai.OpenAI(
        base_url=session.base_url, api_key=session.api_key, max_retries=0, http_client=_HTTP
    )
    drive(client, _HTTP, session.row["prompt"], session.session_url, session.api_key)


if __name__ == "__main__":  # the command harness: the session comes in the environment
    http = httpx.Client(timeout=httpx.Timeout(120.0))
    drive(
        openai.OpenAI(max_retries=0, http_client=http),  # OPENAI_BASE_URL, OPENAI_API_KEY
        http,
        json.loads(os.environ["ADAPTIVE_ROLLOUT_ROW"])["prompt"],
        os.environ["ADAPTIVE_ROLLOUT_SESSION_URL"],
        os.environ["OPENAI_API_KEY"],
    )
