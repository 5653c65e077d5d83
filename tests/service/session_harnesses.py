"""A misbehaving agent harness for the session tests: a command (`python -m
session_harnesses`, its session from the environment the sampler sets) that drives the
toy calculator task as `examples.calculator_harness` does, or fails as the row's
`metadata.harness` asks."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import httpx
import openai

from examples.calculator_harness import drive


def misbehave(
    client: openai.OpenAI, http: httpx.Client, row: dict[str, Any], session_url: str, key: str
) -> None:
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
    drive(client, http, row["prompt"], session_url, key)


if __name__ == "__main__":  # the command harness: the session comes in the environment
    http = httpx.Client(timeout=httpx.Timeout(120.0))
    misbehave(
        openai.OpenAI(max_retries=0, http_client=http),  # OPENAI_BASE_URL, OPENAI_API_KEY
        http,
        json.loads(os.environ["ADAPTIVE_ROLLOUT_ROW"]),
        os.environ["ADAPTIVE_ROLLOUT_SESSION_URL"],
        os.environ["OPENAI_API_KEY"],
    )
