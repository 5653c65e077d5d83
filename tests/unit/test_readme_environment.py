"""The episodes page's example environment is code that runs, with the protocol the runner calls;
a malformed call is a wrong step for the model, never the environment's failure."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "episodes.md"


def test_the_episodes_page_calculator_environment_runs() -> None:
    section = PAGE.read_text().split("# Multi-turn episodes", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "no python block in docs/episodes.md"
    namespace: dict = {}
    exec(compile(code.group(1), "docs/episodes.md", "exec"), namespace)

    async def episode() -> list:
        env = namespace["make"]()
        reset = await env.reset({"id": "p", "prompt": "37*48="}, seed=0)
        call = await env.step("[37*48]")
        malformed = await env.step("[37*]")
        answer = await env.step("1776")
        await env.close()
        return [reset.stop, call.observation, call.done, malformed.observation, answer.done]

    assert asyncio.run(episode()) == [("]",), "1776;", False, "error;", True]
