"""Episode environments, named by spec strings: `calculator` or `python:module:factory`.

A spec names a factory (a class or a function of no arguments) that the episode runner
calls once per episode; built-in names are aliases for import paths, so an environment's
module is imported only where it is used.
"""

from __future__ import annotations

import functools
from typing import cast

from sampler_service.environments.base import (
    Environment,
    EnvironmentFactory,
    EnvironmentFailure,
    Observation,
    Reset,
    Step,
)
from sampler_service.verifiers import python

BUILTIN = {
    "calculator": "sampler_service.environments.calculator:CalculatorEnvironment",
}

__all__ = [
    "BUILTIN",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentFailure",
    "Observation",
    "Reset",
    "Step",
    "load_environment_factory",
]


@functools.cache
def load_environment_factory(spec: str) -> EnvironmentFactory:
    """The environment factory a spec names; a ValueError naming the spec if there is none."""
    kind, sep, target = spec.partition(":")
    if spec in BUILTIN:
        target = BUILTIN[spec]
    elif kind != "python" or not sep:
        raise ValueError(
            f"unknown environment {spec!r}: use {' | '.join(BUILTIN)} | python:module:factory"
        )
    try:
        return cast(EnvironmentFactory, python.load(target))
    except (ImportError, ValueError) as exc:
        raise ValueError(f"environment {spec!r} cannot be loaded: {exc}") from exc
