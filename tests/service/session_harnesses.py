"""A misbehaving agent harness for the session tests: a command (`python -m
session_harnesses`, its session from the environment the sampler sets) that drives the
toy calculator task as `examples.calculator_harness` does, or fails as the row's
`metadata.harness` asks.

`crash` fails before the `openai` package is imported (~0.75 s of CPU), so that its exit,
not a time-out, is what the sampler sees even on a loaded machine."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def misbehave(row: dict[str, Any], session_url: str, key: str) -> None:
    """What the row's `metadata.harness` asks: `silent` (one call, then nothing), `quit`
    (one call, then stop without ending), else the calculator harness."""
    import httpx
    import openai

    from examples.calculator_harness import drive

    http = httpx.Client(timeout=httpx.Timeout(120.0))
    client = openai.OpenAI(max_retries=0, http_client=http)  # OPENAI_BASE_URL, OPENAI_API_KEY
    mode = (row.get("metadata") or {}).get("harness")
    if mode in ("silent", "quit"):
        client.chat.completions.create(
            model="toy", messages=[{"role": "user", "content": row["prompt"]}]
        )
        if mode == "silent":
            time.sleep(3600)
        return
    drive(client, http, row["prompt"], session_url, key)


if __name__ == "__main__":  # the command harness: the session comes in the environment
    session_row = json.loads(os.environ["ADAPTIVE_ROLLOUT_ROW"])
    if (session_row.get("metadata") or {}).get("harness") == "crash":
        sys.exit("the harness crashed")
    misbehave(session_row, os.environ["ADAPTIVE_ROLLOUT_SESSION_URL"], os.environ["OPENAI_API_KEY"])
