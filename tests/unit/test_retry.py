"""The retry policy shared by program verifiers and judges: failures are asked again with
a growing, jittered wait, only the failed answers, a bounded number of times; what still
fails comes back failed (for the scheduler to drop the prompt), never as a reward."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from sampler_service.verifiers.base import Verdict
from sampler_service.verifiers.retry import MAX_BACKOFF_S, RetryPolicy, verify_with_retries


def test_the_wait_doubles_up_to_a_cap_and_is_drawn_in_its_upper_half() -> None:
    policy = RetryPolicy(retries=10, backoff_s=0.5)
    assert [policy.delay(k, draw=lambda: 1.0) for k in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert [policy.delay(k, draw=lambda: 0.0) for k in (1, 2, 3)] == [0.25, 0.5, 1.0]
    assert policy.delay(10, draw=lambda: 1.0) == MAX_BACKOFF_S
    assert 0.25 <= policy.delay(1) <= 0.5
    assert RetryPolicy(retries=1, backoff_s=0.0).delay(1) == 0.0


class Script:
    """A verifier that fails each answer a given number of times before answering."""

    def __init__(self, failures: list[int], kind: str = "error") -> None:
        self.failures, self.kind = failures, kind
        self.asked: list[list[int]] = []

    async def __call__(self, indices: Sequence[int]) -> list[Verdict]:
        self.asked.append(list(indices))
        out = []
        for i in indices:
            if self.failures[i] > 0:
                self.failures[i] -= 1
                out.append(Verdict(0.0, "failed on purpose", kind=self.kind))  # type: ignore[arg-type]
            else:
                out.append(Verdict(float(i % 2)))
        return out


def _run(script: Script, count: int, retries: int) -> tuple[list[Verdict], list[int]]:
    retried: list[int] = []
    policy = RetryPolicy(retries=retries, backoff_s=0.001)
    verdicts = asyncio.run(verify_with_retries(script, count, lambda: policy, retried.append))
    return verdicts, retried


def test_only_the_failed_answers_are_asked_again_until_they_answer() -> None:
    script = Script([0, 2, 0, 1])
    verdicts, retried = _run(script, 4, retries=2)
    assert script.asked == [[0, 1, 2, 3], [1, 3], [1]]
    assert retried == [2, 1]
    assert [v.kind for v in verdicts] == ["ok"] * 4
    assert [v.reward for v in verdicts] == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("kind", ["error", "timeout", "crash"])
def test_a_failure_left_after_the_retries_comes_back_failed(kind: str) -> None:
    script = Script([0, 5], kind=kind)
    verdicts, retried = _run(script, 2, retries=2)
    assert len(script.asked) == 3 and retried == [1, 1]
    assert verdicts[0].kind == "ok" and verdicts[1].kind == kind


def test_no_retries_and_breaker_refusals_are_not_asked_again() -> None:
    script = Script([1, 0])
    verdicts, retried = _run(script, 2, retries=0)
    assert script.asked == [[0, 1]] and retried == [] and verdicts[0].kind == "error"
    refused = Script([1], kind="unavailable")
    verdicts, retried = _run(refused, 1, retries=3)
    assert refused.asked == [[0]] and verdicts[0].kind == "unavailable"


def test_the_policy_is_read_before_each_retry() -> None:
    """A judge's retries are live knobs: lowering them stops a wave's retries."""
    script = Script([5])
    policies = iter([RetryPolicy(3, 0.001), RetryPolicy(1, 0.001)])
    current = [RetryPolicy(3, 0.001)]

    def policy() -> RetryPolicy:
        current[0] = next(policies, current[0])
        return current[0]

    verdicts = asyncio.run(verify_with_retries(script, 1, policy, lambda n: None))
    assert len(script.asked) == 2 and verdicts[0].kind == "error"
