"""Verifiers that misbehave on purpose, loaded by the server as python:flaky_verifiers:NAME."""

from __future__ import annotations

import os
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


def hangs_often(response: str, answer: str, metadata: dict[str, Any] | None) -> float:
    """Hangs on about half of the answers (those whose bytes sum to an even number)."""
    if sum(response.encode()) % 2 == 0:
        time.sleep(3600)
    return float(response.strip() == answer.strip())


def crashes(response: str, answer: str, metadata: dict[str, Any] | None) -> float:
    """Kills its own worker process."""
    os._exit(3)
