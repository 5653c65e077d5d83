"""Verifiers that misbehave on purpose, loaded by the server as python:flaky_verifiers:NAME."""

from __future__ import annotations

import time
from typing import Any


def raises(response: str, answer: str, metadata: dict[str, Any] | None) -> float:
    if response.strip() == answer.strip():
        raise RuntimeError("verifier crashed on a correct answer")
    return 0.0


def hangs(response: str, answer: str, metadata: dict[str, Any] | None) -> float:
    if response.strip() == answer.strip():
        time.sleep(3600)
    return 0.0
