"""The toy calculator as an episode environment: the tool's syntax and answers are the
contract's (`trainer_client.contract.calculator`), shared with the toy model's checks.

A turn that calls (``[37*4]``) gets the tool's answer (``148;``) and the episode goes on;
a turn without a call is the final answer and ends it (the row's verifier scores it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sampler_service.environments.base import Reset, Step
from trainer_client.contract.calculator import STOP, reply


class CalculatorEnvironment:
    """One episode of the toy calculator (see the module's docstring)."""

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        return Reset(stop=STOP)

    async def step(self, action: str) -> Step:
        observation = reply(action)
        if observation is None:
            return Step(observation=None, done=True)
        return Step(observation=observation, done=False, stop=STOP)

    async def close(self) -> None:
        return None
