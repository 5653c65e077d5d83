"""Placeholder of the environment protocol (replaced by the environments package)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Reset:
    messages: list[dict[str, Any]] = field(default_factory=list)
    observation: str | list[int] | None = None
    stop: tuple[str, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Step:
    observation: str | list[dict[str, Any]] | list[int] | None
    done: bool
    reward: float | None = None
    stop: tuple[str, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset: ...
    async def step(self, action: str) -> Step: ...
    async def close(self) -> None: ...


def load_environment_factory(spec: str) -> Callable[[], Environment]:
    if not spec.startswith("python:"):
        raise ValueError(f"unknown environment {spec!r}")
    module, _, name = spec.removeprefix("python:").partition(":")
    factory: Callable[[], Environment] = getattr(importlib.import_module(module), name)
    return factory
