"""Verifier contract: (response_text, reference answer, metadata) -> reward in [0, 1].

Verifiers are plain synchronous functions so they can run in a process pool that
enforces a time limit; a verifier that raises or hangs yields reward 0 and a
`verifier_error`, never a stalled or dead service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

#: How a verification ended: a reward, a verifier error (an exception or a bad value),
#: a time-out, a crashed worker, or not run at all because the spec's breaker is open.
VerdictKind = Literal["ok", "error", "timeout", "crash", "unavailable"]


class VerifierFn(Protocol):
    def __call__(self, response: str, answer: str, metadata: dict[str, Any] | None) -> float: ...


@dataclass(frozen=True)
class Verdict:
    reward: float
    error: str | None = None
    seconds: float = 0.0
    kind: VerdictKind = "ok"
