"""Environments the episode tests run (imported by the sampler as `python:episode_envs:...`).

They speak the toy's alphabet (digits, `+ - * =`, space), so their observations are
tokens the toy model knows; rewards come from the row's verifier on the last turn, except
`contrary`'s, which gives its own. `add_tool` and `BriefedTools` are chat environments of
the tool helper, for a chat tokenizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import random
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sampler_service.environments.base import Reset, Step
from sampler_service.environments.tools import ToolEnvironment, tool_environment
from sampler_service.verifiers import exact

ALPHABET = "0123456789+-*= "


class Retell:
    """Asks the model to answer again: each observation is a few random toy characters
    (a different length and content per episode, so the token layout varies), and the
    episode ends after `turns` model turns."""

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns
        self.turn = 0
        self.rng = random.Random()

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        self.rng = random.Random(seed)
        return Reset()

    async def step(self, action: str) -> Step:
        self.turn += 1
        if self.turn >= self.turns:
            return Step(observation=None, done=True)
        text = "".join(self.rng.choice(ALPHABET) for _ in range(self.rng.randint(1, 5)))
        return Step(observation=text + "=", done=False)

    async def close(self) -> None:
        return None


def retell() -> Retell:
    return Retell(turns=2)


def retell_three() -> Retell:
    return Retell(turns=3)


def endless() -> Retell:
    """Never says done: only `max_turns` or the token budget ends its episodes."""
    return Retell(turns=10**9)


class Contrary(Retell):
    """One turn, rewarded by the environment against the row's verifier: 1.0 exactly
    where the verifier would score the turn 0 (so the two never agree)."""

    answer = ""

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        self.answer = row["answer"]
        return Reset()

    async def step(self, action: str) -> Step:
        return Step(observation=None, done=True, reward=1.0 - exact.verify(action, self.answer))


def contrary() -> Contrary:
    return Contrary()


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


#: A tool helper's environment, as a user writes one.
add_tool = tool_environment(add)


class BriefedTools(ToolEnvironment):
    """The tool helper's environment over `add` whose reset also adds a chat message."""

    BRIEF = {"role": "user", "content": "Use the add tool."}

    def __init__(self) -> None:
        super().__init__([add])

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        start = await super().reset(row, seed=seed)
        return dataclasses.replace(start, messages=[self.BRIEF])


class HeldRetell(Retell):
    """Three turns; the first step waits until the file `open` exists in the directory
    the row's metadata names (`gate`), leaving a file `held-*` there per waiting episode.
    A test so knows when every episode is between its first and second turn with no turn
    in flight, and decides when the second turns start."""

    def __init__(self) -> None:
        super().__init__(turns=3)
        self.gate = Path()

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        self.gate = Path(row["metadata"]["gate"])
        return await super().reset(row, seed=seed)

    async def step(self, action: str) -> Step:
        if self.turn == 0:
            (self.gate / f"held-{uuid.uuid4().hex}").touch()
            while not (self.gate / "open").exists():
                await asyncio.sleep(0.05)
        return await super().step(action)


def held_retell() -> HeldRetell:
    return HeldRetell()


#: Step calls across every flaky environment of the process: every third one fails.
_calls = itertools.count(1)
#: Each blocked step of `hangs` puts its gate here; a test sets it from its event loop.
HELD: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
#: Blocked steps whose gate nobody set in time: the event loop could not run meanwhile.
UNRELEASED = itertools.count()


class Flaky(Retell):
    """Every third step raises (`raises`) or blocks its thread (`hangs`: a blocking wait,
    which would freeze an event loop it ran on) until a test sets its gate from the
    event loop, or for 30 s, which counts in `UNRELEASED`."""

    def __init__(self, mode: str) -> None:
        super().__init__(turns=2)
        self.mode = mode

    async def step(self, action: str) -> Step:
        if next(_calls) % 3 == 0:
            if self.mode == "raises":
                raise RuntimeError("the tool crashed")
            gate = threading.Event()
            HELD.put(gate)
            if not gate.wait(30.0):
                next(UNRELEASED)
        return await super().step(action)


def raises() -> Flaky:
    return Flaky("raises")


def hangs() -> Flaky:
    return Flaky("hangs")


class Broken(Retell):
    async def step(self, action: str) -> Step:
        raise RuntimeError("this environment always fails")


def broken() -> Broken:
    return Broken()


class NoReset(Retell):
    """Returns a dict where a Reset is due (a plain mistake in a user's environment)."""

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        return {"observation": "1"}  # type: ignore[return-value]
