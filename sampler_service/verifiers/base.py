"""Verifier contract: (response_text, reference answer, metadata) -> reward in [0, 1].

Verifiers are plain synchronous functions so they can run in a process pool that
enforces a time limit. A verifier that returns a reward has answered, 0 for "wrong"
included. One that raises, returns something other than a reward, crashes its process
or hangs past the time limit has failed: its verdict's `kind` says so, and a failure is
never a reward. It is asked again (`retry`), and if it keeps failing the prompt is
dropped as `verifier_error`: a failure never becomes a negative, and never stalls or
kills the service.
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
    #: Meaningful only when `kind` is `ok`.
    reward: float
    error: str | None = None
    seconds: float = 0.0
    kind: VerdictKind = "ok"
