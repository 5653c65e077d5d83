"""Verifiers that misbehave on purpose, for testing the pool and the service's fault paths.

They live in the package (like `numpy.testing`) so that any process, a verifier worker or
a server started by a test, imports them without sys.path set-up; operators can point
`--verifier python:sampler_service.verifiers.testing:hang` at a deployment to check
that a stuck verifier costs one timeout and nothing else.
"""

from __future__ import annotations

import os
import time
from typing import Any


def fail(response: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    raise RuntimeError(f"verifier failed on purpose for {response!r}")


def hang(response: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    time.sleep(3600)
    return 1.0


def hang_on_hang(response: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    """Hangs on the response "hang"; any other scores 1 if it is the answer."""
    if response == "hang":
        time.sleep(3600)
    return float(response == answer)


def out_of_range(response: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    return 2.0


def not_a_number(response: str, answer: str, metadata: dict[str, Any] | None = None) -> Any:
    return "yes"


def exit_process(response: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    os._exit(3)


def metadata_reward(response: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    """The reward stored in the row's metadata: shows metadata reaches the verifier."""
    return float((metadata or {})["reward"])
