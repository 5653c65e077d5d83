"""Failed verifications are asked again, with backoff, a bounded number of times.

A failure (a verifier that raised, returned no reward, crashed or ran out of time; a
judge that could not be reached, timed out or gave no verdict) says nothing about the
answer, so it is never scored: it is asked again, and if every try fails the scheduler
drops the prompt as `verifier_error`. Only the failed answers of a wave are asked again.
A verdict of kind `unavailable` (the spec's breaker is open) is not: the breaker already
decided that calling is pointless for now.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from sampler_service.verifiers.base import Verdict

#: The kinds of a verdict that is a failure, not an answer.
FAILED = frozenset({"error", "timeout", "crash"})
#: No single wait is longer, however many retries double it.
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently failed verifications are asked again."""

    retries: int
    backoff_s: float

    def delay(self, retry: int, draw: Callable[[], float] = random.random) -> float:
        """The wait before retry number `retry` (1, 2, ...): `backoff_s` doubled each time
        up to MAX_BACKOFF_S, drawn between half and all of it so that the prompts a judge's
        outage failed together do not come back together."""
        ceiling = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (retry - 1))
        return ceiling * (0.5 + 0.5 * draw())


async def verify_with_retries(
    ask: Callable[[Sequence[int]], Awaitable[list[Verdict]]],
    count: int,
    policy: Callable[[], RetryPolicy],
    on_retry: Callable[[int], None],
) -> list[Verdict]:
    """A verdict for each of `count` answers; `ask(indices)` verifies those answers once.

    `policy` is read before each retry, so a change to a live knob applies to waves in
    progress; `on_retry` is told how many answers each retry asks again. Failures left
    after the last retry are returned as they are, for the caller to drop the prompt.
    """
    verdicts = await ask(range(count))
    retry = 0
    while failed := [i for i, v in enumerate(verdicts) if v.kind in FAILED]:
        current = policy()
        retry += 1
        if retry > current.retries:
            break
        await asyncio.sleep(current.delay(retry))
        on_retry(len(failed))
        for i, verdict in zip(failed, await ask(failed), strict=True):
            verdicts[i] = verdict
    return verdicts
